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
