"""Kernel-level NumPy references: what each lily_py.ops function must compute.

Written for clarity, in float64 on the exact values the kernels see (activations as given,
weights dequantized by :mod:`lily_py.reference.quant` in float32), so a test measures only the
kernel's own rounding. Never imports the extension.
"""
from __future__ import annotations

import numpy as np

from . import quant


def quantized_matmul(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, *,
                     bits: int, group_size: int) -> np.ndarray:
    """``x @ dequantize(w, scales, biases).T`` in float64; ``x`` is ``[..., K]``, result ``[..., N]``."""
    wd = quant.dequantize(w, scales, biases, bits=bits, group_size=group_size).astype(np.float64)
    return np.asarray(x).astype(np.float64) @ wd.T


def quantized_matmul_error_scale(x: np.ndarray, w: np.ndarray, scales: np.ndarray,
                                 biases: np.ndarray, *, bits: int, group_size: int) -> np.ndarray:
    """``sum_k |x[m, k]| * (|s q[n, k]| + |b|)`` per output: the magnitude that fp32 rounding error
    of any summation order of ``x @ dequant(w).T`` is proportional to (``[..., N]``, float64)."""
    q = quant.unpack(w, bits).astype(np.float64)
    k = q.shape[-1]
    s = np.repeat(np.abs(np.asarray(scales).astype(np.float64)), group_size, axis=-1)[..., :k]
    b = np.repeat(np.abs(np.asarray(biases).astype(np.float64)), group_size, axis=-1)[..., :k]
    mag = s * q + b
    return np.abs(np.asarray(x).astype(np.float64)) @ mag.T


def rms_norm(x: np.ndarray, weight: np.ndarray, *, eps: float, weight_offset: float = 0.0) -> np.ndarray:
    """``x * rsqrt(mean(x^2, -1) + eps) * (weight + weight_offset)`` in float64.

    ``weight_offset = 1`` is Hugging Face's zero-centred RMSNorm (``(1 + w)``); MLX-format
    checkpoints store the folded multiplier (offset 0)."""
    x64 = np.asarray(x).astype(np.float64)
    w64 = np.asarray(weight).astype(np.float64) + weight_offset
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + np.float64(np.float32(eps))) * w64


def residual_add(x: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """The new residual stream ``h = x + residual``: added in float32, stored in x's dtype."""
    return (np.asarray(x).astype(np.float32) + np.asarray(residual).astype(np.float32)).astype(x.dtype)


def embedding(ids: np.ndarray, table: np.ndarray, scales: np.ndarray, biases: np.ndarray, *,
              bits: int, group_size: int) -> np.ndarray:
    """Rows ``ids`` of the dequantized table (float32, exactly the values fp32 dequantization gives)."""
    ids = np.asarray(ids)
    rows = quant.dequantize(table[ids.reshape(-1)], scales[ids.reshape(-1)], biases[ids.reshape(-1)],
                            bits=bits, group_size=group_size)
    return rows.reshape(*ids.shape, rows.shape[-1])


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up = gate * sigmoid(gate) * up`` in float64."""
    g = np.asarray(gate).astype(np.float64)
    return g / (1.0 + np.exp(-g)) * np.asarray(up).astype(np.float64)


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``x * sigmoid(gate)`` in float64 (gate broadcasts, e.g. one value per row)."""
    return np.asarray(x).astype(np.float64) / (1.0 + np.exp(-np.asarray(gate).astype(np.float64)))


# ---------------------------------------------------------------------------------------------
# Attention family (shaders/attention.metal): RoPE, fused q/k norm + RoPE + KV append, attention.
# The KV cache the kernels use is bf16 [kv_heads, capacity, head_dim] (head-major, unlike
# reference.attention.KVCache's [capacity, kv_heads, head_dim]).

def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """``float32(1 / theta^(2i / rotary_dim))``, exactly as :func:`lily_py.reference.ops.rope_cos_sin`."""
    return (1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))).astype(np.float32)


def rope_angles(positions, rotary_dim: int, theta: float) -> np.ndarray:
    """``[T, rotary_dim / 2]`` float32 angles ``float32(position) * inv_freq`` (one fp32 product)."""
    return np.asarray(positions, dtype=np.float32)[:, None] * rope_inv_freq(rotary_dim, theta)[None, :]


def rope(x: np.ndarray, *, position: int, rotary_dim: int, theta: float) -> np.ndarray:
    """Partial rotate-half RoPE of ``x [T, heads, D]`` (token t at ``position + t``) in float64,
    from the float32 angles the kernels compute; features ``>= rotary_dim`` pass through."""
    x64 = np.asarray(x).astype(np.float64)
    T = x64.shape[0]
    ang = rope_angles(np.arange(position, position + T), rotary_dim, theta).astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = rotary_dim // 2
    a, b = x64[..., :half], x64[..., half:rotary_dim]
    return np.concatenate([a * c - b * s, b * c + a * s, x64[..., rotary_dim:]], axis=-1)


def qk_norm_rope(qg: np.ndarray, k: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, *, position: int,
                 rotary_dim: int, theta: float, eps: float, weight_offset: float = 0.0):
    """``(q, k)`` after per-head RMSNorm and partial RoPE, float64: ``q`` from the query half of
    ``qg [T, Hq, 2D]`` (``[T, Hq, D]``), ``k`` from ``k [T, Hkv, D]``. The values go to the cache
    unchanged (rounded to bf16 there)."""
    D = k.shape[-1]
    q = rms_norm(np.asarray(qg)[..., :D], q_norm, eps=eps, weight_offset=weight_offset)
    kn = rms_norm(k, k_norm, eps=eps, weight_offset=weight_offset)
    return (rope(q, position=position, rotary_dim=rotary_dim, theta=theta),
            rope(kn, position=position, rotary_dim=rotary_dim, theta=theta))


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, *, position: int,
              gate: np.ndarray | None = None):
    """Causal GQA attention over a head-major cache, float64, and the magnitudes its error scales with.

    ``q [T, Hq, D]``: token ``t`` sits at ``position + t`` and sees cache rows ``0 .. position + t``;
    ``k_cache, v_cache [Hkv, capacity, D]``; query head ``h`` uses KV head ``h // (Hq / Hkv)``.
    Scores ``q . k * float32(D ** -0.5)``; ``out = softmax(scores) v`` times ``sigmoid(gate)``
    when a gate ``[T, Hq, D]`` is given. Returns ``(out [T, Hq, D], score_mag [T, Hq, 1],
    value_mag [T, Hq, D])``: ``score_mag = max_j scale * sum_d |q_d k_jd|`` (what the fp32 error of
    a score is proportional to) and ``value_mag = sum_j p_j |v_jd|`` (times the gate).
    """
    q64 = np.asarray(q).astype(np.float64)
    k64 = np.asarray(k_cache).astype(np.float64)
    v64 = np.asarray(v_cache).astype(np.float64)
    T, Hq, D = q64.shape
    Hkv = k64.shape[0]
    g = Hq // Hkv
    scale = np.float64(np.float32(D ** -0.5))
    out = np.empty((T, Hq, D))
    smag = np.empty((T, Hq, 1))
    vmag = np.empty((T, Hq, D))
    for t in range(T):
        S = position + t + 1
        for h in range(Hq):
            kk, vv = k64[h // g, :S], v64[h // g, :S]
            s = kk @ q64[t, h] * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ vv
            smag[t, h] = (np.abs(kk) @ np.abs(q64[t, h])).max() * scale
            vmag[t, h] = p @ np.abs(vv)
    if gate is not None:
        sg = 1.0 / (1.0 + np.exp(-np.asarray(gate).astype(np.float64)))
        out *= sg
        vmag *= sg
    return out, smag, vmag
