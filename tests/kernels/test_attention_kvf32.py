"""The float32 KV cache (``kv_dtype="float32"``; shaders/common/kv_blocks.h: the bf16 pools' layout
in float) on the kernels: the KV write (qk_norm_rope_kvf32_*) stores each new K and V row as
computed, the decode routes (vec attn_decode_vec_kvf32_*, single attn_decode_kvf32_*, split
attn_decode_split_kvf32_*; the combines are the bf16 cache's) and the prefill routes (mma
attn_prefill_mma_kvf32_*, simd attn_prefill_kvf32_*) read the rows unrounded. The M5 and bf16
tiles routes are never taken: their K / V staging in fp32 does not fit 32 KiB, so an f32 cache
prefills on mma or simd on every device (both sides of each switch below). Pools are paged
through scrambled tables, NaN in the pool blocks outside the table.

Tolerances: the caches are random float32 rows (not bf16 values) given to the float64 reference
exactly, so test_attention.py's fp32 bound (check_attention: the kernels' own fp32 roundings, no
term for the cache) holds. A kernel that rounded K or V to bf16 on the way (2^-9 relative) would
exceed it about 30-fold (test_bf16_rounding_would_fail_the_bound).
"""
from __future__ import annotations

import numpy as np
import pytest

from kernel_checks import BF16_EPS, DEVICES, F32_EPS, assert_close, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py.ops import attention as A
from lily_py.reference import kernels as ref
from lily_py.testing import simulated_device
from test_attention import BF16, attn_case, check_attention, out_rtol, qk_case, rand, rope_atol, sfx
from test_attention_paged import scrambled

F32 = np.dtype(np.float32)
DTYPES = [F32, BF16]


def f32_case(rng, T, Hq, Hkv, D, cap, dtype, gate=True):
    """attn_case with float32 caches of values bf16 cannot hold."""
    q, _, _, g = attn_case(rng, T, Hq, Hkv, D, cap, dtype, gate=gate)
    kc = rand(rng, (Hkv, cap, D), F32, 1.5)
    vc = rand(rng, (Hkv, cap, D), F32)
    return q, kc, vc, g


def test_prefill_route_rule():
    """An f32 cache: mma where the bf16 cache takes m5 / tiles / mma, simd where it takes simd."""
    for D in (32, 64, 96, 128, 192, 256):
        for dt in DTYPES:
            for tensor_ops in (False, True):
                assert ops.attention_prefill_route(D, tensor_ops=tensor_ops, dtype=dt, kv_dtype="float32") == "mma"
    for D in (16, 24, 40, 160, 224):
        assert ops.attention_prefill_route(D, tensor_ops=True, dtype=BF16, kv_dtype="float32") == "simd"
    # the other side of the switch, at the same head dims
    assert ops.attention_prefill_route(64, tensor_ops=True, kv_dtype="bfloat16") == "m5"
    assert ops.attention_prefill_route(256, dtype=BF16, kv_dtype="bfloat16") == "tiles"
    assert ops.attention_prefill_route(256, dtype=BF16, kv_dtype="int8") == "tiles"
    with pytest.raises(ValueError, match="kv_dtype must be 'bfloat16', 'int8' or 'float32'"):
        ops.attention_prefill_route(64, kv_dtype="fp8")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=["wf32", "wbf16"])
@pytest.mark.parametrize("dims", [
    dict(T=3, Hq=6, Hkv=2, D=40, rd=10, position=30, cap=35),         # odd head_dim, rows across a block edge
    dict(T=2, Hq=16, Hkv=2, D=256, rd=64, position=1000, cap=1003),   # real head dims
], ids=["odd", "real"])
def test_kv_write_keeps_fp32_rows(rng, device, x_dtype, w_dtype, dims):
    """K rows: the bf16 kernel's fp32 values before its rounding (bf16 of them is the bf16 cache's
    row bit for bit), within test_attention.py's qk_norm_rope bound with no bf16 term; V rows: v
    widened to fp32, exactly; q and every other row unchanged."""
    d = dims
    qg, k, v, qn, kn, kb, vb = qk_case(rng, d["T"], d["Hq"], d["Hkv"], d["D"], d["cap"], x_dtype, w_dtype)
    kc, vc = rand(rng, kb.shape, F32), rand(rng, vb.shape, F32)
    table = scrambled(rng, d["cap"], 32)
    kw = dict(position=d["position"], rotary_dim=d["rd"], theta=1e7, eps=1e-6, device=device, seed=rng.seed,
              block_tokens=32, block_table=table)
    q, kc2, vc2, stats = A._qk_norm_rope_append(qg, k, v, qn, kn, kc, vc, **kw)
    assert list(stats["kernels"]) == [f"qk_norm_rope_kvf32_x{sfx(x_dtype)}_w{sfx(w_dtype)}"]
    assert kc2.dtype == F32 and vc2.dtype == F32
    qb, kb2, _, sb = A._qk_norm_rope_append(qg, k, v, qn, kn, kb, vb, **kw)
    assert list(sb["kernels"]) == [f"qk_norm_rope_x{sfx(x_dtype)}_w{sfx(w_dtype)}"]
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(qb).view(np.uint8))
    rows = slice(d["position"], d["position"] + d["T"])
    np.testing.assert_array_equal(kc2[:, rows].astype(BF16).view(np.uint16), kb2[:, rows].view(np.uint16))
    _, rk = ref.qk_norm_rope(qg, k, qn, kn, position=d["position"], rotary_dim=d["rd"], theta=1e7, eps=1e-6)
    D, rd = d["D"], d["rd"]
    n = ref.rms_norm(k, kn, eps=1e-6)
    atol = rope_atol(n, rd) / 8 * (4 * np.sqrt(D) + 16) + (4 * np.sqrt(D) + 8) * F32_EPS * np.abs(
        np.concatenate([np.zeros_like(n[..., :rd]), n[..., rd:]], axis=-1))
    assert_close(kc2[:, rows], rk.transpose(1, 0, 2), atol=atol.transpose(1, 0, 2), rtol=0.0, what="k rows",
                 seed=rng.seed)
    np.testing.assert_array_equal(vc2[:, rows], v.astype(np.float32).transpose(1, 0, 2))
    keep = np.ones(d["cap"], bool)
    keep[rows] = False
    np.testing.assert_array_equal(kc2[:, keep], kc[:, keep])
    np.testing.assert_array_equal(vc2[:, keep], vc[:, keep])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 6, 2), (128, 4, 1), (256, 16, 2)], ids=["e2", "e4", "e8"])
@pytest.mark.parametrize("length", [1, 33, 300, 2100])
def test_decode_vec(rng, device, dtype, D, Hq, Hkv, length):
    q, kc, vc, g = f32_case(rng, 1, Hq, Hkv, D, length + 3, dtype)
    out, stats = A._attention_decode(q[0], kc, vc, length=length, gate=g[0], device=device, seed=rng.seed,
                                     block_tokens=64, block_table=scrambled(rng, length + 3, 64))
    assert list(stats["kernels"]) == [f"attn_decode_vec_kvf32_e{D // 32}_{sfx(dtype)}",
                                      f"attn_vec_combine_e{D // 32}_{sfx(dtype)}"]
    check_attention(rng, out[None], q, kc, vc, g, length - 1, f"f32 cache vec decode D={D} L={length}")


# Other head dims: single up to 256 keys, split past it (both sides), odd groups and head dims.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 40), (8, 1, 37), (3, 3, 24), (5, 1, 96)],
                         ids=["g3-D40", "g8-D37", "g1-D24", "g5-D96"])
@pytest.mark.parametrize("length", [1, 256, 257, 641])
def test_decode_single_and_split(rng, device, dtype, Hq, Hkv, D, length):
    q, kc, vc, g = f32_case(rng, 1, Hq, Hkv, D, length + 2, dtype, gate=length % 2 == 1)
    out, stats = A._attention_decode(q[0], kc, vc, length=length, gate=None if g is None else g[0], device=device,
                                     seed=rng.seed)
    route = ops.attention_decode_route(length, D)["route"]
    assert route == ("single" if length <= 256 else "split")
    want = ([f"attn_decode_kvf32_{sfx(dtype)}"] if route == "single"
            else [f"attn_decode_split_kvf32_{sfx(dtype)}", f"attn_combine_{sfx(dtype)}"])
    assert list(stats["kernels"]) == want
    check_attention(rng, out[None], q, kc, vc, g, length - 1, f"f32 cache {route} decode D={D} L={length}")


# mma (head_dim 64, 96, 256: groups 3, 1, 8) and simd (40, 33, 24) with partial blocks and chunks
# after an existing cache.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("T,position,Hq,Hkv,D", [
    (23, 41, 6, 2, 64),    # mma: g = 3 (10 tokens + 2 padding rows per threadgroup), 3 threadgroups
    (40, 5, 2, 2, 96),     # mma: g = 1, 32 tokens per threadgroup
    (5, 300, 16, 2, 256),  # mma: the real heads, 2 V passes, past 256 keys
    (9, 0, 6, 2, 40),      # simd: first chunk of a prompt
    (7, 290, 8, 1, 33),    # simd: g = 8, odd head_dim, 2 blocks of queries
    (4, 37, 3, 3, 24),     # simd: g = 1, a second chunk
], ids=lambda v: str(v))
def test_prefill(rng, device, dtype, T, position, Hq, Hkv, D):
    q, kc, vc, g = f32_case(rng, T, Hq, Hkv, D, position + T + 2, dtype, gate=T % 2 == 1)
    out, stats = A._attention_prefill(q, kc, vc, position=position, gate=g, device=device, seed=rng.seed)
    group = Hq // Hkv
    if ops.attention_prefill_route(D, dtype=dtype, kv_dtype="float32") == "mma":
        assert list(stats["kernels"]) == [f"attn_prefill_mma_kvf32_{sfx(dtype)}"]
        assert stats["threads"] == Hkv * -(-T // (32 // group)) * 128
    else:
        assert list(stats["kernels"]) == [f"attn_prefill_kvf32_{sfx(dtype)}"]
        assert stats["threads"] == Hkv * -(-T // 4) * 32 * group
    check_attention(rng, out, q, kc, vc, g, position, f"f32 cache prefill T={T} position={position} D={D}")


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 4, 2), (256, 16, 2)], ids=["d64", "real"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_prefill_on_tensor_ops_and_tiles_devices_takes_mma(rng, D, Hq, Hkv, dtype):
    """Where the bf16 cache takes the M5 route (simulated tensor ops) or the bf16 tiles (bf16
    activations, M1-M4), the f32 cache takes mma, at the fp32 bound."""
    T, position = 33, 45
    q, kc, vc, g = f32_case(rng, T, Hq, Hkv, D, position + T + 1, dtype)
    table = scrambled(rng, position + T + 1, 32)
    for tensor_ops in (False, True):
        with simulated_device(tensor_ops=tensor_ops):
            out, stats = A._attention_prefill(q, kc, vc, position=position, gate=g, seed=rng.seed, block_tokens=32,
                                              block_table=table)
            _, sb = A._attention_prefill(q, kc.astype(BF16), vc.astype(BF16), position=position, gate=g,
                                         seed=rng.seed, block_tokens=32, block_table=table)
        assert list(stats["kernels"]) == [f"attn_prefill_mma_kvf32_{sfx(dtype)}"]
        bf16_route = "m5" if tensor_ops else ("tiles" if dtype == BF16 else "mma")
        assert list(sb["kernels"])[0].startswith(f"attn_prefill_{bf16_route}_"), sb["kernels"]
        check_attention(rng, out, q, kc, vc, g, position, f"f32 cache prefill D={D} tensor_ops={tensor_ops}")


def test_prefill_equals_looped_decode_bitwise(rng):
    """The simd prefill route and the single decode route share their arithmetic per row."""
    T, position, Hq, Hkv, D = 6, 100, 4, 2, 48
    q, kc, vc, g = f32_case(rng, T, Hq, Hkv, D, position + T, F32)
    pre = ops.attention_prefill(q, kc, vc, position=position, gate=g)
    for t in range(T):
        np.testing.assert_array_equal(pre[t], ops.attention_decode(q[t], kc, vc, length=position + t + 1, gate=g[t]))


@pytest.mark.parametrize("order", ["forward", "reverse", "ahead"])
def test_independent_of_thread_order(rng, order):
    """No races: vec and split decode, mma and simd prefill give bit-identical results in any order."""
    for D in (64, 40):
        q, kc, vc, g = f32_case(rng, 1, 4, 2, D, 700, F32)
        a, _ = A._attention_decode(q[0], kc, vc, length=700, gate=g[0], order="shuffle", seed=rng.seed)
        b, _ = A._attention_decode(q[0], kc, vc, length=700, gate=g[0], order=order)
        np.testing.assert_array_equal(a, b)
        q, kc, vc, g = f32_case(rng, 11, 4, 2, D, 80, F32)
        a, _ = A._attention_prefill(q, kc, vc, position=60, gate=g, order="shuffle", seed=rng.seed)
        b, _ = A._attention_prefill(q, kc, vc, position=60, gate=g, order=order)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("D", [64, 40], ids=["vec-mma", "split-simd"])
def test_rows_past_the_causal_end_are_never_read(rng, D):
    """Cache rows past the last visible key (in the same cache block) hold NaN: every route's
    output is the one over finite rows, bit for bit."""
    length = 300
    q, kc, vc, g = f32_case(rng, 1, 4, 2, D, length + 20, F32)
    kn, vn = kc.copy(), vc.copy()
    kn[:, length:], vn[:, length:] = np.nan, np.nan
    np.testing.assert_array_equal(ops.attention_decode(q[0], kn, vn, length=length, gate=g[0]),
                                  ops.attention_decode(q[0], kc, vc, length=length, gate=g[0]))
    qp, _, _, gp = f32_case(rng, 9, 4, 2, D, length + 20, F32)
    np.testing.assert_array_equal(ops.attention_prefill(qp, kn, vn, position=length - 9, gate=gp),
                                  ops.attention_prefill(qp, kc, vc, position=length - 9, gate=gp))


def test_bf16_rounding_would_fail_the_bound(rng):
    """The same values through the bf16 cache (rounded on the way in) miss the fp32 bound that the
    f32 cache meets: the tests above see a rounding of K or V."""
    T, position, Hq, Hkv, D = 5, 300, 16, 2, 256
    q, kc, vc, g = f32_case(rng, T, Hq, Hkv, D, position + T, F32)
    r, _, vmag = ref.attention(q, kc, vc, position=position, gate=g)
    for prefill in (False, True):
        if prefill:
            got = ops.attention_prefill(q, kc, vc, position=position, gate=g)
            b16 = ops.attention_prefill(q, kc.astype(BF16), vc.astype(BF16), position=position, gate=g)
            want = r
        else:
            got = ops.attention_decode(q[-1], kc, vc, length=position + T, gate=g[-1])
            b16 = ops.attention_decode(q[-1], kc.astype(BF16), vc.astype(BF16), length=position + T, gate=g[-1])
            want = r[-1]
        e32, e16 = np.abs(got - want).max(), np.abs(b16 - want).max()
        assert e16 > 16 * e32, (prefill, e32, e16)


def test_bytes_touched_are_the_fp32_rows(rng):
    """The bound pools: 4 D bytes a row of K and of V instead of 2 D."""
    Hq, Hkv, D, length = 16, 2, 256, 700
    q, kc, vc, g = f32_case(rng, 1, Hq, Hkv, D, length, F32)
    _, s16 = A._attention_decode(q[0], kc.astype(BF16), vc.astype(BF16), length=length, gate=g[0], seed=rng.seed)
    _, s32 = A._attention_decode(q[0], kc, vc, length=length, gate=g[0], seed=rng.seed)
    rows = -(-length // 32) * 32
    assert s32["bytes_bound"] - s16["bytes_bound"] == 2 * rows * Hkv * (4 * D - 2 * D)


def test_errors_are_clear(rng):
    q, kc, vc, g = f32_case(rng, 1, 4, 2, 64, 50, F32)
    with pytest.raises(ValueError, match=r"must both be bfloat16 or both Q8Cache \(or both float32\)"):
        ops.attention_decode(q[0], kc, vc.astype(BF16), length=50)
    with pytest.raises(ValueError, match=r"k_cache must be a bfloat16 or float32 array"):
        ops.attention_prefill(q, kc.astype(np.float64), vc, position=0)
