"""The M5 route of lily_py.ops.moe (shaders/m5/moe_m5.metal: the 64- and 32-row tiles of the tiled
route on Metal 4 tensor ops) on the emulator under lily_py.testing.simulated_device(tensor_ops=True),
vs lily_py.reference.kernels.moe (float64).

Tolerance, derived: the fp32 bound of test_moe.py (reference.kernels.moe_error_bound: dot products,
SwiGLU, routing weights, the sum) plus what the half operands add. The kernels round x, h and the
dequantized weights to half once (relative 2^-11 each, exact products, fp32 sums), so with
e = 2.001 * 2^-11 (two roundings per product):
  gate/up:  |dg| <= e |Wg|.|x|, |du| <= e |Wu|.|x|
  h:        |dh| <= 1.1 |dg| (|u| + |du|) + |silu(g)| |du|               (|silu'| <= 1.1)
  y = D h:  |dy| <= |D|.(1.001 |dh| + e (|h| + |dh|))
  out:      sum_j w_j |dy_j| over the routed slots and the shared slot (w: the kernels' weights).
The few-row tiles (fp32 operands) are inside that bound too. An error of one wrong row, feature or
tile is far above it. Both sides of the route switch: without tensor ops the same inputs take
moe_gate_up_mm* / moe_down_mm*; with them the 64- and 32-row kinds take the *_m5 kernels and the
few-row kind keeps moe_*_few. The plans differ: with tensor ops a remainder of <= 2 rows (not
<= 16) takes a few-row tile, and a 32-row-list tile of <= 16 rows runs a 16-row matmul2d; both
sides of both switches (2 | 3, 16 | 17 rows) are below.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_checks import assert_close, rng  # noqa: F401  (fixture)
from lily_py import ops
from lily_py.reference import kernels as ref
from lily_py.testing import simulated_device
from test_moe import KEYS, expected_executed, expected_tiles, make_block, near_ties, parts

E_HALF = 2.001 * 2.0 ** -11
M5_KINDS = ["moe_gate_up_m5_64_b4_xf32_sbf16", "moe_gate_up_m5_32_b4_xf32_sbf16", "moe_gate_up_few_b4_xf32_sbf16",
            "moe_down_m5_64_b4_sbf16", "moe_down_m5_32_b4_sbf16", "moe_down_few_b4_sbf16", "moe_combine_xf32"]
MM_KINDS = ["moe_gate_up_mm64_b4_xf32_sbf16", "moe_gate_up_mm32_b4_xf32_sbf16", "moe_gate_up_few_b4_xf32_sbf16",
            "moe_down_mm64_b4_sbf16", "moe_down_mm32_b4_sbf16", "moe_down_few_b4_sbf16", "moe_combine_xf32"]


def half_bound(x, dense, ids, weights):
    """The half-operand term of the docstring's bound, [T, H] float64."""
    x64 = np.asarray(x, np.float64)
    T, H = x64.shape
    k = ids.shape[1]
    out = np.zeros((T, H))
    for t in range(T):
        ax = np.abs(x64[t])
        for j in range(k + 1):
            if j < k:
                Wg, Wu, Wd = (dense[n][ids[t, j]] for n in ("gate", "up", "down"))
            else:
                Wg, Wu, Wd = dense["shared_gate_proj"], dense["shared_up"], dense["shared_down"]
            g, u = Wg @ x64[t], Wu @ x64[t]
            silu = g / (1.0 + np.exp(-g))
            h = silu * u
            dg, du = E_HALF * (np.abs(Wg) @ ax), E_HALF * (np.abs(Wu) @ ax)
            dh = 1.1 * dg * (np.abs(u) + du) + np.abs(silu) * du
            dy = np.abs(Wd) @ (1.001 * dh + E_HALF * (np.abs(h) + dh))
            out[t] += abs(float(weights[t, j])) * dy
    return out


def run(rng, W, x, top_k, *, tensor_ops=True, **kw):
    if tensor_ops:
        with simulated_device(tensor_ops=True):
            return ops._moe(x, *ops.moe_weights(W), top_k=top_k, seed=rng.seed, **kw)
    return ops._moe(x, *ops.moe_weights(W), top_k=top_k, seed=rng.seed, **kw)


def check_m5(rng, W, x, top_k, **kw):
    out, ids, weights, stats = run(rng, W, x, top_k, **kw)
    assert stats["route"] == "tiled" and stats["kernels"][3:] == M5_KINDS, stats["kernels"]
    dense, mags = parts(W)
    want, rids, _ = ref.moe(x, *(dense[key] for key in KEYS), top_k=top_k)
    ok = ~near_ties(dense, x, top_k)
    assert (~ok).sum() <= max(1, len(x) // 20)
    np.testing.assert_array_equal(ids[ok], rids[ok], err_msg=f"routing differs (seed {rng.seed})")
    bound = ref.moe_error_bound(x, mags, dense, top_k=top_k) + half_bound(x, dense, ids, weights)
    assert_close(out[ok], want[ok], atol=bound[ok], rtol=0, what=f"moe M5 T={len(x)} k={top_k}", seed=rng.seed)
    # The M5 kernels ran where the plan made 64- or 32-row tiles: the result differs from the
    # simdgroup route's (half operands), and is the same where every tile is a few-row one.
    other = run(rng, W, x, top_k, tensor_ops=False, **kw)[0]
    assert np.array_equal(out, other) == (stats["tiles"]["64"] + stats["tiles"]["32"] == 0)
    assert stats["host_syncs"] == 0
    return out, ids, stats


# Expert 0 (skewed load) and the shared group hold T rows: 9 and 16 (a 16-row tile), 17 and 33
# (32-row), 65 and 66 (64 + a few-row remainder of 1 | 2), 67, 73 and 80 (64 + a 16-row remainder
# of 3 | 9 | 16), 81 (64 + 32-row remainder of 17), 97 (64 + 64-row remainder); the other
# experts scattered loads.
@pytest.mark.parametrize("T", [9, 16, 17, 33, 65, 66, 67, 73, 80, 81, 97])
def test_m5_tiles_sized_by_load(rng, T):
    E = 9
    W, x_of = make_block(rng, E=E, H=64, I=32, gs=32, load="skewed")
    _, ids, stats = check_m5(rng, W, x_of(T, 2), 2)
    assert (ids[:, 0] == 0).all()
    assert stats["tiles"] == expected_tiles(ids, E, m5=True)
    assert stats["flops_executed"] == expected_executed(ids, E, H=64, I=32, Is=32, router_rows=E + 1, m5=True)


@pytest.mark.parametrize("T", [9, 73])
def test_route_switch_same_plan_same_counters(rng, T):
    """Both sides of the switch on the same input: the kernels differ only in the 64- and 32-row
    kinds; dispatches, barriers, useful FLOPs and bytes are equal; each side's tiles and executed
    FLOPs are its plan's (few-row threshold 8 | 2; 16-row tiles on M5); the results agree within
    the bound."""
    E = 7
    W, x_of = make_block(rng, E=E, H=64, I=32, gs=32, load="skewed")
    x = x_of(T)
    o5, i5, w5, s5 = run(rng, W, x, 2)
    o0, i0, w0, s0 = run(rng, W, x, 2, tensor_ops=False)
    assert s0["kernels"][3:] == MM_KINDS and s5["kernels"][3:] == M5_KINDS
    assert s0["kernels"][:3] == s5["kernels"][:3]  # router (8-bit: qmm), route, plan
    for key in ("dispatches", "barriers", "flops_useful", "bytes_bound"):
        assert s5[key] == s0[key], key
    for st, m5 in ((s5, True), (s0, False)):
        assert st["tiles"] == expected_tiles(i5, E, m5=m5)
        assert st["flops_executed"] == expected_executed(i5, E, H=64, I=32, Is=32, router_rows=E + 1, m5=m5)
    # the 9-row remainders (T = 9, 73): few-row matvecs on M1-M4, 16-row matmul2d tiles on M5
    assert s5["tiles"]["few"] < s0["tiles"]["few"] and s5["tiles"]["16"] > 0
    np.testing.assert_array_equal(i5, i0)
    np.testing.assert_array_equal(w5, w0)
    dense, mags = parts(W)
    assert_close(o5, o0, atol=2 * ref.moe_error_bound(x, mags, dense, top_k=2) + half_bound(x, dense, i5, w5),
                 rtol=0, what="M5 vs simdgroup route", seed=rng.seed)


@pytest.mark.parametrize("T", [40])
def test_m5_shared_intermediate_differs_and_group_128(rng, T):
    # I = 128 != Is = 256 (h rows max(I, Is) wide, the shared group's K = 8 steps), group 128.
    W, x_of = make_block(rng, E=5, H=128, I=128, Is=256, gs=128)
    check_m5(rng, W, x_of(T, 2), 2)


def test_m5_many_experts_top8(rng):
    W, x_of = make_block(rng, E=67, H=96, I=64, Is=96, gs=32, load="skewed")
    check_m5(rng, W, x_of(70, 8), 8)


@pytest.mark.parametrize("order", ["reverse", "shuffle", "ahead"])
def test_m5_result_independent_of_thread_order(rng, order):
    W, x_of = make_block(rng, E=7, H=64, I=32, gs=32, load="skewed")
    x = x_of(73)
    a = run(rng, W, x, 2, order="forward")
    b = run(rng, W, x, 2, order=order)
    for u, v in zip(a[:3], b[:3]):
        np.testing.assert_array_equal(u, v, err_msg=f"order {order!r} differs from 'forward': a race")


def test_m5_model_shapes(rng):
    """The real model's expert shapes (H = 2048, I = Is = 512, group 64) with 4 experts, top-2 and a
    skewed load: expert 0 and the shared group (40 rows each) take 64-row tiles, K = 64 steps."""
    E = 4
    W, x_of = make_block(rng, E=E, H=2048, I=512, gs=64, load="skewed")
    _, ids, stats = check_m5(rng, W, x_of(40, 2), 2)
    tiles = stats["tiles"]
    assert tiles["64"] >= 2, tiles
    assert tiles == expected_tiles(ids, E, m5=True)


def test_m5_model_shapes_small_experts(rng):
    """The real expert shapes with loads of a short prompt: 8 experts, top-2, 24 tokens (about 6
    rows per expert): 16-row matmul2d tiles (3..16 rows), few-row tiles (<= 2), the shared group's
    24 rows in a 32-row tile."""
    E = 8
    W, x_of = make_block(rng, E=E, H=2048, I=512, gs=64)
    _, ids, stats = check_m5(rng, W, x_of(24, 2), 2)
    tiles = stats["tiles"]
    assert tiles == expected_tiles(ids, E, m5=True)
    assert tiles["16"] >= 1 and tiles["32"] > tiles["16"], tiles


BF16 = ml_dtypes.bfloat16
BF16_U = 2.0 ** -8  # bfloat16 unit roundoff


@pytest.mark.parametrize("T", [8, 9, 33, 97])
def test_m5_router_bf16_x_takes_qmm_m5(rng, T):
    """bf16 activations on an M5: the 8-bit router + shared gate (E + 1 rows, fp32_operands) take
    qmm_m5_b8 for T > 8 (x is exact in half; the dequantized weights are rounded to half, <= 2^-11
    relative each; fp32 sums) and write bf16 logits; T = 8 keeps qmv. (fp32 x keeps qmm:
    test_route_switch_same_plan_same_counters.) Routing must equal the reference's (float64 logits
    of the bf16 x, rounded to bf16) for every token: tokens whose k-th and (k+1)-th logits are
    closer than 4 bf16 ulps of the row's largest logit plus twice the half-weight bound
    E_HALF |x|.|W_r| are drawn again, and so are tokens with such a near-tie between any two
    adjacent ones of the top k + 1 (the ids are ordered). Routing weights within test_moe.py::test_bf16_activations'
    bound (one bf16 ulp of a logit, amplified <= 4 by the softmax and renormalisation)."""
    E, H, I, k = 7, 64, 32, 2
    W, x_of = make_block(rng, E=E, H=H, I=I, gs=32)
    dense, mags = parts(W)
    wr = np.concatenate([dense["router"], dense["shared_gate"]], 0).astype(np.float64)

    def logits_bf16(xs):
        lg = ref.moe_logits(xs.astype(np.float64), dense["router"], dense["shared_gate"])
        return lg.astype(np.float32).astype(BF16).astype(np.float64)

    def near_tie(xs):
        lg = logits_bf16(xs)
        top = -np.sort(-lg[:, :-1], axis=1)[:, :k + 1]
        half = E_HALF * (np.abs(xs.astype(np.float64)) @ np.abs(wr).T).max(axis=1)
        # every adjacent pair of the top k + 1: the k chosen ids come in order, so a near-tie
        # inside the top k swaps two of them as surely as one at the k-th / (k+1)-th boundary
        gap = (top[:, :-1] - top[:, 1:]).min(axis=1)
        return gap < 4 * BF16_U * np.abs(lg).max(axis=1) + 2 * half

    pool = x_of(4 * T + 16).astype(BF16)
    pool = pool[~near_tie(pool)]
    assert len(pool) >= T, f"only {len(pool)} tokens without a near-tie"
    x = np.ascontiguousarray(pool[:T])
    out, ids, weights, stats = run(rng, W, x, k)
    assert out.dtype == BF16
    assert stats["kernels"][0] == ("qmv_b8_xbf16_sbf16" if T <= 8 else "qmm_m5_b8_xbf16_sbf16"), stats["kernels"]
    lg = logits_bf16(x)
    rids, rw, _ = ref.moe_route(lg, k)
    np.testing.assert_array_equal(ids, rids, err_msg=f"routing differs (T={T}, seed {rng.seed})")
    wtol = 4 * BF16_U * np.abs(lg).max(axis=1, keepdims=True)
    assert_close(weights[:, :k], rw, atol=wtol * np.abs(rw) + 1e-5 * np.abs(rw), rtol=0,
                 what=f"M5 bf16 router T={T} weights", seed=rng.seed)
    # without tensor ops the router takes qmv / qmm (fp32 operands) and routes the same
    _, ids0, _, stats0 = run(rng, W, x, k, tensor_ops=False)
    assert stats0["kernels"][0] == ("qmv_b8_xbf16_sbf16" if T <= 8 else "qmm_b8_xbf16_sbf16"), stats0["kernels"]
    np.testing.assert_array_equal(ids, ids0)
