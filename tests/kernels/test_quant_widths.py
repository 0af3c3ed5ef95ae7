"""Every MLX affine width (2, 3, 4, 5, 6, 8 bits) on the kernels that read quantized weights:
the dense matvecs and fp32 tiles (qmv1, qmv, qmm), the embedding, and the MoE expert kernels
(matvec, fp32 tiles, few-row), on the emulator.

3-, 5- and 6-bit codes straddle 32-bit words (common/quant.h unpack_row and the generic
Qmv1Codes). Two oracles: lily_py.reference (float64 on the same codes; tolerances as
test_quantized_matmul.py and test_moe.py derive them) and MLX itself (tests/fixtures/mlx_widths,
written by mx.quantize / mx.dequantize / mx.quantized_matmul: make_mlx_widths.py), which pins the
packing to MLX's rather than to our own quantizer's.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kernel_checks import DEVICES, F32_EPS, assert_close, rng  # noqa: F401  (fixtures)
from lily_py import _core as core
from lily_py import ops
from lily_py.reference import kernels as ref_kernels
from lily_py.reference import quant
import test_moe
from test_moe import check as moe_check
from test_moe import make_block
from test_quantized_matmul import BF16, check, make_case, qmv1_rows, qmv1_splits

WIDTHS = (2, 3, 5, 6)  # the generic widths; 4 and 8 keep their own tests
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "mlx_widths", "mlx_widths.npz")


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 37], ids=["qmv1", "qmv", "qmm"])
@pytest.mark.parametrize("x_dtype", [np.float32, BF16], ids=["xf32", "xbf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_quantized_matmul_every_route(rng, bits, group_size, m, x_dtype, device):
    """Odd N (45 rows: a partial last group of rows), K = 640 (5 x 128, not a power of two)."""
    x, w, s, b = make_case(rng, m, 45, 640, bits=bits, group_size=group_size, x_dtype=x_dtype, scale_dtype=BF16)
    _, stats = check(rng, x, w, s, b, bits=bits, group_size=group_size, device=device)
    route = {1: "qmv1", 3: "qmv", 37: "qmm"}[m]
    name = f"{route}_b{bits}_{'xbf16' if x_dtype == BF16 else 'xf32'}_sbf16"
    # 45 rows: qmv1 takes one row per threadgroup (qmv1_rows: ceil(45 / 8) x 1 split = 6 < 1024 simdgroups at 8)
    assert stats["kernels"] == [name + ("_r1" if m == 1 else "")]


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("device", DEVICES)
def test_lm_head_fp32_logits_and_one_row_kernels(rng, bits, device):
    """bf16 x with float32 y (lm_head), and N small enough that qmv1 takes one row per threadgroup."""
    x, w, s, b = make_case(rng, 1, 45, 384, bits=bits, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    _, stats = check(rng, x, w, s, b, bits=bits, group_size=64, y_f32=True, device=device)
    assert stats["kernels"] == [f"qmv1_b{bits}_xbf16_sbf16_yf32_r1"]


@pytest.mark.parametrize("bits", WIDTHS)
def test_tensor_op_and_bf16_tile_devices_take_the_fp32_tiles(rng, bits):
    """The bf16 and tensor-op tiles are 4/8-bit: other widths take qmm on every device."""
    from lily_py.testing import simulated_device
    x, w, s, b = make_case(rng, 40, 45, 384, bits=bits, group_size=64, x_dtype=BF16, scale_dtype=BF16)
    with simulated_device(tensor_ops=True):
        _, stats = check(rng, x, w, s, b, bits=bits, group_size=64)
    assert stats["kernels"] == [f"qmm_b{bits}_xbf16_sbf16"]
    assert ops.quantized_matmul_route(40, bits=bits, tensor_ops=True) == "qmm"


@pytest.mark.parametrize("bits", WIDTHS)
def test_float32_scales_are_refused_by_name(rng, bits):
    x, w, s, b = make_case(rng, 1, 8, 128, bits=bits, group_size=64, x_dtype=np.float32, scale_dtype=np.float32)
    with pytest.raises(ValueError, match=rf"{bits}-bit weights take bfloat16 scales"):
        ops.quantized_matmul(x, w, s, b, bits=bits, group_size=64)


@pytest.mark.parametrize("bits", (2, 3, 4, 5, 6, 8))
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_mlx_packing_and_matmul(bits, group_size):
    """MLX's own quantization (fixture): our unpack gives MLX's codes exactly, our dequantization its
    values, and the kernels its quantized_matmul within the fp32 bound on the same operands."""
    f = np.load(FIXTURE)
    k = f"b{bits}_g{group_size}_"
    w, deq = f[k + "w"], f[k + "deq"].astype(np.float64)
    s = f[k + "scales"].view(BF16)
    b = f[k + "biases"].view(BF16)
    s64 = np.repeat(s.astype(np.float64), group_size, axis=1)
    b64 = np.repeat(b.astype(np.float64), group_size, axis=1)
    codes = quant.unpack(w, bits).astype(np.float64)
    mlx_codes = np.rint((deq - b64) / np.where(s64 == 0, 1, s64))
    np.testing.assert_array_equal(codes, mlx_codes, err_msg=f"{bits}-bit group {group_size}: codes differ from MLX's")
    ours = quant.dequantize(w, s, b, bits=bits, group_size=group_size).astype(np.float64)
    assert_close(ours, deq, atol=2 * F32_EPS * (np.abs(s64 * codes) + np.abs(b64)), rtol=0,
                 what=f"dequantize {bits}-bit group {group_size} vs mx.dequantize")
    x, y_mlx = f[k + "x"], f[k + "y"].astype(np.float64)
    for m in (1, 3):  # qmv1, qmv (the fixture's 3 rows; qmm is covered above on the same unpack)
        y = ops.quantized_matmul(x[:m], w, s, b, bits=bits, group_size=group_size)
        mag = ref_kernels.quantized_matmul_error_scale(x[:m], w, s, b, bits=bits, group_size=group_size)
        assert_close(y, y_mlx[:m], atol=16 * np.sqrt(x.shape[1]) * F32_EPS * mag, rtol=0,
                     what=f"quantized_matmul {bits}-bit group {group_size} M={m} vs mx.quantized_matmul")


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("x_dtype", [np.float32, BF16], ids=["xf32", "xbf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_embedding(rng, bits, x_dtype, device):
    V, D, gs = 37, 384, 64
    table = rng.standard_normal((V, D)).astype(np.float32) * 0.1
    w, s, b = quant.quantize(table, bits=bits, group_size=gs, scale_dtype=BF16)
    ids = np.array([0, 36, 5, 5, 17], np.uint32)
    out = ops.embedding(ids, w, s, b, bits=bits, group_size=gs, dtype=x_dtype, device=device)
    want = quant.dequantize(w, s, b, bits=bits, group_size=gs)[ids]
    assert_close(out, want, atol=2 * F32_EPS * np.abs(want), rtol=(2.0 ** -8 if x_dtype == BF16 else 0.0),
                 what=f"embedding {bits}-bit")


@pytest.mark.parametrize("bits,down_bits", [(2, 2), (3, 3), (5, 5), (6, 6), (8, 8), (3, 4), (4, 6)])
@pytest.mark.parametrize("T", [1, 3, 40], ids=["mv1", "mv3", "tiled"])
@pytest.mark.parametrize("device", DEVICES)
def test_moe_expert_widths(rng, bits, down_bits, T, device):
    """Every expert width on the decode matvecs (T <= the mv limit) and the tiled route (fp32 tiles
    and few-row kernels), with gate/up and down at different widths (mixed-bit checkpoints)."""
    W, x_of = make_block(rng, E=7, H=128, I=64, Is=96, gs=32, bits=bits, down_bits=down_bits)
    _, _, stats = moe_check(rng, W, x_of(T, 2), 2, device=device)
    x = "xf32"
    if T <= 3:
        assert stats["route"] == "mv" and stats["kernels"][1:] == test_moe.mv_route_kernels(T) + [
            f"moe_gate_up_mv_b{bits}_{x}_sbf16", f"moe_down_mv_b{down_bits}_{x}_sbf16"]
    else:
        assert stats["route"] == "tiled" and stats["kernels"][3:9] == [
            f"moe_gate_up_mm64_b{bits}_{x}_sbf16", f"moe_gate_up_mm32_b{bits}_{x}_sbf16",
            f"moe_gate_up_few_b{bits}_{x}_sbf16", f"moe_down_mm64_b{down_bits}_sbf16",
            f"moe_down_mm32_b{down_bits}_sbf16", f"moe_down_few_b{down_bits}_sbf16"]


@pytest.mark.parametrize("bits", (3, 6))
def test_moe_widths_on_a_tensor_op_device_take_the_fp32_tiles(rng, bits):
    """The M5 MoE tiles are 4-bit: other widths take the M1-M4 plan and fp32 tiles there too."""
    from lily_py.testing import simulated_device
    W, x_of = make_block(rng, E=7, H=128, I=64, Is=96, gs=32, bits=bits)
    with simulated_device(tensor_ops=True):
        _, _, stats = moe_check(rng, W, x_of(40, 2), 2)
    assert stats["kernels"][3] == f"moe_gate_up_mm64_b{bits}_xf32_sbf16"


SHARED_WIDTHS = [(2, 6), (3, 6), (4, 6), (4, 8)]  # (routed, shared): issue 41 item 4


def test_shared_width_pairs_are_the_built_ones():
    assert sorted(map(tuple, core.engine_quant_support()["moe_shared_widths"])) == SHARED_WIDTHS


@pytest.mark.parametrize("bits,sbits", SHARED_WIDTHS)
@pytest.mark.parametrize("T", [1, 5, 12, 24, 40], ids=["mv1", "mv5", "few", "t32", "t64"])
@pytest.mark.parametrize("device", DEVICES)
def test_moe_shared_expert_at_its_own_width(rng, bits, sbits, T, device):
    """A mixed checkpoint's MoE (routed experts at `bits`, the shared expert at `sbits` in both
    stages) on the matvecs and on the tiled route, where T puts the shared group (T rows) in the
    few-row (12), the 32-row (24) and the 64-row (40) kind, against the float64 reference."""
    W, x_of = make_block(rng, E=7, H=128, I=64, Is=96, gs=32, bits=bits, shared_bits=sbits, shared_down_bits=sbits)
    _, _, stats = moe_check(rng, W, x_of(T, 2), 2, device=device)
    t = f"b{bits}s{sbits}"
    if T <= 8:
        assert stats["route"] == "mv" and stats["kernels"][1:] == test_moe.mv_route_kernels(T) + [
            f"moe_gate_up_mv_{t}_xf32_sbf16", f"moe_down_mv_{t}_xf32_sbf16"]
    else:
        assert stats["route"] == "tiled" and stats["kernels"][3:9] == [
            f"moe_gate_up_mm64_{t}_xf32_sbf16", f"moe_gate_up_mm32_{t}_xf32_sbf16", f"moe_gate_up_few_{t}_xf32_sbf16",
            f"moe_down_mm64_{t}_sbf16", f"moe_down_mm32_{t}_sbf16", f"moe_down_few_{t}_sbf16"]


def _check_bf16(rng, W, x, top_k):
    """The block on bfloat16 activations against the float64 reference on the same (bf16) values:
    tokens routed as the reference routes them, within the fp32 bound plus the bfloat16 rounding of
    the router logits' consequences and of the output (2^-7 of each token's largest |output|)."""
    out, ids, _, stats = ops._moe(x, *ops.moe_weights(W), top_k=top_k, seed=rng.seed)
    xs = np.asarray(x, np.float32)
    dense, mags = test_moe.parts(W)
    want, rids, _ = ref_kernels.moe(xs, *(dense[k] for k in test_moe.KEYS), top_k=top_k)
    same = (np.sort(ids, 1) == np.sort(rids, 1)).all(1)
    assert same.mean() >= 0.75, f"only {same.sum()} of {len(x)} tokens routed as the reference (seed {rng.seed})"
    bound = ref_kernels.moe_error_bound(xs, mags, dense, top_k=top_k)
    scale = np.abs(want).max(axis=1, keepdims=True) * 2.0 ** -7
    assert_close(np.asarray(out, np.float32)[same], want[same], atol=(bound + scale)[same], rtol=0,
                 what="moe bf16 x", seed=rng.seed)
    return stats


@pytest.mark.parametrize("T", [1, 40])
def test_moe_shared_width_in_one_stage_only(rng, T):
    """The down stage 6-bit throughout (routed and shared), gate/up routed 3-bit and shared 6-bit
    (the shared expert at its own width in one stage), on bfloat16 activations."""
    W, x_of = make_block(rng, E=7, H=128, I=64, Is=96, gs=32, bits=3, down_bits=6, shared_bits=6)
    stats = _check_bf16(rng, W, x_of(T, 2).astype(BF16), 2)
    want = (["moe_gate_up_mv_b3s6_xbf16_sbf16", "moe_down_mv_b6_xbf16_sbf16"] if T == 1 else
            ["moe_gate_up_mm64_b3s6_xbf16_sbf16", "moe_down_mm64_b6_sbf16"])
    assert [k for k in stats["kernels"] if k in want] == want


def test_moe_mixed_4_8_takes_the_fp32_tiles_on_tensor_op_and_bf16_devices(rng):
    """Uniform 4-bit experts take the M5 tensor-op tiles (and the bf16 tiles with bf16 x); with the
    shared expert at 8 bits the block takes the fp32 tiles built for the pair."""
    from lily_py.testing import simulated_device
    W, x_of = make_block(rng, E=7, H=128, I=64, Is=96, gs=32, bits=4, shared_bits=8, shared_down_bits=8)
    with simulated_device(tensor_ops=True):
        _, _, stats = moe_check(rng, W, x_of(40, 2), 2)
    assert stats["kernels"][3] == "moe_gate_up_mm64_b4s8_xf32_sbf16"
    stats = _check_bf16(rng, W, x_of(40, 2).astype(BF16), 2)
    assert stats["kernels"][3] == "moe_gate_up_mm64_b4s8_xbf16_sbf16"


def test_moe_unbuilt_shared_width_is_refused_with_the_built_pairs(rng):
    W, x_of = make_block(rng, E=7, H=128, I=64, Is=96, gs=32, bits=3, shared_bits=5)
    with pytest.raises(ValueError, match=r"routed experts are 3-bit and its shared expert 5-bit: .* routed/shared "
                                         r"bits 2/6, 3/6, 4/6, 4/8"):
        ops.moe(x_of(1), *ops.moe_weights(W), top_k=2)


# ------------------------------------------------------------------------------ more qmv1 / fp32 y
# (cross-checks written independently of the kernels above, feat/bits2)
def test_qmv1_split_rule_at_every_width():
    import lily_py._core as core
    for bits in (2, 3, 4, 5, 6, 8):
        for n in (1, 45, 2041, 2728, 2729, 2731, 4089, 8185, 40952, 40953, 40961):
            for k in (128, 384, 1088, 2048, 2432):
                assert core.ops.qmv1_splits(n, k, bits) == qmv1_splits(n, k, bits), (n, k, bits)
                assert core.ops.qmv1_rows(n, k, bits) == qmv1_rows(n, k, bits), (n, k, bits)  # 16: 4 and 8 bits only


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("device", DEVICES)
def test_qmv1_eight_rows_and_three_splits(rng, bits, device):
    """The 8-row qmv1 kernels (N past the 1-row switch: ceil(2731 / 8) x 3 splits = 1026 >= 1024
    simdgroups, the last threadgroup with 3 rows); K = 2432: 3 splits of 1024-code blocks, the last
    one partial."""
    n, k = 2731, 2432
    x, w, s, b = make_case(rng, 1, n, k, bits=bits, group_size=128, x_dtype=BF16, scale_dtype=BF16)
    _, stats = check(rng, x, w, s, b, bits=bits, group_size=128, device=device)
    assert stats["kernels"] == [f"qmv1_b{bits}_xbf16_sbf16"]
    assert stats["threads"] == -(-n // 8) * 32 * 3


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("m", [3, 37], ids=["qmv", "qmm"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp32_y_on_the_qmv_and_qmm_routes(rng, bits, m, device):
    x, w, s, b = make_case(rng, m, 37, 384, bits=bits, group_size=32, x_dtype=BF16, scale_dtype=BF16)
    _, stats = check(rng, x, w, s, b, bits=bits, group_size=32, y_f32=True, device=device)
    assert stats["kernels"] == [f"{'qmv' if m == 3 else 'qmm'}_b{bits}_xbf16_sbf16_yf32"]


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_norm(rng, bits, device):
    """quantized_matmul_norm (residual, side outputs) on the same qmv1 kernels; the bound of
    test_quantized_matmul.py's test_qmv1_fused_norm."""
    n, k, gs = 13, 640, 64
    x, w, s, b = make_case(rng, 1, n, k, bits=bits, group_size=gs, x_dtype=BF16, scale_dtype=BF16)
    nw = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    res = rng.standard_normal(k).astype(np.float32).astype(BF16)
    y, h, _, stats = ops._quantized_matmul_norm(x[0], w, s, b, nw, bits=bits, group_size=gs, eps=1e-6,
                                                residual=res, side=True, seed=rng.seed, device=device)
    h_ref = ref_kernels.residual_add(x[0], res)
    xn_ref = ref_kernels.rms_norm(h_ref[None], nw, eps=1e-6)
    y_ref = ref_kernels.quantized_matmul(xn_ref, w, s, b, bits=bits, group_size=gs)[0]
    mag = ref_kernels.quantized_matmul_error_scale(xn_ref, w, s, b, bits=bits, group_size=gs)[0]
    norm_err = (4 * np.sqrt(k) + 8) * F32_EPS
    assert_close(y, y_ref, atol=(8 * np.sqrt(k) * F32_EPS + norm_err) * mag, rtol=2.0 ** -8,
                 what=f"qmv1 fused norm {stats['kernels']}", seed=rng.seed)
    np.testing.assert_array_equal(h, h_ref)
    assert stats["kernels"] == [f"qmv1_b{bits}_xbf16_sbf16_r1"]


def test_pack_puts_a_straddling_code_in_both_words(rng):
    for bits in (2, 3, 4, 5, 6, 8):
        q = rng.integers(0, 1 << bits, size=(5, 96)).astype(np.uint8)
        np.testing.assert_array_equal(quant.unpack(quant.pack(q, bits), bits), q)
    q = np.zeros((1, 32), np.uint8)
    q[0, 10] = 0b111  # 3 bits: code 10 = bits 30, 31 of word 0 and bit 0 of word 1
    np.testing.assert_array_equal(quant.pack(q, 3)[0], [0b11 << 30, 0b1, 0])
