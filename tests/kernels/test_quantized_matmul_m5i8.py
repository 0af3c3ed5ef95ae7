"""qmm_m5i8: the M5 quantized matmul with int8 activations (shaders/m5/qmm_m5.metal), after
quantize_i8 wrote x's codes into the int8 activation scratch, on the emulator under
lily_py.testing.simulated_device(tensor_ops=True, tensor_int8=True), vs the reference.

Tolerances, derived:
* exact semantics (lily_py.reference.kernels.quantized_matmul_i8): x rounded to int8 per row and 32
  columns (s_x = max |x| / 127 in fp32, codes rint(x / s_x)) times the dequantized weights; each
  32-wide integer dot product is exact and the kernel adds s_w (s_xa D_a + s_xb D_b) + b_w
  (s_xa C_a + s_xb C_b) (C: code sums) per 64-wide step to an fp32 accumulator: a few fp32
  roundings per step, bounded by 8 sqrt(K) u mag with u = 2^-24 and mag the sum of the terms'
  magnitudes (as the half route's bound). Far below what the int8 rounding itself moves (up to
  s_x / 2 per element), so it also shows the quantization, the permuted code order and the sums
  are the stated ones.
* against the fp32 reference (x unrounded): |x_k - codes_k s_x| <= s_x / 2, so
  |y - ref| <= sum_k (s_x(k) / 2) |w_k| + the fp32 term, per (row, feature).
A bfloat16 output adds its final rounding (rtol 2^-8). Only bf16 x, 4-bit weights with group_size
% 64 == 0 and K % 64 == 0, bf16 y take it: fp32 x, 8-bit weights (the router), fp32 y (lm_head's
logits), groups of 32 keep qmm_m5; without tensor_int8 qmm_m5 too.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernel_checks import BF16_EPS, F32_EPS, assert_close, rng  # noqa: F401  (fixture)
from lily_py import device_info, ops
from lily_py.reference import kernels as ref_kernels
from lily_py.reference import quant
from lily_py.testing import simulated_device
from test_quantized_matmul import BF16, QMV_MAX_ROWS, make_case


def run_i8(rng, x, w, s, b, *, bits=4, group_size=64, int8=True, **kw):
    with simulated_device(tensor_ops=True, tensor_int8=int8):
        return ops._quantized_matmul(x, w, s, b, bits=bits, group_size=group_size, seed=rng.seed, **kw)


def dequantized(w, s, b, *, bits, group_size):
    k = w.shape[1] * 32 // bits
    q = quant.unpack(w, bits).astype(np.float64).reshape(w.shape[0], k // group_size, group_size)
    wd = q * np.asarray(s).astype(np.float64)[..., None] + np.asarray(b).astype(np.float64)[..., None]
    return wd.reshape(w.shape[0], k)


def check_i8(rng, x, w, s, b, *, group_size=64):
    y, stats = run_i8(rng, x, w, s, b, group_size=group_size)
    k = x.shape[-1]
    exact, mag = ref_kernels.quantized_matmul_i8(x, w, s, b, group_size=group_size)
    rtol = 2 * BF16_EPS
    assert_close(y, exact, atol=8 * np.sqrt(k) * F32_EPS * mag, rtol=rtol,
                 what=f"qmm_m5i8 (int8 x) {stats['kernels']} x{x.shape}", seed=rng.seed)
    _, sx = ref_kernels.int8_rows(x)
    wd = dequantized(w, s, b, bits=4, group_size=group_size)
    ref = ref_kernels.quantized_matmul(x, w, s, b, bits=4, group_size=group_size)
    step = np.repeat(sx, 32, axis=-1) / 2                         # |x - x_int8| per element
    mag32 = np.abs(np.asarray(x).astype(np.float64)) @ np.abs(wd).T
    assert_close(y, ref, atol=step @ np.abs(wd).T + 8 * np.sqrt(k) * F32_EPS * mag32, rtol=rtol,
                 what=f"qmm_m5i8 vs fp32 reference x{x.shape}", seed=rng.seed)
    # the int8 rounding is visible: the output is not the half route's (or the exact product)
    assert not np.allclose(exact, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    return y, stats


def test_simulation_reports_tensor_int8():
    with simulated_device(tensor_ops=True, tensor_int8=True):
        assert device_info("emu")["tensor_int8"] is True
    with simulated_device(tensor_ops=True):
        assert device_info("emu")["tensor_int8"] is False
    with simulated_device(tensor_int8=True):  # int8 needs tensor ops
        assert device_info("emu")["tensor_int8"] is False


@pytest.mark.parametrize("m", [QMV_MAX_ROWS + 1, 64, 65, 130])
@pytest.mark.parametrize("scale_dtype", [np.float32, BF16], ids=["sf32", "sbf16"])
def test_m5i8_matches_reference(rng, m, scale_dtype):
    n, k = 101, 192  # N: not a multiple of the 64-wide tile; K: 3 steps of 64
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=64, x_dtype=BF16, scale_dtype=scale_dtype)
    _, stats = check_i8(rng, x, w, s, b)
    ss = "bf16" if np.dtype(scale_dtype) == BF16 else "f32"
    assert stats["kernels"] == ["quantize_i8_xbf16", f"qmm_m5i8_b4_xbf16_s{ss}"]
    assert stats["dispatches"] == 2 and stats["barriers"] == 1


@pytest.mark.parametrize("m,n,k,group_size", [(9, 1, 64, 64), (65, 63, 128, 128), (130, 129, 256, 128),
                                              (64, 64, 64, 64), (33, 70, 2048, 64), (71, 35, 4096, 64)])
def test_m5i8_odd_shapes(rng, m, n, k, group_size):
    # Tile edges on both sides, K of 1 step (64) to 64 steps, groups of 64 and 128.
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=group_size, x_dtype=BF16, scale_dtype=BF16)
    _, stats = check_i8(rng, x, w, s, b, group_size=group_size)
    assert stats["kernels"] == ["quantize_i8_xbf16", "qmm_m5i8_b4_xbf16_sbf16"]


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_quantize_i8_scratch_layout(rng, dtype):
    """The scratch quantize_i8 writes equals the reference's bit for bit (codes in the permuted order,
    scales, the dequantized code sums), read back through the op that exposes it; bf16 x (the
    projections', the MoE's x) and fp32 (the MoE's h)."""
    x = (rng.standard_normal((37, 192)) * np.logspace(-2, 2, 192)).astype(dtype)
    x[4] = 0
    x[6, 64:96] = 0
    with simulated_device(tensor_ops=True, tensor_int8=True):
        codes, scales, sums, stats = ops._quantize_i8(x, seed=rng.seed)
    name = "quantize_i8_xbf16" if dtype == BF16 else "quantize_i8_xf32"
    assert stats["kernels"] == [name] and stats["dispatches"] == 1
    rc, rs, ru = ref_kernels.quantize_i8(x)
    np.testing.assert_array_equal(codes, rc)
    np.testing.assert_array_equal(scales, rs)
    np.testing.assert_array_equal(sums, ru)
    assert np.all(codes[4] == 0) and np.all(scales[4] == 0) and np.all(scales[6, 2] == 0)


def test_m5i8_rows_of_any_range(rng):
    """Each row and 32 columns has its own scale: rows 1e-3 .. 1e3 apart, an all-zero row (s_x = 0),
    a row that is zero in one 32-column group only, and a single outlier per group."""
    m, n, k = 24, 40, 128
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=64, x_dtype=np.float32, scale_dtype=BF16)
    x = x * np.logspace(-3, 3, m, dtype=np.float32)[:, None]
    x[3] = 0.0
    x[5, 32:64] = 0.0
    x[7, ::32] *= 100.0
    x = x.astype(BF16)
    y, _ = check_i8(rng, x, w, s, b)
    assert np.all(y[3] == 0)


def test_m5i8_takes_only_bf16_x_4bit_bf16_y(rng):
    """fp32 x, 8-bit weights, fp32 y, groups of 32 and K % 64 != 0 keep qmm_m5; M <= 8 keeps qmv;
    without tensor_int8 qmm_m5."""
    x, w, s, b = make_case(rng, 20, 40, 128, bits=4, group_size=64, x_dtype=np.float32, scale_dtype=BF16)
    assert run_i8(rng, x, w, s, b)[1]["kernels"] == ["qmm_m5_b4_xf32_sbf16"]
    xb = x.astype(BF16)
    assert run_i8(rng, xb, w, s, b, y_f32=True)[1]["kernels"] == ["qmm_m5_b4_xbf16_sbf16_yf32"]
    assert run_i8(rng, xb, w, s, b, int8=False)[1]["kernels"] == ["qmm_m5_b4_xbf16_sbf16"]
    assert run_i8(rng, xb[:QMV_MAX_ROWS], w, s, b)[1]["kernels"] == ["qmv_b4_xbf16_sbf16"]
    x8, w8, s8, b8 = make_case(rng, 20, 40, 128, bits=8, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    assert run_i8(rng, x8, w8, s8, b8, bits=8)[1]["kernels"] == ["qmm_m5_b8_xbf16_sbf16"]
    x3, w3, s3, b3 = make_case(rng, 20, 40, 128, bits=4, group_size=32, x_dtype=BF16, scale_dtype=BF16)
    assert run_i8(rng, x3, w3, s3, b3, group_size=32)[1]["kernels"] == ["qmm_m5_b4_xbf16_sbf16"]
    x9, w9, s9, b9 = make_case(rng, 20, 40, 96, bits=4, group_size=32, x_dtype=BF16, scale_dtype=BF16)
    assert run_i8(rng, x9, w9, s9, b9, group_size=32)[1]["kernels"] == ["qmm_m5_b4_xbf16_sbf16"]


@pytest.mark.parametrize("order", ["forward", "reverse", "ahead"])
def test_m5i8_result_independent_of_thread_order(rng, order):
    x, w, s, b = make_case(rng, 70, 65, 128, bits=4, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    y0, _ = run_i8(rng, x, w, s, b, order="shuffle")
    y1, _ = run_i8(rng, x, w, s, b, order=order)
    np.testing.assert_array_equal(y0, y1)
