"""The M5 route of lily_py.ops.attention_prefill (shaders/m5/attention_m5.metal: S = Q K^T and
O += P V as matmul2d, Metal 4 tensor ops) on the emulator under
lily_py.testing.simulated_device(tensor_ops=True), vs lily_py.reference.kernels.attention (float64).

Tolerance, derived (u = 2^-24; h = 2^-11, half's unit roundoff; smag, vmag as in test_attention.py):
* scores: Q is rounded to half once (relative h per element); the bf16 keys are exact in half
  except below half's normal range (|k| < 2^-14: absolute <= 2^-25). So a score errs by
  <= (h + 8 sqrt(D) u) smag + 2^-25 scale sum_d |q_d|  (=: e_s), and the softmax weights by a
  relative 2 e_s: the output by 2 e_s vmag.
* P is rounded to half before P V (relative h, absolute 2^-25 below half's normal range) while l
  sums the unrounded p: the output moves by <= h vmag + 2^-25 (keys) max|v| (V is exact in half
  but for the same absolute 2^-25, included in the last term with keys + 1).
* fp32: the online rescaling and sums as test_attention.py: (64 + 2 nb) u vmag, nb = 32-key blocks (BLOCK).
* bf16 outputs: rtol 2 * 2^-8.
Wrong masking, a missed or doubled key, a wrong KV head or row mapping moves the output by a
sizeable fraction of vmag. Both sides of the route switch: tensor ops on / off, head_dim 64, 128,
256 (m5) | 96 (mma) | 40 (simd) with tensor ops.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernel_checks import BF16_EPS, F32_EPS, assert_close, rng  # noqa: F401  (fixture)
from lily_py import ops
from lily_py.ops import attention as A
from lily_py.reference import kernels as ref
from lily_py.testing import simulated_device
from test_attention import BF16, DTYPES, attn_case, out_rtol, sfx

HALF_EPS = 2.0 ** -11
ROWS, BLOCK = 16, 32  # kAttnM5Rows, kAttnM5BlockKeys (shaders/common/args_attention.h)


def run(rng, q, kc, vc, g, position, *, tensor_ops=True, **kw):
    if tensor_ops:
        with simulated_device(tensor_ops=True):
            return A._attention_prefill(q, kc, vc, position=position, gate=g, seed=rng.seed, **kw)
    return A._attention_prefill(q, kc, vc, position=position, gate=g, seed=rng.seed, **kw)


def m5_atol(q, kc, vc, g, position):
    r, smag, vmag = ref.attention(q, kc, vc, position=position, gate=g)
    T, Hq, D = q.shape
    scale = float(np.float32(D ** -0.5))
    keys = position + T
    nb = -(-keys // BLOCK)
    qabs = np.abs(np.asarray(q, np.float64)).sum(-1, keepdims=True)
    e_s = (HALF_EPS + 8 * np.sqrt(D) * F32_EPS) * smag + 2.0 ** -25 * scale * qabs
    vmax = float(np.abs(np.asarray(vc, np.float64)[:, :keys]).max())
    atol = (2 * e_s + HALF_EPS + (64 + 2 * nb) * F32_EPS) * vmag + 2.0 ** -25 * (keys + 1) * vmax
    fp32 = (8 * np.sqrt(D) * F32_EPS * smag + (64 + 2 * nb) * F32_EPS) * vmag
    return r, atol, fp32


def check_m5(rng, q, kc, vc, g, position, what):
    out, stats = run(rng, q, kc, vc, g, position)
    T, Hq, D = q.shape
    Hkv = kc.shape[0]
    group = Hq // Hkv
    assert list(stats["kernels"]) == [f"attn_prefill_m5_d{D}_{sfx(q.dtype)}"]
    assert stats["dispatches"] == 1 and stats["barriers"] == 0
    assert stats["threads"] == Hkv * -(-T // (ROWS // group)) * 128
    r, atol, fp32 = m5_atol(q, kc, vc, g, position)
    assert_close(out, r, atol=atol, rtol=out_rtol(q.dtype), what=what, seed=rng.seed)
    if q.dtype == np.float32:  # the half rounding is visible: the fp32 bound alone does not hold
        assert np.any(np.abs(out - r) > fp32)
    return out, stats


def test_prefill_route_rule_with_tensor_ops():
    assert [ops.attention_prefill_route(d, tensor_ops=True) for d in (64, 128, 256)] == ["m5"] * 3
    assert [ops.attention_prefill_route(d, tensor_ops=True) for d in (32, 96, 192)] == ["mma"] * 3
    assert [ops.attention_prefill_route(d, tensor_ops=True) for d in (16, 40, 160)] == ["simd"] * 3
    assert [ops.attention_prefill_route(d) for d in (64, 128, 256)] == ["mma"] * 3


# Every group shape of the row packing (g = 1: 16 tokens per threadgroup; 3: 5 tokens + 1 padding
# row; 8: 2 tokens), partial token and key blocks, chunks after an existing cache, all head dims.
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("T,position,Hq,Hkv,D", [
    (5, 3, 16, 2, 256),    # real heads, a partial key block
    (23, 41, 6, 2, 64),    # g = 3: 5 tokens + 1 padding row per threadgroup, 5 threadgroups
    (40, 5, 2, 2, 128),    # g = 1: 16 tokens per threadgroup, 3 threadgroups
    (9, 70, 8, 1, 64),     # g = 8: 2 tokens per threadgroup
    (2, 0, 4, 2, 128),     # the smallest prefill chunk, first of a prompt
    (17, 15, 4, 4, 256),   # key blocks of 32 on both sides of the chunk's first key
], ids=lambda v: str(v))
def test_attention_prefill_m5(rng, dtype, T, position, Hq, Hkv, D):
    q, kc, vc, g = attn_case(rng, T, Hq, Hkv, D, position + T + 3, dtype, gate=T % 2 == 1)
    check_m5(rng, q, kc, vc, g, position, f"prefill M5 T={T} position={position} Hq={Hq} Hkv={Hkv} D={D}")


def test_real_heads_long_context(rng):
    # The model's heads (16 query, 2 KV, head_dim 256, bf16 activations), 300 cached keys.
    q, kc, vc, g = attn_case(rng, 12, 16, 2, 256, 320, BF16)
    check_m5(rng, q, kc, vc, g, 300, "prefill M5 real heads at 300")


@pytest.mark.parametrize("D,route", [(96, "mma"), (40, "simd")])
def test_other_head_dims_keep_their_routes_with_tensor_ops(rng, D, route):
    q, kc, vc, g = attn_case(rng, 7, 4, 2, D, 20, np.float32)
    _, stats = run(rng, q, kc, vc, g, 10)
    assert list(stats["kernels"]) == ([f"attn_prefill_mma_f32"] if route == "mma" else ["attn_prefill_f32"])


def test_without_tensor_ops_mma_route(rng):
    q, kc, vc, g = attn_case(rng, 7, 4, 2, 64, 20, np.float32)
    _, stats = run(rng, q, kc, vc, g, 10, tensor_ops=False)
    assert list(stats["kernels"]) == ["attn_prefill_mma_f32"]


@pytest.mark.parametrize("T,position,Hq,Hkv,D", [(23, 41, 6, 2, 64), (33, 100, 16, 2, 256)])
def test_m5_flops(rng, T, position, Hq, Hkv, D):
    """flops_useful: 4 D per (row, visible key); flops_executed: each threadgroup's 16 rows against
    every 32-key block up to its last token's causal end, S and P V."""
    q, kc, vc, g = attn_case(rng, T, Hq, Hkv, D, position + T, np.float32)
    _, stats = run(rng, q, kc, vc, g, position)
    assert stats["flops_useful"] == 4 * D * Hq * (T * position + T * (T + 1) // 2)
    qt = ROWS // (Hq // Hkv)
    blocks = sum(-(-(position + min(t0 + qt, T)) // BLOCK) for t0 in range(0, T, qt))
    assert stats["flops_executed"] == Hkv * blocks * 4 * ROWS * BLOCK * D


@pytest.mark.parametrize("order", ["forward", "reverse", "ahead"])
def test_m5_independent_of_thread_order(rng, order):
    q, kc, vc, g = attn_case(rng, 11, 6, 2, 64, 80, np.float32)
    a, _ = run(rng, q, kc, vc, g, 60, order="shuffle")
    b, _ = run(rng, q, kc, vc, g, 60, order=order)
    np.testing.assert_array_equal(a, b)


def test_cache_rows_past_the_causal_end_are_never_read(rng):
    # Rows at and past position + T (and, per row, past its own token) must not change the output.
    q, kc, vc, g = attn_case(rng, 9, 8, 2, 128, 40, np.float32)
    a, _ = run(rng, q, kc, vc, g, 20)
    kc2, vc2 = kc.copy(), vc.copy()
    kc2[:, 29:] = BF16.type(1e4)
    vc2[:, 29:] = BF16.type(-1e4)
    b, _ = run(rng, q, kc2, vc2, g, 20)
    np.testing.assert_array_equal(a, b)
