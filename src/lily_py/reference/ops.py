"""Elementwise and normalisation ops of the reference model (float32 NumPy)."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis.

    ``weight`` is the effective multiplier: for the zero-centred norms of the Hugging Face
    checkpoint that is ``1 + w`` (the checkpoint loader adds the 1; MLX files store it folded).
    """
    x = x.astype(np.float32, copy=False)
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * weight


def gated_rms_norm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gated DeltaNet output norm: ``weight * rms_norm(x) * silu(z)`` (norm first, then gate)."""
    return rms_norm(x, weight, eps) * silu(z)


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (the DeltaNet q/k normalisation)."""
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def sigmoid(x: np.ndarray) -> np.ndarray:
    # Written with exp of a non-positive number only, so it never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x * sigmoid(x)).astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))``, computed stably."""
    return np.logaddexp(np.float32(0), x).astype(np.float32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def rope_cos_sin(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables ``[T, rotary_dim]`` for rotate-half (NeoX) RoPE.

    ``inv_freq[i] = theta^(-2i/rotary_dim)`` rounded to float32, angle = float32(position) *
    inv_freq rounded to float32 — the precision transformers, mlx and our kernels use. (At
    position 1e5 a float32 angle is off by up to ~4e-3 rad from the exact one; matching the
    implementations matters more here than exactness.) cos/sin are then taken in float64.
    """
    inv_freq = (1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
                ).astype(np.float32)
    ang = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    ang = np.concatenate([ang, ang], axis=-1).astype(np.float64)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_partial_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the first ``rotary_dim`` features of ``x [T, heads, D]``; the rest pass through.

    Rotate-half pairing inside the rotary part: feature ``i`` pairs with ``i + rotary_dim/2``.
    """
    rd = cos.shape[-1]
    r, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot_half = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([r * c + rot_half * s, rest], axis=-1).astype(np.float32)
