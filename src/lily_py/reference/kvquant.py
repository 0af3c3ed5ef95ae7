"""8-bit KV cache formats in NumPy: quantize a K or V row and return what a kernel reads back.

Each function takes float32 rows ``[..., D]`` (one row per token and KV head) and returns the
dequantized float32 rows, the values attention computes with. The study in
``benchmarks/kv_quant_error.py`` compares them (docs/memory.md, "8-bit KV cache").

* ``int8_row``     symmetric int8, one scale per row of a head (``D`` values); the scale
                   ``max|x| / 127`` is stored as ``scale_dtype`` (float32 or bfloat16).
* ``int8_block``   symmetric int8, one float16 scale per ``block`` values (llama.cpp's q8_0
                   idea: blocks of 32).
* ``int8_affine``  asymmetric 8-bit, ``scale * q + bias`` per ``group`` values, scale and bias in
                   bfloat16 (mlx-lm's ``kv_bits=8``: ``mx.quantize`` with group size 64).
* ``fp8_row``      float8 e4m3 (finite variant, max 448) after dividing by a float32 scale per
                   row ``max|x| / 448``; ``scaled=False`` stores the values as e4m3 directly
                   (NaN above 448).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


def _round_to(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def int8_row_codes(x: np.ndarray, scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of each row (last axis): ``(codes int8, scales float32 [..., 1])`` with
    scale = max|x| / 127 and code = rint(x * (1 / scale)) in [-127, 127], all in float32: the
    engine's int8 KV cache (shaders/common/kv_blocks.h) rounds at exactly these points."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    s = _round_to(amax / np.float32(127), scale_dtype).astype(np.float32)
    inv = np.where(s > 0, np.float32(1) / np.where(s > 0, s, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(x * inv), -127, 127).astype(np.int8)
    return q, s


def int8_row(x: np.ndarray, scale_dtype=np.float32) -> np.ndarray:
    q, s = int8_row_codes(x, scale_dtype)
    return (q.astype(np.float32) * s).astype(np.float32)


def _grouped(x: np.ndarray, g: int) -> np.ndarray:
    if x.shape[-1] % g:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of the group size {g}")
    return np.asarray(x, np.float32).reshape(x.shape[:-1] + (x.shape[-1] // g, g))


def int8_block(x: np.ndarray, block: int = 32) -> np.ndarray:
    return int8_row(_grouped(x, block), np.float16).reshape(np.shape(x))


def int8_affine(x: np.ndarray, group: int = 64) -> np.ndarray:
    xg = _grouped(x, group)
    lo, hi = xg.min(axis=-1, keepdims=True), xg.max(axis=-1, keepdims=True)
    s = _round_to((hi - lo) / np.float32(255), ml_dtypes.bfloat16)
    b = _round_to(lo, ml_dtypes.bfloat16)
    q = np.clip(np.rint((xg - b) / np.where(s > 0, s, 1)), 0, 255)
    return (q * s + b).astype(np.float32).reshape(np.shape(x))


def fp8_row(x: np.ndarray, scaled: bool = True) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if not scaled:
        return _round_to(x, ml_dtypes.float8_e4m3fn)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(448), np.float32(1))
    return (_round_to(x / s, ml_dtypes.float8_e4m3fn) * s).astype(np.float32)


FORMATS = {
    "int8, fp32 scale per row (256)": int8_row,
    "int8, bf16 scale per row (256)": lambda x: int8_row(x, ml_dtypes.bfloat16),
    "int8, fp16 scale per 32 (q8_0-like)": int8_block,
    "int8, fp16 scale per 64": lambda x: int8_block(x, 64),
    "8-bit affine per 64, bf16 scale+bias (mlx-lm kv_bits=8)": int8_affine,
    "fp8 e4m3, fp32 scale per row": fp8_row,
    "fp8 e4m3, no scale": lambda x: fp8_row(x, scaled=False),
}


def row_bytes(name: str, d: int = 256) -> int:
    """Bytes one stored row of ``d`` values takes in format ``name`` (codes + scales + biases)."""
    per = {"int8, fp32 scale per row (256)": d + 4, "int8, bf16 scale per row (256)": d + 2,
           "int8, fp16 scale per 32 (q8_0-like)": d + 2 * (d // 32),
           "int8, fp16 scale per 64": d + 2 * (d // 64),
           "8-bit affine per 64, bf16 scale+bias (mlx-lm kv_bits=8)": d + 4 * (d // 64),
           "fp8 e4m3, fp32 scale per row": d + 4, "fp8 e4m3, no scale": d}
    return per[name]
