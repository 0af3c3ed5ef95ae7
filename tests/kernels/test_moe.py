"""lily_py.ops.moe (router, routing plan, expert kernels, combine) on the emulator vs
lily_py.reference.kernels.moe (float64) and lily_py.reference.moe.moe_block (the model's fp32
reference).

Tolerance: reference.kernels.moe_error_bound, derived in its docstring: fp32 rounding of the
router / gate / up / down dot products (8 sqrt(K) u times the magnitude sum |x|.(|s| q + |b|), the
factor the quantized_matmul tests justify), propagated through SwiGLU (|silu'| <= 1.1), the
softmax + renormalisation (relative error 4 max|d logit| + (2E + 2k + 16) u of each routing
weight) and the final sum of k + 2 terms. Against the fp32 model reference (which makes the same
kind of errors) the bound is doubled. The elementwise bound is loose (worst-case factor 8 sqrt(K)
and no cancellation in the magnitude sums: observed errors stay below 2e-4 of it) and would let an
intermediate rounded to bfloat16 through (that errs by ~0.12-0.15 of the bound in RMS, up to 0.8
of it elementwise), so the RMS error must also stay below 1/64 of the RMS bound.

Routing: token by token the chosen experts must equal the reference exactly, except where the
reference itself has a near-tie (two of the top k + 1 probabilities within a relative 1e-5, far
above the ~1e-6 the two fp32 computations can differ by); such tokens are left out of the output comparison
and must be rare. Exact ties (identical router rows) must go to the lowest index on both sides.
"""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import lily_py._core as core
from kernel_checks import assert_close, device, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py.reference import kernels as ref
from lily_py.reference import quant
from lily_py.reference.moe import moe_block
from lily_py.weights import QuantLinear

BF16 = np.dtype(ml_dtypes.bfloat16)
MV_MAX_TOKENS = 8          # must match kMoeMvMaxTokens (checked below)
FEW_MAX_ROWS = 16          # must match kMoeFewMaxRows (checked below): the M1-M4 few-row threshold
TILE32_MAX_ROWS = 32       # must match kMoeTile32MaxRows (checked below)
FEW_MAX_ROWS_M5 = 2        # must match kMoeFewMaxRowsM5: the few-row threshold with tensor ops
TILE16_MAX_ROWS = 16       # must match kMoeTile16MaxRows: 32-row-list tiles run as 16 rows on M5
MV_ROWS = 4                # kMoeMvRows: output rows per threadgroup of moe_down_mv
GATE_UP_ROWS = 4           # kMoeGateUpRows: rows of every slot per threadgroup of moe_gate_up_mv
GATE_UP_ROWS_ONE = 2       # kMoeGateUpRowsOne: its rows at one token (twice the threadgroups)
ROUTE_MIN_TOKENS = 3       # kMoeMvRouteMinTokens: from here the mv route runs moe_route as a level
GATE_UP_MAX_SPLITS = 4     # kMoeGateUpMaxSplits
GATE_UP_MAX_SIMDS = 17     # kMoeGateUpMaxSimds: simdgroups of a gate/up threadgroup, (k + 1) x splits
DOWN_MAX_SPLITS = 8        # kMoeDownMaxSplits
CODES = 32                 # 4-bit codes per lane and row in the decode matvecs: one 16-byte load
TIE_MARGIN = 1e-5
KEYS = ("router", "gate", "up", "down", "shared_gate_proj", "shared_up", "shared_down", "shared_gate")


def quantized(rng, shape, bits, gs, scale=0.1, fill=None):
    w = fill if fill is not None else rng.standard_normal(shape).astype(np.float32) * scale
    return QuantLinear(*quant.quantize(w, bits=bits, group_size=gs, scale_dtype=BF16), bits, gs)


def make_block(rng, *, E, H, I, Is=None, gs=64, load="uniform", bits=4, down_bits=None, shared_bits=None,
               shared_down_bits=None):
    """A quantized MoE block (router 8-bit, experts `bits`-bit with the down matrices at
    `down_bits` (default `bits`), the shared expert's gate/up at `shared_bits` and its down at
    `shared_down_bits` (default: the routed widths), bf16 scales) and its x generator.

    load: "uniform" (random router), "skewed" (expert 0 is every token's first choice) or
    "few" (only experts 0..2 are ever chosen for top_k <= 3: many empty experts)."""
    Is = Is or I
    r = rng.standard_normal((E, H)).astype(np.float32) * 0.1
    if load == "skewed":
        r[0] = 0.2 + rng.standard_normal(H).astype(np.float32) * 0.01
    elif load == "few":
        r[:3] = 0.2 + rng.standard_normal((3, H)).astype(np.float32) * 0.05
    W = SimpleNamespace(
        router=quantized(rng, (E, H), 8, gs, fill=r),
        gate_proj=quantized(rng, (E, I, H), bits, gs), up_proj=quantized(rng, (E, I, H), bits, gs),
        down_proj=quantized(rng, (E, H, I), down_bits or bits, gs),
        shared_gate_proj=quantized(rng, (Is, H), shared_bits or bits, gs),
        shared_up_proj=quantized(rng, (Is, H), shared_bits or bits, gs),
        shared_down_proj=quantized(rng, (H, Is), shared_down_bits or down_bits or bits, gs),
        shared_expert_gate=quantized(rng, (1, H), 8, gs))
    offset = 0.0 if load == "uniform" else 1.0
    gates = {"router": W.router.dense(), "shared_gate": W.shared_expert_gate.dense()}

    def x_of(T, top_k=None):
        """T fresh rows; with top_k, redrawn until at most T // 20 of them are routing near-ties
        (none below 20 rows), so that the comparison in check() never runs on no row at all."""
        for _ in range(100):
            x = (rng.standard_normal((T, H)) * 0.5 + offset).astype(np.float32)
            if top_k is None or near_ties(gates, x, top_k).sum() <= T // 20:
                return x
        raise AssertionError(f"100 draws of {T} rows all had near-ties for top_k={top_k} (seed {rng.seed})")
    return W, x_of


def parts(W):
    mats = (W.router, W.gate_proj, W.up_proj, W.down_proj, W.shared_gate_proj, W.shared_up_proj,
            W.shared_down_proj, W.shared_expert_gate)
    dense = {k: m.dense() if len(m.shape) == 2 else np.stack([m.expert(e).dense() for e in range(m.shape[0])])
             for k, m in zip(KEYS, mats)}
    mags = {k: ref.dequantized_magnitude(m.w, m.scales, m.biases, bits=m.bits, group_size=m.group_size)
            for k, m in zip(KEYS, mats)}
    return dense, mags


def near_ties(dense, x, top_k):
    logits = ref.moe_logits(x, dense["router"], dense["shared_gate"])[:, :-1]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = -np.sort(-p, axis=1)[:, :top_k + 1]
    gap = -np.diff(top, axis=1)  # relative: the two sides' probabilities differ by a relative ~1e-6
    return (gap < TIE_MARGIN * top[:, :-1]).any(axis=1)


def check(rng, W, x, top_k, *, residual=None, route=None, **kw):
    out, ids, weights, stats = ops._moe(x, *ops.moe_weights(W), top_k=top_k, residual=residual,
                                        seed=rng.seed, **kw)
    if route is not None:
        assert stats["route"] == route, stats
    dense, mags = parts(W)
    want, rids, rweights = ref.moe(x, *(dense[k] for k in KEYS), top_k=top_k, residual=residual)
    tie = near_ties(dense, x, top_k)
    ok = ~tie
    assert tie.sum() <= max(1, len(x) // 20), f"too many near-ties ({tie.sum()}) for a meaningful test"
    what = f"moe T={len(x)} k={top_k} route={stats['route']}"
    np.testing.assert_array_equal(ids[ok], rids[ok], err_msg=f"{what}: routing differs (seed {rng.seed})")
    bound = ref.moe_error_bound(x, mags, dense, top_k=top_k, residual=residual)
    # routing weights: softmax + renormalisation in fp32 from logits within e_H |x|.|Wr|
    wb = np.abs(rweights[ok]) * 1e-5
    assert_close(weights[ok, :top_k], rweights[ok], atol=wb, rtol=0, what=what + " weights", seed=rng.seed)
    assert_close(out[ok], want[ok], atol=bound[ok], rtol=0, what=what, seed=rng.seed)
    rms = np.sqrt(np.mean((out[ok] - want[ok]) ** 2)) / np.sqrt(np.mean(bound[ok] ** 2))
    assert rms <= 1 / 64, f"{what}: RMS error {rms:.3g} of the RMS bound (seed {rng.seed})"
    f32 = moe_block(x, W, top_k) + (0 if residual is None else residual)
    assert_close(out[ok], f32[ok], atol=2 * bound[ok], rtol=0, what=what + " vs reference.moe.moe_block",
                 seed=rng.seed)
    assert stats["host_syncs"] == 0
    return out, ids, stats


# ------------------------------------------------------------------------------ routes
def test_route_constants_match_extension():
    assert core.ops.MOE_MV_MAX_TOKENS == MV_MAX_TOKENS
    assert core.ops.MOE_FEW_MAX_ROWS == FEW_MAX_ROWS
    assert core.ops.MOE_TILE32_MAX_ROWS == TILE32_MAX_ROWS
    assert core.ops.MOE_FEW_MAX_ROWS_M5 == FEW_MAX_ROWS_M5
    assert core.ops.MOE_TILE16_MAX_ROWS == TILE16_MAX_ROWS
    assert core.ops.MOE_MV_ROWS == MV_ROWS
    assert core.ops.MOE_GATE_UP_ROWS == GATE_UP_ROWS
    assert core.ops.MOE_GATE_UP_ROWS_ONE == GATE_UP_ROWS_ONE
    assert core.ops.MOE_MV_ROUTE_MIN_TOKENS == ROUTE_MIN_TOKENS
    assert core.ops.MOE_GATE_UP_MAX_SPLITS == GATE_UP_MAX_SPLITS
    assert core.ops.MOE_GATE_UP_MAX_SIMDS == GATE_UP_MAX_SIMDS
    assert core.ops.MOE_DOWN_MAX_SPLITS == DOWN_MAX_SPLITS
    assert ops.moe_route(MV_MAX_TOKENS, 8) == "mv"
    assert ops.moe_route(MV_MAX_TOKENS + 1, 8) == "tiled"
    assert ops.moe_route(4096, 8) == "tiled"


def mv_route_kernels(T, x="xf32"):
    """The mv route's moe_route level: from ROUTE_MIN_TOKENS tokens on, moe_route selects once per
    token and gate/up reads its ids; below, each gate/up threadgroup selects for itself."""
    return [] if T < ROUTE_MIN_TOKENS else ["moe_route" if x == "xf32" else "moe_route_xbf16"]


def expected_route(T, k):
    return "mv" if T <= MV_MAX_TOKENS else "tiled"


def expected_tiles(ids, E, m5=False):
    """The plan's tiles by load (shaders/moe_plan.metal moe_plan), from the routing: per group (each
    expert, and the shared group holding every token) 64-row tiles, and the remainder r in a
    few-row tile (r <= 16; r <= 2 with tensor ops, m5), a 32-row tile (r <= 32) or one more 64-row
    tile; "16": the 32-row tiles of r <= 16 rows (they run 16 rows on M5)."""
    T = ids.shape[0]
    few = FEW_MAX_ROWS_M5 if m5 else FEW_MAX_ROWS
    counts = list(np.bincount(ids.ravel(), minlength=E)) + [T]
    tiles = {"64": 0, "32": 0, "few": 0, "few_rows": 0, "16": 0}
    for c in counts:
        rem = c % 64
        tiles["64"] += c // 64 + (rem > TILE32_MAX_ROWS)
        tiles["32"] += few < rem <= TILE32_MAX_ROWS
        tiles["16"] += few < rem <= TILE16_MAX_ROWS
        tiles["few"] += 0 < rem <= few
        tiles["few_rows"] += rem if rem <= few else 0
    return tiles


def expected_executed(ids, E, *, H, I, Is, router_rows, m5=False):
    """FLOPs the tiles execute (H, I, Is multiples of 32: no column padding): 64- and 32-row
    tiles compute every row of the tile (on M5, m5, a 32-row-list tile of <= 16 rows runs 16),
    few-row tiles only their rows; 6 H N per row (gate, up, down); plus the router (qmm: T and
    E + 1 padded to 32)."""
    T = ids.shape[0]
    few = FEW_MAX_ROWS_M5 if m5 else FEW_MAX_ROWS
    total = 0
    for g, c in enumerate(list(np.bincount(ids.ravel(), minlength=E)) + [T]):
        N = Is if g == E else I
        rem = c % 64
        small = 16 if m5 and rem <= TILE16_MAX_ROWS else 32
        rows = 64 * (c // 64) + (64 if rem > TILE32_MAX_ROWS else small if rem > few else rem)
        total += 6 * H * N * rows
    pad = lambda n: -(-n // 32) * 32  # noqa: E731
    return total + 2 * pad(T) * pad(router_rows) * H


# Token counts of the issue, both sides of the mv | tiled switch (8 | 9); 7 experts (not a power of
# two), H = 64, I = 32, group 32.
@pytest.mark.parametrize("T", [1, 2, 7, 8, 9, 33, 257, 300])
def test_token_counts(rng, device, T):
    W, x_of = make_block(rng, E=7, H=64, I=32, gs=32)
    check(rng, W, x_of(T, 2), 2, route=expected_route(T, 2), device=device)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("T", [1, 9, 33])
def test_top_k(rng, T, top_k):
    W, x_of = make_block(rng, E=11, H=128, I=64, gs=64)
    check(rng, W, x_of(T, top_k), top_k, route=expected_route(T, top_k))


# Many experts: several logits per router lane (E > 32) and, at E = 300 > kMoePlanThreads, plan
# threads owning two experts; 256 is the real model's count.
@pytest.mark.parametrize("E", [67, 256, 300])
@pytest.mark.parametrize("T", [1, 33])
def test_many_experts(rng, T, E):
    W, x_of = make_block(rng, E=E, H=64, I=32, gs=32)
    check(rng, W, x_of(T, 8), 8, route=expected_route(T, 8))


@pytest.mark.parametrize("T", [3, 40])
def test_shared_intermediate_differs_and_group_128(rng, T):
    # I = 128 != Is = 256: the h rows are max(I, Is) wide, the shared group's K differs.
    W, x_of = make_block(rng, E=5, H=128, I=128, Is=256, gs=128)
    check(rng, W, x_of(T, 2), 2)


@pytest.mark.parametrize("T,top_k", [(1, 2), (9, 2), (257, 8)])
def test_skewed_load_one_expert_gets_every_token(rng, T, top_k):
    W, x_of = make_block(rng, E=9, H=64, I=32, gs=32, load="skewed")
    x = x_of(T)
    _, ids, _ = check(rng, W, x, top_k)
    assert (ids[:, 0] == 0).all()


@pytest.mark.parametrize("T,top_k", [(2, 1), (33, 2), (257, 2)])
def test_many_empty_experts(rng, T, top_k):
    W, x_of = make_block(rng, E=24, H=64, I=32, gs=32, load="few")
    _, ids, _ = check(rng, W, x_of(T, top_k), top_k)
    assert set(np.unique(ids)) <= {0, 1, 2}  # >= 21 of 24 experts receive no token


# Tiles sized by each group's load, both sides of every switch: expert 0 (skewed load: every
# token's first choice) and the shared group hold exactly T rows, so T = 9 and 16 | 17 (few, in
# one and two register blocks of 8 rows | 32-row), 16 + 64 = 80 | 81 (few | 32-row remainder),
# 32 | 33 and 96 | 97 (32-row | 64-row remainder), 64 and 65 (full tiles, a one-row few tile); the
# other experts get the scattered small loads.
@pytest.mark.parametrize("T", [9, 16, 17, 32, 33, 64, 65, 80, 81, 96, 97])
def test_tiles_sized_by_load(rng, device, T):
    E = 9
    W, x_of = make_block(rng, E=E, H=64, I=32, gs=32, load="skewed")
    _, ids, stats = check(rng, W, x_of(T, 2), 2, route="tiled", device=device)
    assert (ids[:, 0] == 0).all()
    assert stats["tiles"] == expected_tiles(ids, E), (T, np.bincount(ids.ravel(), minlength=E))
    assert stats["flops_executed"] == expected_executed(ids, E, H=64, I=32, Is=32, router_rows=E + 1)


def test_tiles_uniform_load_small_experts(rng):
    """256 experts, top-8, 33 tokens: most experts get 1..3 rows, all in few-row tiles (no
    padding): only the shared group's 33 rows take a 64-row tile."""
    E = 256
    W, x_of = make_block(rng, E=E, H=64, I=32, gs=32)
    _, ids, stats = check(rng, W, x_of(33, 8), 8, route="tiled")
    assert stats["tiles"] == expected_tiles(ids, E)
    assert stats["tiles"]["32"] == 0 and stats["tiles"]["64"] == 1


@pytest.mark.parametrize("T", [1, 17])
def test_layer_of_a_loaded_mlx_checkpoint(rng, tiny_mlx, T):
    # The packing lily_py.ops.moe documents is what the loader maps (memory-mapped MLX tensors).
    from lily_py.checkpoint import load_weights
    cfg, weights = load_weights(tiny_mlx)
    layer = weights.layers[1].moe
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    check(rng, layer, x, cfg.num_experts_per_tok)


@pytest.mark.parametrize("T", [2, 20])
def test_residual_add_fused(rng, T):
    W, x_of = make_block(rng, E=6, H=64, I=32, gs=32)
    res = rng.standard_normal((T, 64)).astype(np.float32)
    check(rng, W, x_of(T, 2), 2, residual=res)


@pytest.mark.parametrize("T", [1, 12])
def test_exact_ties_go_to_the_lowest_index(rng, T):
    W, x_of = make_block(rng, E=6, H=64, I=32, gs=32)
    r = W.router.dense()
    r[4] = r[1] = 0.3  # experts 1 and 4 tie exactly and win every token
    W.router = quantized(rng, r.shape, 8, 32, fill=r)
    x = np.abs(x_of(T)) + 0.1
    out, ids, weights, _ = ops._moe(x, *ops.moe_weights(W), top_k=3, seed=rng.seed)
    assert (ids[:, 0] == 1).all() and (ids[:, 1] == 4).all()
    np.testing.assert_array_equal(weights[:, 0], weights[:, 1])
    dense, _ = parts(W)
    rids = ref.moe(x, *(dense[k] for k in KEYS), top_k=3)[1]
    np.testing.assert_array_equal(ids[:, :2], rids[:, :2])


# Exact ties at every rank: the router's rows come from a pool of about E / 4 distinct rows, so
# each probability is shared by about 4 experts. The selection must give the reference's order
# (equal probabilities: the lowest index first) at every rank, k = 12 included, and
# moe_gate_up_mv (which selects in every threadgroup) must agree with the routing it writes: the outputs are
# checked too.
@pytest.mark.parametrize("E,top_k", [(40, 3), (256, 8), (256, 12), (300, 8)])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_selection_with_exact_ties_at_every_rank(rng, device, E, top_k, T):
    W, _ = make_block(rng, E=E, H=64, I=32, gs=32)
    pool = rng.standard_normal((E // 4 + 1, 64)).astype(np.float32) * 0.1
    W.router = quantized(rng, (E, 64), 8, 32, fill=pool[rng.integers(0, len(pool), E)])
    dense, mags = parts(W)
    x = (rng.standard_normal((T, 64)) * 0.5).astype(np.float32)
    out, ids, weights, stats = ops._moe(x, *ops.moe_weights(W), top_k=top_k, seed=rng.seed, device=device)
    assert stats["route"] == expected_route(T, top_k)
    want, rids, _ = ref.moe(x, *(dense[k] for k in KEYS), top_k=top_k)
    logits = ref.moe_logits(x, dense["router"], dense["shared_gate"])[:, :-1]
    p = np.exp(logits - logits.max(1, keepdims=True))
    top = -np.sort(-p, axis=1)[:, :top_k + 1]
    gap = -np.diff(top, axis=1)
    ok = ~((gap > 0) & (gap < TIE_MARGIN * top[:, :-1])).any(axis=1)  # exact ties kept, near ones not
    assert ok.sum() >= max(1, T // 2), f"too few rows without a near-tie ({ok.sum()} of {T}, seed {rng.seed})"
    assert (gap[ok] == 0).any(), f"no exact tie among the top {top_k + 1}: the test tests nothing (seed {rng.seed})"
    what = f"E={E} k={top_k} T={T} route={stats['route']}"
    np.testing.assert_array_equal(ids[ok], rids[ok], err_msg=f"{what}: routing differs (seed {rng.seed})")
    bound = ref.moe_error_bound(x, mags, dense, top_k=top_k)
    assert_close(out[ok], want[ok], atol=bound[ok], rtol=0, what=what, seed=rng.seed)


@pytest.mark.parametrize("E,top_k", [(256, 8), (77, 5), (5, 5), (256, 12), (300, 8)])
@pytest.mark.parametrize("T", [1, ROUTE_MIN_TOKENS, 11])
def test_every_expert_tied(rng, device, E, top_k, T):
    """A router of zeros: every expert has the same probability, so the selection must name
    experts 0 .. k - 1 in order with weights 1 / k, on every path that selects (gate/up at one
    token, where every threadgroup selects and the output shows it, the moe_route level at 3
    tokens, the tiled route's moe_route at 11), with 8 probabilities a lane (E <= 256) and 16
    (E = 300). E = 5, k = 5: every expert, with lanes past E."""
    W, x_of = make_block(rng, E=E, H=64, I=32, gs=32)
    W.router = quantized(rng, (E, 64), 8, 32, fill=np.zeros((E, 64), np.float32))
    x = x_of(T)
    out, ids, weights, stats = ops._moe(x, *ops.moe_weights(W), top_k=top_k, seed=rng.seed, device=device)
    assert stats["route"] == expected_route(T, top_k)
    what = f"E={E} k={top_k} T={T}"
    np.testing.assert_array_equal(ids, np.tile(np.arange(top_k), (T, 1)), err_msg=what)
    np.testing.assert_allclose(weights[:, :top_k], 1.0 / top_k, rtol=1e-6)  # k sums of one float32
    dense, mags = parts(W)
    want, rids, _ = ref.moe(x, *(dense[k] for k in KEYS), top_k=top_k)
    np.testing.assert_array_equal(rids, ids, err_msg=f"{what}: the reference's stable sort")
    assert_close(out, want, atol=ref.moe_error_bound(x, mags, dense, top_k=top_k), rtol=0, what=what,
                 seed=rng.seed)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("T", [5, 40])
def test_nan_and_inf_activations_choose_valid_experts(rng, device, T, dtype):
    """A NaN or infinite activation makes the router's logits NaN. The selection must still name k
    distinct experts below E (an id past E reads outside the expert stacks: on the H200 an illegal
    address, on the emulator a read outside a binding) with NaN weights, and leave the other
    tokens' results as the reference's. T=5: the matvec route, T=40: the tiles."""
    E, k = 67, 4
    W, x_of = make_block(rng, E=E, H=64, I=32, gs=32)
    x = x_of(T, top_k=k)
    bad = np.zeros(T, bool)
    bad[[0, T // 2, T - 1]] = True
    x[0, 3] = np.nan
    x[T // 2, 17] = np.inf
    x[T - 1, :] = np.nan
    x = x.astype(dtype)
    out, ids, weights, stats = ops._moe(x, *ops.moe_weights(W), top_k=k, device=device, seed=rng.seed,
                                        fp_traps=False)
    assert (stats["route"] == "mv") == (T <= MV_MAX_TOKENS), stats
    assert ((ids >= 0) & (ids < E)).all(), f"expert ids outside [0, {E}): {ids[~((ids >= 0) & (ids < E)).all(1)]}"
    for t in range(T):
        assert len(set(ids[t].tolist())) == k, f"token {t}: experts not distinct: {ids[t]}"
    assert np.isnan(weights[bad, :k]).all(), "a token with a NaN logit must get NaN routing weights"
    assert np.isnan(np.asarray(out, np.float32)[bad]).all(axis=1).all(), "a bad token's output must be NaN"
    ok = ~bad
    dense, mags = parts(W)
    xs = np.asarray(x[ok], np.float32) if dtype is BF16 else x[ok]
    want, rids, _ = ref.moe(xs, *(dense[key] for key in KEYS), top_k=k)
    tie = near_ties(dense, xs, k)
    if dtype is np.float32:  # bf16 rounds the logits (ties at bf16 resolution): the clean rows are checked at fp32
        np.testing.assert_array_equal(ids[ok][~tie], rids[~tie], err_msg=f"routing differs (seed {rng.seed})")
        bound = ref.moe_error_bound(xs, mags, dense, top_k=k)
        assert_close(out[ok][~tie], want[~tie], atol=bound[~tie], rtol=0, what="clean tokens", seed=rng.seed)
    else:
        assert np.isfinite(np.asarray(out[ok], np.float32)).all()


# ------------------------------------------------------------------------------ decode matvecs
def mv_shapes(T, *, H, k, I, Is):
    """(grid x, grid y, grid z, threads) of moe_gate_up_mv and moe_down_mv, as docs/kernels-moe.md
    states them: gate_up runs every slot of a token in one threadgroup, rows in fours (in twos at
    T = 1), one grid row per token; each slot splits K = H over min(4, ceil(H / 1024), 17 // (k + 1)) simdgroups (a
    block = 32 lanes x 32 codes); down splits the concatenated K' = k I + Is (chunks of 32 codes)
    over min(8, ceil(chunks / 32)) simdgroups."""
    gu = max(1, min(GATE_UP_MAX_SPLITS, -(-H // (32 * CODES)), GATE_UP_MAX_SIMDS // (k + 1)))
    dn = max(1, min(DOWN_MAX_SPLITS, -(-(k * (I // CODES) + Is // CODES) // 32)))
    rows = GATE_UP_ROWS_ONE if T == 1 else GATE_UP_ROWS
    route = [(T, 1, 1, 32)] if mv_route_kernels(T) else []  # moe_route: one simdgroup per token
    return route + [(-(-max(I, Is) // rows), T, 1, 32 * (k + 1) * gu), (-(-H // MV_ROWS), T, 1, 32 * dn)]


# Both sides of every shape switch of the decode matvecs (odd expert counts, T = 1 and a few tokens):
#   gate_up splits: H = 1024 (1 block, 1 split) | 1088 (2 splits, the second block partial: 2 of 32
#     lanes) | 4160 (5 blocks > 4 splits: split 0 walks blocks 0 and 4, the last partial) | 4160
#     at k = 4 (17 // 5 = 3 splits a slot: split 0 walks blocks 0 and 3) | k = 8 (one split);
#   down splits: chunks 32 (1 split) | 33 (2 splits, one lane of the second) | 258 > 8 x 32 (8
#     splits, lanes 0 and 1 of simdgroup 0 take a second chunk);
#   Is > I (routed slots' threadgroups past I load nothing) and Is < I (the shared slot's do), the
#     shared slot's chunks of another width than the routed ones; group sizes 32, 64, 128.
MV_CASES = {
    "H1024-1split": dict(E=5, H=1024, I=64, Is=64, k=2, gs=64),
    "H1088-2splits-partial": dict(E=5, H=1088, I=64, Is=64, k=2, gs=64),
    "H4160-capped-4splits": dict(E=3, H=4160, I=32, Is=32, k=1, gs=32),
    "H4160-k4-3splits": dict(E=9, H=4160, I=64, Is=32, k=4, gs=32),
    "chunks32-1split": dict(E=9, H=64, I=128, Is=128, k=7, gs=32),
    "chunks33-2splits": dict(E=9, H=64, I=128, Is=32, k=8, gs=32),
    "chunks258-8splits-loop": dict(E=17, H=64, I=512, Is=64, k=16, gs=64),
    "Is-wider": dict(E=7, H=128, I=32, Is=160, k=3, gs=32),
    "Is-narrower-gs128": dict(E=7, H=256, I=384, Is=128, k=3, gs=128),
}


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("case", list(MV_CASES))
def test_decode_matvec_shapes(rng, device, case, T):
    c = MV_CASES[case]
    W, x_of = make_block(rng, E=c["E"], H=c["H"], I=c["I"], Is=c["Is"], gs=c["gs"])
    res = rng.standard_normal((T, c["H"])).astype(np.float32)
    _, ids, stats = check(rng, W, x_of(T, c["k"]), c["k"], residual=res, route="mv", device=device)
    assert stats["kernels"][1:] == mv_route_kernels(T) + ["moe_gate_up_mv_b4_xf32_sbf16", "moe_down_mv_b4_xf32_sbf16"]
    assert stats["shapes"][1:] == mv_shapes(T, H=c["H"], k=c["k"], I=c["I"], Is=c["Is"]), case


@pytest.mark.parametrize("T", [2, ROUTE_MIN_TOKENS])  # gate/up selecting itself | reading moe_route's ids
@pytest.mark.parametrize("case", ["H1088-2splits-partial", "chunks258-8splits-loop", "Is-narrower-gs128"])
def test_decode_matvec_thread_order(rng, case, T):
    """Split-K partial sums meet in threadgroup memory: every scheduling order (the adversarial
    'ahead' one included) gives bit-identical results."""
    c = MV_CASES[case]
    W, x_of = make_block(rng, E=c["E"], H=c["H"], I=c["I"], Is=c["Is"], gs=c["gs"])
    x = x_of(T)
    runs = [ops._moe(x, *ops.moe_weights(W), top_k=c["k"], order=o, seed=rng.seed)
            for o in ("forward", "reverse", "shuffle", "ahead")]
    assert runs[0][3]["route"] == "mv"
    for o, r in zip(("reverse", "shuffle", "ahead"), runs[1:]):
        for a, b in zip(runs[0][:3], r[:3]):
            np.testing.assert_array_equal(a, b, err_msg=f"{case}: order {o!r} differs from 'forward'")


class _LazyStack:
    """``stack[e]``: expert e of a stacked QuantLinear, dequantized (or its magnitude) on demand:
    the real model's 256 experts are never expanded to float64 at once."""

    def __init__(self, m, magnitude=False):
        self.m, self.magnitude, self.cache = m, magnitude, {}

    def __getitem__(self, e):
        if e not in self.cache:
            q = self.m.expert(int(e))
            self.cache[e] = (ref.dequantized_magnitude(q.w, q.scales, q.biases, bits=q.bits, group_size=q.group_size)
                             if self.magnitude else q.dense())
        return self.cache[e]


def _random_quant(rng, shape, gs):
    """A 4-bit [.., N, K] stack from random codes (cheap at the real sizes: no float weights made):
    scales 0.004..0.012, biases centring the codes (-7.5 s) plus noise."""
    *lead, N, K = shape
    w = rng.integers(0, 2 ** 32, size=(*lead, N, K // 8), dtype=np.uint32)
    s = (rng.random((*lead, N, K // gs)) * 0.008 + 0.004).astype(np.float32)
    b = (-7.5 * s + rng.standard_normal(s.shape).astype(np.float32) * 0.002).astype(np.float32)
    return QuantLinear(w, s.astype(BF16), b.astype(BF16), 4, gs)


@pytest.mark.parametrize("T", [1, 2, ROUTE_MIN_TOKENS])  # gate/up selecting itself at 1 and 2
def test_decode_matvecs_real_shapes(rng, device, T):
    """The real model's MoE block (hidden 2048, 256 experts of intermediate 512, top-8, shared
    expert 512, group 64): routing, output and weights against the float64 reference (only the
    selected experts are dequantized); the decode grids as documented."""
    E, H, I, Is, k, gs = 256, 2048, 512, 512, 8, 64
    W = SimpleNamespace(
        router=quantized(rng, (E, H), 8, gs, scale=0.05), shared_expert_gate=quantized(rng, (1, H), 8, gs, scale=0.05),
        gate_proj=_random_quant(rng, (E, I, H), gs), up_proj=_random_quant(rng, (E, I, H), gs),
        down_proj=_random_quant(rng, (E, H, I), gs), shared_gate_proj=_random_quant(rng, (Is, H), gs),
        shared_up_proj=_random_quant(rng, (Is, H), gs), shared_down_proj=_random_quant(rng, (H, Is), gs))
    x = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    out, ids, weights, stats = ops._moe(x, *ops.moe_weights(W), top_k=k, residual=res, seed=rng.seed,
                                        device=device)
    assert stats["route"] == "mv" and stats["host_syncs"] == 0
    assert stats["shapes"][1:] == mv_shapes(T, H=H, k=k, I=I, Is=Is)
    gu_groups = 256 if T == 1 else 128  # 2 rows a threadgroup at one token, else 4
    route = [(T, 1, 1, 32)] if T >= ROUTE_MIN_TOKENS else []  # moe_route: one simdgroup a token
    assert stats["shapes"][1:] == route + [(gu_groups, T, 1, 288), (512, T, 1, 160)]  # 9 x 1 and 5 simdgroups
    dense = {"router": W.router.dense(), "shared_gate": W.shared_expert_gate.dense(),
             "gate": _LazyStack(W.gate_proj), "up": _LazyStack(W.up_proj), "down": _LazyStack(W.down_proj),
             "shared_gate_proj": W.shared_gate_proj.dense(), "shared_up": W.shared_up_proj.dense(),
             "shared_down": W.shared_down_proj.dense()}
    mags = {"router": ref.dequantized_magnitude(W.router.w, W.router.scales, W.router.biases, bits=8, group_size=gs),
            "shared_gate": ref.dequantized_magnitude(W.shared_expert_gate.w, W.shared_expert_gate.scales,
                                                     W.shared_expert_gate.biases, bits=8, group_size=gs),
            "gate": _LazyStack(W.gate_proj, True), "up": _LazyStack(W.up_proj, True),
            "down": _LazyStack(W.down_proj, True)}
    for key, m in (("shared_gate_proj", W.shared_gate_proj), ("shared_up", W.shared_up_proj),
                   ("shared_down", W.shared_down_proj)):
        mags[key] = ref.dequantized_magnitude(m.w, m.scales, m.biases, bits=4, group_size=gs)
    assert not near_ties(dense, x, k).any(), f"near-tie in the routing (seed {rng.seed}): pick another"
    want, rids, rweights = ref.moe(x, *(dense[key] for key in KEYS), top_k=k, residual=res)
    np.testing.assert_array_equal(ids, rids, err_msg=f"routing differs (seed {rng.seed})")
    assert_close(weights[:, :k], rweights, atol=np.abs(rweights) * 1e-5, rtol=0, what="weights", seed=rng.seed)
    bound = ref.moe_error_bound(x, mags, dense, top_k=k, residual=res)
    assert_close(out, want, atol=bound, rtol=0, what="moe real shapes", seed=rng.seed)
    rms = np.sqrt(np.mean((out - want) ** 2)) / np.sqrt(np.mean(bound ** 2))
    assert rms <= 1 / 64, f"RMS error {rms:.3g} of the RMS bound (seed {rng.seed})"
    err, y = np.abs(out - want), want - res
    print(f"\nreal shapes T={T}: max|err| {err.max():.3g}, RMS err / RMS bound {rms:.3g}, "
          f"RMS err / RMS block output {np.sqrt(np.mean(err ** 2) / np.mean(y ** 2)):.3g}")
    # The magnitude bound is loose at these sizes (|b| ~ 7.5 s in every term): the RMS error must
    # also stay at fp32 level against the block's own output (one bfloat16 rounding is 2^-9 relative).
    assert np.sqrt(np.mean(err ** 2) / np.mean(y ** 2)) < 1e-5


# ------------------------------------------------------------------------------ counters
@pytest.mark.parametrize("T,route,dispatches,barriers", [(1, "mv", 3, 2), (ROUTE_MIN_TOKENS - 1, "mv", 3, 2),
                                                         (ROUTE_MIN_TOKENS, "mv", 4, 3), (MV_MAX_TOKENS, "mv", 4, 3),
                                                         (MV_MAX_TOKENS + 1, "tiled", 10, 9), (257, "tiled", 10, 9)])
def test_dispatches_per_block_and_no_host_sync(rng, T, route, dispatches, barriers):
    W, x_of = make_block(rng, E=9, H=64, I=32, gs=32)
    _, _, _, stats = ops._moe(x_of(T), *ops.moe_weights(W), top_k=8)
    print(f"\nMoE block T={T} k=8 route={route}: {stats['dispatches']} dispatches, {stats['barriers']} barriers, "
          f"{stats['host_syncs']} host syncs: {stats['kernels']}")
    assert stats["route"] == route
    assert stats["dispatches"] == dispatches and stats["barriers"] == barriers
    H, I = 64, 32  # FLOPs of the expert matmuls: 3 H I multiply-adds per routed and shared row,
    router = 2 * T * H * (9 + 1)  # plus the router's E + 1 logits
    assert stats["flops_useful"] == router + 6 * H * I * T * (8 + 1)
    assert stats["flops_executed"] >= stats["flops_useful"]
    if route == "mv":
        assert stats["flops_executed"] == stats["flops_useful"]
    else:
        assert stats["kernels"][3:] == ["moe_gate_up_mm64_b4_xf32_sbf16", "moe_gate_up_mm32_b4_xf32_sbf16",
                                        "moe_gate_up_few_b4_xf32_sbf16", "moe_down_mm64_b4_sbf16",
                                        "moe_down_mm32_b4_sbf16", "moe_down_few_b4_sbf16", "moe_combine_xf32"]
    assert stats["host_syncs"] == 0  # no commit / wait inside the block: nothing read back
    assert stats["kernels"][0] == ("qmv1_b8_xf32_sbf16_r1" if T == 1 else "qmv_b8_xf32_sbf16" if route == "mv"
                                   else "qmm_b8_xf32_sbf16")
    # mv: below ROUTE_MIN_TOKENS gate/up selects the experts from the logits itself (no moe_route level)
    if route == "mv":
        assert stats["kernels"][1:] == mv_route_kernels(T) + ["moe_gate_up_mv_b4_xf32_sbf16", "moe_down_mv_b4_xf32_sbf16"]
    else:
        assert stats["kernels"][1] == "moe_route"


@pytest.mark.parametrize("T", [3, 40])
def test_result_independent_of_thread_order(rng, T):
    W, x_of = make_block(rng, E=7, H=64, I=32, gs=32)
    x = x_of(T)
    runs = [ops._moe(x, *ops.moe_weights(W), top_k=2, order=o, seed=rng.seed) for o in ("forward", "reverse", "shuffle", "ahead")]
    for o, r in zip(("reverse", "shuffle", "ahead"), runs[1:]):
        for a, b in zip(runs[0][:3], r[:3]):
            np.testing.assert_array_equal(a, b, err_msg=f"order {o!r} differs from 'forward': a race (missing barrier?)")


def test_leading_dims(rng):
    W, x_of = make_block(rng, E=5, H=64, I=32, gs=32)
    x = x_of(6).reshape(2, 3, 64)
    y = ops.moe(x, *ops.moe_weights(W), top_k=2)
    assert y.shape == (2, 3, 64)
    # One token takes the qmv1 router (its own reduction order), six tokens the qmv router: the
    # same routing, logits equal to fp32 rounding (the experts' kernels are the same).
    one = ops.moe(x[1, 2], *ops.moe_weights(W), top_k=2)
    np.testing.assert_allclose(y[1, 2], one, rtol=1e-4, atol=1e-6 * np.abs(one).max())


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("mutate,match", [
    (lambda a: {**a, "x": a["x"].astype(np.float64)}, "x must be a float32 or bfloat16 array"),
    (lambda a: {**a, "top_k": 0}, r"top_k must be in \[1, min\(E=5, 16\)\], got 0"),
    (lambda a: {**a, "top_k": 6}, r"top_k must be in \[1, min\(E=5, 16\)\], got 6"),
    (lambda a: {**a, "experts": {k: v for k, v in a["experts"].items() if k != "up_proj"}}, "experts lacks"),
    (lambda a: {**a, "x": a["x"][:, :32]}, r"x has H=32 features but experts\['down_proj'\] is \[5, 64, 4\]"),
    (lambda a: {**a, "router": (a["router"].w.astype(np.int32), a["router"].scales, a["router"].biases)},
     "router w must be uint32"),
    (lambda a: {**a, "residual": a["x"][:1]}, "residual must have x's dtype .* and shape"),
    (lambda a: {**a, "device": "vulkan"}, "device must be 'emu', 'metal' or 'cuda'"),
], ids=["x-float64", "k-0", "k-too-big", "missing-up", "H-mismatch", "router-int32", "residual", "device"])
def test_bad_input_raises_clear_error(rng, mutate, match):
    W, x_of = make_block(rng, E=5, H=64, I=32, gs=32)
    router, experts, shared = ops.moe_weights(W)
    a = mutate({"x": x_of(2), "router": router, "experts": experts, "shared": shared, "top_k": 2,
                "residual": None, "device": "emu"})
    with pytest.raises(ValueError, match=match):
        ops.moe(a["x"], a["router"], a["experts"], a["shared"], top_k=a["top_k"], residual=a["residual"],
                device=a["device"])


def test_7bit_experts_rejected(rng):
    """MLX has no 7-bit width: a 7-bit-wide packed expert is refused, naming the matrix."""
    W, x_of = make_block(rng, E=5, H=64, I=32, gs=32)
    q = W.up_proj
    W.up_proj = QuantLinear(np.zeros((5, 32, 64 * 7 // 32), np.uint32), q.scales, q.biases, 7, 32)
    with pytest.raises(ValueError, match=r"experts\['up_proj'\] is 7-bit; the expert kernels take \(2, 3, 4, 5, 6, 8\)"):
        ops.moe(x_of(1), *ops.moe_weights(W), top_k=2)


def test_gate_up_widths_must_agree(rng):
    """The routed gate and up share one width, and so do the shared expert's (which may differ
    from the routed ones: tests/kernels/test_quant_widths.py)."""
    W, x_of = make_block(rng, E=5, H=64, I=32, gs=32)
    W.up_proj = quantized(rng, (5, 32, 64), 8, 32)
    with pytest.raises(ValueError, match=r"routed gate/up matrices must share one width"):
        ops.moe(x_of(1), *ops.moe_weights(W), top_k=2)
    W, x_of = make_block(rng, E=5, H=64, I=32, gs=32)
    W.shared_up_proj = quantized(rng, (32, 64), 6, 32)
    with pytest.raises(ValueError, match=r"and the shared expert's gate/up another; got .*"
                                         r"shared_expert\['up_proj'\] 6-bit"):
        ops.moe(x_of(1), *ops.moe_weights(W), top_k=2)


# ------------------------------------------------------------------------------ bf16 activations
BF16_U = 2.0 ** -8  # bfloat16 unit roundoff (8 significand bits: relative 2^-8 after rounding)


@pytest.mark.parametrize("T", [1, 7, 9, 33, 130])
def test_bf16_activations(rng, T):
    """bfloat16 x / residual / out (the engine's bf16 residual stream): the *_xbf16 kernels, both
    routes (mv: T <= 8; tiled: 64-, 32- and few-row tiles). The router logits are written in
    bf16 (as MLX's bf16 model writes them), the expert intermediates and the sum stay fp32, the
    output is rounded to bf16 once.

    Reference: reference.kernels.moe's float64 math on the exact bf16 inputs, with the router
    logits rounded to bf16 before the fp32 softmax, as the kernels do. Bound per token: the fp32
    bound (moe_error_bound, doubled as against the model reference), plus a routing-weight error
    from a logit the kernel's fp32 rounding pushed to the neighbouring bf16 value (one bf16 ulp
    <= 2^-8 |l|; softmax + renormalisation amplify a logit error by <= 4, see moe_error_bound)
    times sum_j w_j |y_j| + g |y_shared|, plus the output's own rounding, rtol 2^-8. Tokens at a
    bf16-level near-tie of two adjacent ones of the top k + 1 logits are redrawn, so routing must equal the
    reference's for every token."""
    E, H, I, k = 7, 64, 32, 2
    W, x_of = make_block(rng, E=E, H=H, I=I, gs=32)
    dense, mags = parts(W)

    def near_tie(xs):
        # two adjacent ones of the top k + 1 bf16 logits within 4 bf16 ulps of the row's largest
        # (the k-th / (k+1)-th pair changes the set; a pair inside the top k swaps the ordered ids)
        lg = ref.moe_logits(xs.astype(np.float64), dense["router"], dense["shared_gate"])
        lg = lg.astype(np.float32).astype(BF16).astype(np.float64)
        top = -np.sort(-lg[:, :-1], axis=1)[:, :k + 1]
        return (top[:, :-1] - top[:, 1:]).min(axis=1) < 4 * BF16_U * np.abs(lg).max(axis=1)

    # Tokens whose routing is a bf16-level near-tie are drawn again (at 7 experts about one token
    # in twelve is one): then every token's routing must equal the reference's exactly.
    pool = x_of(4 * T + 16).astype(BF16)
    pool = pool[~near_tie(pool)]
    assert len(pool) >= T, f"only {len(pool)} tokens without a bf16 near-tie"
    x = np.ascontiguousarray(pool[:T])
    res = rng.standard_normal((T, H)).astype(np.float32).astype(BF16)
    out, ids, weights, stats = ops._moe(x, *ops.moe_weights(W), top_k=k, residual=res, seed=rng.seed)
    assert out.dtype == BF16 and out.shape == (T, H)
    # mv: gate/up selects the experts from the bf16 logits itself, or (from ROUTE_MIN_TOKENS) moe_route does
    want_kernels = ({"moe_gate_up_mv_b4_xbf16_sbf16", "moe_down_mv_b4_xbf16_sbf16", *mv_route_kernels(T, "xbf16")}
                    if T <= 8 else
                    {"moe_route_xbf16", "moe_gate_up_bf16_64_b4_xbf16_sbf16", "moe_gate_up_bf16_32_b4_xbf16_sbf16",
                     "moe_gate_up_few_b4_xbf16_sbf16", "moe_down_bf16_64_b4_sbf16", "moe_down_bf16_32_b4_sbf16",
                     "moe_combine_xbf16"})
    assert want_kernels <= set(stats["kernels"]), stats["kernels"]
    assert ("moe_route_xbf16" in stats["kernels"]) == (T >= ROUTE_MIN_TOKENS), stats["kernels"]
    # the router's qmv/qmm reads bf16 x (T = 1: qmv1 with 1 row per threadgroup, E + 1 = 8 rows)
    assert stats["kernels"][0] == ("qmv1_b8_xbf16_sbf16_r1" if T == 1 else
                                   "qmv_b8_xbf16_sbf16" if T <= 8 else "qmm_b8_xbf16_sbf16"), stats["kernels"]
    x64, r64 = x.astype(np.float64), res.astype(np.float64)
    logits = ref.moe_logits(x64, dense["router"], dense["shared_gate"]).astype(np.float32).astype(BF16)
    logits = logits.astype(np.float64)
    rids, rw, sgate = ref.moe_route(logits, k)
    want = r64.copy()
    mag = np.zeros_like(want)
    for t in range(T):
        for j in range(k):
            e = rids[t, j]
            y = dense["down"][e].astype(np.float64) @ ref.swiglu(dense["gate"][e] @ x64[t], dense["up"][e] @ x64[t])
            want[t] += float(rw[t, j]) * y
            mag[t] += float(rw[t, j]) * np.abs(y)
    hs = ref.swiglu(x64 @ dense["shared_gate_proj"].astype(np.float64).T, x64 @ dense["shared_up"].astype(np.float64).T)
    ys = hs @ dense["shared_down"].astype(np.float64).T
    want += sgate[:, None] * ys
    mag += sgate[:, None] * np.abs(ys)
    lmax = np.abs(logits).max(axis=1, keepdims=True)
    ok = ~near_tie(x)
    assert ok.all()
    np.testing.assert_array_equal(ids[ok], rids[ok], err_msg=f"bf16 moe T={T}: routing differs (seed {rng.seed})")
    wtol = 4 * BF16_U * lmax
    assert_close(weights[ok, :k], rw[ok], atol=wtol[ok] * np.abs(rw[ok]) + 1e-5 * np.abs(rw[ok]), rtol=0,
                 what=f"bf16 moe T={T} weights", seed=rng.seed)
    bound = 2 * ref.moe_error_bound(x64, mags, dense, top_k=k, residual=r64) + wtol * mag
    assert_close(out[ok].astype(np.float64), want[ok], atol=bound[ok], rtol=BF16_U,
                 what=f"bf16 moe T={T}", seed=rng.seed)
    assert stats["host_syncs"] == 0
    for order in ("forward", "reverse"):  # no race in the bf16 kernels: any thread order, same bits
        o2 = ops._moe(x, *ops.moe_weights(W), top_k=k, residual=res, order=order, seed=rng.seed)[0]
        np.testing.assert_array_equal(o2.view(np.uint16), out.view(np.uint16), err_msg=f"order {order!r}")
