"""Argmax and sampling kernels as functions over NumPy arrays (re-exported by lily_py.ops).

The device reproduces :func:`lily_py.sampling.sample` bit for bit for the same seed and step
(see docs/kernels-sampling.md, "Sampling"); the chosen id goes to a uint32 device slot (the engine reads it
as the next step's embedding input). Logits are float32 ``[V]`` or ``[R, V]``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["argmax", "sample", "sample_logprobs"]


def _core():
    from .. import _core
    return _core


def _logits_2d(logits, fn: str) -> np.ndarray:
    if not isinstance(logits, np.ndarray):
        raise TypeError(f"{fn}: logits must be a numpy.ndarray, got {type(logits).__name__}")
    if logits.dtype != np.float32:
        raise ValueError(f"{fn}: logits must be float32, got {logits.dtype}")
    if logits.ndim not in (1, 2) or logits.shape[-1] == 0 or (logits.ndim == 2 and logits.shape[0] == 0):
        raise ValueError(f"{fn}: logits must have shape [V] or [R, V] with V, R > 0, got {list(logits.shape)}")
    if logits.shape[-1] >= 2 ** 31:
        raise ValueError(f"{fn}: vocabulary of {logits.shape[-1]} entries is too large")
    return np.ascontiguousarray(logits.reshape(-1, logits.shape[-1]))


def _mask_2d(mask, rows: int, valid: int, fn: str):
    """A bool [V] / [R, V] allowed set or a packed uint32 bitset [W] / [R, W] (lily_py.sampling.
    pack_mask) as uint32 [R, ceil(valid / 32)]; one row applies to every row."""
    if mask is None:
        return None
    from ..sampling import pack_mask
    m = np.asarray(mask)
    words = -(-valid // 32)
    if m.dtype == bool:
        m = m.reshape(-1, m.shape[-1])[:, :valid]
        if m.shape[-1] != valid:
            raise ValueError(f"{fn}: mask has {m.shape[-1]} entries per row, needs >= valid_vocab {valid}")
        m = np.stack([pack_mask(r) for r in m])
    elif m.dtype == np.uint32:
        m = m.reshape(-1, m.shape[-1])
        if m.shape[-1] != words:
            raise ValueError(f"{fn}: packed mask has {m.shape[-1]} words per row, needs {words}")
    else:
        raise ValueError(f"{fn}: mask must be bool or a packed uint32 bitset, got {m.dtype}")
    if m.shape[0] not in (1, rows):
        raise ValueError(f"{fn}: mask has {m.shape[0]} rows, logits {rows}")
    return np.ascontiguousarray(np.broadcast_to(m, (rows, words)), dtype=np.uint32)


def _int(v, what: str, fn: str, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{fn}: {what} must be an integer {rng}, got {v!r}")
    return int(v)


def _run(fn, logits, *, valid_vocab, greedy, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0,
         step=0, slot=0, device="emu", order="shuffle", emu_seed=0, fp_traps=True, candidate_cap=None,
         logprobs=-1, mask=None):
    x = _logits_2d(logits, fn)
    v = x.shape[1]
    valid = v if valid_vocab is None else _int(valid_vocab, "valid_vocab", fn, 1, v)
    slot = _int(slot, "slot", fn, 0, 2 ** 31)
    if device not in ("emu", "metal", "cuda"):
        raise ValueError(f"{fn}: device must be 'emu', 'metal' or 'cuda', got {device!r}")
    ids, chosen, status, bad, stats = _core().ops.sample(
        x, valid_vocab=valid, greedy=greedy, temperature=float(temperature), top_k=top_k, top_p=float(top_p),
        min_p=float(min_p), seed=seed, step=step, slot=slot, device=device, order=order, emu_seed=emu_seed,
        fp_traps=fp_traps, logprobs=logprobs, mask=_mask_2d(mask, x.shape[0], valid, fn),
        **({} if candidate_cap is None else {"candidate_cap": candidate_cap}))
    return ids, chosen, status, bad, stats


def _raise_on_error(fn, status, bad, logits2d):
    for r, (s, b) in enumerate(zip(status.tolist(), bad.tolist())):
        if s:
            where = f"row {r}: " if logits2d.shape[0] > 1 else ""
            if b != 0xFFFFFFFF:
                raise FloatingPointError(f"{fn}: {where}logits contain a non-finite value at token id {b}: "
                                         f"{logits2d[r, b]} (numerical failure in the model)")
            raise FloatingPointError(f"{fn}: {where}logits contain a non-finite value at token id 0: "
                                     f"every logit below valid_vocab is -inf")


def _result(logits, ids_rows, chosen_rows, return_logit):
    if logits.ndim == 1:
        out = int(ids_rows[0])
        return (out, float(chosen_rows[0])) if return_logit else out
    return (ids_rows.astype(np.int64), chosen_rows) if return_logit else ids_rows.astype(np.int64)


def argmax(logits: np.ndarray, *, valid_vocab: int | None = None, return_logit: bool = False,
           device: str = "emu"):
    """Greedy choice: the id of the largest logit among ids ``< valid_vocab`` (ties to the lowest id).

    ``logits``: float32 ``[V]`` (returns an int) or ``[R, V]`` (returns int64 ``[R]``). With
    ``return_logit`` also the chosen logit(s). NaN / +inf below ``valid_vocab``, or no finite logit,
    raise ``FloatingPointError`` as :func:`lily_py.sampling.sample` does (the device writes the
    sentinel id 0xFFFFFFFF and sets a status the host checks)."""
    ids, chosen, status, bad, _ = _argmax(logits, valid_vocab=valid_vocab, device=device)
    _raise_on_error("argmax", status, bad, _logits_2d(logits, "argmax"))
    r = status.shape[0]
    return _result(logits, ids[-r:], chosen[-r:], return_logit)


def _argmax(logits, *, valid_vocab=None, slot=0, device="emu", order="shuffle", emu_seed=0, fp_traps=True):
    """argmax without the error check: (ids [slot + R], chosen [slot + R], status, bad_id, stats)."""
    return _run("argmax", logits, valid_vocab=valid_vocab, greedy=True, slot=slot, device=device, order=order,
                emu_seed=emu_seed, fp_traps=fp_traps)


def sample(logits: np.ndarray, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           seed: int, step: int, valid_vocab: int | None = None, return_logit: bool = False,
           device: str = "emu", mask=None):
    """Sample the next token like ``lily_py.sampling.sample(logits[:valid_vocab], SamplingParams(
    temperature, top_k, top_p, min_p), step, seed)``, bit for bit, on the device.

    ``temperature == 0`` is greedy. A batch ``[R, V]`` samples every row with the same seed and
    step. Bad parameters raise ``ValueError``; non-finite logits ``FloatingPointError``.
    ``mask``: the allowed tokens (bool ``[V]`` / ``[R, V]`` or the packed bitset of
    ``lily_py.sampling.pack_mask``), applied before every route: the reference's ``allowed``."""
    ids, chosen, status, bad, _ = _sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                          min_p=min_p, seed=seed, step=step, valid_vocab=valid_vocab,
                                          device=device, mask=mask)
    _raise_on_error("sample", status, bad, _logits_2d(logits, "sample"))
    r = status.shape[0]
    return _result(logits, ids[-r:], chosen[-r:], return_logit)


def _sample(logits, *, temperature, top_k=0, top_p=1.0, min_p=0.0, seed, step, valid_vocab=None, slot=0,
            device="emu", order="shuffle", emu_seed=0, fp_traps=True, candidate_cap=None, logprobs=-1,
            mask=None):
    """sample without the error check: (ids [slot + R], chosen [slot + R], status, bad_id, stats).
    ``candidate_cap`` (tests): the bucket route's candidate limit; 0 runs its fallback (resolve
    scans the row) on every input."""
    fn = "sample"
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
            or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{fn}: temperature must be a finite number >= 0, got {temperature!r}")
    top_k = _int(top_k, "top_k", fn, 0, 2 ** 32 - 1)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating)) or not 0 < top_p <= 1:
        raise ValueError(f"{fn}: top_p must be in (0, 1], got {top_p!r}")
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float, np.floating)) or not 0 <= min_p <= 1:
        raise ValueError(f"{fn}: min_p must be in [0, 1], got {min_p!r}")
    seed = _int(seed, "seed", fn, 0, 2 ** 64 - 1)
    step = _int(step, "step", fn, 0, 2 ** 32 - 1)
    return _run(fn, logits, valid_vocab=valid_vocab, greedy=temperature == 0, temperature=temperature or 1.0,
                top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step, slot=slot, device=device,
                order=order, emu_seed=emu_seed, fp_traps=fp_traps, candidate_cap=candidate_cap,
                logprobs=logprobs, mask=mask)


def logprob_records(words: np.ndarray) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Decode logprob records (uint32 ``[n, 2 + 2 * 20]``, shaders/common/args_sampling.h) into
    (chosen logprob, top ids int64 [k], top logprobs float32 [k]) per record."""
    out = []
    for r in np.asarray(words, dtype=np.uint32).reshape(-1, words.shape[-1]):
        k = int(r[1])
        pairs = r[2:2 + 2 * k].reshape(k, 2)
        out.append((float(r[:1].view(np.float32)[0]), pairs[:, 0].astype(np.int64),
                    pairs[:, 1].copy().view(np.float32)))
    return out


def sample_logprobs(logits: np.ndarray, *, top_logprobs: int, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, step: int = 0,
                    valid_vocab: int | None = None, device: str = "emu", mask=None):
    """``sample`` plus the device's logprobs of each row: ``(ids int64 [R], chosen logprob
    float32 [R], top ids int64 [R, k], top logprobs float32 [R, k])`` with ``k = top_logprobs``
    (0..20; fewer columns when a row has fewer valid entries). Logprobs are the model's
    distribution, ``log_softmax(logits[:valid_vocab])`` of the raw logits (no temperature, no
    filters; lily_py.sampling.logprobs is the reference); with ``mask`` (as ``sample``), of the
    masked logits."""
    top_logprobs = _int(top_logprobs, "top_logprobs", "sample_logprobs", 0, _core().ops.SAMPLE_MAX_LOGPROBS)
    x = _logits_2d(logits, "sample_logprobs")
    ids, chosen, status, bad, stats = _sample(x, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                              seed=seed, step=step, valid_vocab=valid_vocab, device=device,
                                              logprobs=top_logprobs, mask=mask)
    _raise_on_error("sample_logprobs", status, bad, x)
    recs = logprob_records(stats["logprobs"])
    k = min(len(r[1]) for r in recs)
    return (ids.astype(np.int64), np.array([r[0] for r in recs], np.float32),
            np.stack([r[1][:k] for r in recs]), np.stack([r[2][:k] for r in recs]))
