"""lily_py.ops.quantized_matmul on the emulator vs lily_py.reference.kernels.

Tolerance (kernel_checks.assert_close): the inputs the kernel sees (x as float32 or bfloat16,
MLX-packed codes, scales and biases) are given exactly to a float64 reference, so the only error
is the kernel's fp32 arithmetic: per-element dequantization (s*q + b, two roundings) and a sum of
K rounded products in some order. Each rounding is at most u = 2^-24 relative and they do not
conspire, so the error stays within a small multiple of sqrt(K) u mag with
mag = sum_k |x_k| (|s q_k| + |b|) (kernels.quantized_matmul_error_scale); we allow
8 sqrt(K) u mag (observed: < 2% of that). The worst case 2 K u mag would be too loose to see
precision-policy violations: rounding the dequantized weights to bf16 (as MLX does in
threadgroup memory) errs by ~2^-9 mag / sqrt(K), which this bound rejects. A bfloat16 output adds
its final rounding: rtol = 2^-8 (>= one bf16 unit roundoff 2^-9 of |y|). A wrong group, code,
row or route changes y by a sizeable fraction of mag.
"""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from kernel_checks import BF16_EPS, F32_EPS, assert_close, device, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py.reference import kernels as ref_kernels
from lily_py.reference import quant

BF16 = np.dtype(ml_dtypes.bfloat16)
QMV_MAX_ROWS = 8  # must match kQmvMaxRows in shaders/common/args.h (checked below)
QMM_BF16_MIN_ROWS = 33  # kQmmBf16MinRows: M >= this takes the 64 x 64 bf16 tiles (checked below)
BF16_U = 2.0 ** -8  # bfloat16's unit roundoff (8 significant bits, round to nearest even)


def make_case(rng, m, n, k, *, bits, group_size, x_dtype, scale_dtype, lead=None):
    w_float = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w, scales, biases = quant.quantize(w_float, bits=bits, group_size=group_size, scale_dtype=scale_dtype)
    shape = (m, k) if lead is None else (*lead, k)
    x = rng.standard_normal(shape).astype(np.float32).astype(x_dtype)  # bf16-rounded when bf16
    return x, w, scales, biases


def bf16_operands(x, w, s, b, *, bits, group_size):
    """x and the dequantized weights as qmm_bf16 stages them (float64 copies of bfloat16 values):
    w dequantized in fp32 (s * q, rounded, + b, rounded), then both rounded to bf16."""
    k = x.shape[-1]
    q = quant.unpack(w, bits).astype(np.float32).reshape(w.shape[0], k // group_size, group_size)
    wd = q * np.asarray(s).astype(np.float32)[..., None] + np.asarray(b).astype(np.float32)[..., None]
    wb = wd.reshape(w.shape[0], k).astype(BF16).astype(np.float64)
    xb = np.asarray(x).astype(np.float32).astype(BF16).astype(np.float64)
    return xb, wb


def check(rng, x, w, scales, biases, *, bits, group_size, device="emu", **kw):
    y, stats = ops._quantized_matmul(x, w, scales, biases, bits=bits, group_size=group_size, device=device,
                                     seed=rng.seed, **kw)
    ref = ref_kernels.quantized_matmul(x, w, scales, biases, bits=bits, group_size=group_size)
    mag = ref_kernels.quantized_matmul_error_scale(x, w, scales, biases, bits=bits, group_size=group_size)
    k = x.shape[-1]
    y_f32 = kw.get("y_f32", False)
    assert y.dtype == (np.float32 if y_f32 else x.dtype) and y.shape == ref.shape
    rtol = 2 * BF16_EPS if y.dtype == BF16 else 0.0
    what = f"quantized_matmul {stats['kernels']} x{x.shape} w{w.shape}"
    if stats["kernels"][0].startswith("qmm_bf16"):
        # Exact semantics: given the bf16 operands the kernel stages, only the fp32 sum errs.
        xb, wb = bf16_operands(x.reshape(-1, k), w, scales, biases, bits=bits, group_size=group_size)
        exact = (xb @ wb.T).reshape(ref.shape)
        mag_b = (np.abs(xb) @ np.abs(wb).T).reshape(ref.shape)
        assert_close(y, exact, atol=8 * np.sqrt(k) * F32_EPS * mag_b, rtol=rtol, what=what + " (bf16 operands)",
                     seed=rng.seed)
        # Against the fp32 reference: each operand's bf16 rounding is <= BF16_U relative, the fp32
        # dequantization 2 F32_EPS of |s q| + |b|: per product <= (2 BF16_U + BF16_U^2 + 3 F32_EPS)
        # |x_k| (|s q_k| + |b|), plus the fp32 sum.
        assert_close(y, ref, atol=(2.01 * BF16_U + 8 * np.sqrt(k) * F32_EPS) * mag, rtol=rtol,
                     what=what + " vs fp32 reference", seed=rng.seed)
        return y, stats
    assert_close(y, ref, atol=8 * np.sqrt(k) * F32_EPS * mag, rtol=rtol, what=what, seed=rng.seed)
    return y, stats


def test_route_boundary_constant_matches_extension():
    import lily_py._core as core
    assert core.ops.QMV_MAX_ROWS == QMV_MAX_ROWS
    assert ops.quantized_matmul_route(1) == "qmv1"
    assert ops.quantized_matmul_route(2) == "qmv"
    assert ops.quantized_matmul_route(QMV_MAX_ROWS) == "qmv"
    assert ops.quantized_matmul_route(QMV_MAX_ROWS + 1) == "qmm"
    assert core.ops.QMM_BF16_MIN_ROWS == QMM_BF16_MIN_ROWS
    assert ops.quantized_matmul_route(QMM_BF16_MIN_ROWS - 1) == "qmm"
    assert ops.quantized_matmul_route(QMM_BF16_MIN_ROWS) == "qmm_bf16"
    assert ops.quantized_matmul_route(4096, bits=8) == "qmm_bf16"
    assert ops.quantized_matmul_route(4096, bf16_tiles=False) == "qmm"


# Both sides of the qmv1 / qmv (M = 1 | 2) and qmv / qmm (M = 8 | 9) route switches, every bits x
# group x dtype combination,
# odd N (not a multiple of the 8-row qmv threadgroup nor of the 32-wide qmm tile) and odd K.
COMBOS = list(itertools.product([4, 8], [32, 64, 128], [np.float32, BF16], [np.float32, BF16]))


def route_of(m, x_dtype):
    # qmm_bf16 rounds the operands to bf16: bf16 x takes it; fp32 x only when asked (f32_x_bf16_tiles)
    return ("qmv1" if m == 1 else "qmv" if m <= QMV_MAX_ROWS else
            "qmm_bf16" if m >= QMM_BF16_MIN_ROWS and np.dtype(x_dtype) == BF16 else "qmm")


@pytest.mark.parametrize("m", [1, 2, 3, QMV_MAX_ROWS, QMV_MAX_ROWS + 1, QMM_BF16_MIN_ROWS - 1,
                               QMM_BF16_MIN_ROWS, 45])
@pytest.mark.parametrize("bits,group_size,x_dtype,scale_dtype", COMBOS,
                         ids=[f"b{b}-g{g}-x{np.dtype(x).name}-s{np.dtype(s).name}" for b, g, x, s in COMBOS])
def test_quantized_matmul_matches_reference(rng, device, m, bits, group_size, x_dtype, scale_dtype):
    n = 37
    k = 3 * group_size if group_size != 32 else 7 * 32
    x, w, s, b = make_case(rng, m, n, k, bits=bits, group_size=group_size, x_dtype=x_dtype,
                           scale_dtype=scale_dtype)
    _, stats = check(rng, x, w, s, b, bits=bits, group_size=group_size, device=device)
    route = route_of(m, x_dtype)
    xs = "bf16" if np.dtype(x_dtype) == BF16 else "f32"
    ss = "bf16" if np.dtype(scale_dtype) == BF16 else "f32"
    r1 = "_r1" if route == "qmv1" and qmv1_rows(n, k, bits) == 1 else ""  # N = 37: 1 row per threadgroup
    assert stats["kernels"] == [f"{route}_b{bits}_x{xs}_s{ss}{r1}"]


@pytest.mark.parametrize("m", [QMV_MAX_ROWS, QMV_MAX_ROWS + 1])
@pytest.mark.parametrize("n,k", [(1, 64), (7, 576), (33, 1088), (65, 128)])
def test_odd_shapes_around_route_switch(rng, device, m, n, k):
    # K = 576, 1088: not multiples of qmv's 512-code step (4-bit), so lanes run out mid-row.
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    check(rng, x, w, s, b, bits=4, group_size=64, device=device)


@pytest.mark.parametrize("m", [1, 9])
def test_model_shape_slice(rng, device, m):
    # The real model's 4-bit / group-64 / bf16 configuration at K = hidden size 2048.
    x, w, s, b = make_case(rng, m, 70, 2048, bits=4, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    check(rng, x, w, s, b, bits=4, group_size=64, device=device)


def test_leading_dims_and_1d_x(rng, device):
    x, w, s, b = make_case(rng, 0, 19, 128, bits=8, group_size=64, x_dtype=np.float32,
                           scale_dtype=np.float32, lead=(2, 5))
    y, _ = check(rng, x, w, s, b, bits=8, group_size=64, device=device)
    assert y.shape == (2, 5, 19)
    y1 = ops.quantized_matmul(x[1, 2], w, s, b, bits=8, group_size=64, device=device)
    assert y1.shape == (19,)
    y1b = ops.quantized_matmul(x[1, 2][None], w, s, b, bits=8, group_size=64, device=device)[0]
    np.testing.assert_array_equal(y1, y1b)


@pytest.mark.parametrize("m", [1, 2, 20, 40])
def test_result_independent_of_thread_order(rng, m):
    # No races: forward, reverse, shuffled and 'ahead' scheduling give bit-identical results.
    x, w, s, b = make_case(rng, m, 40, 256, bits=4, group_size=64, x_dtype=np.float32, scale_dtype=BF16)
    kw = {"f32_x_bf16_tiles": True} if m >= QMM_BF16_MIN_ROWS else {}  # m = 40: qmm_bf16
    runs = [ops._quantized_matmul(x, w, s, b, bits=4, group_size=64, order=o, seed=rng.seed, **kw)[0]
            for o in ("forward", "reverse", "shuffle", "ahead")]
    for o, r in zip(("reverse", "shuffle", "ahead"), runs[1:]):
        np.testing.assert_array_equal(runs[0], r, err_msg=f"order {o!r} differs from 'forward': a race (missing barrier?)")


def test_counters_report_exact_bytes(rng):
    m, n, k = 3, 50, 256
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    _, stats = ops._quantized_matmul(x, w, s, b, bits=4, group_size=64)
    assert stats["dispatches"] == 1 and stats["barriers"] == 0
    assert stats["bytes_bound"] == x.nbytes + w.nbytes + s.nbytes + b.nbytes + m * n * 2
    # qmv: kQmvRows (4) rows per threadgroup of 32 * splits threads, K split in blocks of 256
    # codes (32 lanes x 8), at most 4 (qmv_splits)
    assert stats["threads"] == -(-n // 4) * 32 * min(4, -(-k // 256))


# ------------------------------------------------------------------------------ qmm_bf16
# The M1-M4 prefill tiles (64 x 64 outputs, K steps of 16, bf16 operands, fp32 accumulators).
# Tile edges on both sides (M, N = 63 | 64 | 65, 1, 129, 130), K of one step pair (32: gs 32) up to
# odd step counts (K = 96, 160: the 4-bit register's second half at the last step), both bits,
# both x dtypes (fp32 x rounded to bf16 at the tile load), both scale dtypes.
BF16_SHAPES = [(33, 1, 32, 32, 4), (64, 64, 64, 64, 8), (65, 63, 96, 32, 4), (130, 129, 320, 64, 8),
               (97, 200, 160, 32, 4), (40, 70, 384, 128, 4)]


@pytest.mark.parametrize("x_dtype,scale_dtype", [(np.float32, np.float32), (BF16, BF16), (np.float32, BF16)],
                         ids=["xf32-sf32", "xbf16-sbf16", "xf32-sbf16"])
@pytest.mark.parametrize("m,n,k,group_size,bits", BF16_SHAPES)
def test_qmm_bf16_odd_shapes(rng, m, n, k, group_size, bits, x_dtype, scale_dtype):
    x, w, s, b = make_case(rng, m, n, k, bits=bits, group_size=group_size, x_dtype=x_dtype,
                           scale_dtype=scale_dtype)
    _, stats = check(rng, x, w, s, b, bits=bits, group_size=group_size, f32_x_bf16_tiles=True)
    xs = "bf16" if np.dtype(x_dtype) == BF16 else "f32"
    ss = "bf16" if np.dtype(scale_dtype) == BF16 else "f32"
    assert stats["kernels"] == [f"qmm_bf16_b{bits}_x{xs}_s{ss}"]


@pytest.mark.slow
@pytest.mark.parametrize("m,n,k", [(33, 193, 2048), (40, 2048, 4096)], ids=["in_proj_slice", "out_proj"])
def test_qmm_bf16_real_shapes(rng, m, n, k):
    # The real model's linear-attention out_proj (2048 x 4096) whole, and in_proj (qkv|z|b|a:
    # 12352 x 2048) at its real K on 193 of its rows (the whole matrix is 193 column tiles x 128 K
    # steps: ~60 s on the emulator, for no path this slice does not take), 4-bit / group 64 / bf16,
    # on a few rows of x.
    x, w, s, b = make_case(rng, m, n, k, bits=4, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    _, stats = check(rng, x, w, s, b, bits=4, group_size=64)
    assert stats["kernels"] == ["qmm_bf16_b4_xbf16_sbf16"]


@pytest.mark.parametrize("m,n,k,bits", [(33, 37, 192, 4), (130, 129, 128, 8), (64, 64, 64, 4)])
def test_qmm_bf16_counters(rng, m, n, k, bits):
    x, w, s, b = make_case(rng, m, n, k, bits=bits, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    _, stats = ops._quantized_matmul(x, w, s, b, bits=bits, group_size=64)
    tiles_m, tiles_n = -(-m // 64), -(-n // 64)
    assert stats["kernels"] == [f"qmm_bf16_b{bits}_xbf16_sbf16"]
    assert stats["dispatches"] == 1 and stats["barriers"] == 0
    assert stats["threads"] == tiles_m * tiles_n * 128
    assert stats["bytes_bound"] == x.nbytes + w.nbytes + s.nbytes + b.nbytes + m * n * 2
    assert stats["flops_useful"] == 2 * m * n * k
    assert stats["flops_executed"] == 2 * (tiles_m * 64) * (tiles_n * 64) * k


def test_qmm_bf16_route_needs_bf16_operands_allowed(rng):
    # bf16_tiles: bf16 x (or fp32 x with f32_x_bf16_tiles), 16-byte aligned x rows and w, and no
    # fp32_operands request (the MoE router); otherwise qmm. fp32 x keeps fp32 operands by default.
    import lily_py._core as core
    assert core.ops.qmm_route(64, bf16_tiles=True) == "qmm_bf16"
    assert core.ops.qmm_route(64, bf16_tiles=False) == "qmm"
    assert core.ops.qmm_route(64, bits=4, tensor_ops=True, bf16_tiles=False) == "qmm_m5"
    x, w, s, b = make_case(rng, 64, 40, 128, bits=4, group_size=64, x_dtype=np.float32, scale_dtype=BF16)
    _, stats = check(rng, x, w, s, b, bits=4, group_size=64)
    assert stats["kernels"] == ["qmm_b4_xf32_sbf16"]
    _, stats = check(rng, x, w, s, b, bits=4, group_size=64, f32_x_bf16_tiles=True)
    assert stats["kernels"] == ["qmm_bf16_b4_xf32_sbf16"]


def test_qmm_bf16_rounds_operands_where_stated(rng):
    # The fp32 reference with bf16-rounded operands is matched to the fp32 sum's precision, and the
    # result is measurably not the unrounded fp32 product (the rounding happens, once, in staging).
    x, w, s, b = make_case(rng, 64, 64, 512, bits=4, group_size=64, x_dtype=np.float32, scale_dtype=np.float32)
    y, _ = check(rng, x, w, s, b, bits=4, group_size=64, f32_x_bf16_tiles=True)
    ref = ref_kernels.quantized_matmul(x, w, s, b, bits=4, group_size=64)
    mag = ref_kernels.quantized_matmul_error_scale(x, w, s, b, bits=4, group_size=64)
    assert np.max(np.abs(y - ref) / mag) > 8 * np.sqrt(512) * F32_EPS


# ------------------------------------------------------------------------------ qmv1
# The single-token route: K split over min(4, ceil(K / block)) simdgroups (block = 1024 codes at 4
# bits, 512 at 8): K = 64 (one partial block, most lanes idle), 1088 (a full and a partial block,
# 2 simdgroups), 2048 and 4096 + 128 (4 simdgroups, several blocks each, a partial last one).
# Rows per threadgroup (qmv1_rows): QMV1_ROWS = 8 when ceil(N / 8) * splits >= QMV1_MIN_SIMDGROUPS
# (1024: 25.6 simdgroups per core on a 40-core GPU), else 1 (the *_r1 kernels). Small N (1, 5, 37)
# take 1 row; the switch is tested from both sides at odd N (QMV1_SWITCH: the smallest N that
# keeps 8 rows).
QMV1_ROWS = 8  # must match kQmv1Rows (checked below)
QMV1_MIN_SIMDGROUPS = 1024  # must match kQmv1MinSimdgroups (checked below)
QMV1_ONE_SPLIT_GROUPS = 4 * 1280  # kQmv1OneSplitGroups: from ceil(N / 8) this (N > 40,952), K is not split (lm_head)


def qmv1_splits(n, k, bits):
    # blocks of 32 lanes x V codes: V = 128 / bits at 4 and 8 bits, 32 at 2, 3, 5 and 6
    v = 128 // bits if bits in (4, 8) else 32
    return 1 if -(-n // QMV1_ROWS) >= QMV1_ONE_SPLIT_GROUPS else min(4, -(-k // (32 * v)))


def qmv1_rows(n, k, bits):
    if -(-n // QMV1_ROWS) >= QMV1_ONE_SPLIT_GROUPS and bits in (4, 8):
        return 16  # kQmv1WideRows: K not split (lm_head), x loaded once per 16 rows
    return QMV1_ROWS if -(-n // QMV1_ROWS) * qmv1_splits(n, k, bits) >= QMV1_MIN_SIMDGROUPS else 1


def qmv1_name(bits, xt, rows, yf32=False):
    return f"qmv1_b{bits}_x{xt}_sbf16{'_yf32' if yf32 else ''}{ {1: '_r1', QMV1_ROWS: '', 16: '_r16'}[rows]}"


# K = 2048: 4 splits at 8 bits (8 rows from N = 2041 = 8 * 255 + 1: 256 x 4 = 1024 simdgroups),
# 2 at 4 bits (from N = 4089 = 8 * 511 + 1: 512 x 2).
QMV1_SWITCH = {8: 2041, 4: 4089}


def test_qmv1_rows_rule_matches_extension():
    import lily_py._core as core
    assert core.ops.QMV1_ROWS == QMV1_ROWS
    assert core.ops.QMV1_MIN_SIMDGROUPS == QMV1_MIN_SIMDGROUPS
    assert core.ops.QMV1_ONE_SPLIT_GROUPS == QMV1_ONE_SPLIT_GROUPS
    for bits in (4, 8):
        for k in (64, 1088, 2048, 4096):
            # the smallest N that keeps QMV1_ROWS at this K (splits from K alone below lm_head's side)
            groups = -(-QMV1_MIN_SIMDGROUPS // min(4, -(-k // (32 * 128 // bits))))
            sw = QMV1_ROWS * (groups - 1) + 1
            for n in (1, 5, 257, 2039, 2040, 2041, 4087, 4088, 4089, 12352, 40952, 40953, 40960, 248320,
                      sw - 1, sw):
                assert core.ops.qmv1_rows(n, k, bits) == qmv1_rows(n, k, bits), (n, k, bits)
                assert core.ops.qmv1_splits(n, k, bits) == qmv1_splits(n, k, bits), (n, k, bits)
            assert qmv1_rows(sw - 1, k, bits) == 1 and qmv1_rows(sw, k, bits) == QMV1_ROWS, (sw, k, bits)
        sw = QMV1_SWITCH[bits]
        assert qmv1_rows(sw - 1, 2048, bits) == 1 and qmv1_rows(sw, 2048, bits) == 8
    # lm_head (N = 248320, K = 2048): one simdgroup per 16 rows walks all of K; K is not split from
    # ceil(N / 8) >= 5120 (N = 40,953)
    assert qmv1_splits(248320, 2048, 4) == 1 and qmv1_splits(40953, 2048, 4) == 1
    assert qmv1_splits(40952, 2048, 4) == 2
    # the real config: the 8-bit router + shared gate takes 1 row (1028 simdgroups, not 33 x 4 =
    # 132); every other decode projection keeps 8 (out_proj / o_proj 2048 x 4096: 256 x 4 = 1024,
    # exactly QMV1_MIN_SIMDGROUPS)
    assert qmv1_rows(257, 2048, 8) == 1 and -(-257 // 1) * qmv1_splits(257, 2048, 8) == 1028
    for n, k in [(12352, 2048), (2048, 4096), (9216, 2048)]:
        assert qmv1_rows(n, k, 4) == 8
    assert -(-2048 // 8) * qmv1_splits(2048, 4096, 4) == 1024
    assert qmv1_rows(248320, 2048, 4) == 16 and qmv1_rows(248320, 2048, 8) == 16  # lm_head: 15,520 threadgroups


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group_size", [(1, 64, 64), (5, 1088, 64), (37, 2048, 32), (6, 4224, 128),
                                            ("below", 2048, 64), ("switch", 2048, 64), ("one_split", 1088, 64)])
def test_qmv1_shapes_and_splits(rng, device, bits, n, k, group_size):
    # one_split: N past QMV1_ROWS x kQmv1OneSplitGroups rows, so one simdgroup walks a full and a partial block
    n = {"below": QMV1_SWITCH[bits] - 2, "switch": QMV1_SWITCH[bits],
         "one_split": QMV1_ROWS * QMV1_ONE_SPLIT_GROUPS + 1}.get(n, n)
    x, w, s, b = make_case(rng, 1, n, k, bits=bits, group_size=group_size, x_dtype=np.float32, scale_dtype=BF16)
    _, stats = check(rng, x, w, s, b, bits=bits, group_size=group_size, device=device)
    rows = qmv1_rows(n, k, bits)
    assert stats["kernels"] == [qmv1_name(bits, "f32", rows)]
    assert stats["threads"] == -(-n // rows) * 32 * qmv1_splits(n, k, bits)


def norm_case(rng, n, k, *, bits, group_size, x_dtype, residual):
    x, w, s, b = make_case(rng, 1, n, k, bits=bits, group_size=group_size, x_dtype=x_dtype, scale_dtype=BF16)
    nw = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    res = rng.standard_normal(k).astype(np.float32).astype(x_dtype) if residual else None
    return x[0], w, s, b, nw, res


# The fused RMSNorm in front of qmv1 (decode's input, post and final norms): against
# rms_norm -> quantized_matmul in float64. Error: the norm factor carries (4 sqrt(K) + 8) u (as the
# rms_norm kernel), the dot product 8 sqrt(K) u mag with mag taken over the normalized row; the
# side outputs h (exact in float32, one rounding in bf16) and xn (the rms_norm kernel's bound).
# bf16 x, fp32 y (the engine's lm_head: fp32 logits from the bf16 residual stream): the *_yf32
# kernels of every route, both sides of each switch; y gets no bf16 rounding, so rtol is 0 and
# only the fp32 arithmetic bound remains (a y rounded to bf16 errs by ~2^-9 |y|, far outside it).
YF32 = list(itertools.product([4, 8], [np.float32, BF16]))


@pytest.mark.parametrize("m", [1, 2, QMV_MAX_ROWS, QMV_MAX_ROWS + 1, 45])
@pytest.mark.parametrize("bits,scale_dtype", YF32, ids=[f"b{b}-s{np.dtype(s).name}" for b, s in YF32])
def test_bf16_x_fp32_y(rng, device, m, bits, scale_dtype):
    n, k, gs = 37, 3 * 64, 64
    x, w, s, b = make_case(rng, m, n, k, bits=bits, group_size=gs, x_dtype=BF16, scale_dtype=scale_dtype)
    _, stats = check(rng, x, w, s, b, bits=bits, group_size=gs, device=device, y_f32=True)
    route = "qmv1" if m == 1 else "qmv" if m <= QMV_MAX_ROWS else "qmm"
    ss = "bf16" if np.dtype(scale_dtype) == BF16 else "f32"
    r1 = "_r1" if route == "qmv1" and qmv1_rows(n, k, bits) == 1 else ""  # N = 37: 1 row per threadgroup
    assert stats["kernels"] == [f"{route}_b{bits}_xbf16_s{ss}_yf32{r1}"]
    # float32 x with y_f32 is the plain float32 kernel
    xf = x.astype(np.float32)
    _, stats = check(rng, xf, w, s, b, bits=bits, group_size=gs, device=device, y_f32=True)
    assert stats["kernels"] == [f"{route}_b{bits}_xf32_s{ss}{r1}"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(7, 192), (13, 2048), ("below", 2048), ("switch", 2048), ("one_split", 1088)])
def test_qmv1_fused_norm_bf16_x_fp32_y(rng, device, bits, n, k):
    """The decode lm_head: the final norm fused into qmv1 on the bf16 residual stream, fp32
    logits: the bound of test_qmv1_fused_norm without the output's bf16 rounding. one_split: past
    QMV1_ROWS x kQmv1OneSplitGroups rows (lm_head's side): 16 rows per threadgroup, K not split,
    the last threadgroup with 3 rows of N."""
    n = {"below": QMV1_SWITCH[bits] - 2, "switch": QMV1_SWITCH[bits],
         "one_split": QMV1_ROWS * QMV1_ONE_SPLIT_GROUPS + 3}.get(n, n)
    gs = 64
    x, w, s, b, nw, res = norm_case(rng, n, k, bits=bits, group_size=gs, x_dtype=BF16, residual=True)
    y, _, _, stats = ops._quantized_matmul_norm(x, w, s, b, nw, bits=bits, group_size=gs, eps=1e-6,
                                                residual=res, device=device, seed=rng.seed, y_f32=True)
    h_ref = ref_kernels.residual_add(x, res)
    xn_ref = ref_kernels.rms_norm(h_ref[None], nw, eps=1e-6)
    y_ref = ref_kernels.quantized_matmul(xn_ref, w, s, b, bits=bits, group_size=gs)[0]
    mag = ref_kernels.quantized_matmul_error_scale(xn_ref, w, s, b, bits=bits, group_size=gs)[0]
    norm_err = (4 * np.sqrt(k) + 8) * F32_EPS
    assert y.dtype == np.float32
    assert_close(y, y_ref, atol=(8 * np.sqrt(k) * F32_EPS + norm_err) * mag, rtol=0,
                 what=f"qmv1 fused norm {stats['kernels']}", seed=rng.seed)
    assert stats["kernels"] == [qmv1_name(bits, "bf16", qmv1_rows(n, k, bits), yf32=True)]


@pytest.mark.parametrize("x_dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("residual,side", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("n,k", [(7, 192), (13, 2048), (257, 2048), ("below", 2048), ("switch", 2048)])
def test_qmv1_fused_norm(rng, device, x_dtype, bits, residual, side, n, k):
    """Both sides of the rows switch; (257, 2048) is the router + shared gate's shape (1 row per
    threadgroup: every threadgroup recomputes the sum of squares; threadgroup 0 alone writes the
    side outputs h, xn)."""
    n = {"below": QMV1_SWITCH[bits] - 2, "switch": QMV1_SWITCH[bits]}.get(n, n)
    gs = 64
    x, w, s, b, nw, res = norm_case(rng, n, k, bits=bits, group_size=gs, x_dtype=x_dtype, residual=residual)
    y, h, xn, stats = ops._quantized_matmul_norm(x, w, s, b, nw, bits=bits, group_size=gs, eps=1e-6,
                                                 residual=res, side=side, device=device, seed=rng.seed)
    h_ref = ref_kernels.residual_add(x, res) if residual else x
    xn_ref = ref_kernels.rms_norm(h_ref[None], nw, eps=1e-6)
    y_ref = ref_kernels.quantized_matmul(xn_ref, w, s, b, bits=bits, group_size=gs)[0]
    mag = ref_kernels.quantized_matmul_error_scale(xn_ref, w, s, b, bits=bits, group_size=gs)[0]
    rtol = 2 * BF16_EPS if np.dtype(x_dtype) == BF16 else 0.0
    norm_err = (4 * np.sqrt(k) + 8) * F32_EPS
    assert_close(y, y_ref, atol=(8 * np.sqrt(k) * F32_EPS + norm_err) * mag, rtol=rtol,
                 what=f"qmv1 fused norm {stats['kernels']}", seed=rng.seed)
    rows = qmv1_rows(n, k, bits)
    assert stats["kernels"] == [qmv1_name(bits, "bf16" if np.dtype(x_dtype) == BF16 else "f32", rows)]
    assert stats["dispatches"] == 1
    assert stats["threads"] == -(-n // rows) * 32 * qmv1_splits(n, k, bits)
    if side:
        np.testing.assert_array_equal(h, h_ref)
        assert_close(xn, xn_ref[0], atol=norm_err * np.abs(xn_ref[0]) + 1e-30, rtol=rtol,
                     what="qmv1 side output xn", seed=rng.seed)
    else:
        assert h is None and xn is None


# 1 row per threadgroup (N = 9; the router's 257 x 2048 at 8 bits), 8 (the 8-bit switch) and 16
# (K not split: lm_head's side of QMV1_ONE_SPLIT_GROUPS; threadgroup 0 writes the side outputs).
@pytest.mark.parametrize("n,k,bits", [(9, 1088, 4), (257, 2048, 8), (QMV1_SWITCH[8], 2048, 8),
                                      (QMV1_ROWS * QMV1_ONE_SPLIT_GROUPS + 5, 192, 4)])
def test_qmv1_fused_norm_independent_of_thread_order(rng, n, k, bits):
    x, w, s, b, nw, res = norm_case(rng, n, k, bits=bits, group_size=64, x_dtype=np.float32, residual=True)
    runs = [ops._quantized_matmul_norm(x, w, s, b, nw, bits=bits, group_size=64, residual=res, side=True,
                                       order=o, seed=rng.seed)[:3] for o in ("forward", "reverse", "shuffle", "ahead")]
    for r in runs[1:]:
        for a, c in zip(runs[0], r):
            np.testing.assert_array_equal(a, c)


def test_qmv1_fused_norm_bad_input(rng):
    x, w, s, b, nw, _ = norm_case(rng, 4, 128, bits=4, group_size=64, x_dtype=np.float32, residual=False)
    with pytest.raises(ValueError, match="norm_weight must be float32"):
        ops.quantized_matmul_norm(x, w, s, b, nw.astype(np.float64), bits=4, group_size=64)
    with pytest.raises(ValueError, match="residual must be"):
        ops.quantized_matmul_norm(x, w, s, b, nw, bits=4, group_size=64, residual=x[:64])
    with pytest.raises(ValueError, match="eps must be > 0"):
        ops.quantized_matmul_norm(x, w, s, b, nw, bits=4, group_size=64, eps=0.0)


# ------------------------------------------------------------------------------ bad input
def _ok(rng):
    return make_case(rng, 2, 16, 128, bits=4, group_size=64, x_dtype=np.float32, scale_dtype=np.float32)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: {**a, "x": a["x"].astype(np.float64)}, "x must be float32 or bfloat16, got float64"),
    (lambda a: {**a, "x": a["x"].tolist()}, "x must be a numpy.ndarray"),
    (lambda a: {**a, "x": a["x"][:, :100]}, "K=100 .* not a multiple of group_size=64"),
    (lambda a: {**a, "x": np.zeros((2, 192), np.float32)}, r"w is \(16, 16\) but x has K=192"),
    (lambda a: {**a, "w": a["w"].astype(np.int32)}, "w must be a 2-D uint32 array"),
    (lambda a: {**a, "w": a["w"][None]}, "w must be a 2-D uint32 array"),
    (lambda a: {**a, "scales": a["scales"][:, :1]}, r"scales must be \[N, K/group_size\] = \[16, 2\], got \[16, 1\]"),
    (lambda a: {**a, "biases": a["biases"][:8]}, r"biases must be \[N, K/group_size\]"),
    (lambda a: {**a, "biases": a["biases"].astype(BF16)}, "scales .* and biases .* must have the same dtype"),
    (lambda a: {**a, "bits": 7}, r"bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"),
    (lambda a: {**a, "group_size": 16}, r"group_size must be one of \(32, 64, 128\), got 16"),
    (lambda a: {**a, "device": "vulkan"}, "device must be 'emu', 'metal' or 'cuda', got 'vulkan'"),
], ids=["x-float64", "x-list", "K-not-group-multiple", "w-K-mismatch", "w-int32", "w-3d",
        "scales-shape", "biases-shape", "dtype-mismatch", "bits", "group", "device"])
def test_bad_input_raises_clear_error(rng, mutate, match):
    x, w, s, b = _ok(rng)
    a = mutate({"x": x, "w": w, "scales": s, "biases": b, "bits": 4, "group_size": 64, "device": "emu"})
    with pytest.raises((ValueError, TypeError), match=match):
        ops.quantized_matmul(a["x"], a["w"], a["scales"], a["biases"], bits=a["bits"],
                             group_size=a["group_size"], device=a["device"])


def test_metal_device_unavailable_is_a_clear_error(rng):
    import lily_py._core as core
    if "metal" in core.devices():
        pytest.skip("this build has the Metal device")
    x, w, s, b = _ok(rng)
    with pytest.raises(ValueError, match="device 'metal' is not available"):
        ops.quantized_matmul(x, w, s, b, bits=4, group_size=64, device="metal")


def test_extension_validates_too(rng):
    # The binding re-checks shapes itself (callers other than lily_py.ops).
    import lily_py._core as core
    x, w, s, b = _ok(rng)
    with pytest.raises(ValueError, match="scales/biases must be"):
        core.ops.quantized_matmul(x, w, s[:, :1].copy(), b, bits=4, group_size=64, x_dtype="float32",
                                  scale_dtype="float32")
    with pytest.raises(ValueError, match="unsupported dtype 'float16'"):
        core.ops.quantized_matmul(x, w, s, b, bits=4, group_size=64, x_dtype="float16", scale_dtype="float32")
