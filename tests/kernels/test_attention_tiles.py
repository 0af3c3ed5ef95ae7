"""The M1-M4 bf16 tiles route of lily_py.ops.attention_prefill (shaders/attention_prefill.metal
attention_prefill_tiles: bf16 Q / K / V / P operands of simdgroup_bfloat8x8 products into fp32
simdgroup_float8x8 accumulators) on the emulator, vs lily_py.reference.kernels.attention (float64).

Taken for bfloat16 activations at head_dim 64, 128, 256 on a device without tensor ops; float32
activations and other head dims keep attn_prefill_mma / the simd route (both sides tested here).

Tolerance, derived (u = 2^-24; b = 2^-8, bfloat16's unit roundoff: 8 significant bits, so
round-to-nearest errs by <= 2^-8 relative; smag, vmag as in test_attention.py):
* scores: q and the cache are bf16 already, so the bf16 operands are exact and every product is
  exact in fp32; the fp32 sums err as on the fp32 routes: 8 sqrt(D) u smag (-> 2 e vmag).
* P is rounded to bf16 as the operand of P V while l sums the unrounded p: the weights move by a
  relative b each, so the output by <= b * sum_j w_j |v_j| = b vmag.
* fp32 rescaling and sums: (64 + 2 nb) u vmag, nb = key blocks of 2048 / D keys.
* the bf16 output: rtol 2 * 2^-8 (out_rtol), >= one rounding of |y|.
Wrong masking, a missed or doubled key, a wrong KV head or row mapping moves the output by a
sizeable fraction of vmag (>> b vmag).
"""
from __future__ import annotations

import numpy as np
import pytest

from kernel_checks import F32_EPS, assert_close, rng  # noqa: F401  (fixture)
from lily_py import ops
from lily_py.ops import attention as A
from lily_py.reference import kernels as ref
from lily_py.testing import simulated_device
from test_attention import BF16, attn_case, out_rtol

B = 2.0 ** -8          # bfloat16 unit roundoff
ROWS, KEY_DIMS = 32, 2048  # kAttnMmaRows, kAttnTilesKeyDims (shaders/common/args_attention.h)


def block(D):
    return KEY_DIMS // D


def run(rng, q, kc, vc, g, position, **kw):
    return A._attention_prefill(q, kc, vc, position=position, gate=g, seed=rng.seed, **kw)


def bound(q, kc, vc, g, position):
    r, smag, vmag = ref.attention(q, kc, vc, position=position, gate=g)
    T, Hq, D = q.shape
    nb = -(-(position + T) // block(D))
    atol = (2 * 8 * np.sqrt(D) * F32_EPS * smag + B + (64 + 2 * nb) * F32_EPS) * vmag
    return r, atol


def executed(T, position, Hq, Hkv, D):
    qt, bk = ROWS // (Hq // Hkv), block(D)
    blocks = sum(-(-(position + min(t0 + qt, T)) // bk) for t0 in range(0, T, qt))
    return Hkv * blocks * 4 * ROWS * bk * D


def check_tiles(rng, q, kc, vc, g, position, what):
    out, stats = run(rng, q, kc, vc, g, position)
    T, Hq, D = q.shape
    Hkv = kc.shape[0]
    assert list(stats["kernels"]) == [f"attn_prefill_tiles_d{D}_bf16"]
    assert stats["dispatches"] == 1 and stats["barriers"] == 0
    assert stats["threads"] == Hkv * -(-T // (ROWS // (Hq // Hkv))) * 128
    assert stats["flops_useful"] == 4 * D * Hq * (T * position + T * (T + 1) // 2)
    assert stats["flops_executed"] == executed(T, position, Hq, Hkv, D)
    assert out.dtype == BF16 and out.shape == q.shape
    r, atol = bound(q, kc, vc, g, position)
    assert_close(out, r, atol=atol, rtol=out_rtol(BF16), what=what, seed=rng.seed)
    return out, stats


def test_prefill_route_rule_tiles():
    for d in (64, 128, 256):
        assert ops.attention_prefill_route(d, dtype=BF16) == "tiles"
        assert ops.attention_prefill_route(d, dtype="bfloat16") == "tiles"
        assert ops.attention_prefill_route(d, dtype=np.float32) == "mma"   # fp32 keeps mma
        assert ops.attention_prefill_route(d) == "mma"
        assert ops.attention_prefill_route(d, tensor_ops=True, dtype=BF16) == "m5"
    assert [ops.attention_prefill_route(d, dtype=BF16) for d in (32, 96, 192)] == ["mma"] * 3
    assert [ops.attention_prefill_route(d, dtype=BF16) for d in (16, 40, 160)] == ["simd"] * 3
    with pytest.raises(ValueError, match="dtype"):
        ops.attention_prefill_route(64, dtype=np.float16)


# Every group shape of the row packing (g = 1: 32 tokens per threadgroup; 3: 10 tokens + 2 padding
# rows; 8: 4 tokens), odd lengths, chunks starting past position 0, all three head dims / blocks.
@pytest.mark.parametrize("T,position,Hq,Hkv,D", [
    (37, 5, 16, 2, 256),   # real heads, 10 threadgroups per KV head, partial 8-key blocks
    (5, 3, 16, 2, 256),    # real heads, one partial threadgroup
    (1, 0, 16, 2, 256),    # one token, the first of a prompt
    (23, 41, 6, 2, 64),    # g = 3: 10 tokens + 2 padding rows per threadgroup, 32-key blocks
    (40, 7, 2, 2, 128),    # g = 1: 32 tokens per threadgroup, 2 threadgroups, 16-key blocks
    (9, 70, 8, 1, 64),     # g = 8: 4 tokens per threadgroup
    (33, 100, 3, 1, 128),  # g = 3, past 100 cached keys
    (17, 15, 4, 4, 256),   # g = 1, D = 256
], ids=lambda v: str(v))
def test_attention_prefill_tiles(rng, T, position, Hq, Hkv, D):
    q, kc, vc, g = attn_case(rng, T, Hq, Hkv, D, position + T + 3, BF16, gate=T % 2 == 1)
    check_tiles(rng, q, kc, vc, g, position, f"prefill tiles T={T} position={position} Hq={Hq} Hkv={Hkv} D={D}")


def test_real_heads_long_context(rng):
    # The model's heads (16 query, 2 KV, head_dim 256), 300 cached keys, 45 new tokens.
    q, kc, vc, g = attn_case(rng, 45, 16, 2, 256, 350, BF16)
    check_tiles(rng, q, kc, vc, g, 300, "prefill tiles real heads at 300")


def test_the_p_rounding_is_visible_and_within_its_bound(rng):
    # The bound's b vmag term is needed (P in bf16), and the mma route (fp32 P) is closer.
    q, kc, vc, g = attn_case(rng, 31, 4, 2, 128, 200, BF16, gate=False)
    r, smag, vmag = ref.attention(q, kc, vc, position=160, gate=None)
    tiles, _ = run(rng, q, kc, vc, None, 160)
    qf = q.astype(np.float32)
    mma, st = run(rng, qf, kc, vc, None, 160)
    assert list(st["kernels"]) == ["attn_prefill_mma_f32"]
    err_tiles = np.abs(tiles.astype(np.float64) - r)
    err_mma = np.abs(mma.astype(np.float64) - r)
    print(f"max |tiles - ref| / vmag {float((err_tiles / vmag).max()):.3e} (bound 2^-8 + bf16 output), "
          f"fp32 mma {float((err_mma / vmag).max()):.3e}")
    assert float(err_mma.max()) < float(err_tiles.max())


@pytest.mark.parametrize("D,route", [(96, "mma"), (40, "simd")])
def test_other_head_dims_keep_their_routes_in_bf16(rng, D, route):
    q, kc, vc, g = attn_case(rng, 7, 4, 2, D, 20, BF16)
    _, stats = run(rng, q, kc, vc, g, 10)
    assert list(stats["kernels"]) == (["attn_prefill_mma_bf16"] if route == "mma" else ["attn_prefill_bf16"])


@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp32_keeps_mma_and_tensor_ops_take_m5(rng, D):
    q, kc, vc, g = attn_case(rng, 7, 4, 2, D, 20, np.float32)
    _, stats = run(rng, q, kc, vc, g, 10)
    assert list(stats["kernels"]) == ["attn_prefill_mma_f32"]
    qb = q.astype(BF16)
    with simulated_device(tensor_ops=True):
        _, stats = run(rng, qb, kc, vc, g.astype(BF16), 10)
    assert list(stats["kernels"]) == [f"attn_prefill_m5_d{D}_bf16"]


@pytest.mark.parametrize("order", ["forward", "reverse", "ahead"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_tiles_independent_of_thread_order(rng, order, D):
    q, kc, vc, g = attn_case(rng, 11, 6, 2, D, 80, BF16)
    a, _ = run(rng, q, kc, vc, g, 60, order="shuffle")
    b, _ = run(rng, q, kc, vc, g, 60, order=order)
    np.testing.assert_array_equal(a, b)


def test_cache_rows_past_the_causal_end_are_never_read(rng):
    # Rows at and past position + T must not change the output (NaN there would poison it).
    for D in (64, 128, 256):
        q, kc, vc, g = attn_case(rng, 9, 8, 2, D, 40, BF16)
        a, _ = run(rng, q, kc, vc, g, 20)
        kc2, vc2 = kc.copy(), vc.copy()
        kc2[:, 29:] = BF16.type(np.nan)
        vc2[:, 29:] = BF16.type(np.nan)
        b, _ = run(rng, q, kc2, vc2, g, 20)
        np.testing.assert_array_equal(a, b)


# Causal edges at the key-block boundaries and both stages of the double buffer: g = 8 (4 tokens
# per threadgroup), 5 tokens after 3 BK - 4 cached keys, so threadgroup 0 ends exactly on a block
# boundary (3 blocks: stages 0, 1, 0) and threadgroup 1 one key past it (a 1-key partial 4th
# block in stage 1); every thread order, the adversarial `ahead` included (a stage overwritten
# while another simdgroup still reads it changes the output there).
@pytest.mark.parametrize("order", ["shuffle", "ahead"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_block_edges_and_both_stages(rng, D, order):
    bk = block(D)
    position = 3 * bk - 4
    q, kc, vc, g = attn_case(rng, 5, 8, 1, D, position + 5 + 2, BF16, gate=True)
    out, stats = run(rng, q, kc, vc, g, position, order=order)
    assert list(stats["kernels"]) == [f"attn_prefill_tiles_d{D}_bf16"]
    assert stats["flops_executed"] == executed(5, position, 8, 1, D) == 1 * (3 + 4) * 4 * ROWS * bk * D
    r, atol = bound(q, kc, vc, g, position)
    assert_close(out, r, atol=atol, rtol=out_rtol(BF16), what=f"block edges D={D} {order}", seed=rng.seed)
