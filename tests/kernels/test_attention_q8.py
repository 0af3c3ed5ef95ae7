"""The int8 KV cache (``kv_dtype="int8"``, shaders/common/kv_blocks.h) on the kernels: the KV write
(qk_norm_rope_q8_*) quantizes each new row as lily_py.reference.kvquant.int8_row_codes does, the
vec decode route (attn_decode_vec_q8_*) and the mma prefill route (attn_prefill_mma_q8_*) read the
codes times the row's scale. Pools are paged through scrambled tables with NaN scales in the blocks
outside the table. Attention is held to test_attention.py's bounds against the float64 reference
over the cache's own values (codes * scales), so the kernels' error is measured apart from the
format's, which benchmarks/kv_quant_error.py measures.
"""
from __future__ import annotations

import numpy as np
import pytest

from kernel_checks import BF16_EPS, DEVICES, F32_EPS, assert_close, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py.ops import attention as A
from lily_py.ops.attention import Q8Cache
from lily_py.reference import kernels as ref
from lily_py.reference.kvquant import int8_row_codes
from lily_py.testing import simulated_device
from test_attention import BF16, attn_case, check_attention, out_rtol, qk_case, sfx
from test_attention_paged import scrambled

DTYPES = [np.dtype(np.float32), BF16]


def q8(rng, Hkv, cap, D, scale=1.5):
    """A random int8 cache whose rows span the full code range (|code| 127 on each row)."""
    return Q8Cache.quantize((rng.standard_normal((Hkv, cap, D)) * scale).astype(np.float32))


def test_quantize_matches_the_reference_format(rng):
    x = (rng.standard_normal((3, 37, 64)) * 4).astype(np.float32)
    x[1, 5] = 0.0  # an all-zero row: scale 0, codes 0
    c = Q8Cache.quantize(x)
    assert c.codes.dtype == np.int8 and c.scales.shape == (3, 37)
    assert np.abs(c.codes).max(axis=-1)[np.arange(3) != 1].min() == 127
    assert c.scales[1, 5] == 0 and not c.codes[1, 5].any()
    err = np.abs(c.values() - x)
    # half a step, plus x * (1 / scale)'s rounding in code units (127 x 2 eps) and the product's
    bound = (0.5 + 2.0 ** -14) * c.scales[..., None] + 2 * F32_EPS * np.abs(x)
    assert (err <= bound).all(), f"first bad index {np.argwhere(err > bound)[0]}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=["wf32", "wbf16"])
@pytest.mark.parametrize("dims", [
    dict(T=3, Hq=4, Hkv=2, D=64, rd=16, position=29, cap=41),             # rows across a 32-token block edge
    dict(T=2, Hq=16, Hkv=2, D=256, rd=64, position=1000, cap=1003),       # real head dims
], ids=["d64", "real"])
def test_kv_write_quantizes_each_row(rng, device, x_dtype, w_dtype, dims):
    d = dims
    qg, k, v, qn, kn, _, _ = qk_case(rng, d["T"], d["Hq"], d["Hkv"], d["D"], d["cap"], x_dtype, w_dtype)
    kc, vc = q8(rng, d["Hkv"], d["cap"], d["D"]), q8(rng, d["Hkv"], d["cap"], d["D"])
    table = scrambled(rng, d["cap"], 32)
    q, kc2, vc2, stats = A._qk_norm_rope_append(qg, k, v, qn, kn, kc, vc, position=d["position"], rotary_dim=d["rd"],
                                                theta=1e7, device=device, seed=rng.seed, block_tokens=32,
                                                block_table=table)
    assert list(stats["kernels"]) == [f"qk_norm_rope_q8_x{sfx(x_dtype)}_w{sfx(w_dtype)}"]
    # The query side is the bf16-cache kernel's, bit for bit.
    qb, _, _, _ = A._qk_norm_rope_append(qg, k, v, qn, kn, *attn_case(rng, 1, 2, d["Hkv"], d["D"], d["cap"], x_dtype)[1:3],
                                         position=d["position"], rotary_dim=d["rd"], theta=1e7, device=device,
                                         seed=rng.seed)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(qb).view(np.uint8))
    rows = slice(d["position"], d["position"] + d["T"])
    # V rows: the input values quantized exactly as the reference does.
    vq, vs = int8_row_codes(v.astype(np.float32).transpose(1, 0, 2))
    np.testing.assert_array_equal(vc2.codes[:, rows], vq)
    np.testing.assert_array_equal(vc2.scales[:, rows], vs[..., 0])
    # K rows: the kernel's fp32 keys differ from the float64 reference by rounding, so a code may
    # sit one step off where the reference lands within that rounding of a half step.
    _, rk = ref.qk_norm_rope(qg, k, qn, kn, position=d["position"], rotary_dim=d["rd"], theta=1e7, eps=1e-6)
    rk = rk.transpose(1, 0, 2)
    kq, ks = int8_row_codes(rk.astype(np.float32))
    assert_close(kc2.scales[:, rows], ks[..., 0], atol=0.0, rtol=2.0 ** -16, what="k scales", seed=rng.seed)
    diff = np.abs(kc2.codes[:, rows].astype(np.int32) - kq)
    assert diff.max() <= 1, f"k codes more than one step off at {np.unravel_index(diff.argmax(), diff.shape)}"
    assert_close(kc2.values()[:, rows], rk, atol=(0.5 + 2.0 ** -10) * ks + 2.0 ** -12 * np.abs(rk).max(axis=-1, keepdims=True),
                 rtol=0.0, what="k rows", seed=rng.seed)
    keep = np.ones(d["cap"], bool)
    keep[rows] = False
    for new, old in ((kc2, kc), (vc2, vc)):
        np.testing.assert_array_equal(new.codes[:, keep], old.codes[:, keep])
        np.testing.assert_array_equal(new.scales[:, keep], old.scales[:, keep])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 6, 2), (128, 4, 1), (256, 16, 2)], ids=["e2", "e4", "e8"])
@pytest.mark.parametrize("length", [1, 33, 300, 2100])
def test_decode_reads_codes_times_scale(rng, device, dtype, D, Hq, Hkv, length):
    q, _, _, g = attn_case(rng, 1, Hq, Hkv, D, length + 3, dtype)
    kc, vc = q8(rng, Hkv, length + 3, D), q8(rng, Hkv, length + 3, D, 1.0)
    table = scrambled(rng, length + 3, 64)
    out, stats = A._attention_decode(q[0], kc, vc, length=length, gate=g[0], device=device, seed=rng.seed,
                                     block_tokens=64, block_table=table)
    assert list(stats["kernels"]) == [f"attn_decode_vec_q8_e{D // 32}_{sfx(dtype)}",
                                      f"attn_vec_combine_e{D // 32}_{sfx(dtype)}"]
    check_attention(rng, out[None], q, kc.values(), vc.values(), g, length - 1, f"q8 decode D={D} L={length}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 4, 2), (256, 16, 2)], ids=["d64", "real"])
@pytest.mark.parametrize("position,T", [(45, 50), (0, 33), (300, 7)])
def test_prefill_reads_codes_times_scale(rng, device, dtype, D, Hq, Hkv, position, T):
    cap = position + T + 1
    q, _, _, g = attn_case(rng, T, Hq, Hkv, D, cap, dtype)
    kc, vc = q8(rng, Hkv, cap, D), q8(rng, Hkv, cap, D, 1.0)
    out, stats = A._attention_prefill(q, kc, vc, position=position, gate=g, device=device, seed=rng.seed,
                                      block_tokens=32, block_table=scrambled(rng, cap, 32))
    if dtype == BF16:  # the bf16 tiles (M1-M4): K and V staged as bf16(code x scale), P in bf16
        assert list(stats["kernels"]) == [f"attn_prefill_tiles_q8_d{D}_bf16"]
        r, smag, vmag = ref.attention(q, kc.values(), vc.values(), position=position, gate=g)
        # K's rounding moves a score by <= 2^-9 smag, so a weight by <= 2^-8 smag relative; V's and
        # P's roundings 2^-9 and 2^-8; the output's bf16 rounding is in rtol
        assert_close(out, r, atol=(2.0 ** -7 + 2.0 ** -8 * smag) * vmag, rtol=2 * BF16_EPS,
                     what=f"q8 prefill tiles D={D}", seed=rng.seed)
    else:
        assert list(stats["kernels"]) == [f"attn_prefill_mma_q8_{sfx(dtype)}"]
        check_attention(rng, out, q, kc.values(), vc.values(), g, position, f"q8 prefill D={D}")


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 4, 2), (256, 16, 2)], ids=["d64", "real"])
@pytest.mark.parametrize("position,T", [(45, 50), (0, 33)])
def test_prefill_on_tensor_ops_reads_codes_times_scale(rng, D, Hq, Hkv, position, T):
    """The M5 route (simulated tensor ops) with fp32 activations: K staged as its codes (exact in
    half) with the row's scale applied to S in fp32, V as its codes with 128 x its scale applied to
    P; test_attention_m5.py's derived bound plus V's rounding to half (relative 2^-11). A wrong
    column permutation of Q against the codes, or a scale applied to the wrong key, moves the
    output by a sizeable fraction of vmag. (bf16 activations: S on int8, the next test.)"""
    dtype = np.float32
    from test_attention_m5 import HALF_EPS, m5_atol
    cap = position + T + 1
    q, _, _, g = attn_case(rng, T, Hq, Hkv, D, cap, dtype)
    kc, vc = q8(rng, Hkv, cap, D), q8(rng, Hkv, cap, D, 1.0)
    with simulated_device(tensor_ops=True):
        out, stats = A._attention_prefill(q, kc, vc, position=position, gate=g, seed=rng.seed,
                                          block_tokens=32, block_table=scrambled(rng, cap, 32))
    assert list(stats["kernels"]) == [f"attn_prefill_m5_q8_d{D}_{sfx(dtype)}"]
    r, atol, _ = m5_atol(q, kc.values(), vc.values(), g, position)
    _, _, vmag = ref.attention(q, kc.values(), vc.values(), position=position, gate=g)
    assert_close(out, r, atol=atol + HALF_EPS * vmag, rtol=out_rtol(dtype), what=f"q8 prefill m5 D={D}",
                 seed=rng.seed)


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 4, 2), (128, 6, 2), (256, 16, 2)], ids=["d64", "d128", "real"])
@pytest.mark.parametrize("position,T", [(45, 50), (0, 33), (300, 7)])
def test_prefill_int8_scores_with_bf16_activations(rng, D, Hq, Hkv, position, T):
    """The M5 route (simulated tensor ops; the int8 opt-in takes the same kernel: the cases at
    position 300 run with it) with the int8 cache and bf16 activations: S = Q K^T on int8
    operands, each Q row (token, head) quantized as the cache quantizes its rows
    (reference.kvquant.int8_row_codes), K's codes as stored. Against the reference on that
    quantized Q: test_attention_m5.py's derived bound plus P's rounding to half. A wrong Q scale
    or a row reduced over the wrong threads moves the output by a sizeable fraction of vmag."""
    from lily_py.reference.kvquant import int8_row
    from test_attention_m5 import HALF_EPS, m5_atol
    cap = position + T + 1
    q, _, _, g = attn_case(rng, T, Hq, Hkv, D, cap, BF16)
    kc, vc = q8(rng, Hkv, cap, D), q8(rng, Hkv, cap, D, 1.0)
    table = scrambled(rng, cap, 32)
    with simulated_device(tensor_ops=True, tensor_int8=position == 300):
        out, stats = A._attention_prefill(q, kc, vc, position=position, gate=g, seed=rng.seed,
                                          block_tokens=32, block_table=table)
        _, s32 = A._attention_prefill(q.astype(np.float32), kc, vc, position=position, gate=g.astype(np.float32),
                                      seed=rng.seed, block_tokens=32, block_table=table)
    assert list(stats["kernels"]) == [f"attn_prefill_m5i8_q8_d{D}_bf16"]
    assert list(s32["kernels"]) == [f"attn_prefill_m5_q8_d{D}_f32"]  # fp32 activations: half operands
    qq = int8_row(np.asarray(q, np.float32))
    r, atol, _ = m5_atol(qq, kc.values(), vc.values(), g, position)
    _, _, vmag = ref.attention(qq, kc.values(), vc.values(), position=position, gate=g)
    assert_close(out, r, atol=atol + HALF_EPS * vmag, rtol=out_rtol(BF16), what=f"int8 scores m5i8 D={D}",
                 seed=rng.seed)


def test_bytes_touched_are_the_int8_rows(rng):
    """The bound pools: (D + 4) bytes a row of K and of V instead of 2 D (the op pages `length` rows
    into 32-token blocks)."""
    Hq, Hkv, D, length = 16, 2, 256, 700
    q, kb, vb, g = attn_case(rng, 1, Hq, Hkv, D, length, np.float32)
    _, s16 = A._attention_decode(q[0], kb, vb, length=length, gate=g[0], seed=rng.seed)
    _, s8 = A._attention_decode(q[0], q8(rng, Hkv, length, D), q8(rng, Hkv, length, D), length=length, gate=g[0],
                                seed=rng.seed)
    rows = -(-length // 32) * 32
    assert s16["bytes_bound"] - s8["bytes_bound"] == 2 * rows * Hkv * (2 * D - (D + 4))


def test_q8_errors_are_clear(rng):
    q, kb, vb, g = attn_case(rng, 1, 4, 2, 40, 50, np.float32)
    bad = Q8Cache(np.zeros((2, 50, 40), np.int8), np.ones((2, 50), np.float32))
    with pytest.raises(ValueError, match=r"an int8 cache needs head_dim 64, 128 or 256, got 40"):
        A.attention_decode(q[0], bad, bad, length=50)
    good = q8(rng, 2, 50, 64)
    q64, _, _, _ = attn_case(rng, 1, 4, 2, 64, 50, np.float32)
    with pytest.raises(ValueError, match=r"must both be bfloat16 or both Q8Cache"):
        A.attention_decode(q64[0], good, attn_case(rng, 1, 4, 2, 64, 50, np.float32)[2], length=50)
    with pytest.raises(ValueError, match=r"float32 scales \[kv_heads, capacity\]"):
        A.attention_decode(q64[0], Q8Cache(good.codes, good.scales[:, :3]), good, length=50)
    assert ops.attention_decode_route(50, 64)["route"] == "vec"
