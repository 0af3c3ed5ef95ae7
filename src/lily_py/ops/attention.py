"""Attention-family kernels over NumPy arrays (re-exported by :mod:`lily_py.ops`).

The functions take the KV cache as bfloat16 ``[kv_heads, capacity, head_dim]`` (head-major; a
float32 array is the engine's ``kv_dtype="float32"`` cache, a ``Q8Cache`` its int8 one) and hand
it to the kernels paged, as the engine holds it: pools ``[blocks, kv_heads, block_tokens,
head_dim]`` read and written through a block table (``block_tokens`` a power of two >= 32, default
32; ``block_table`` the pool block of each logical block, default a scrambled order, so that every
call crosses block boundaries through the table). They return new arrays (inputs are copied to the
device, never modified). NumPy oracles:
``lily_py.reference.kernels.rope / qk_norm_rope / attention``. Shapes of the real model: 16 query
heads, 2 KV heads, head_dim 256, rotary_dim 64, theta 1e7.
"""
from __future__ import annotations

import numpy as np

import ml_dtypes

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


from typing import NamedTuple

from ._common import _check_device, _core, _float_array, _from_core

__all__ = ["rope", "qk_norm_rope_append", "attention_decode", "attention_prefill",
           "attention_decode_route", "attention_prefill_route", "attention_mixer", "Q8Cache"]


class Q8Cache(NamedTuple):
    """An int8 KV cache (the engine's ``kv_dtype="int8"``, shaders/common/kv_blocks.h): ``codes``
    int8 ``[kv_heads, capacity, head_dim]`` and ``scales`` float32 ``[kv_heads, capacity]``; row
    values are ``codes * scales[..., None]``. Pass it wherever the functions here take a bfloat16
    cache (head_dim 64, 128 or 256): the KV write quantizes each new row
    (``lily_py.reference.kvquant.int8_row_codes``) and attention reads the codes."""
    codes: np.ndarray
    scales: np.ndarray

    @classmethod
    def quantize(cls, x: np.ndarray) -> "Q8Cache":
        from ..reference.kvquant import int8_row_codes
        q, s = int8_row_codes(x)
        return cls(q, s[..., 0])

    def values(self) -> np.ndarray:
        return self.codes.astype(np.float32) * self.scales[..., None]

    @property
    def shape(self) -> tuple:
        return self.codes.shape


def _uint(v, what: str, fn: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{fn}: {what} must be a non-negative integer, got {v!r}")
    return int(v)


def _check_rotary(rotary_dim, head_dim: int, theta, fn: str) -> int:
    rd = _uint(rotary_dim, "rotary_dim", fn)
    if rd % 2 or rd > head_dim:
        raise ValueError(f"{fn}: rotary_dim must be even and <= head_dim ({head_dim}), got {rd}")
    if not float(theta) > 0:
        raise ValueError(f"{fn}: theta must be > 0, got {theta!r}")
    return rd


def _cache(a, what: str, fn: str):
    if isinstance(a, Q8Cache):
        c, sc = np.asarray(a.codes), np.asarray(a.scales)
        if c.dtype != np.int8 or c.ndim != 3 or sc.dtype != np.float32 or sc.shape != c.shape[:2]:
            raise ValueError(f"{fn}: {what} (Q8Cache) must hold int8 codes [kv_heads, capacity, head_dim] and "
                             f"float32 scales [kv_heads, capacity], got {c.dtype} {list(c.shape)} and "
                             f"{sc.dtype} {list(sc.shape)}")
        if c.shape[2] not in (64, 128, 256):
            raise ValueError(f"{fn}: an int8 cache needs head_dim 64, 128 or 256, got {c.shape[2]}")
        return Q8Cache(np.ascontiguousarray(c), np.ascontiguousarray(sc))
    if not isinstance(a, np.ndarray) or a.dtype not in (BFLOAT16, np.float32) or a.ndim != 3:
        raise ValueError(f"{fn}: {what} must be a bfloat16 or float32 array [kv_heads, capacity, head_dim], got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {list(getattr(a, 'shape', []))}")
    if a.dtype == np.float32:  # the float32 cache: pools of float32 rows
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(a).view(np.uint16)


def _same_format(kc, vc, fn: str) -> None:
    if type(kc) is not type(vc) or (isinstance(kc, np.ndarray) and kc.dtype != vc.dtype):
        raise ValueError(f"{fn}: k_cache and v_cache must both be bfloat16 or both Q8Cache (or both float32)")


def _as_cache(pool_rows: np.ndarray) -> np.ndarray:
    """Unpaged uint16 rows -> bfloat16; float32 rows stay float32."""
    return pool_rows if pool_rows.dtype == np.float32 else pool_rows.view(BFLOAT16)


BF16_NAN = 0x7fc0
DEFAULT_OP_BLOCK_TOKENS = 32    # the ops' cache blocks (the engine's default is 1024: docs/memory.md)
ENGINE_BLOCK_TOKENS = 1024      # the engine's default tokens per KV cache block


def _page(kc, vc, block_tokens, block_table, fn: str):
    """[Hkv, cap, D] uint16 (bf16) or float32 caches -> pools [blocks, Hkv, B, D] of that dtype +
    uint32 table [ceil(cap / B)]; Q8Cache -> uint8 pools [blocks, Hkv, B, D + 4] (each block: codes,
    then float32 scales)."""
    B = DEFAULT_OP_BLOCK_TOKENS if block_tokens is None else _uint(block_tokens, "block_tokens", fn)
    minb = int(_core().ops.ATTN_KV_MIN_BLOCK)
    if B < minb or B & (B - 1):
        raise ValueError(f"{fn}: block_tokens must be a power of two >= {minb}, got {B}")
    Hkv, cap, D = kc.shape
    nb = -(-cap // B)
    if block_table is None:
        table = ((np.arange(nb, dtype=np.int64) * 5 + 3) % nb).astype(np.uint32)  # a permutation (5 coprime)
        if nb % 5 == 0:
            table = np.arange(nb, dtype=np.uint32)[::-1].copy()
    else:
        table = np.asarray(block_table)
        if table.ndim != 1 or table.shape[0] < nb or table.dtype.kind not in "iu" or (table < 0).any():
            raise ValueError(f"{fn}: block_table must be {nb} or more non-negative integers, got "
                             f"{table.dtype} {list(table.shape)}")
        table = table[:nb].astype(np.uint32)
        if len(set(table.tolist())) != nb:
            raise ValueError(f"{fn}: block_table maps two logical blocks to one pool block")
    blocks = int(table.max()) + 1
    pools = []
    if isinstance(kc, Q8Cache):
        for c in (kc, vc):
            # Pool blocks outside the table: all bytes 0xff, so their scales are NaN (fp traps).
            pool = np.full((blocks, Hkv * B * (D + 4)), 0xFF, np.uint8)
            codes = np.zeros((Hkv, nb * B, D), np.int8)
            codes[:, :cap] = c.codes
            scales = np.zeros((Hkv, nb * B), np.float32)
            scales[:, :cap] = c.scales
            cb = codes.reshape(Hkv, nb, B, D).transpose(1, 0, 2, 3).reshape(nb, -1).view(np.uint8)
            sb = np.ascontiguousarray(scales.reshape(Hkv, nb, B).transpose(1, 0, 2)).reshape(nb, -1).view(np.uint8)
            pool[table] = np.concatenate([cb, sb], axis=1)
            pools.append(pool.reshape(blocks, Hkv, B, D + 4))
        return pools[0], pools[1], table
    for c in (kc, vc):
        # Pool blocks outside the table hold NaN: a kernel reading them fails the call (fp traps).
        pool = np.full((blocks, Hkv, B, D), np.nan if c.dtype == np.float32 else BF16_NAN, c.dtype)
        pad = np.zeros((Hkv, nb * B, D), c.dtype)
        pad[:, :cap] = c
        pool[table] = pad.reshape(Hkv, nb, B, D).transpose(1, 0, 2, 3)
        pools.append(pool)
    return pools[0], pools[1], table


def _unpage(pool: np.ndarray, table: np.ndarray, cap: int):
    if pool.dtype == np.uint8:  # int8 pools [blocks, Hkv, B, D + 4] -> Q8Cache
        blocks, Hkv, B, D = pool.shape[0], pool.shape[1], pool.shape[2], pool.shape[3] - 4
        flat = np.ascontiguousarray(pool.reshape(blocks, -1)[table])
        nb = len(table)
        codes = flat[:, :Hkv * B * D].copy().view(np.int8).reshape(nb, Hkv, B, D).transpose(1, 0, 2, 3)
        scales = flat[:, Hkv * B * D:].copy().view(np.float32).reshape(nb, Hkv, B).transpose(1, 0, 2)
        return Q8Cache(np.ascontiguousarray(codes.reshape(Hkv, -1, D)[:, :cap]),
                       np.ascontiguousarray(scales.reshape(Hkv, -1)[:, :cap]))
    blocks, Hkv, B, D = pool.shape
    return np.ascontiguousarray(pool[table].transpose(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :cap])


def rope(x: np.ndarray, *, position: int, rotary_dim: int, theta: float, device: str = "emu") -> np.ndarray:
    """Partial rotary embedding (rotate-half) of ``x [tokens, heads, head_dim]``; token ``t`` is at
    ``position + t``. Feature ``i < rotary_dim / 2`` pairs with ``i + rotary_dim / 2``; features
    ``>= rotary_dim`` pass through. Angles ``float32(pos) * inv_freq`` in float32 as
    ``lily_py.reference.ops.rope_cos_sin``; float32 or bfloat16, math in float32."""
    return _rope(x, position=position, rotary_dim=rotary_dim, theta=theta, device=device)[0]


def _rope(x, *, position, rotary_dim, theta, device="emu", order="shuffle", seed=0, fp_traps=True):
    fn = "rope"
    xc, dt = _float_array(x, "x", fn)
    if xc.ndim != 3 or 0 in xc.shape:
        raise ValueError(f"{fn}: x must be a non-empty [tokens, heads, head_dim] array, got {list(x.shape)}")
    rd = _check_rotary(rotary_dim, x.shape[2], theta, fn)
    pos = _uint(position, "position", fn)
    _check_device(device, fn)
    y, stats = _core().ops.rope(xc, rotary_dim=rd, position=pos, theta=float(theta), dtype=dt, device=device,
                                order=order, seed=seed, fp_traps=fp_traps)
    return _from_core(y, dt), stats


def qk_norm_rope_append(qg: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray,
                        k_cache: np.ndarray, v_cache: np.ndarray, *, position: int, rotary_dim: int,
                        theta: float, eps: float = 1e-6, weight_offset: float = 0.0, device: str = "emu",
                        block_tokens: int | None = None, block_table=None):
    """The attention layer's fused step after the projections: returns ``(q, k_cache, v_cache)``.

    ``qg [T, Hq, 2 * D]`` is q_proj's output (per head the query, then the output gate),
    ``k, v [T, Hkv, D]``. The query and key heads get RMSNorm (weights ``q_norm``/``k_norm [D]``
    plus ``weight_offset``: 1 for Hugging Face's zero-centred weights, 0 for MLX files) and partial
    RoPE at positions ``position .. position + T - 1``; ``q [T, Hq, D]`` is returned, the keys and
    ``v`` are written to rows ``position ..`` of copies of the bfloat16 caches
    ``[Hkv, capacity, D]`` (other rows unchanged; written through the block table, module doc).
    Activations float32 or bfloat16, math float32.
    """
    q, kc, vc, _ = _qk_norm_rope_append(qg, k, v, q_norm, k_norm, k_cache, v_cache, position=position,
                                        rotary_dim=rotary_dim, theta=theta, eps=eps,
                                        weight_offset=weight_offset, device=device,
                                        block_tokens=block_tokens, block_table=block_table)
    return q, kc, vc


def _qk_norm_rope_append(qg, k, v, q_norm, k_norm, k_cache, v_cache, *, position, rotary_dim, theta, eps=1e-6,
                         weight_offset=0.0, device="emu", order="shuffle", seed=0, fp_traps=True,
                         block_tokens=None, block_table=None):
    fn = "qk_norm_rope_append"
    qc, dt = _float_array(qg, "qg", fn)
    if qc.ndim != 3 or 0 in qc.shape or qc.shape[2] % 2:
        raise ValueError(f"{fn}: qg must be [tokens, q_heads, 2 * head_dim], got {list(qg.shape)}")
    T, Hq, D = qc.shape[0], qc.shape[1], qc.shape[2] // 2
    kc_, kdt = _float_array(k, "k", fn)
    vc_, vdt = _float_array(v, "v", fn)
    if kdt != dt or vdt != dt:
        raise ValueError(f"{fn}: qg, k and v must have the same dtype, got {qg.dtype}, {k.dtype}, {v.dtype}")
    if kc_.ndim != 3 or kc_.shape[0] != T or kc_.shape[2] != D or kc_.shape[1] == 0 or vc_.shape != kc_.shape:
        raise ValueError(f"{fn}: k and v must be [tokens={T}, kv_heads, head_dim={D}], got "
                         f"{list(k.shape)} and {list(v.shape)}")
    Hkv = kc_.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{fn}: q_heads={Hq} is not a multiple of kv_heads={Hkv}")
    qn, wdt = _float_array(q_norm, "q_norm", fn)
    kn, kwdt = _float_array(k_norm, "k_norm", fn)
    if qn.shape != (D,) or kn.shape != (D,) or kwdt != wdt:
        raise ValueError(f"{fn}: q_norm and k_norm must be [{D}] of one dtype, got {q_norm.dtype} "
                         f"{list(q_norm.shape)} and {k_norm.dtype} {list(k_norm.shape)}")
    kcache, vcache = _cache(k_cache, "k_cache", fn), _cache(v_cache, "v_cache", fn)
    _same_format(kcache, vcache, fn)
    if kcache.shape[0] != Hkv or kcache.shape[2] != D or vcache.shape != kcache.shape:
        raise ValueError(f"{fn}: caches must be [kv_heads={Hkv}, capacity, head_dim={D}], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    pos = _uint(position, "position", fn)
    if pos + T > kcache.shape[1]:
        raise ValueError(f"{fn}: rows {pos}..{pos + T - 1} do not fit a cache of capacity {kcache.shape[1]}")
    rd = _check_rotary(rotary_dim, D, theta, fn)
    if not float(eps) > 0:
        raise ValueError(f"{fn}: eps must be > 0, got {eps!r}")
    _check_device(device, fn)
    kp, vp, table = _page(kcache, vcache, block_tokens, block_table, fn)
    q, kco, vco, stats = _core().ops.qk_norm_rope(
        qc, kc_, vc_, qn, kn, kp, vp, table, position=pos, rotary_dim=rd, theta=float(theta), eps=float(eps),
        weight_offset=float(weight_offset), x_dtype=dt, w_dtype=wdt, device=device, order=order, seed=seed,
        fp_traps=fp_traps)
    cap = kcache.shape[1]
    if isinstance(kcache, Q8Cache):
        return _from_core(q, dt), _unpage(kco, table, cap), _unpage(vco, table, cap), stats
    return _from_core(q, dt), _as_cache(_unpage(kco, table, cap)), _as_cache(_unpage(vco, table, cap)), stats


def attention_decode_route(length: int, head_dim: int, block_tokens: int = ENGINE_BLOCK_TOKENS) -> dict:
    """How :func:`attention_decode` runs for ``length`` keys and ``head_dim``: ``{"route": "vec" |
    "single" | "split", "splits", "split_keys"}``. head_dim 64, 128 or 256: the "vec" route (lanes
    split the head dim, min(80, ceil(length / 8)) key blocks per KV head wanted, each of that share
    of the keys rounded down to a power of two (>= 8, so at most twice as many blocks) within one
    cache block of ``block_tokens``, then a combine pass).
    Other head dims: up to 256 keys one pass; longer contexts split the keys into at most 32 ranges
    (multiples of 32 keys) and combine the partial softmaxes."""
    fn = "attention_decode_route"
    return dict(_core().ops.attention_decode_route(_uint(length, "length", fn), _uint(head_dim, "head_dim", fn),
                                                   _uint(block_tokens, "block_tokens", fn)))


def attention_prefill_route(head_dim: int, *, tensor_ops: bool = False, dtype="float32",
                            kv_dtype: str = "bfloat16") -> str:
    """How :func:`attention_prefill` runs for ``head_dim``, activation ``dtype`` (float32 or
    bfloat16) and a cache of ``kv_dtype`` ("bfloat16", "int8" or "float32"): ``"m5"`` (Metal 4
    tensor ops, shaders/m5/attention_m5.metal: head_dim 64, 128 or 256 on a device with tensor
    ops, an M5), ``"tiles"`` (bfloat16 activations at head_dim 64, 128 or 256 without tensor ops:
    bf16 simdgroup matrices, M1-M4), ``"mma"`` (8x8 fp32 simdgroup matrices; head_dim a multiple
    of 32, and of 64 above 128: 64, 128, 256, ...) or ``"simd"`` (scalar fp32). A float32 cache
    takes mma or simd on every device (fp32 K and V operands)."""
    fn = "attention_prefill_route"
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"{fn}: dtype must be float32 or bfloat16, got {dtype!r}")
    if kv_dtype not in ("bfloat16", "int8", "float32"):
        raise ValueError(f"{fn}: kv_dtype must be 'bfloat16', 'int8' or 'float32', got {kv_dtype!r}")
    return str(_core().ops.attention_prefill_route(_uint(head_dim, "head_dim", fn), bool(tensor_ops),
                                                   name == "bfloat16", kv_dtype))


def _check_attention(q, k_cache, v_cache, gate, fn, tokens_axis: bool):
    qc, dt = _float_array(q, "q", fn)
    want = "[tokens, q_heads, head_dim]" if tokens_axis else "[q_heads, head_dim]"
    if qc.ndim != (3 if tokens_axis else 2) or 0 in qc.shape:
        raise ValueError(f"{fn}: q must be a non-empty {want} array, got {list(q.shape)}")
    q3 = qc if tokens_axis else qc[None]
    T, Hq, D = q3.shape
    kc, vc = _cache(k_cache, "k_cache", fn), _cache(v_cache, "v_cache", fn)
    _same_format(kc, vc, fn)
    if kc.shape[2] != D or vc.shape != kc.shape or kc.shape[0] == 0:
        raise ValueError(f"{fn}: caches must be [kv_heads, capacity, head_dim={D}], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    Hkv = kc.shape[0]
    max_group = int(_core().ops.ATTN_MAX_GROUP)
    if Hq % Hkv or Hq // Hkv > max_group:
        raise ValueError(f"{fn}: q_heads={Hq} must be a multiple of kv_heads={Hkv} with at most "
                         f"{max_group} query heads per KV head")
    if D > int(_core().ops.ATTN_MAX_HEAD_DIM):
        raise ValueError(f"{fn}: head_dim={D} > {int(_core().ops.ATTN_MAX_HEAD_DIM)}")
    gc = None
    if gate is not None:
        gc, gdt = _float_array(gate, "gate", fn)
        if gc.shape != qc.shape or gdt != dt:
            raise ValueError(f"{fn}: gate must match q ({q.dtype} {list(q.shape)}), got {gate.dtype} {list(gate.shape)}")
        gc = gc.reshape(q3.shape)
    return q3, kc, vc, gc, dt


def attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, *, length: int,
                     gate: np.ndarray | None = None, device: str = "emu", block_tokens: int | None = None,
                     block_table=None) -> np.ndarray:
    """One query token's attention over cache rows ``0 .. length - 1``: ``q [Hq, D]`` (float32 or
    bfloat16), caches bfloat16 ``[Hkv, capacity, D]``; query head ``h`` uses KV head
    ``h // (Hq / Hkv)`` and the heads sharing a KV head read each cache row once. Returns
    ``softmax(q k^T / sqrt(D)) v`` ``[Hq, D]``, times ``sigmoid(gate)`` if ``gate [Hq, D]`` is given.
    Route: :func:`attention_decode_route`."""
    return _attention_decode(q, k_cache, v_cache, length=length, gate=gate, device=device,
                             block_tokens=block_tokens, block_table=block_table)[0]


def _attention_decode(q, k_cache, v_cache, *, length, gate=None, device="emu", order="shuffle", seed=0,
                      fp_traps=True, block_tokens=None, block_table=None):
    fn = "attention_decode"
    q3, kc, vc, gc, dt = _check_attention(q, k_cache, v_cache, gate, fn, tokens_axis=False)
    n = _uint(length, "length", fn)
    if not 1 <= n <= kc.shape[1]:
        raise ValueError(f"{fn}: length must be in [1, capacity={kc.shape[1]}], got {n}")
    _check_device(device, fn)
    kp, vp, table = _page(kc, vc, block_tokens, block_table, fn)
    out, stats = _core().ops.attention(q3, kp, vp, table, gc, position=n - 1, decode=True, dtype=dt, device=device,
                                       order=order, seed=seed, fp_traps=fp_traps)
    return _from_core(out, dt)[0], stats


def attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, *, position: int,
                      gate: np.ndarray | None = None, device: str = "emu", block_tokens: int | None = None,
                      block_table=None) -> np.ndarray:
    """Causal attention of a chunk of queries ``q [T, Hq, D]`` at positions ``position ..
    position + T - 1`` over the bfloat16 caches ``[Hkv, capacity, D]``, which must already hold
    rows ``0 .. position + T - 1`` (earlier chunks and this chunk's own keys). Token ``t`` attends
    rows ``0 .. position + t``. Blockwise with an online softmax: no ``T x T`` score matrix.
    Returns ``[T, Hq, D]`` (times ``sigmoid(gate)`` if ``gate [T, Hq, D]`` is given)."""
    return _attention_prefill(q, k_cache, v_cache, position=position, gate=gate, device=device,
                              block_tokens=block_tokens, block_table=block_table)[0]


def _attention_prefill(q, k_cache, v_cache, *, position, gate=None, device="emu", order="shuffle", seed=0,
                       fp_traps=True, block_tokens=None, block_table=None):
    fn = "attention_prefill"
    q3, kc, vc, gc, dt = _check_attention(q, k_cache, v_cache, gate, fn, tokens_axis=True)
    pos = _uint(position, "position", fn)
    if pos + q3.shape[0] > kc.shape[1]:
        raise ValueError(f"{fn}: rows up to {pos + q3.shape[0] - 1} needed but the cache has capacity {kc.shape[1]}")
    _check_device(device, fn)
    kp, vp, table = _page(kc, vc, block_tokens, block_table, fn)
    out, stats = _core().ops.attention(q3, kp, vp, table, gc, position=pos, decode=False, dtype=dt, device=device,
                                       order=order, seed=seed, fp_traps=fp_traps)
    return _from_core(out, dt), stats


def attention_mixer(x: np.ndarray, weights: dict, k_cache: np.ndarray, v_cache: np.ndarray, *, position: int,
                    q_heads: int, rotary_dim: int, theta: float, eps: float = 1e-6, weight_offset: float = 0.0,
                    bits: int = 4, group_size: int = 64, device: str = "emu", block_tokens: int | None = None,
                    block_table=None):
    """The gated-attention token mixer of one layer for ``x [T, hidden]`` at ``position``, encoded
    as one device step: q/k/v projections (quantized matmul), q/k norm + RoPE + KV append,
    attention (decode route for ``T == 1``, prefill otherwise), output gate, o_proj.

    ``weights``: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` as ``(w, scales, biases)`` in MLX
    layout (``bits``, ``group_size``), ``q_norm``, ``k_norm`` ``[head_dim]``. Instead of the three
    input projections, ``qkv_proj`` (their rows concatenated, as a loader fuses them) makes them one
    matmul. Returns ``(out [T, hidden], k_cache, v_cache)``."""
    out, kc, vc, _ = _attention_mixer(x, weights, k_cache, v_cache, position=position, q_heads=q_heads,
                                      rotary_dim=rotary_dim, theta=theta, eps=eps, weight_offset=weight_offset,
                                      bits=bits, group_size=group_size, device=device,
                                      block_tokens=block_tokens, block_table=block_table)
    return out, kc, vc


def _attention_mixer(x, weights, k_cache, v_cache, *, position, q_heads, rotary_dim, theta, eps=1e-6,
                     weight_offset=0.0, bits=4, group_size=64, device="emu", order="shuffle", seed=0,
                     fp_traps=True, block_tokens=None, block_table=None):
    fn = "attention_mixer"
    xc, dt = _float_array(x, "x", fn)
    if xc.ndim != 2 or 0 in xc.shape:
        raise ValueError(f"{fn}: x must be a non-empty [tokens, hidden] array, got {list(x.shape)}")
    kc, vc = _cache(k_cache, "k_cache", fn), _cache(v_cache, "v_cache", fn)
    if vc.shape != kc.shape:
        raise ValueError(f"{fn}: k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ")
    D = kc.shape[2]
    proj, sdt = [], None
    names = ("qkv_proj", "o_proj") if "qkv_proj" in weights else ("q_proj", "k_proj", "v_proj", "o_proj")
    for name in names:
        if name not in weights or len(weights[name]) != 3:
            raise ValueError(f"{fn}: weights[{name!r}] must be (w, scales, biases)")
        w, s, b = weights[name]
        if not isinstance(w, np.ndarray) or w.dtype != np.uint32 or w.ndim != 2:
            raise ValueError(f"{fn}: {name} weight must be a 2-D uint32 array")
        sc, st = _float_array(s, f"{name} scales", fn)
        bc, bt = _float_array(b, f"{name} biases", fn)
        if sdt is None:
            sdt = st
        if st != sdt or bt != sdt:
            raise ValueError(f"{fn}: every projection's scales and biases must share one dtype")
        proj += [np.ascontiguousarray(w), sc, bc]
    qn, wdt = _float_array(weights.get("q_norm"), "q_norm", fn)
    kn, kwdt = _float_array(weights.get("k_norm"), "k_norm", fn)
    if kwdt != wdt:
        raise ValueError(f"{fn}: q_norm and k_norm must share one dtype")
    pos = _uint(position, "position", fn)
    if pos + xc.shape[0] > kc.shape[1]:
        raise ValueError(f"{fn}: rows up to {pos + xc.shape[0] - 1} needed but the cache has capacity {kc.shape[1]}")
    rd = _check_rotary(rotary_dim, D, theta, fn)
    _check_device(device, fn)
    kp, vp, table = _page(kc, vc, block_tokens, block_table, fn)
    out, kco, vco, stats = _core().ops.attention_mixer(
        xc, proj, bits=bits, group_size=group_size, scale_dtype=sdt, q_norm=qn, k_norm=kn, k_cache=kp,
        v_cache=vp, block_table=table, q_heads=_uint(q_heads, "q_heads", fn), rotary_dim=rd, theta=float(theta), eps=float(eps),
        weight_offset=float(weight_offset), position=pos, dtype=dt, w_dtype=wdt, device=device, order=order,
        seed=seed, fp_traps=fp_traps)
    cap = kc.shape[1]
    return (_from_core(out, dt), _unpage(kco, table, cap).view(BFLOAT16), _unpage(vco, table, cap).view(BFLOAT16),
            stats)
