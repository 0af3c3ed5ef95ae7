"""The 8-bit KV cache formats of reference/kvquant.py: each dequantized row is within its format's
rounding bound of the input, uses the format's codes, and is not the input unchanged."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from lily_py.reference import kvquant as K


def rows(rng, shape=(37, 3, 256)):
    """Fresh K-like rows with a few outliers, the rows' scales spread over decades."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp(rng.uniform(-4, 3, shape[:-1] + (1,))).astype(np.float32)
    x[rng.random(shape) < 0.01] *= 20
    return x


def _scale(amax, dtype):
    return (amax / np.float32(127)).astype(dtype).astype(np.float32)


@pytest.mark.parametrize("scale_dtype", [np.float32, ml_dtypes.bfloat16])
def test_int8_row_within_half_a_step(scale_dtype):
    rng = np.random.default_rng()
    x = rows(rng)
    y = K.int8_row(x, scale_dtype)
    s = _scale(np.abs(x).max(-1, keepdims=True), scale_dtype)
    q = y / s
    assert np.all(np.abs(q - np.rint(q)) <= 1e-3) and np.abs(np.rint(q)).max() <= 127
    # a bf16 scale rounded down can clip the row's largest value by up to 127 * (rounding of s)
    clip = np.abs(x).max(-1, keepdims=True) - 127 * s
    bound = s / 2 + np.maximum(clip, 0) + 1e-6 * np.abs(x)
    assert np.all(np.abs(y - x) <= bound)
    assert np.abs(y - x).max() > 0


def test_int8_row_zero_row_stays_zero():
    x = rows(np.random.default_rng(), (5, 2, 64))
    x[2, 1] = 0
    y = K.int8_row(x)
    assert np.all(y[2, 1] == 0) and np.all(np.isfinite(y))


@pytest.mark.parametrize("block", [32, 64])
def test_int8_block_per_block_scale(block):
    rng = np.random.default_rng()
    x = rows(rng, (11, 2, 256))
    y = K.int8_block(x, block)
    xg = x.reshape(11, 2, 256 // block, block)
    s = _scale(np.abs(xg).max(-1, keepdims=True), np.float16)
    clip = np.maximum(np.abs(xg).max(-1, keepdims=True) - 127 * s, 0)
    assert np.all(np.abs(y.reshape(xg.shape) - xg) <= s / 2 + clip + 1e-6 * np.abs(xg))
    # finer blocks than a row: never worse than one fp32 scale per row by more than rounding
    assert np.abs(y - x).mean() <= np.abs(K.int8_row(x) - x).mean() * 1.05


def test_int8_affine_within_half_a_step():
    rng = np.random.default_rng()
    x = rows(rng, (9, 2, 256)) + np.float32(rng.uniform(-3, 3))
    y = K.int8_affine(x, 64).reshape(9, 2, 4, 64)
    xg = x.reshape(y.shape)
    lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    s = ((hi - lo) / np.float32(255)).astype(ml_dtypes.bfloat16).astype(np.float32)
    b = lo.astype(ml_dtypes.bfloat16).astype(np.float32)
    levels = (y - b) / s
    assert np.all(np.abs(levels - np.rint(levels)) <= 2e-3 * np.maximum(1, np.abs(levels)))
    edge = np.abs(lo - b) + np.maximum(hi - (b + 255 * s), 0)
    assert np.all(np.abs(y - xg) <= s / 2 + edge + 1e-5 * np.abs(xg))


@pytest.mark.parametrize("scaled", [True, False])
def test_fp8_e4m3_relative_step(scaled):
    rng = np.random.default_rng()
    x = rows(rng, (13, 2, 128))
    if not scaled:  # e4m3fn has no inf: above 448 the unscaled format gives NaN
        x *= np.float32(440) / np.abs(x).max()
    y = K.fp8_row(x, scaled)
    s = np.abs(x).max(-1, keepdims=True) / np.float32(448) if scaled else np.float32(1)
    # e4m3: 3 mantissa bits, half an ulp is 2^-4 relative for normals (>= 2^-6), 2^-10 absolute below
    bound = np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10) * 1.0001
    assert np.all(np.abs(y - x) <= bound)
    assert np.abs(y - x).max() > 0


def test_group_must_divide_the_row():
    with pytest.raises(ValueError, match="multiple of the group size 64"):
        K.int8_affine(np.ones((2, 96), np.float32), 64)


def test_row_bytes_counts_codes_and_scales():
    assert K.row_bytes("int8, fp32 scale per row (256)") == 256 + 4
    assert K.row_bytes("int8, fp16 scale per 32 (q8_0-like)") == 256 + 8 * 2
    assert K.row_bytes("8-bit affine per 64, bf16 scale+bias (mlx-lm kv_bits=8)") == 256 + 4 * (2 + 2)
    assert K.row_bytes("int8, fp32 scale per row (256)", 128) == 132
    assert all(256 <= K.row_bytes(n) <= 272 for n in K.FORMATS)
