"""Attention family on the emulator: rope, qk_norm_rope_append, attention decode (single and
split-K routes) and prefill, and the whole attention mixer, vs lily_py.reference.

Tolerances (u = 2^-24, the fp32 unit roundoff; bf16 outputs add rtol 2^-8 >= one bf16 rounding
2^-9 of |y|). Inputs are given exactly (bf16-rounded where the kernel sees bf16) to float64
references, so only the kernels' own fp32 rounding is measured:
* rope: angles are bit-identical (same fp32 product of the same fp32 inverse frequency); cos/sin
  of that angle are within a few ulp, and a*c - b*s adds three roundings: |err| <= 8 u (|a| + |b|).
  Features past rotary_dim are copied: exact.
* qk_norm_rope: the RMSNorm factor carries (4 sqrt(D) + 8) u relative error (see the rms_norm
  test), the rotation 8 u more, on magnitudes |n_i| + |n_{i+half}|. The keys are then rounded to
  bf16 in the cache: + 2^-8 relative. v is copied through one bf16 rounding: exact vs bf16(v).
* attention: a score's fp32 dot product errs by <= ~sqrt(D) u smag in practice (smag = scale *
  sum_d |q_d k_d|; allow 8 sqrt(D) u smag); a score error e changes the softmax weights by a
  relative 2e at most, so the output moves by <= 2e * vmag (vmag = sum_j p_j |v_j|). The online
  rescaling multiplies by one correction per block (nb blocks), the block sums and the running sum
  add <= 32 + nb roundings, exp / division / sigmoid a few: (64 + 2 nb + 2 splits) u vmag.
  Wrong masking, a missed or doubled key, a wrong KV head or split boundary moves the output by
  a sizeable fraction of vmag.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import lily_py._core as core
from kernel_checks import BF16_EPS, F32_EPS, assert_close, device, rng  # noqa: F401  (fixtures)
from lily_py.ops import attention as A
from lily_py import ops
from lily_py.reference import attention as ref_attention
from lily_py.reference import kernels as ref
from lily_py.reference import ops as ref_ops
from lily_py.reference import quant

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16]
SPLIT_KEYS = 256    # must match kAttnSplitKeys in shaders/common/args_attention.h (checked below)
MAX_SPLITS = 32     # kAttnMaxSplits
BLOCK_KEYS = 32     # kAttnBlockKeys
REAL = dict(q_heads=16, kv_heads=2, head_dim=256, rotary_dim=64, theta=1e7)


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def out_rtol(dtype):
    return 2 * BF16_EPS if np.dtype(dtype) == BF16 else 0.0


def sfx(dtype):
    return "bf16" if np.dtype(dtype) == BF16 else "f32"


# ------------------------------------------------------------------------------ routes
def test_constants_match_extension():
    assert core.ops.ATTN_SPLIT_KEYS == SPLIT_KEYS
    assert core.ops.ATTN_MAX_SPLITS == MAX_SPLITS
    assert core.ops.ATTN_BLOCK_KEYS == BLOCK_KEYS
    assert core.ops.ATTN_MAX_HEAD_DIM == 256 and core.ops.ATTN_MAX_GROUP == 8
    assert core.ops.ATTN_VEC_SIMDS == VEC_SIMDS and core.ops.ATTN_VEC_MAX_BLOCKS == VEC_MAX_BLOCKS


VEC_SIMDS = 8        # kAttnVecSimds
VEC_MAX_BLOCKS = 80  # kAttnVecMaxBlocks


def test_decode_route_rule():
    # head_dims other than 64 / 128 / 256: single up to 256 keys, then split-K (both sides).
    for D in (16, 40, 96, 255):
        assert ops.attention_decode_route(SPLIT_KEYS, D) == {"route": "single", "splits": 1, "split_keys": 0}
        assert ops.attention_decode_route(SPLIT_KEYS + 1, D)["route"] == "split"
    assert ops.attention_decode_route(MAX_SPLITS * SPLIT_KEYS, 40) == {"route": "split", "splits": MAX_SPLITS,
                                                                       "split_keys": SPLIT_KEYS}
    for n in list(range(1, 1200, 7)) + [8191, 8192, 8193, 100_000, 262_144]:
        r = ops.attention_decode_route(n, 40)
        if n <= SPLIT_KEYS:
            assert r["route"] == "single"
            continue
        s, k = r["splits"], r["split_keys"]
        assert 2 <= s <= MAX_SPLITS and k % BLOCK_KEYS == 0, (n, r)
        assert (s - 1) * k < n <= s * k, (n, r)  # every split non-empty, all keys covered
    # head_dim 64 / 128 / 256: the vec route at every length, blocks non-empty, each a power of
    # two keys (>= 8) inside one cache block of B keys; at most 2 min(80, ceil(n / 8)) per KV head
    # (the share of the 80 wanted rounded down), and past 160 cache blocks one per cache block.
    for D in (64, 128, 256):
        for B in (32, 64, 1024, 2048):
            for n in list(range(1, 1200, 7)) + [8, 9, 639, 640, 641, 8192, 100_000, 262_144]:
                r = ops.attention_decode_route(n, D, B)
                s, k = r["splits"], r["split_keys"]
                assert r["route"] == "vec" and k >= VEC_SIMDS and k & (k - 1) == 0 and B % k == 0, (n, B, r)
                assert (s - 1) * k < n <= s * k, (n, B, r)
                want = min(VEC_MAX_BLOCKS, -(-n // VEC_SIMDS))
                assert s <= max(2 * want, -(-n // B)) and (s >= want or k == B), (n, B, r)
                assert k == B or 2 * k > -(-n // want), (n, B, r)  # the largest power of two <= the share
                if n > 2 * VEC_MAX_BLOCKS * B:
                    assert k == B, (n, B, r)  # a threadgroup's work is one cache block at any length
            assert ops.attention_decode_route(80 * 8 * 4, D, B) == {"route": "vec", "splits": 80, "split_keys": 32}
        assert ops.attention_decode_route(262_144, D) == {"route": "vec", "splits": 256, "split_keys": 1024}
        assert ops.attention_decode_route(32_768, D) == {"route": "vec", "splits": 128, "split_keys": 256}


# ------------------------------------------------------------------------------ rope
def test_rope_inv_freq_is_the_reference_bit_for_bit():
    for rd, theta in [(64, 1e7), (16, 1e4), (2, 10.0), (128, 5e5)]:
        np.testing.assert_array_equal(core.ops.rope_inv_freq(rd, theta), ref.rope_inv_freq(rd, theta))
    # ... and the same angles as the model reference's cos/sin tables
    pos = np.array([0, 1, 4095, 100_000])
    cos, _ = ref_ops.rope_cos_sin(pos, 64, 1e7)
    np.testing.assert_array_equal(cos[:, :32], np.cos(ref.rope_angles(pos, 64, 1e7).astype(np.float64)).astype(np.float32))


def rope_atol(x, rotary_dim):
    """8 u (|a| + |b|) on rotated features, 0 on copied ones."""
    x64 = np.abs(np.asarray(x).astype(np.float64))
    half = rotary_dim // 2
    pair = x64[..., :half] + x64[..., half:rotary_dim]
    return 8 * F32_EPS * np.concatenate([pair, pair, np.zeros_like(x64[..., rotary_dim:])], axis=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,rotary_dim,theta,position", [
    ((3, 5, 40), 16, 1e4, 7),          # odd heads, head_dim not a multiple of 32
    ((2, 16, 256), 64, 1e7, 100_000),  # the model's q heads at a long-context position
    ((1, 3, 70), 70, 1e4, 0),          # full rotation, position 0 (identity)
    ((4, 2, 33), 2, 500.0, 3),         # one rotated pair, odd head_dim
])
def test_rope(rng, device, dtype, shape, rotary_dim, theta, position):
    x = rand(rng, shape, dtype, 2.0)
    y, stats = A._rope(x, position=position, rotary_dim=rotary_dim, theta=theta, device=device, seed=rng.seed)
    assert y.dtype == dtype and y.shape == x.shape
    assert list(stats["kernels"]) == [f"rope_{sfx(dtype)}"] and stats["dispatches"] == 1
    assert stats["threads"] == shape[0] * shape[1] * 32
    r = ref.rope(x, position=position, rotary_dim=rotary_dim, theta=theta)
    assert_close(y, r, atol=rope_atol(x, rotary_dim), rtol=out_rtol(dtype), what="rope", seed=rng.seed)
    np.testing.assert_array_equal(y[..., rotary_dim:], x[..., rotary_dim:])


# ------------------------------------------------------------------------------ qk_norm_rope_append
def qk_case(rng, T, Hq, Hkv, D, cap, x_dtype, w_dtype):
    qg = rand(rng, (T, Hq, 2 * D), x_dtype, 3.0)
    k = rand(rng, (T, Hkv, D), x_dtype, 3.0)
    v = rand(rng, (T, Hkv, D), x_dtype)
    qn = rand(rng, (D,), w_dtype, 0.5)
    kn = rand(rng, (D,), w_dtype, 0.5)
    kc = rand(rng, (Hkv, cap, D), BF16)  # rows not written must survive unchanged
    vc = rand(rng, (Hkv, cap, D), BF16)
    return qg, k, v, qn, kn, kc, vc


@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=["wf32", "wbf16"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dims", [
    dict(T=3, Hq=6, Hkv=2, D=40, rd=10, theta=1e4, position=4, cap=9),
    dict(T=2, Hq=16, Hkv=2, D=256, rd=64, theta=1e7, position=1000, cap=1003),  # real head dims
], ids=["odd", "real"])
def test_qk_norm_rope_append(rng, device, x_dtype, w_dtype, offset, dims):
    d = dims
    qg, k, v, qn, kn, kc, vc = qk_case(rng, d["T"], d["Hq"], d["Hkv"], d["D"], d["cap"], x_dtype, w_dtype)
    q, kc2, vc2, stats = A._qk_norm_rope_append(qg, k, v, qn, kn, kc, vc, position=d["position"], rotary_dim=d["rd"],
                                                theta=d["theta"], eps=1e-6, weight_offset=offset, device=device,
                                                seed=rng.seed)
    assert list(stats["kernels"]) == [f"qk_norm_rope_x{sfx(x_dtype)}_w{sfx(w_dtype)}"]
    assert stats["dispatches"] == 1 and stats["threads"] == (d["Hq"] + d["Hkv"]) * d["T"] * 32
    rq, rk = ref.qk_norm_rope(qg, k, qn, kn, position=d["position"], rotary_dim=d["rd"], theta=d["theta"],
                              eps=1e-6, weight_offset=offset)
    D, rd = d["D"], d["rd"]

    def atol(x, w):
        n = ref.rms_norm(x, w, eps=1e-6, weight_offset=offset)
        return rope_atol(n, rd) / 8 * (4 * np.sqrt(D) + 16) + (4 * np.sqrt(D) + 8) * F32_EPS * np.abs(
            np.concatenate([np.zeros_like(n[..., :rd]), n[..., rd:]], axis=-1))

    assert q.dtype == x_dtype and q.shape == (d["T"], d["Hq"], D)
    assert_close(q, rq, atol=atol(qg[..., :D], qn), rtol=out_rtol(x_dtype), what="q", seed=rng.seed)
    rows = slice(d["position"], d["position"] + d["T"])
    assert_close(kc2[:, rows], rk.transpose(1, 0, 2), atol=atol(k, kn).transpose(1, 0, 2), rtol=2 * BF16_EPS,
                 what="k_cache rows", seed=rng.seed)
    np.testing.assert_array_equal(vc2[:, rows], v.astype(np.float32).astype(BF16).transpose(1, 0, 2))
    untouched = np.ones(d["cap"], bool)
    untouched[rows] = False
    np.testing.assert_array_equal(kc2[:, untouched], kc[:, untouched])
    np.testing.assert_array_equal(vc2[:, untouched], vc[:, untouched])


# ------------------------------------------------------------------------------ attention
def attn_case(rng, T, Hq, Hkv, D, cap, dtype, gate=True):
    q = rand(rng, (T, Hq, D), dtype, 1.5)
    kc = rand(rng, (Hkv, cap, D), BF16, 1.5)
    vc = rand(rng, (Hkv, cap, D), BF16)
    g = rand(rng, (T, Hq, D), dtype, 2.0) if gate else None
    return q, kc, vc, g


def check_attention(rng, out, q, kc, vc, g, position, what):
    r, smag, vmag = ref.attention(q, kc, vc, position=position, gate=g)
    D = q.shape[-1]
    S = position + q.shape[0]
    nb = -(-S // BLOCK_KEYS)
    splits = MAX_SPLITS
    atol = (8 * np.sqrt(D) * F32_EPS * smag + (64 + 2 * nb + 2 * splits) * F32_EPS) * vmag
    assert_close(out, r, atol=atol, rtol=out_rtol(q.dtype), what=what, seed=rng.seed)


# Context lengths on both sides of the single/split switch (256 | 257) and of the split cap,
# at the model's head shapes.
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("length", [1, 2, 255, 256, 257, 3001])
def test_attention_decode_real_heads(rng, device, dtype, length):
    Hq, Hkv, D = REAL["q_heads"], REAL["kv_heads"], REAL["head_dim"]
    q, kc, vc, g = attn_case(rng, 1, Hq, Hkv, D, length + 5, dtype)
    out, stats = A._attention_decode(q[0], kc, vc, length=length, gate=g[0], device=device, seed=rng.seed)
    assert out.dtype == dtype and out.shape == (Hq, D)
    route = ops.attention_decode_route(length, D, A.DEFAULT_OP_BLOCK_TOKENS)
    assert route["route"] == "vec"
    assert list(stats["kernels"]) == [f"attn_decode_vec_e8_{sfx(dtype)}", f"attn_vec_combine_e8_{sfx(dtype)}"]
    assert stats["dispatches"] == 2 and stats["barriers"] == 1
    assert stats["threads"] == Hkv * route["splits"] * 256 + Hq * (D // 32) * 256  # combine: (head, 32-dim chunk)
    check_attention(rng, out[None], q, kc, vc, g, length - 1, f"decode L={length}")


@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 40), (3, 3, 24), (8, 1, 37), (5, 1, 256), (3, 1, 64), (7, 7, 128),
                                       (12, 2, 64)],
                         ids=["g3-D40", "g1-D24", "g8-D37", "g5-D256", "g3-D64", "g1-D128", "g6-D64"])
@pytest.mark.parametrize("length", [1, 7, 33, 256, 257, 600, 641])
def test_attention_decode_odd_shapes(rng, device, Hq, Hkv, D, length):
    q, kc, vc, g = attn_case(rng, 1, Hq, Hkv, D, length + 1, np.float32, gate=length % 2 == 1)
    out, _ = A._attention_decode(q[0], kc, vc, length=length, gate=None if g is None else g[0], device=device,
                                 seed=rng.seed)
    check_attention(rng, out[None], q, kc, vc, g, length - 1, f"decode Hq={Hq} Hkv={Hkv} D={D} L={length}")


@pytest.mark.parametrize("length", [MAX_SPLITS * SPLIT_KEYS, MAX_SPLITS * SPLIT_KEYS + 1, 9001])
def test_attention_decode_split_cap(rng, device, length):
    # At 8192 keys 32 splits of 256; beyond, at most 32 splits of more keys each (rounded to blocks).
    q, kc, vc, g = attn_case(rng, 1, 2, 1, 32, length, np.float32)
    out, stats = A._attention_decode(q[0], kc, vc, length=length, gate=g[0], device=device, seed=rng.seed)
    route = ops.attention_decode_route(length, 32)
    assert route["split_keys"] > SPLIT_KEYS or length == MAX_SPLITS * SPLIT_KEYS
    assert stats["threads"] == route["splits"] * 64 + 2 * 32
    check_attention(rng, out[None], q, kc, vc, g, length - 1, f"decode L={length}")


def rising_case(rng, Hq, Hkv, D, length, dtype):
    """Scores that climb from about -1.3 sqrt(D) to 4 sqrt(D) along the keys, with noise: the
    softmax base of the vec route (kAttnVecRebase) must move many times within each simdgroup's
    keys, where random inputs move it only at the first key."""
    u = rng.choice([-1.0, 1.0], size=D)
    q = (u + 0.1 * rng.standard_normal((1, Hq, D))).astype(np.float32).astype(dtype)
    c = np.linspace(-1.3, 4.0, length + 1)
    c[: length // 3] = rng.permutation(c[: length // 3])  # falling and rising too
    kc = (c[None, :, None] * u + 0.3 * rng.standard_normal((Hkv, length + 1, D))).astype(np.float32)
    vc = rng.standard_normal((Hkv, length + 1, D)).astype(np.float32)
    return q, kc, vc, rand(rng, (1, Hq, D), dtype, 2.0)


@pytest.mark.parametrize("kv", ["bf16", "q8", "f32"])
@pytest.mark.parametrize("D,Hq,Hkv,length", [(64, 6, 2, 700), (128, 4, 1, 77), (256, 16, 2, 3001)],
                         ids=["e2", "e4", "e8"])
def test_attention_decode_vec_rising_scores(rng, device, kv, D, Hq, Hkv, length):
    from test_attention_q8 import Q8Cache
    q, kc, vc, g = rising_case(rng, Hq, Hkv, D, length, np.float32)
    if kv == "bf16":
        kc, vc = kc.astype(BF16), vc.astype(BF16)
        kref, vref = kc, vc
    elif kv == "q8":
        kc, vc = Q8Cache.quantize(kc), Q8Cache.quantize(vc)
        kref, vref = kc.values(), vc.values()
    else:
        kref, vref = kc, vc
    out, stats = A._attention_decode(q[0], kc, vc, length=length, gate=g[0], device=device, seed=rng.seed)
    pre = {"bf16": "", "q8": "q8_", "f32": "kvf32_"}[kv]
    assert list(stats["kernels"])[0] == f"attn_decode_vec_{pre}e{D // 32}_f32"
    G = Hq // Hkv
    s = np.stack([np.asarray(kref[h, :length], np.float32) @ np.asarray(q[0, h * G], np.float32) for h in range(Hkv)])
    assert (s.max() - s[:, :8].max()) / np.sqrt(D) > 3 * 8, "the scores do not climb past the base three times"
    check_attention(rng, out[None], q, kref, vref, g, length - 1, f"rising scores {kv} D={D} L={length}")


def test_attention_decode_ignores_rows_past_length(rng):
    q, kc, vc, g = attn_case(rng, 1, 4, 2, 64, 300, np.float32)
    a = ops.attention_decode(q[0], kc, vc, length=270, gate=g[0])
    kc2, vc2 = kc.copy(), vc.copy()
    kc2[:, 270:] = np.float32(1e4)
    vc2[:, 270:] = np.float32(-1e4)
    np.testing.assert_array_equal(a, ops.attention_decode(q[0], kc2, vc2, length=270, gate=g[0]))


def test_prefill_route_rule():
    # mma: head_dim a multiple of 32 (of 64 above 128, so each of 2 passes stages a multiple of 32)
    assert [ops.attention_prefill_route(d) for d in (32, 64, 96, 128, 192, 256)] == ["mma"] * 6
    assert [ops.attention_prefill_route(d) for d in (16, 24, 40, 100, 160, 224)] == ["simd"] * 6
    # bf16 activations at head_dim 64, 128, 256: the bf16 tiles (test_attention_tiles.py)
    assert [ops.attention_prefill_route(d, dtype=BF16) for d in (32, 64, 96, 128, 192, 256)] == \
        ["mma", "tiles", "mma", "tiles", "mma", "tiles"]


# Both prefill routes (mma: head_dim 64, 96, 256; simd: 16, 24, 33, 40, 160), every group size
# shape of the mma row packing (group 1: 32 tokens per threadgroup, 3: 10 tokens + 2 padding
# rows, 8: 4 tokens), partial token blocks, chunks after an existing cache.
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("T,position,Hq,Hkv,D", [
    (5, 3, 16, 2, 256),    # real heads (mma, 2 V passes), a partial block
    (9, 0, 6, 2, 40),      # simd: first chunk of a prompt, odd sizes
    (4, 37, 3, 3, 24),     # simd: a second chunk attending to the first, g = 1
    (7, 290, 8, 1, 33),    # simd: past a 256-key context, 2 blocks of queries, g = 8
    (1, 12, 4, 2, 16),     # simd: one token through the prefill kernel
    (23, 41, 6, 2, 64),    # mma: g = 3 (10 tokens + 2 padding rows per threadgroup), 3 threadgroups
    (40, 5, 2, 2, 96),     # mma: g = 1, 32 tokens per threadgroup, 2 threadgroups
    (9, 70, 8, 1, 64),     # mma: g = 8, 4 tokens per threadgroup
    (6, 2, 4, 2, 160),     # simd: 160 > 128 and not a multiple of 64
], ids=lambda v: str(v))
def test_attention_prefill(rng, device, dtype, T, position, Hq, Hkv, D):
    q, kc, vc, g = attn_case(rng, T, Hq, Hkv, D, position + T + 2, dtype, gate=T % 2 == 1)
    out, stats = A._attention_prefill(q, kc, vc, position=position, gate=g, device=device, seed=rng.seed)
    group = Hq // Hkv
    route = ops.attention_prefill_route(D, dtype=dtype)
    if route == "tiles":  # bf16 at head_dim 64 / 256: checked with its P rounding bound
        assert list(stats["kernels"]) == [f"attn_prefill_tiles_d{D}_bf16"]
        from test_attention_tiles import bound
        r, atol = bound(q, kc, vc, g, position)
        assert_close(out, r, atol=atol, rtol=out_rtol(dtype), what=f"prefill tiles T={T} D={D}", seed=rng.seed)
        return
    if route == "mma":
        assert list(stats["kernels"]) == [f"attn_prefill_mma_{sfx(dtype)}"]
        assert stats["threads"] == Hkv * -(-T // (32 // group)) * 128
    else:
        assert list(stats["kernels"]) == [f"attn_prefill_{sfx(dtype)}"]
        assert stats["threads"] == Hkv * -(-T // 4) * 32 * group
    assert stats["dispatches"] == 1
    check_attention(rng, out, q, kc, vc, g, position, f"prefill T={T} position={position} D={D}")


def test_prefill_equals_looped_decode_bitwise(rng):
    # Same blocks, same per-row arithmetic: on the single route the two kernels agree exactly.
    T, position, Hq, Hkv, D = 6, 100, 4, 2, 48
    q, kc, vc, g = attn_case(rng, T, Hq, Hkv, D, position + T, np.float32)
    pre = ops.attention_prefill(q, kc, vc, position=position, gate=g)
    for t in range(T):
        dec = ops.attention_decode(q[t], kc, vc, length=position + t + 1, gate=g[t])
        np.testing.assert_array_equal(pre[t], dec)


@pytest.mark.parametrize("order", ["forward", "reverse", "ahead"])
def test_attention_independent_of_thread_order(rng, order):
    # No races: vec and split decode and both prefill routes give bit-identical results in any order.
    for D in (64, 40):  # vec, split
        q, kc, vc, g = attn_case(rng, 1, 4, 2, D, 700, np.float32)
        a, _ = A._attention_decode(q[0], kc, vc, length=700, gate=g[0], order="shuffle", seed=rng.seed)
        b, _ = A._attention_decode(q[0], kc, vc, length=700, gate=g[0], order=order)
        np.testing.assert_array_equal(a, b)
    for D in (64, 40):  # mma, simd
        q, kc, vc, g = attn_case(rng, 11, 4, 2, D, 80, np.float32)
        a, _ = A._attention_prefill(q, kc, vc, position=60, gate=g, order="shuffle", seed=rng.seed)
        b, _ = A._attention_prefill(q, kc, vc, position=60, gate=g, order=order)
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------ the whole mixer
class _Cfg:
    def __init__(self, Hq, Hkv, D, rd, theta, eps=1e-6):
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = Hq, Hkv, D
        self.rotary_dim, self.rope_theta, self.rms_norm_eps = rd, theta, eps


class _Lin:
    def __init__(self, w):
        self.w = w

    def matmul(self, x):
        return (x @ self.w.T).astype(np.float32)


class _W:
    pass


def mixer_case(rng, hidden, Hq, Hkv, D, scale_dtype=BF16):
    weights, dense = {}, _W()
    for name, n, k in [("q_proj", Hq * 2 * D, hidden), ("k_proj", Hkv * D, hidden), ("v_proj", Hkv * D, hidden),
                       ("o_proj", hidden, Hq * D)]:
        w, s, b = quant.quantize(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), bits=4,
                                 group_size=64, scale_dtype=scale_dtype)
        weights[name] = (w, s, b)
        setattr(dense, name, _Lin(quant.dequantize(w, s, b, bits=4, group_size=64).astype(np.float32)))
    weights["q_norm"] = rand(rng, (D,), BF16, 0.3) + BF16.type(1.0)
    weights["k_norm"] = rand(rng, (D,), BF16, 0.3) + BF16.type(1.0)
    dense.q_norm = weights["q_norm"].astype(np.float32)
    dense.k_norm = weights["k_norm"].astype(np.float32)
    return weights, dense


def mixer_bound(x, dense, cfg, cache_k, cache_v, position):
    """Error bound of the device mixer vs the float32 model oracle: dominated by the bf16 KV cache
    (each key/value rounded, relative 2^-9): scores move by <= 2^-9 smag (q fp32, k rounded), the
    softmax weights by 2 * 2^-9 smag relative, values by 2^-9 -> attention output by
    2^-9 (1 + 2 smag) vmag; o_proj sums those with weights |W_o|, plus fp32 matmul rounding
    (8 sqrt(K) u on |x| |W|) - doubled for margin (rounding of k that is itself off by ~u can
    flip a bf16 rounding)."""
    T = x.shape[0]
    D, Hq = cfg.head_dim, cfg.num_attention_heads
    qg = x.astype(np.float64) @ dense.q_proj.w.T.astype(np.float64)
    q = ref.rms_norm(qg.reshape(T, Hq, 2 * D)[..., :D], dense.q_norm, eps=cfg.rms_norm_eps)
    q = ref.rope(q, position=position, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta)
    gate = qg.reshape(T, Hq, 2 * D)[..., D:]
    _, smag, vmag = ref.attention(q, cache_k, cache_v, position=position, gate=gate)
    attn_err = 2 * 2.0 ** -9 * (1 + 2 * smag) * vmag
    wo = np.abs(dense.o_proj.w.astype(np.float64))
    mm = 8 * np.sqrt(wo.shape[1]) * F32_EPS * (np.abs(x) @ np.abs(dense.q_proj.w.T)).max()
    return attn_err.reshape(T, Hq * D) @ wo.T + mm


def run_mixer_chunks(rng, chunks, hidden, Hq, Hkv, D, rd, theta, offset=0.0):
    cfg = _Cfg(Hq, Hkv, D, rd, theta)
    weights, dense = mixer_case(rng, hidden, Hq, Hkv, D)
    if offset:  # Hugging Face convention: the device adds the 1, the oracle gets the multiplier
        weights = dict(weights, q_norm=(weights["q_norm"].astype(np.float32) - 1).astype(BF16),
                       k_norm=(weights["k_norm"].astype(np.float32) - 1).astype(BF16))
        dense.q_norm = weights["q_norm"].astype(np.float32) + 1
        dense.k_norm = weights["k_norm"].astype(np.float32) + 1
    total = sum(chunks)
    cap = total + 3
    kc = np.zeros((Hkv, cap, D), BF16)
    vc = np.zeros((Hkv, cap, D), BF16)
    cache = ref_attention.KVCache()
    x_all = rand(rng, (total, hidden), np.float32)
    position, stats_all = 0, []
    for n in chunks:
        x = x_all[position:position + n]
        out, kc, vc, stats = A._attention_mixer(x, weights, kc, vc, position=position, q_heads=Hq, rotary_dim=rd,
                                                theta=theta, eps=1e-6, weight_offset=offset, seed=rng.seed)
        r = ref_attention.attention_layer(x, dense, cfg, cache, position)
        ck = cache.k[:cache.length].transpose(1, 0, 2)
        cv = cache.v[:cache.length].transpose(1, 0, 2)
        bound = mixer_bound(x, dense, cfg, ck, cv, position)
        assert_close(out, r, atol=bound, rtol=0, what=f"mixer chunk at {position} (+{n})", seed=rng.seed)
        position += n
        stats_all.append(stats)
    # the cache holds the oracle's keys/values (rounded to bf16)
    assert_close(kc[:, :total], cache.k[:total].transpose(1, 0, 2), atol=1e-4, rtol=2 * BF16_EPS,
                 what="k cache", seed=rng.seed)
    return stats_all


def test_mixer_chunked_prefill_then_decode(rng):
    # chunk 2 attends to chunk 1 through the cache (its projections take the tiled qmm route:
    # 11 rows > 8), then decode steps (vec route at head_dim 64: attention + combine)
    stats = run_mixer_chunks(rng, [5, 11, 1, 1], hidden=128, Hq=4, Hkv=2, D=64, rd=16, theta=1e4, offset=1.0)
    assert [s["dispatches"] for s in stats] == [6, 6, 7, 7]


def test_mixer_chunking_does_not_change_the_result(rng):
    # A prompt prefilled in chunks of 9 + 10 + 11 equals the same prompt in one chunk of 30, bit for
    # bit: every chunk takes the qmm route (a row's sum order does not depend on M), a query row
    # walks the same 32-key blocks from key 0 whatever chunk it is in, and keys it cannot see
    # contribute exact zeros.
    Hq, Hkv, D, hidden = 4, 2, 32, 64
    weights, _ = mixer_case(rng, hidden, Hq, Hkv, D)
    x = rand(rng, (30, hidden), np.float32)
    empty = np.zeros((Hkv, 32, D), BF16)
    kw = dict(q_heads=Hq, rotary_dim=8, theta=1e4)
    one, k1, v1 = ops.attention_mixer(x, weights, empty, empty, position=0, **kw)
    kc, vc, outs, pos = empty, empty, [], 0
    for n in (9, 10, 11):
        o, kc, vc = ops.attention_mixer(x[pos:pos + n], weights, kc, vc, position=pos, **kw)
        outs.append(o)
        pos += n
    np.testing.assert_array_equal(np.concatenate(outs), one)
    np.testing.assert_array_equal(kc, k1)
    np.testing.assert_array_equal(vc, v1)


def test_mixer_decode_dispatch_counts_both_routes(rng):
    # 3 projections | qk_norm_rope | attention (1, or split + combine) | o_proj
    stats = run_mixer_chunks(rng, [SPLIT_KEYS - 1, 1, 1], hidden=64, Hq=2, Hkv=1, D=32, rd=8, theta=1e4)
    short, long_ = stats[1], stats[2]  # contexts of 256 (single route) and 257 keys (split route)
    assert (short["dispatches"], short["barriers"]) == (6, 3)
    assert (long_["dispatches"], long_["barriers"]) == (7, 4)


def fuse_qkv(weights):
    """q/k/v projections row-concatenated into one matrix, as a loader would fuse them."""
    parts = [weights[n] for n in ("q_proj", "k_proj", "v_proj")]
    fused = {k: v for k, v in weights.items() if k not in ("q_proj", "k_proj", "v_proj")}
    fused["qkv_proj"] = tuple(np.concatenate([p[i] for p in parts]) for i in range(3))
    return fused


@pytest.mark.parametrize("chunks", [[3, 1], [SPLIT_KEYS, 1], [12]], ids=["decode", "decode-split", "prefill-qmm"])
def test_mixer_fused_qkv_projection(rng, chunks):
    # One matmul over row-concatenated q/k/v weights gives bit-identical results (an output's sum
    # does not depend on the other weight rows), with two dispatches fewer and the same barriers.
    Hq, Hkv, D, hidden = 4, 2, 32, 64
    weights, _ = mixer_case(rng, hidden, Hq, Hkv, D)
    fused = fuse_qkv(weights)
    x = rand(rng, (sum(chunks), hidden), np.float32)
    kw = dict(q_heads=Hq, rotary_dim=8, theta=1e4, seed=rng.seed)
    caches = [np.zeros((Hkv, sum(chunks), D), BF16)] * 2
    kc_a, vc_a = kc_b, vc_b = caches
    pos = 0
    for n in chunks:
        a, kc_a, vc_a, sa = A._attention_mixer(x[pos:pos + n], weights, kc_a, vc_a, position=pos, **kw)
        b, kc_b, vc_b, sb = A._attention_mixer(x[pos:pos + n], fused, kc_b, vc_b, position=pos, **kw)
        np.testing.assert_array_equal(a, b)
        assert sb["dispatches"] == sa["dispatches"] - 2 and sb["barriers"] == sa["barriers"]
        pos += n
    np.testing.assert_array_equal(kc_a, kc_b)
    np.testing.assert_array_equal(vc_a, vc_b)
    split = chunks[-1] == 1 and ops.attention_decode_route(pos, D)["route"] != "single"
    assert (sb["dispatches"], sb["barriers"]) == ((5, 4) if split else (4, 3))


def test_mixer_real_shapes_decode(rng):
    # The model's attention layer: hidden 2048, 16 / 2 heads of 256, rotary 64, theta 1e7.
    stats = run_mixer_chunks(rng, [3, 1], hidden=2048, Hq=16, Hkv=2, D=256, rd=64, theta=1e7)
    assert (stats[1]["dispatches"], stats[1]["barriers"]) == (7, 4)  # vec route: attention + combine


# ------------------------------------------------------------------------------ bad input
def test_bad_input_raises_clear_errors(rng):
    q, kc, vc, g = attn_case(rng, 1, 4, 2, 16, 10, np.float32)
    with pytest.raises(ValueError, match="length must be in"):
        ops.attention_decode(q[0], kc, vc, length=11)
    with pytest.raises(ValueError, match="length must be in"):
        ops.attention_decode(q[0], kc, vc, length=0)
    with pytest.raises(ValueError, match="k_cache must be a bfloat16 or float32 array"):
        ops.attention_decode(q[0], kc.astype(np.float64), vc, length=3)
    with pytest.raises(ValueError, match="q_heads=4 must be a multiple of kv_heads=3"):
        ops.attention_decode(q[0], kc[:1].repeat(3, 0), vc[:1].repeat(3, 0), length=3)
    with pytest.raises(ValueError, match="gate must match q"):
        ops.attention_decode(q[0], kc, vc, length=3, gate=g[0, :2])
    with pytest.raises(ValueError, match="rows up to 10 needed"):
        ops.attention_prefill(q.repeat(3, 0), kc, vc, position=8)
    with pytest.raises(ValueError, match="head_dim=300 > 256"):
        ops.attention_decode(np.zeros((2, 300), np.float32), np.zeros((1, 4, 300), BF16),
                             np.zeros((1, 4, 300), BF16), length=1)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        ops.rope(np.zeros((1, 1, 8), np.float32), position=0, rotary_dim=3, theta=1e4)
    with pytest.raises(ValueError, match="rotary_dim must be even and <= head_dim"):
        ops.rope(np.zeros((1, 1, 8), np.float32), position=0, rotary_dim=10, theta=1e4)
    with pytest.raises(ValueError, match="position must be a non-negative integer"):
        ops.rope(np.zeros((1, 1, 8), np.float32), position=-1, rotary_dim=4, theta=1e4)
    qg, k, v, qn, kn, kc2, vc2 = qk_case(rng, 2, 4, 2, 16, 5, np.float32, np.float32)
    with pytest.raises(ValueError, match=r"rows 4..5 do not fit a cache of capacity 5"):
        ops.qk_norm_rope_append(qg, k, v, qn, kn, kc2, vc2, position=4, rotary_dim=8, theta=1e4)
    with pytest.raises(ValueError, match="must have the same dtype"):
        ops.qk_norm_rope_append(qg, k.astype(BF16), v, qn, kn, kc2, vc2, position=0, rotary_dim=8, theta=1e4)
    with pytest.raises(ValueError, match="device must be 'emu', 'metal' or 'cuda'"):
        ops.attention_decode(q[0], kc, vc, length=3, device="gpu")
