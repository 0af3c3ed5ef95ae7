"""The M5 route of lily_py.ops.quantized_matmul (qmm_m5: Metal 4 tensor ops, shaders/m5/qmm_m5.metal)
on the emulator, under lily_py.testing.simulated_device(tensor_ops=True), vs the reference.

Two tolerances:
* exact semantics: the kernel rounds x and the dequantized weights (fp32 s*q + b, as the kernel
  computes it) to half once and matmul2d sums the exact half x half products in fp32. Given those
  rounded operands, a float64 reference differs only by the fp32 sum: 8 sqrt(K) u mag with
  u = 2^-24 and mag = sum_k |x_k w_k| (as in test_quantized_matmul.py). This bound is far below
  what the half rounding itself changes (~2^-11 mag / sqrt(K)), so it also shows the rounding
  happens where stated.
* against the fp32 reference (no half rounding): each operand's rounding is <= 2^-11 relative,
  so each product errs by <= (2 * 2^-11 + 2^-22) |x_k w_k|: the worst case 2.001 * 2^-11 mag plus
  the fp32 term. A bfloat16 output adds its final rounding (rtol 2^-8).
Both sides of the route switch: M = 8 takes qmv on an M5 too, M = 9 qmm_m5, for 4- and 8-bit
weights (qmm_m5_b8_*: the MoE router + shared gate of MLX conversions, 4 codes per word); without
tensor ops M = 9 takes qmm. bf16 x with fp32 y (lm_head's logits) takes qmm_m5's *_yf32 variant
(4-bit): the same fp32 accumulator written unrounded (rtol 0 in both bounds).
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

HALF_EPS = 2.0 ** -11
TILE = 64  # kQmmM5TileM = kQmmM5TileN (shaders/common/args.h)


def half_operands(x, w, s, b, *, bits, group_size):
    """x and the dequantized weights as the M5 kernel stages them (float64 copies of halves)."""
    k = x.shape[-1]
    q = quant.unpack(w, bits).astype(np.float32).reshape(w.shape[0], k // group_size, group_size)
    wd = (q * np.asarray(s).astype(np.float32)[..., None] + np.asarray(b).astype(np.float32)[..., None])
    wh = wd.reshape(w.shape[0], k).astype(np.float16).astype(np.float64)
    xh = np.asarray(x).astype(np.float32).astype(np.float16).astype(np.float64)
    return xh, wh


def run_m5(rng, x, w, s, b, *, bits=4, group_size=64, **kw):
    with simulated_device(tensor_ops=True):
        return ops._quantized_matmul(x, w, s, b, bits=bits, group_size=group_size, seed=rng.seed, **kw)


def check_m5(rng, x, w, s, b, *, bits=4, group_size=64, y_f32=False):
    y, stats = run_m5(rng, x, w, s, b, bits=bits, group_size=group_size, y_f32=y_f32)
    k = x.shape[-1]
    assert y.dtype == (np.float32 if y_f32 else x.dtype)
    rtol = 2 * BF16_EPS if x.dtype == BF16 and not y_f32 else 0.0
    ref = ref_kernels.quantized_matmul(x, w, s, b, bits=bits, group_size=group_size)
    mag = ref_kernels.quantized_matmul_error_scale(x, w, s, b, bits=bits, group_size=group_size)
    if not stats["kernels"][0].startswith("qmm_m5"):  # qmv (M <= 8): fp32 operands, the fp32 bound
        assert_close(y, ref, atol=8 * np.sqrt(k) * F32_EPS * mag, rtol=rtol,
                     what=f"{stats['kernels']} x{x.shape}", seed=rng.seed)
        return y, stats
    xh, wh = half_operands(x, w, s, b, bits=bits, group_size=group_size)
    exact = xh @ wh.T
    mag_h = np.abs(xh) @ np.abs(wh).T
    assert_close(y, exact, atol=8 * np.sqrt(k) * F32_EPS * mag_h, rtol=rtol,
                 what=f"qmm_m5 (half operands) {stats['kernels']} x{x.shape}", seed=rng.seed)
    assert_close(y, ref, atol=(2.001 * HALF_EPS + 8 * np.sqrt(k) * F32_EPS) * mag, rtol=rtol,
                 what=f"qmm_m5 vs fp32 reference x{x.shape}", seed=rng.seed)
    return y, stats


def test_route_switch():
    assert ops.quantized_matmul_route(QMV_MAX_ROWS, tensor_ops=True) == "qmv"
    assert ops.quantized_matmul_route(QMV_MAX_ROWS + 1, tensor_ops=True) == "qmm_m5"
    assert ops.quantized_matmul_route(QMV_MAX_ROWS, bits=8, tensor_ops=True) == "qmv"
    assert ops.quantized_matmul_route(QMV_MAX_ROWS + 1, bits=8, tensor_ops=True) == "qmm_m5"
    assert ops.quantized_matmul_route(QMV_MAX_ROWS + 1, bits=8) == "qmm"
    assert ops.quantized_matmul_route(QMV_MAX_ROWS + 1) == "qmm"


def test_simulation_reports_tensor_ops():
    assert device_info("emu")["tensor_ops"] is False
    with simulated_device(tensor_ops=True):
        info = device_info("emu")
        assert info["tensor_ops"] is True and info["tensor_ops_reason"] is None
    assert device_info("emu")["tensor_ops"] is False


@pytest.mark.parametrize("m", [QMV_MAX_ROWS, QMV_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("x_dtype,scale_dtype", [(np.float32, np.float32), (np.float32, BF16),
                                                 (BF16, np.float32), (BF16, BF16)])
def test_m5_route_matches_reference(rng, m, x_dtype, scale_dtype):
    n, k = 101, 192  # N: not a multiple of the 64-wide tile; K: 6 steps of 32 (3 groups of 64)
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=64, x_dtype=x_dtype, scale_dtype=scale_dtype)
    _, stats = check_m5(rng, x, w, s, b)
    xs = "bf16" if np.dtype(x_dtype) == BF16 else "f32"
    ss = "bf16" if np.dtype(scale_dtype) == BF16 else "f32"
    want = f"qmv_b4_x{xs}_s{ss}" if m <= QMV_MAX_ROWS else f"qmm_m5_b4_x{xs}_s{ss}"
    assert stats["kernels"] == [want]


@pytest.mark.parametrize("m,n,k,group_size", [(9, 1, 32, 32), (65, 63, 96, 32), (130, 129, 256, 128),
                                              (64, 64, 64, 64)])
def test_m5_odd_shapes(rng, m, n, k, group_size):
    # Tile edges on both sides (M, N = 63 | 64 | 65, 129, 130) and K of 1 step (32), 2, 3 and 8.
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=group_size, x_dtype=BF16, scale_dtype=BF16)
    _, stats = check_m5(rng, x, w, s, b, group_size=group_size)
    assert stats["kernels"] == ["qmm_m5_b4_xbf16_sbf16"]


@pytest.mark.parametrize("bits", [4, 8])
def test_m5_without_tensor_ops_takes_the_simdgroup_path(rng, bits):
    x, w, s, b = make_case(rng, 20, 40, 128, bits=bits, group_size=64, x_dtype=np.float32, scale_dtype=BF16)
    y5, stats = run_m5(rng, x, w, s, b, bits=bits)
    assert stats["kernels"] == [f"qmm_m5_b{bits}_xf32_sbf16"]
    y0, stats = ops._quantized_matmul(x, w, s, b, bits=bits, group_size=64)
    assert stats["kernels"] == [f"qmm_b{bits}_xf32_sbf16"]
    assert not np.array_equal(y5, y0)  # fp32 y shows the half operands: the routes differ


# 8-bit (MLX affine, 4 codes per uint32 word, least significant first; scale and bias per group).
@pytest.mark.parametrize("m", [QMV_MAX_ROWS, QMV_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("x_dtype,scale_dtype", [(np.float32, np.float32), (np.float32, BF16),
                                                 (BF16, np.float32), (BF16, BF16)])
def test_m5_8bit_matches_reference(rng, m, x_dtype, scale_dtype):
    n, k = 101, 192  # N: 2 tiles, the second partial; K: 6 steps of 32, 3 groups of 64
    x, w, s, b = make_case(rng, m, n, k, bits=8, group_size=64, x_dtype=x_dtype, scale_dtype=scale_dtype)
    _, stats = check_m5(rng, x, w, s, b, bits=8)
    xs = "bf16" if np.dtype(x_dtype) == BF16 else "f32"
    ss = "bf16" if np.dtype(scale_dtype) == BF16 else "f32"
    want = f"qmv_b8_x{xs}_s{ss}" if m <= QMV_MAX_ROWS else f"qmm_m5_b8_x{xs}_s{ss}"
    assert stats["kernels"] == [want]


@pytest.mark.parametrize("m,n,k,group_size", [(9, 1, 64, 64), (65, 63, 64, 64), (63, 65, 96, 32),
                                              (130, 129, 256, 128), (64, 64, 128, 64), (33, 257, 2048, 64)])
def test_m5_8bit_odd_shapes(rng, m, n, k, group_size):
    # K = 64: one group (2 steps); 96 / 256 / 2048: 3, 2 and 32 groups; M, N on both sides of the
    # 64-wide tile edges; (33, 257, 2048, 64): the real router + shared gate (E + 1 = 257 rows).
    x, w, s, b = make_case(rng, m, n, k, bits=8, group_size=group_size, x_dtype=BF16, scale_dtype=BF16)
    _, stats = check_m5(rng, x, w, s, b, bits=8, group_size=group_size)
    assert stats["kernels"] == ["qmm_m5_b8_xbf16_sbf16"]


def test_m5_8bit_codes_each_in_place(rng):
    # Row n has one weight 1 (code 255 at scale 1/255, bias 0; the other codes 0) in column
    # c(n) = (5 n + 1) % 128, which visits every position of a word, both halves of a K step and
    # both groups: y[m, n] = x[m, c(n)] w[n, c(n)] exactly (one nonzero product), so a wrong shift,
    # word, step or group offset moves or drops it.
    m, n, k = 9, 64, 128
    cols = (5 * np.arange(n) + 1) % k
    assert set(cols % 4) == {0, 1, 2, 3} and set(cols // 16 % 2) == {0, 1} and set(cols // 64) == {0, 1}
    w_float = np.zeros((n, k), np.float32)
    w_float[np.arange(n), cols] = 1.0
    w, s, b = quant.quantize(w_float, bits=8, group_size=64, scale_dtype=np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32).astype(BF16)
    y, stats = run_m5(rng, x, w, s, b, bits=8)
    assert stats["kernels"] == ["qmm_m5_b8_xbf16_sf32"]
    xh, wh = half_operands(x, w, s, b, bits=8, group_size=64)
    np.testing.assert_array_equal(np.asarray(y).astype(np.float64), (xh @ wh.T).astype(np.float32).astype(BF16).astype(np.float64))


@pytest.mark.parametrize("bits", [4, 8])
def test_m5_counters(rng, bits):
    m, n, k = 70, 101, 192
    x, w, s, b = make_case(rng, m, n, k, bits=bits, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    _, stats = run_m5(rng, x, w, s, b, bits=bits)
    assert stats["kernels"] == [f"qmm_m5_b{bits}_xbf16_sbf16"]
    groups = -(-m // TILE) * -(-n // TILE)
    assert stats["dispatches"] == 1 and stats["barriers"] == 0
    assert stats["threads"] == groups * 128
    assert stats["bytes_bound"] == x.nbytes + w.nbytes + s.nbytes + b.nbytes + m * n * 2
    assert stats["flops_useful"] == 2 * m * n * k
    assert stats["flops_executed"] == 2 * (-(-m // TILE) * TILE) * (-(-n // TILE) * TILE) * k


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("order", ["forward", "reverse", "shuffle"])
def test_m5_result_independent_of_thread_order(rng, order, bits):
    # The double-buffered staging has one barrier per K step: any schedule gives the same bits
    # (and the emulator's matmul2d fails if a stage is written while a run reads it).
    x, w, s, b = make_case(rng, 40, 70, 256, bits=bits, group_size=64, x_dtype=np.float32, scale_dtype=BF16)
    y0, _ = run_m5(rng, x, w, s, b, bits=bits, order="forward")
    y1, _ = run_m5(rng, x, w, s, b, bits=bits, order=order)
    np.testing.assert_array_equal(y0, y1)


def test_m5_model_shape_slice(rng):
    # The real model's 4-bit / group-64 / bf16 configuration at K = hidden size 2048.
    x, w, s, b = make_case(rng, 9, 70, 2048, bits=4, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    check_m5(rng, x, w, s, b)


# bf16 x, fp32 y (the engine's all-logits lm_head): qmm_m5's *_yf32 variants. The same fp32
# accumulator as the bf16-output kernel, written unrounded: rounding it to bf16 gives the bf16
# kernel's output bit for bit. Both sides of the switch: M = 8 -> qmv *_yf32, 8-bit -> qmm *_yf32,
# no tensor ops -> qmm *_yf32.
@pytest.mark.parametrize("m,n,k,group_size", [(9, 101, 192, 64), (70, 63, 256, 128), (65, 129, 96, 32)])
@pytest.mark.parametrize("scale_dtype", [np.float32, BF16])
def test_m5_fp32_output(rng, m, n, k, group_size, scale_dtype):
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=group_size, x_dtype=BF16, scale_dtype=scale_dtype)
    ss = "bf16" if np.dtype(scale_dtype) == BF16 else "f32"
    y32, stats = check_m5(rng, x, w, s, b, group_size=group_size, y_f32=True)
    assert stats["kernels"] == [f"qmm_m5_b4_xbf16_s{ss}_yf32"]
    assert stats["dispatches"] == 1 and stats["barriers"] == 0
    assert stats["threads"] == -(-m // TILE) * -(-n // TILE) * 128
    assert stats["bytes_bound"] == x.nbytes + w.nbytes + s.nbytes + b.nbytes + m * n * 4
    assert stats["flops_executed"] == 2 * (-(-m // TILE) * TILE) * (-(-n // TILE) * TILE) * k
    y16, stats16 = run_m5(rng, x, w, s, b, group_size=group_size)
    assert stats16["kernels"] == [f"qmm_m5_b4_xbf16_s{ss}"]
    np.testing.assert_array_equal(y32.astype(BF16), y16)
    assert np.any(y32 != y16.astype(np.float32))  # the fp32 output is not the bf16 one widened


def test_m5_fp32_output_other_side_of_the_switches(rng):
    x, w, s, b = make_case(rng, QMV_MAX_ROWS, 40, 128, bits=4, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    _, stats = check_m5(rng, x, w, s, b, y_f32=True)
    assert stats["kernels"] == ["qmv_b4_xbf16_sbf16_yf32"]
    x, w, s, b = make_case(rng, 20, 40, 128, bits=8, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    y, stats = run_m5(rng, x, w, s, b, bits=8, y_f32=True)
    assert stats["kernels"] == ["qmm_b8_xbf16_sbf16_yf32"] and y.dtype == np.float32
    x, w, s, b = make_case(rng, 20, 40, 128, bits=4, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    y, stats = ops._quantized_matmul(x, w, s, b, bits=4, group_size=64, y_f32=True)
    assert stats["kernels"] == ["qmm_b4_xbf16_sbf16_yf32"] and y.dtype == np.float32
