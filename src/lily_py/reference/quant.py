"""MLX affine quantization, in NumPy (the oracle for every quantized kernel).

Layout (mlx ``mx.quantize``, mode "affine"; see MODEL_FACTS.md section 5):

* ``w``      uint32 ``[..., N, K * bits / 32]`` — ``32 // bits`` values per word, element ``j`` of a
  word in bits ``[bits*j, bits*(j+1))``, least significant first.
* ``scales`` ``[..., N, K / group_size]`` (bf16, fp16 or fp32)
* ``biases`` ``[..., N, K / group_size]``
* dequantized ``W[n, k] = scales[n, k // g] * q[n, k] + biases[n, k // g]``

All math here is float32: scales and biases are widened exactly (bf16/fp16 -> fp32), the product and
sum are done in fp32, so the result is what a kernel that dequantizes in fp32 must produce.
"""
from __future__ import annotations

import numpy as np

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


def _check(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bits={bits}; expected one of {SUPPORTED_BITS}")
    if w.dtype != np.uint32:
        raise ValueError(f"packed weight must be uint32, got {w.dtype}")
    if scales.shape != biases.shape:
        raise ValueError(f"scales {scales.shape} and biases {biases.shape} differ in shape")
    if w.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"packed weight {w.shape} and scales {scales.shape} disagree on leading dims")
    k = w.shape[-1] * 32 // bits
    if w.shape[-1] * 32 % bits:
        raise ValueError(f"packed width {w.shape[-1]} words is not a whole number of {bits}-bit values")
    if scales.shape[-1] * group_size != k:
        raise ValueError(
            f"packed weight holds K={k} values per row but scales {scales.shape} with "
            f"group_size={group_size} cover {scales.shape[-1] * group_size}")
    return k


def unpack(w: np.ndarray, bits: int) -> np.ndarray:
    """Unpack uint32 words into integer codes ``[..., N, K]`` (uint8)."""
    w = np.ascontiguousarray(w, dtype=np.uint32)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (np.arange(per, dtype=np.uint32) * bits)
        q = (w[..., :, None] >> shifts) & np.uint32((1 << bits) - 1)
        return q.reshape(*w.shape[:-1], w.shape[-1] * per).astype(np.uint8)
    # 3/5/6-bit: values straddle words; treat the row as a little-endian bit stream.
    nbits = w.shape[-1] * 32
    k = nbits // bits
    as_bytes = w.view(np.uint8).reshape(*w.shape[:-1], w.shape[-1] * 4)
    bitstream = np.unpackbits(as_bytes, axis=-1, bitorder="little")
    bitstream = bitstream[..., : k * bits].reshape(*w.shape[:-1], k, bits)
    weights = (1 << np.arange(bits)).astype(np.uint16)
    return (bitstream.astype(np.uint16) * weights).sum(-1).astype(np.uint8)


def dequantize(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, *, bits: int,
               group_size: int) -> np.ndarray:
    """Dequantize MLX affine weights to float32 ``[..., N, K]``."""
    k = _check(w, scales, biases, bits, group_size)
    q = unpack(w, bits).astype(np.float32)
    s = np.asarray(scales).astype(np.float32)
    b = np.asarray(biases).astype(np.float32)
    q = q.reshape(*q.shape[:-1], k // group_size, group_size)
    out = q * s[..., None] + b[..., None]
    return out.reshape(*out.shape[:-2], k)


def quantize(x: np.ndarray, *, bits: int = 4, group_size: int = 64,
             scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize float weights ``[..., N, K]`` like ``mx.quantize`` (affine).

    Per group: ``scale = (max - min) / (2**bits - 1)``, ``bias = min``,
    ``q = round((x - bias) / scale)``. The scale and bias are rounded to ``scale_dtype`` first and
    the codes computed against the rounded values, so ``dequantize`` reproduces the grid exactly.
    Used to build test inputs and the demo checkpoint; exact agreement with mlx is not required.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bits={bits}; expected one of {SUPPORTED_BITS}")
    x = np.asarray(x, dtype=np.float32)
    *lead, n, k = x.shape
    if k % group_size:
        raise ValueError(f"last dim {k} is not a multiple of group_size {group_size}")
    g = x.reshape(*lead, n, k // group_size, group_size)
    lo = g.min(-1)
    hi = g.max(-1)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(scale_dtype)
    bias = lo.astype(scale_dtype)
    s32 = scale.astype(np.float32)
    b32 = bias.astype(np.float32)
    safe = np.where(s32 == 0, 1.0, s32)
    q = np.clip(np.rint((g - b32[..., None]) / safe[..., None]), 0, levels).astype(np.uint32)
    return pack(q.reshape(*lead, n, k), bits), scale, bias


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes ``[..., K]`` into uint32 words ``[..., K * bits / 32]``, MLX's layout (the
    inverse of :func:`unpack`): code i occupies bits [i * bits, (i + 1) * bits) of the row read as a
    little-endian bit stream, so 3-, 5- and 6-bit codes straddle words."""
    q = np.asarray(q, dtype=np.uint32)
    k = q.shape[-1]
    if k * bits % 32:
        raise ValueError(f"{k} codes of {bits} bits are not a whole number of 32-bit words")
    if 32 % bits == 0:
        per = 32 // bits
        shifts = np.arange(per, dtype=np.uint32) * bits
        return np.bitwise_or.reduce(q.reshape(*q.shape[:-1], k // per, per) << shifts, axis=-1).astype(np.uint32)
    stream = ((q[..., None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    as_bytes = np.packbits(stream.reshape(*q.shape[:-1], k * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(as_bytes).view(np.uint32)
