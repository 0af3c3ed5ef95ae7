"""RMSNorm (plain, fused residual), quantized embedding lookup, SwiGLU and sigmoid gate on the
emulator vs lily_py.reference.kernels.

Tolerances (u = 2^-24; bf16 outputs add rtol 2^-8 >= one bf16 rounding of |y|):
* rms_norm: a sum of D squares in fp32 (relative error <= ~sqrt(D) u in practice; allow
  8 sqrt(D) u), sqrt + reciprocal + two products (<= 6 u) -> rtol = (4 sqrt(D) + 8) u on y
  (the square root halves the sum's relative error).
* embedding: s*q + b in fp32 is exactly what the reference computes: atol = 2 u (|s q| + |b|)
  only to allow a fused multiply-add on the GPU; the emulator is bit-exact.
* swiglu / sigmoid_mul: exp (a few ulp), one division, two products: rtol = 16 u.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import lily_py._core as core
from kernel_checks import BF16_EPS, F32_EPS, assert_close, device, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py.reference import kernels as ref
from lily_py.reference import quant

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16]


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def out_rtol(dtype):
    return 2 * BF16_EPS if np.dtype(dtype) == BF16 else 0.0


# ------------------------------------------------------------------------------ rms_norm
# D = 256 | 257 and 8192 | 8193: both sides of the threads-per-row rule (max(32, ceil(D/8)) up to 1024).
@pytest.mark.parametrize("d", [1, 37, 256, 257, 2048, 8193])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=["wf32", "wbf16"])
def test_rms_norm(rng, device, d, x_dtype, w_dtype):
    rows = 3
    x = rand(rng, (rows, d), x_dtype, scale=3.0)
    w = rand(rng, (d,), w_dtype)
    y, _, stats = ops._rms_norm(x, w, eps=1e-6, device=device, seed=rng.seed)
    assert y.dtype == x_dtype and y.shape == x.shape
    assert stats["kernels"] == [f"rms_norm_x{'bf16' if x_dtype == BF16 else 'f32'}_w{'bf16' if w_dtype == BF16 else 'f32'}"]
    per_8 = -(-d // 8)  # ceil(D / 8), rounded up to whole simdgroups, within [32, 1024]
    expected_threads = min(1024, max(32, -(-per_8 // 32) * 32))
    assert stats["threads"] == rows * expected_threads
    rtol = (4 * np.sqrt(d) + 8) * F32_EPS + out_rtol(x_dtype)
    assert_close(y, ref.rms_norm(x, w, eps=1e-6), atol=0, rtol=rtol, what=f"rms_norm D={d}", seed=rng.seed)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
def test_rms_norm_fused_residual(rng, device, offset, x_dtype):
    shape = (2, 3, 700)  # leading dims flattened to 6 rows
    x, r = rand(rng, shape, x_dtype), rand(rng, shape, x_dtype, scale=4.0)
    w = rand(rng, (700,), BF16, scale=0.1)
    y, h = ops.rms_norm(x, w, eps=1e-5, weight_offset=offset, residual=r, device=device)
    h_ref = ref.residual_add(x, r)
    np.testing.assert_array_equal(h, h_ref)  # the add is one fp32 add + one rounding: exact
    rtol = (4 * np.sqrt(700) + 8) * F32_EPS + out_rtol(x_dtype)
    assert_close(y, ref.rms_norm(h_ref, w, eps=1e-5, weight_offset=offset), atol=0, rtol=rtol,
                 what="rms_norm_residual", seed=rng.seed)


def test_rms_norm_zero_centred_offset_equals_folded_weight(rng):
    x = rand(rng, (4, 96), np.float32)
    w = rand(rng, (96,), np.float32, scale=0.1)
    a = ops.rms_norm(x, w, weight_offset=1.0)
    b = ops.rms_norm(x, (w.astype(np.float64) + 1).astype(np.float32))
    assert_close(a, b, atol=0, rtol=4 * F32_EPS, what="(1 + w) vs folded", seed=rng.seed)


def test_rms_norm_bad_input(rng):
    x = rand(rng, (2, 8), np.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        ops.rms_norm(x, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="eps must be > 0"):
        ops.rms_norm(x, np.ones(8, np.float32), eps=0.0)
    with pytest.raises(ValueError, match="residual must match x"):
        ops.rms_norm(x, np.ones(8, np.float32), residual=x.astype(BF16))
    with pytest.raises(ValueError, match="x must be float32 or bfloat16, got int32"):
        ops.rms_norm(x.astype(np.int32), np.ones(8, np.float32))


# ------------------------------------------------------------------------------ embedding
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=["of32", "obf16"])
@pytest.mark.parametrize("scale_dtype", DTYPES, ids=["sf32", "sbf16"])
def test_embedding(rng, device, bits, group_size, out_dtype, scale_dtype):
    vocab, d = 53, 5 * group_size  # D not a multiple of the 512 values one threadgroup covers
    table, s, b = quant.quantize(rng.standard_normal((vocab, d)).astype(np.float32), bits=bits,
                                 group_size=group_size, scale_dtype=scale_dtype)
    ids = rng.integers(0, vocab, size=(2, 7))
    ids[0, 0], ids[1, 6] = 0, vocab - 1
    out, stats = ops._embedding(ids, table, s, b, bits=bits, group_size=group_size, dtype=out_dtype,
                                device=device, seed=rng.seed)
    assert out.shape == (2, 7, d) and out.dtype == out_dtype
    want = ref.embedding(ids, table, s, b, bits=bits, group_size=group_size)
    mag = ref.embedding(ids, table, np.abs(s.astype(np.float32)), np.abs(b.astype(np.float32)),
                        bits=bits, group_size=group_size)
    assert_close(out, want, atol=2 * F32_EPS * mag, rtol=out_rtol(out_dtype), what="embedding", seed=rng.seed)
    # Only the looked-up rows are read, but the whole table is bound (ids decide the rows).
    assert stats["bytes_bound"] == ids.size * 4 + table.nbytes + s.nbytes + b.nbytes + out.nbytes


def test_embedding_out_of_range_id(rng, device):
    table, s, b = quant.quantize(rng.standard_normal((10, 64)).astype(np.float32), bits=4, group_size=64)
    with pytest.raises(ValueError, match=r"token id 10 outside the table's vocabulary \[0, 10\)"):
        ops.embedding(np.array([1, 10]), table, s, b, bits=4, group_size=64)
    # Ids coming from a device slot skip the host check: the kernel writes NaN, never reads past the table.
    out, _ = core.ops.embedding(np.array([1, 10, 2], np.uint32), table, s, b, bits=4, group_size=64,
                                out_dtype="float32", scale_dtype="float32", device=device)
    assert np.isnan(out[1]).all() and not np.isnan(out[[0, 2]]).any()
    np.testing.assert_array_equal(out[[0, 2]], ref.embedding(np.array([1, 2]), table, s, b, bits=4, group_size=64))


# ------------------------------------------------------------------------------ elementwise
@pytest.mark.parametrize("shape", [(1,), (255,), (3, 257), (2, 2, 300)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_swiglu(rng, device, shape, dtype):
    g, u = rand(rng, shape, dtype, scale=4.0), rand(rng, shape, dtype)
    y = ops.swiglu(g, u, device=device)
    assert y.shape == g.shape and y.dtype == dtype
    assert_close(y, ref.swiglu(g, u), atol=0, rtol=16 * F32_EPS + out_rtol(dtype), what="swiglu", seed=rng.seed)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_sigmoid_mul(rng, device, per_row, dtype):
    x = rand(rng, (5, 301), dtype)
    gate = rand(rng, (5, 1) if per_row else (5, 301), dtype, scale=5.0)
    y, stats = ops._elementwise("sigmoid_mul", x, gate, device=device, seed=rng.seed)
    assert stats["kernels"] == [f"sigmoid_mul_{'bf16' if dtype == BF16 else 'f32'}"]
    assert_close(y, ref.sigmoid_mul(x, gate), atol=0, rtol=16 * F32_EPS + out_rtol(dtype),
                 what=f"sigmoid_mul per_row={per_row}", seed=rng.seed)


def test_swiglu_extreme_inputs_stay_finite(device):
    g = np.array([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4], np.float32)
    y = ops.swiglu(g, np.ones_like(g), device=device)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[[0, 1, 3]], 0.0, atol=1e-30)
    np.testing.assert_allclose(y[-1], 1e4, rtol=1e-7)


def test_elementwise_bad_input(rng):
    a = rand(rng, (2, 4), np.float32)
    with pytest.raises(ValueError, match=r"up must have shape \[2, 4\], got \[2, 1\]"):
        ops.swiglu(a, a[:, :1].copy())
    with pytest.raises(ValueError, match="same dtype"):
        ops.sigmoid_mul(a, a.astype(BF16))
    with pytest.raises(ValueError, match=r"gate must have shape \[2, 4\] or \[2, 1\], got \[4\]"):
        ops.sigmoid_mul(a, a[0])
