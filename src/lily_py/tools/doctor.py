"""``lily-py doctor`` / ``lily_py.doctor()``: check that this build works on this machine.

On one device (``"metal"`` where the device registry says it is usable, else ``"emu"``, the CPU
emulator of the Metal kernels) it reports, section by section:

1. **Device**: name, GPU family, working set, how each shader library was found (Metal: the
   base library and the M5 tensor-op library, each a prebuilt metallib, the installed source
   compiled at run time, or unavailable with the reason; :func:`library_rows`), an installed
   metallib's load error, the OS / SDK the build targeted. A device that is not usable is a
   failure, with the registry's reason.
2. **Pipelines**: every kernel id of the host kernel table, and its pipeline limits (threads per
   threadgroup, static threadgroup memory, SIMD width) where this build reports them.
3. **Kernels**: every kernel family of :mod:`lily_py.ops` on fresh random inputs at two shapes (a
   small odd one and one at the real model's dimensions) against the float64 NumPy reference
   (:mod:`lily_py.reference.kernels`), with the tolerance formulas of the kernel tests
   (``tests/kernels/``, derived in each test module's docstring). A case passes when every
   element is within its bound: the table prints max |error| and the worst error / bound.
4. **Model**: the bundled demo checkpoint on the device against the NumPy reference backend:
   the prompt's logits within the engine tests' tolerance (``tests/model/test_engine.py``) and 32
   greedy tokens identical.

The exit status is 1 when any check fails, 0 otherwise. ``--quick`` keeps every family and the
model check but runs the model-sized cases at reduced sizes (for the emulator).
"""
from __future__ import annotations

import json
import platform
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, TextIO

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
U = 2.0 ** -24        # float32 unit roundoff (tests/kernels/kernel_checks.py: F32_EPS)
BF16_U = 2.0 ** -9    # half of bfloat16's unit roundoff 2^-8 (as BF16_EPS in the kernel tests); used in multiples >= 2


def _out_rtol(dtype) -> float:
    """A bfloat16 output adds its final rounding: rtol 2^-8 (the kernel tests' out_rtol)."""
    return 2 * BF16_U if np.dtype(dtype) == BF16 else 0.0


# ------------------------------------------------------------------------------ device adapter
# The device registry API (lily_py._devices: devices(), device_info(), pipeline_limits(); issue
# 13) may be absent from a build: these adapters fall back to what lily_py._core reports, and say
# so. They import lily_py._devices, never the package (lily_py imports this module).

def _core():
    from .. import _core
    return _core


def _registry() -> list | None:
    from .. import _devices
    fn = getattr(_devices, "devices", None)
    if not callable(fn):
        return None
    try:
        out = list(fn())
    except Exception:   # noqa: BLE001 - an older signature: use the fallback
        return None
    return out if out and hasattr(out[0], "available") else None


def device_status(name: str) -> tuple[bool, str]:
    """(usable, reason when not) for a device name, from the registry where the build has one."""
    reg = _registry()
    if reg is not None:
        for s in reg:
            if s.name == name:
                return bool(s.available), str(s.reason or "")
        return False, f"unknown device {name!r} (registry: {[s.name for s in reg]})"
    core = _core()
    if name == "emu":
        return True, ""
    if name == "metal":
        if "metal" not in core.devices():
            return False, "not in this build (built without the Metal device: not macOS)"
        if not core.metal.available():
            return False, "no Metal GPU of family apple7 or newer on this machine"
        return True, ""
    return False, f"unknown device {name!r} (expected 'metal' or 'emu')"


def default_device() -> str:
    """"metal" where it is usable, else "emu"."""
    return "metal" if device_status("metal")[0] else "emu"


def device_facts(name: str) -> dict:
    """Facts about a usable device: the registry's ``device_info`` where present, else what the
    core reports (keys as in device_api.md; None where unknown)."""
    from .. import _devices
    fn = getattr(_devices, "device_info", None)
    if callable(fn):
        return dict(fn(name))
    core = _core()
    facts = {"name": name, "device_name": None, "gpu_family": None, "working_set_bytes": None,
             "max_buffer_bytes": None, "library_path": None, "library_source": None,
             "metallib_error": None, "build_target": None, "build_sdk": None, "math_mode": None}
    if name == "emu":
        facts.update(device_name="CPU emulator (shaders/*.metal compiled as C++)",
                     library_source="compiled into the extension",
                     build_target=f"{platform.system()} {platform.machine()}")
    elif name == "metal":
        info = dict(core.metal.info())
        facts.update(device_name=info.get("name"), gpu_family=info.get("family"),
                     library_path=info.get("library"))
    facts["compiler"] = core.compiler()
    return facts


def library_rows(facts: dict) -> list[tuple[str, str | None]]:
    """The Device section's library rows, from the device facts.

    Metal has two shader libraries, each found the same way (``csrc/metal/device.mm``): the
    prebuilt metallib, else the installed amalgamated source compiled at run time. The facts say
    which: ``library_path`` is the base library's file, plus ``" + <file>"`` when the M5 tensor-op
    library loaded; ``library_source`` is the base's (``"metallib"`` | ``"source"``);
    ``tensor_ops_reason`` says why there is no M5 library. Rows:

    - ``("library", "prebuilt metallib <path>")`` or ``"compiled at run time from <path> (MSL 3.1)"``;
    - ``("M5 library", ...)``: the same for ``lily_m5.metallib`` / ``lily_shaders_m5.metal``
      (MSL 4.0), or ``"unavailable: <tensor_ops_reason>"``.

    Other devices (the emulator, cuda) and builds that do not report the source: the library path
    and its source as reported."""
    path, source = facts.get("library_path"), facts.get("library_source")
    if source not in ("metallib", "source") or not path:
        return [("library", path), ("library source", source)]

    def how(file: str, lang: str) -> str:
        if file.endswith(".metallib"):
            return f"prebuilt metallib {file}"
        return f"compiled at run time from {file} ({lang})"

    base, _, m5 = path.partition(" + ")
    rows: list[tuple[str, str | None]] = [("library", how(base, "MSL 3.1"))]
    if facts.get("tensor_ops") and m5:
        rows.append(("M5 library", how(m5, "MSL 4.0")))
    else:
        rows.append(("M5 library", f"unavailable: {facts.get('tensor_ops_reason') or 'not reported by this build'}"))
    return rows


def pipeline_limits(name: str) -> list[dict] | None:
    """Per kernel id: max_threads, static_threadgroup_bytes, simd_width; None when this build
    does not report them."""
    from .. import _devices
    fn = getattr(_devices, "pipeline_limits", None)
    return [dict(d) for d in fn(name)] if callable(fn) else None


# ------------------------------------------------------------------------------ results
@dataclass
class Check:
    section: str               # "device", "pipelines", "kernels", "model"
    name: str                  # family or fact
    case: str = ""
    ok: bool | None = None     # None: information only
    max_err: float | None = None
    ratio: float | None = None  # worst |error| / bound (pass: <= 1)
    seconds: float | None = None
    detail: str = ""


@dataclass
class Report:
    device: str
    quick: bool
    seed: int
    checks: list[Check] = field(default_factory=list)
    limits: list[dict] | None = None
    facts: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    @property
    def exit_status(self) -> int:
        return 1 if self.failed else 0

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"] = sum(c.ok is True for c in self.checks)
        d["failed"] = len(self.failed)
        return d


def measure(actual, ref, *, atol, rtol) -> tuple[float, float]:
    """(max |actual - ref|, worst |actual - ref| / (atol + rtol |ref|)); NaN or a shape mismatch
    gives an infinite ratio. Same bound as tests' assert_close."""
    a = np.asarray(actual, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if a.shape != r.shape:
        return float("inf"), float("inf")
    err = np.abs(a - r)
    bound = np.broadcast_to(np.asarray(atol, np.float64) + rtol * np.abs(r), err.shape)
    if err.size == 0:
        return 0.0, 0.0
    if not np.isfinite(err).all():
        return float("inf"), float("inf")
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(bound > 0, err / np.where(bound > 0, bound, 1.0), np.where(err > 0, np.inf, 0.0))
    return float(err.max()), float(q.max())


# ------------------------------------------------------------------------------ kernel families
# Each family function yields (case, max_err, ratio, detail) for its two shapes; the tolerance is
# the one of the named kernel test. ``model`` selects the real model's dimensions (reduced by
# ``quick``).

def _rand(rng, shape, dtype=F32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def _dt(dtype) -> str:
    return "bf16" if np.dtype(dtype) == BF16 else "f32"


def fam_quantized_matmul(rng, device, *, quick):
    """tests/kernels/test_quantized_matmul.py: atol 8 sqrt(K) u mag, bf16 out rtol 2^-8."""
    from .. import ops
    from ..reference import kernels as ref, quant
    for m, n, k, xdt in [(3, 37, 192, F32), (9, 70, 512 if quick else 2048, BF16)]:
        w, s, b = quant.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, bits=4,
                                 group_size=64, scale_dtype=BF16)
        x = _rand(rng, (m, k), xdt)
        y = ops.quantized_matmul(x, w, s, b, bits=4, group_size=64, device=device)
        want = ref.quantized_matmul(x, w, s, b, bits=4, group_size=64)
        mag = ref.quantized_matmul_error_scale(x, w, s, b, bits=4, group_size=64)
        yield (f"{ops.quantized_matmul_route(m)} x[{m},{k}] {_dt(xdt)}, w[{n},{k}] 4-bit g64",
               *measure(y, want, atol=8 * np.sqrt(k) * U * mag, rtol=_out_rtol(xdt)), "")


def fam_rms_norm(rng, device, *, quick):
    """tests/kernels/test_norm_embedding_elementwise.py: rtol (4 sqrt(D) + 8) u (+ bf16 out)."""
    from .. import ops
    from ..reference import kernels as ref
    for rows, d, xdt in [(3, 257, F32), (4, 2048, BF16)]:
        x, w = _rand(rng, (rows, d), xdt, 3.0), _rand(rng, (d,), BF16)
        y = ops.rms_norm(x, w, eps=1e-6, device=device)
        rtol = (4 * np.sqrt(d) + 8) * U + _out_rtol(xdt)
        yield f"x[{rows},{d}] {_dt(xdt)}", *measure(y, ref.rms_norm(x, w, eps=1e-6), atol=0, rtol=rtol), ""


def fam_embedding(rng, device, *, quick):
    """tests/kernels/test_norm_embedding_elementwise.py: atol 2 u (|s q| + |b|)."""
    from .. import ops
    from ..reference import kernels as ref, quant
    for vocab, d, odt in [(53, 320, F32), (1000 if quick else 4096, 2048, BF16)]:
        table, s, b = quant.quantize(rng.standard_normal((vocab, d)).astype(np.float32), bits=4,
                                     group_size=64, scale_dtype=BF16)
        ids = rng.integers(0, vocab, size=7)
        ids[0], ids[-1] = 0, vocab - 1
        y = ops.embedding(ids, table, s, b, bits=4, group_size=64, dtype=odt, device=device)
        want = ref.embedding(ids, table, s, b, bits=4, group_size=64)
        mag = ref.embedding(ids, table, np.abs(s.astype(np.float32)), np.abs(b.astype(np.float32)),
                            bits=4, group_size=64)
        yield (f"7 ids of [{vocab},{d}] 4-bit -> {_dt(odt)}",
               *measure(y, want, atol=2 * U * mag, rtol=_out_rtol(odt)), "")


def fam_elementwise(rng, device, *, quick):
    """tests/kernels/test_norm_embedding_elementwise.py: rtol 16 u (+ bf16 out)."""
    from .. import ops
    from ..reference import kernels as ref
    g, u = _rand(rng, (3, 257), F32, 4.0), _rand(rng, (3, 257), F32)
    yield ("swiglu [3,257] f32",
           *measure(ops.swiglu(g, u, device=device), ref.swiglu(g, u), atol=0, rtol=16 * U), "")
    x, gate = _rand(rng, (4, 4096), BF16), _rand(rng, (4, 4096), BF16, 5.0)
    yield ("sigmoid_mul [4,4096] bf16",
           *measure(ops.sigmoid_mul(x, gate, device=device), ref.sigmoid_mul(x, gate), atol=0,
                    rtol=16 * U + _out_rtol(BF16)), "")


def fam_sampling(rng, device, *, quick):
    """tests/kernels/test_sampling_kernels.py: the device picks exactly the reference's token."""
    from .. import ops, sampling as S
    for v, params in [(1000, dict(temperature=0.7, top_k=20, top_p=0.9)),
                      (32768 if quick else 248320, dict(temperature=1.0, top_p=0.95, min_p=0.02))]:
        logits = (rng.standard_normal(v) * 3.0).astype(np.float32)
        seed, step = int(rng.integers(0, 2 ** 63)), int(rng.integers(0, 1000))
        got_g = int(np.asarray(ops.argmax(logits, device=device)).reshape(-1)[0])
        want_g = int(np.argmax(logits))
        got = int(np.asarray(ops.sample(logits, seed=seed, step=step, device=device, **params)).reshape(-1)[0])
        want = S.sample(logits, S.SamplingParams(**params), step, seed)
        bad = (got_g != want_g) + (got != want)
        short = {"temperature": "T", "top_k": "top-k ", "top_p": "top-p ", "min_p": "min-p "}
        yield (f"argmax + sample V={v} " + " ".join(f"{short[k]}{p}" for k, p in params.items()),
               float(bad), float("inf") if bad else 0.0,
               f"argmax {got_g} vs {want_g}, sample {got} vs {want}")


def fam_gated_delta(rng, device, *, quick):
    """tests/kernels/test_gated_delta.py: conv1d atol 2K u mag + 8 u |y|; gated delta state
    atol 16 sqrt((T+1) Dk) u M, y atol that / rms(o) * |w silu(z)| + rtol 16 u."""
    from .. import ops
    from ..reference import kernels as ref
    for T, C in [(5, 257), (3, 8192)]:
        K = 4
        x, w, st = _rand(rng, (T, C), BF16, 2.0), _rand(rng, (C, K), BF16, 0.5), _rand(rng, (K - 1, C), BF16, 2.0)
        y, new_st = ops.causal_conv1d(x, w, st, device=device)
        yr, sr = ref.causal_conv1d(x, w, st)
        err, ratio = measure(y, yr, atol=2 * K * U * ref.conv1d_error_scale(x, w, st) + 8 * U * np.abs(yr),
                             rtol=_out_rtol(BF16))
        if not np.array_equal(np.asarray(new_st).view(np.uint16), np.asarray(sr).view(np.uint16)):
            ratio = float("inf")
        yield f"causal_conv1d x[{T},{C}] bf16, K=4", err, ratio, ""
    shapes = [(5, 2, 4, 32, 16), (2, 2, 4, 128, 128) if quick else (2, 16, 32, 128, 128)]
    for T, Hk, Hv, Dk, Dv in shapes:
        q, k = _rand(rng, (T, Hk, Dk), BF16), _rand(rng, (T, Hk, Dk), BF16)
        v, z = _rand(rng, (T, Hv, Dv), BF16), _rand(rng, (T, Hv, Dv), BF16)
        a, b = _rand(rng, (T, Hv), BF16), _rand(rng, (T, Hv), BF16, 2.0)
        A_log = rng.uniform(-3, 0.5, Hv).astype(np.float32)
        dt_bias = _rand(rng, (Hv,), BF16)
        norm_w = (1 + _rand(rng, (Dv,), F32, 0.2)).astype(BF16)
        S0 = _rand(rng, (Hv, Dk, Dv), F32, 0.3)
        y, S = ops.gated_delta_scan(q, k, v, z, a, b, A_log, dt_bias, norm_w, S0, eps=1e-6, device=device)
        yr, Sr = ref.gated_delta(q, k, v, z, a, b, A_log, dt_bias, norm_w, S0, eps=1e-6)
        M = max(np.abs(Sr).max(), np.abs(S0).max(), np.abs(v.astype(np.float64)).max())
        rel_s = 16 * np.sqrt((T + 1) * Dk) * U
        e1, r1 = measure(S, Sr, atol=rel_s * M, rtol=0)
        z64 = z.astype(np.float64)
        gate = np.abs(norm_w.astype(np.float64) * z64 / (1 + np.exp(-z64)))
        o_rms = _gd_o_rms(q, k, v, a, b, A_log, dt_bias, S0, 1e-6)
        e2, r2 = measure(y, yr, atol=rel_s * M / o_rms[..., None] * gate, rtol=16 * U + _out_rtol(BF16))
        yield (f"gated_delta T={T} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} bf16", max(e1, e2), max(r1, r2),
               f"state err/bound {r1:.2g}, y err/bound {r2:.2g}")


def _gd_o_rms(q, k, v, a, b, A_log, dt_bias, S0, eps):
    """rms(o) per (token, head) of the reference's pre-norm output (as in test_gated_delta.py)."""
    from ..reference import kernels as ref
    y, _ = ref.gated_delta(q, k, v, np.full(v.shape, 50.0), a, b, A_log, dt_bias, np.ones(v.shape[2]),
                           S0, eps=eps)
    m = np.mean((y / 50.0) ** 2, -1)
    return np.sqrt(m * eps / np.maximum(1 - m, 1e-300) + eps)


def fam_moe(rng, device, *, quick):
    """tests/kernels/test_moe.py: routing equal (near-ties excluded), output within
    reference.kernels.moe_error_bound, RMS error <= 1/64 of the RMS bound."""
    from .. import ops
    from ..reference import kernels as ref, quant
    from ..weights import QuantLinear
    from types import SimpleNamespace

    def ql(shape, bits, gs, fill=None):
        w = fill if fill is not None else rng.standard_normal(shape).astype(np.float32) * 0.1
        return QuantLinear(*quant.quantize(w, bits=bits, group_size=gs, scale_dtype=BF16), bits, gs)

    cases = [(3, 7, 64, 32, 32, 2), (9, 64 if quick else 256, 128 if quick else 256, 64, 64, 8)]
    for T, E, H, I, gs, top_k in cases:
        W = SimpleNamespace(router=ql((E, H), 8, gs), gate_proj=ql((E, I, H), 4, gs),
                            up_proj=ql((E, I, H), 4, gs), down_proj=ql((E, H, I), 4, gs),
                            shared_gate_proj=ql((I, H), 4, gs), shared_up_proj=ql((I, H), 4, gs),
                            shared_down_proj=ql((H, I), 4, gs), shared_expert_gate=ql((1, H), 8, gs))
        x = (rng.standard_normal((T, H)) * 0.5).astype(np.float32)
        out, ids, weights, stats = ops._moe(x, *ops.moe_weights(W), top_k=top_k, device=device)
        keys = ("router", "gate", "up", "down", "shared_gate_proj", "shared_up", "shared_down", "shared_gate")
        mats = (W.router, W.gate_proj, W.up_proj, W.down_proj, W.shared_gate_proj, W.shared_up_proj,
                W.shared_down_proj, W.shared_expert_gate)
        dense = {k: m.dense() if len(m.shape) == 2 else np.stack([m.expert(e).dense() for e in range(m.shape[0])])
                 for k, m in zip(keys, mats)}
        mags = {k: ref.dequantized_magnitude(m.w, m.scales, m.biases, bits=m.bits, group_size=m.group_size)
                for k, m in zip(keys, mats)}
        want, rids, rweights = ref.moe(x, *(dense[k] for k in keys), top_k=top_k)
        logits = ref.moe_logits(x, dense["router"], dense["shared_gate"])[:, :-1]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        top = -np.sort(-p, axis=1)[:, :top_k + 1]
        ok = ~(-np.diff(top, axis=1) < 1e-5 * top[:, :-1]).any(axis=1)
        bound = ref.moe_error_bound(x, mags, dense, top_k=top_k)
        err, ratio = measure(out[ok], want[ok], atol=bound[ok], rtol=0)
        _, wratio = measure(weights[ok, :top_k], rweights[ok], atol=np.abs(rweights[ok]) * 1e-5, rtol=0)
        ratio = max(ratio, wratio)
        rms = float(np.sqrt(np.mean((out[ok] - want[ok]) ** 2)) / np.sqrt(np.mean(bound[ok] ** 2))) if ok.any() else 0.0
        routing = bool(np.array_equal(ids[ok], rids[ok]))
        if not routing or rms > 1 / 64:
            ratio = float("inf")
        yield (f"{stats['route']} T={T} E={E} top-{top_k} H={H} I={I}", err, ratio,
               f"routing {'equal' if routing else 'DIFFERS'}, rms err {rms:.2g} of rms bound"
               + (f", {int((~ok).sum())} near-tie token(s) left out" if not ok.all() else ""))


def fam_attention(rng, device, *, quick):
    """tests/kernels/test_attention.py: atol (8 sqrt(D) u smag + (64 + 2 nb + 2 splits) u) vmag."""
    from .. import ops
    from ..reference import kernels as ref

    def bound(q, kc, vc, g, position):
        r, smag, vmag = ref.attention(q, kc, vc, position=position, gate=g)
        nb = -(-(position + q.shape[0]) // 32)
        return r, (8 * np.sqrt(q.shape[-1]) * U * smag + (64 + 2 * nb + 2 * 32) * U) * vmag

    shapes = [(6, 2, 40, 33, 9, 0), (16, 2, 256, 300 if quick else 3001, 5, 3)]  # Hq Hkv D L T pos
    for Hq, Hkv, D, L, T, pos in shapes:
        cap = max(L, pos + T) + 2
        kc, vc = _rand(rng, (Hkv, cap, D), BF16, 1.5), _rand(rng, (Hkv, cap, D), BF16)
        q, g = _rand(rng, (1, Hq, D), BF16, 1.5), _rand(rng, (1, Hq, D), BF16, 2.0)
        out = ops.attention_decode(q[0], kc, vc, length=L, gate=g[0], device=device)
        r, atol = bound(q, kc, vc, g, L - 1)
        route = ops.attention_decode_route(L, D)
        yield (f"decode ({route['route']}) Hq={Hq} Hkv={Hkv} D={D} L={L} bf16",
               *measure(out[None], r, atol=atol, rtol=_out_rtol(BF16)), "")
        q, g = _rand(rng, (T, Hq, D), BF16, 1.5), _rand(rng, (T, Hq, D), BF16, 2.0)
        out = ops.attention_prefill(q, kc, vc, position=pos, gate=g, device=device)
        r, atol = bound(q, kc, vc, g, pos)
        route = ops.attention_prefill_route(D, dtype=BF16)
        if route == "tiles":  # P rounded to bf16 as the operand of P V: + 2^-8 vmag (test_attention_tiles.py)
            atol = atol + 2.0 ** -8 * ref.attention(q, kc, vc, position=pos, gate=g)[2]
        yield (f"prefill ({route}) Hq={Hq} Hkv={Hkv} D={D} T={T} at {pos} bf16",
               *measure(out, r, atol=atol, rtol=_out_rtol(BF16)), "")


FAMILIES: dict[str, Callable] = {
    "quantized_matmul": fam_quantized_matmul, "rms_norm": fam_rms_norm, "embedding": fam_embedding,
    "swiglu/sigmoid_mul": fam_elementwise, "sampling": fam_sampling, "gated_delta": fam_gated_delta,
    "moe": fam_moe, "attention": fam_attention,
}


# ------------------------------------------------------------------------------ model
def check_model(device: str, *, tokens: int = 32) -> list[Check]:
    """The demo checkpoint on the device vs the reference backend (tests/model/test_engine.py:
    prompt logits within 2^-7 max|ref| (bf16 KV cache), greedy tokens identical)."""
    from ..model import load
    out = []
    t0 = time.perf_counter()
    dev = load(backend=device, context_length=128, verbose=False)
    ref = load(backend="reference", context_length=128)
    out.extend(_engine_checks(dev, time.perf_counter() - t0))
    prompt = dev.tokenizer.encode("The quick brown fox")
    got, want = dev.prefill(prompt), ref.prefill(prompt)
    err, ratio = measure(got, want, atol=2.0 ** -7 * float(np.abs(want).max()), rtol=0)
    out.append(Check("model", "demo logits", f"prompt of {len(prompt)} tokens, last position",
                     ratio <= 1, err, ratio, time.perf_counter() - t0))
    t0 = time.perf_counter()
    dev.reset(), ref.reset()
    a = dev.generate_text(prompt, max_tokens=tokens)
    b = ref.generate_text(prompt, max_tokens=tokens)
    same = a.tokens == b.tokens
    first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    out.append(Check("model", f"demo greedy {tokens}", f"{len(a.tokens)} tokens", same,
                     seconds=time.perf_counter() - t0,
                     detail="identical" if same else f"first difference at token {first}: "
                     f"{a.tokens[first:first + 3] if first is not None else a.tokens} vs "
                     f"{b.tokens[first:first + 3] if first is not None else b.tokens}"))
    return out


def _engine_checks(model, seconds: float) -> list[Check]:
    """What the loaded engine reports about its plan, where this build has it: the pipelines every
    step uses (threads per threadgroup vs the pipeline's limit, checked at load) and the device
    memory it allocated against the working set."""
    eng = getattr(model._backend, "engine", None)
    out = []
    pipes = getattr(eng, "pipelines", None)
    if pipes is not None:
        pipes = [dict(d) for d in pipes]
        over = [d["kernel"] for d in pipes if d.get("max_threads") and d.get("threads", 0) > d["max_threads"]]
        top = max(pipes, key=lambda d: d.get("threads", 0), default=None)
        out.append(Check("model", "demo pipelines", f"{len(pipes)} kernels the plan uses", not over,
                         seconds=seconds, detail=(f"over the limit: {over}" if over else
                         f"checked at load; most threads: {top['kernel']} {top.get('threads')} of "
                         f"{top.get('max_threads')}" if top else "")))
    mem = getattr(eng, "memory", None)
    if mem is not None:
        mem = dict(mem)
        ws = mem.get("working_set_bytes")
        out.append(Check("model", "demo memory", f"{_fmt_bytes(mem.get('total_bytes'))} allocated", None,
                         detail=f"working set {'unlimited' if ws is None else _fmt_bytes(ws)}"
                         + (f"; {mem['warning']}" if mem.get("warning") else "")))
    return out


# ------------------------------------------------------------------------------ run + print
def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


class _Printer:
    def __init__(self, out: TextIO | None):
        self.out = out

    def __call__(self, line: str = "") -> None:
        if self.out is not None:
            print(line, file=self.out, flush=True)


def run(device: str | None = None, *, quick: bool = False, families: list[str] | None = None,
        model: bool = True, seed: int | None = None, out: TextIO | None = sys.stdout) -> Report:
    """Run every check on ``device`` (default: :func:`default_device`), printing the tables to
    ``out`` as they complete (None: silent). Returns the :class:`Report`."""
    from .._version import __version__
    device = device or default_device()
    seed = secrets.randbits(63) if seed is None else int(seed)
    rep = Report(device=device, quick=quick, seed=seed)
    p = _Printer(out)
    t_start = time.perf_counter()
    p(f"lily-py doctor: lily_py {__version__} on device '{device}'"
      f"{' (--quick)' if quick else ''}, random seed {seed}")

    # 1. device
    p()
    p("Device")
    reg = _registry()
    if reg is not None:
        p("  registry        " + "; ".join(f"{d.name}: " + ("usable" if d.available else f"not usable ({d.reason})")
                                      for d in reg))
    usable, reason = device_status(device)
    rep.checks.append(Check("device", "usable", device, usable, detail=reason))
    if not usable:
        p(f"  {device}: not usable: {reason}    FAIL")
        return _finish(rep, p, t_start)
    try:
        rep.facts = device_facts(device)
    except Exception as e:  # noqa: BLE001 - report, do not crash
        rep.checks.append(Check("device", "facts", ok=False, detail=f"{type(e).__name__}: {e}"))
        p(f"  device facts: {type(e).__name__}: {e}    FAIL")
    f = rep.facts
    libraries = library_rows(f)
    if any(k == "M5 library" for k, _ in libraries):
        f["libraries"] = dict(libraries)  # how each Metal library was found, for --json
    rows = [("name", f.get("device_name")), ("GPU family", f.get("gpu_family")),
            ("working set", "unlimited" if f.get("working_set_bytes") is None else _fmt_bytes(f["working_set_bytes"])),
            ("max buffer", "unlimited" if f.get("max_buffer_bytes") is None else _fmt_bytes(f["max_buffer_bytes"])),
            *libraries,
            ("metallib error", f.get("metallib_error")), ("build target", f.get("build_target")),
            ("build SDK", f.get("build_sdk")), ("math mode", f.get("math_mode")),
            ("compiler", f.get("compiler")),
            ("simulated", "yes (limits set by lily_py.testing.simulated_device)" if f.get("simulated") else None)]
    for k, v in rows:
        if v is not None or k in ("name", "GPU family", "library"):
            p(f"  {k:<16}{'-' if v is None else v}")
    if f.get("metallib_error") and f.get("metallib_built"):
        rep.checks.append(Check("device", "metallib", ok=False, detail=str(f["metallib_error"])))
        p("  an installed metallib was built but did not load    FAIL")

    # 2. pipelines
    p()
    _pipelines(rep, p, device)

    # 3. kernels
    p()
    p("Kernels vs the NumPy reference (float64); bound = the kernel tests' tolerance, pass when "
      "err/bound <= 1.")
    p("  (bf16 outputs: their final rounding, up to 2^-8 relative, is most of the bound: ratios near 1 "
      "are expected)")
    p(f"  {'family':<19}{'case':<52}{'max |err|':>10}{'err/bound':>11}{'time':>7}  result")
    rng = np.random.default_rng(seed)
    for name, fn in FAMILIES.items():
        if families is not None and name not in families:
            continue
        _run_family(rep, p, name, fn, rng, device, quick)

    # 4. model
    if model:
        p()
        p(f"Model: the bundled demo checkpoint on '{device}' vs the reference backend")
        try:
            for c in check_model(device):
                rep.checks.append(c)
                p(_kernel_row(c))
        except Exception as e:  # noqa: BLE001
            c = Check("model", "demo", ok=False, detail=f"{type(e).__name__}: {e}")
            rep.checks.append(c)
            p(f"  demo model: {c.detail}    FAIL")
    return _finish(rep, p, t_start)


def _pipelines(rep: Report, p, device: str) -> None:
    core = _core()
    table = [k["name"] for k in core.kernel_table()]
    try:
        rep.limits = pipeline_limits(device)
    except Exception as e:  # noqa: BLE001 - e.g. a pipeline that fails to build on Metal
        rep.checks.append(Check("pipelines", "create", ok=False, detail=f"{type(e).__name__}: {e}"))
        p(f"Pipelines: {type(e).__name__}: {e}    FAIL")
        return
    registered = None
    if device == "emu":
        registered = {k["name"] for k in core.emu.kernels()}
    elif device == "metal" and hasattr(core, "metal") and hasattr(core.metal, "library_functions"):
        registered = set(core.metal.library_functions())
    if registered is not None:
        # Tensor-op kernels (lily_m5.metallib) are expected only where the device reports tensor ops.
        m5 = {k["name"] for k in core.kernel_table() if k.get("tensor_ops")}
        has_m5 = device == "emu" or bool(device_facts(device).get("tensor_ops"))
        missing = [n for n in table if n not in registered and (has_m5 or n not in m5)]
        where = "emulator registry" if device == "emu" else "Metal library"
        rep.checks.append(Check("pipelines", "kernel table", f"{len(table)} ids", not missing,
                                detail=f"missing from the {where}: {missing}" if missing else ""))
        p(f"Pipelines: {len(table)} kernel ids, "
          + (f"all in the {where}    PASS" if not missing else f"{len(missing)} missing from the {where}: "
             f"{', '.join(missing[:5])}    FAIL"))
    else:
        p(f"Pipelines: {len(table)} kernel ids")
    if rep.limits is None:
        p("  pipeline limits: not reported by this build")
        rep.checks.append(Check("pipelines", "limits", detail="not reported by this build"))
        return
    shape = lambda d: (d.get("max_threads"), d.get("static_threadgroup_bytes"), d.get("simd_width"))  # noqa: E731
    if rep.limits and len({shape(d) for d in rep.limits}) == 1:
        # e.g. the emulator: one line instead of a table of identical rows (--json has them all)
        mt, tg, sw = shape(rep.limits[0])
        p(f"  every kernel id: max threads per threadgroup {mt}, static threadgroup memory "
          f"{'not known before a run' if tg is None else _fmt_bytes(tg)}, SIMD width {sw}")
    else:
        p(f"  {'kernel':<34}{'max threads':>12}{'threadgroup mem':>17}{'simd':>6}")
        for d in rep.limits:
            tg = d.get("static_threadgroup_bytes")
            p(f"  {d.get('kernel', '?'):<34}{d.get('max_threads', '-')!s:>12}"
              f"{'-' if tg is None else _fmt_bytes(tg):>17}{d.get('simd_width', '-')!s:>6}")
    over = [d["kernel"] for d in rep.limits if (d.get("static_threadgroup_bytes") or 0) > 32 * 1024]
    listed = {d.get("kernel") for d in rep.limits}
    unlisted = [n for n in table if n not in listed]
    ok = not over and not unlisted
    rep.checks.append(Check("pipelines", "limits", f"{len(rep.limits)} pipelines", ok,
                            detail=(f"over 32 KiB of threadgroup memory: {over}; " if over else "")
                            + (f"no limits for: {unlisted}" if unlisted else "")))
    if not ok:
        p(f"  {rep.checks[-1].detail}    FAIL")


def _run_family(rep: Report, p, name: str, fn, rng, device: str, quick: bool) -> None:
    t0 = time.perf_counter()
    gen = fn(rng, device, quick=quick)
    while True:
        try:
            case, err, ratio, detail = next(gen)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - a kernel error is a failed check, not a crash
            c = Check("kernels", name, "(error)", False, seconds=time.perf_counter() - t0,
                      detail=f"{type(e).__name__}: {e}")
            rep.checks.append(c)
            p(_kernel_row(c))
            return
        c = Check("kernels", name, case, bool(ratio <= 1.0), err, ratio, time.perf_counter() - t0, detail)
        rep.checks.append(c)
        p(_kernel_row(c))
        t0 = time.perf_counter()


def _kernel_row(c: Check) -> str:
    err = "-" if c.max_err is None else f"{c.max_err:.2e}"
    ratio = "-" if c.ratio is None else ("inf" if c.ratio == float("inf") else f"{c.ratio:.3f}")
    t = "" if c.seconds is None else f"{c.seconds:.1f}s"
    res = "PASS" if c.ok else ("INFO" if c.ok is None else "FAIL")
    line = f"  {c.name:<19}{c.case:<52}{err:>10}{ratio:>11}{t:>7}  {res}"
    if c.detail and (c.ok is not True or c.section == "model"):
        line += f"  ({c.detail})"
    return line


def _finish(rep: Report, p, t_start: float) -> Report:
    rep.seconds = time.perf_counter() - t_start
    n = sum(c.ok is not None for c in rep.checks)
    p()
    if rep.failed:
        p(f"FAILED: {len(rep.failed)} of {n} checks failed ({rep.seconds:.1f} s): "
          + ", ".join(f"{c.name} {c.case}".strip() for c in rep.failed))
        p(f"Replay with --seed {rep.seed}; attach the output of `lily-py doctor --json doctor.json` "
          "to a bug report.")
    else:
        p(f"OK: all {n} checks passed ({rep.seconds:.1f} s)")
    return rep


def doctor(device: str | None = None, *, quick: bool = False, json_path: str | None = None,
           seed: int | None = None, out: TextIO | None = sys.stdout) -> int:
    """Run the checks (see the module docstring), print them, and return the exit status:
    0 when everything passed, 1 when a check failed."""
    rep = run(device, quick=quick, seed=seed, out=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep.to_json(), f, indent=2, default=str)
    return rep.exit_status
