"""The paged KV cache on the emulator: the KV write (qk_norm_rope) and every attention route read
through a block table (shaders/common/kv_blocks.h) with small blocks, scrambled tables and pools
larger than the table (the unmapped blocks hold NaN, so a read through a wrong entry fails the
call). Positions, lengths and chunks straddle block boundaries. The bounds are test_attention.py's.
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py._core as core
from kernel_checks import BF16_EPS, DEVICES, assert_close, rng  # noqa: F401  (fixture)
from lily_py import ops
from lily_py.ops import attention as A
from lily_py.reference import kernels as ref
from lily_py.testing import simulated_device
from test_attention import BF16, attn_case, check_attention, qk_case, sfx


def scrambled(rng, length, B):
    """A table for `length` positions at B tokens a block into a pool of twice as many blocks."""
    nb = -(-length // B)
    return rng.permutation(2 * nb + 1)[:nb].astype(np.uint32)


def test_min_block_matches_extension():
    assert core.ops.ATTN_KV_MIN_BLOCK == 32


# Decode: vec (D 64), single and split (D 40) routes; lengths on both sides of block edges, and
# (B = 32) past 160 cache blocks, where each threadgroup reads exactly one cache block.
@pytest.mark.parametrize("B", [32, 64])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 6, 2), (40, 4, 1)], ids=["vec", "split"])
@pytest.mark.parametrize("length", [31, 32, 33, 97, 129, 300, 5300])
@pytest.mark.parametrize("device", DEVICES)
def test_decode_across_blocks(rng, B, D, Hq, Hkv, length, device):
    q, kc, vc, g = attn_case(rng, 1, Hq, Hkv, D, length + 3, np.float32)
    table = scrambled(rng, length + 3, B)
    out, stats = A._attention_decode(q[0], kc, vc, length=length, gate=g[0], seed=rng.seed, block_tokens=B,
                                     block_table=table, device=device)
    route = ops.attention_decode_route(length, D, B)
    if route["route"] == "vec":
        assert stats["threads"] == Hkv * route["splits"] * 256 + Hq * (D // 32) * 256
        assert B % route["split_keys"] == 0
        if length > 2 * 80 * B:
            assert route["split_keys"] == B and route["splits"] == -(-length // B)
    check_attention(rng, out[None], q, kc, vc, g, length - 1, f"paged decode B={B} D={D} L={length}")


PREFILL = [  # (route, dtype, D, tensor_ops)
    ("mma", np.dtype(np.float32), 64, False),
    ("simd", np.dtype(np.float32), 40, False),
    ("tiles", BF16, 64, False),
    ("m5", np.dtype(np.float32), 64, True),
]


def prefill(rng, q, kc, vc, g, position, tensor_ops, **kw):
    if tensor_ops:
        with simulated_device(tensor_ops=True):
            return A._attention_prefill(q, kc, vc, position=position, gate=g, seed=rng.seed, **kw)
    return A._attention_prefill(q, kc, vc, position=position, gate=g, seed=rng.seed, **kw)


# Prefill: a chunk at an odd position straddling two block edges; the result is bit-identical to
# the same chunk over one identity-mapped block (the table changes addresses, never the math), and
# within the reference's bound.
def _on_devices(cases):
    """`cases` on every device of DEVICES; the tensor-op route only on the emulator (it simulates them)."""
    out = []
    for d in DEVICES:
        name, marks = (d, ()) if isinstance(d, str) else (d.values[0], d.marks)
        out += [pytest.param(*c, name, marks=marks, id=f"{c[0]}-{name}") for c in cases if name == "emu" or not c[3]]
    return out


@pytest.mark.parametrize("route,dtype,D,tensor_ops,device", _on_devices(PREFILL))
@pytest.mark.parametrize("position,T", [(45, 50), (0, 33), (63, 2)])
def test_prefill_across_blocks(rng, route, dtype, D, tensor_ops, device, position, T):
    Hq, Hkv = 4, 2
    cap = position + T + 1
    q, kc, vc, g = attn_case(rng, T, Hq, Hkv, D, cap, dtype)
    table = scrambled(rng, cap, 32)
    out, stats = prefill(rng, q, kc, vc, g, position, tensor_ops, block_tokens=32, block_table=table, device=device)
    assert list(stats["kernels"])[0].startswith(
        {"mma": "attn_prefill_mma", "simd": f"attn_prefill_{sfx(dtype)}", "tiles": "attn_prefill_tiles",
         "m5": "attn_prefill_m5"}[route])
    whole, _ = prefill(rng, q, kc, vc, g, position, tensor_ops, block_tokens=128, block_table=np.zeros(1, np.uint32),
                       device=device)
    np.testing.assert_array_equal(out.view(np.uint8), whole.view(np.uint8))
    if route == "simd" or route == "mma":
        check_attention(rng, out, q, kc, vc, g, position, f"paged prefill {route}")
    else:  # bf16 P (tiles) or half operands (m5): their own tests hold the tight bounds
        r, _, vmag = ref.attention(q, kc, vc, position=position, gate=g)
        assert_close(out, r, atol=2.0 ** -7 * vmag, rtol=2 * BF16_EPS, what=f"paged prefill {route}", seed=rng.seed)


# The KV write: a chunk at position 29 of 40 tokens crosses two edges of 32-token blocks; rows land
# in the mapped blocks (read back through the table), other rows keep their values, and the pool
# blocks outside the table stay untouched (NaN).
@pytest.mark.parametrize("position,T", [(29, 40), (31, 1), (32, 1), (0, 65)])
@pytest.mark.parametrize("device", DEVICES)
def test_kv_write_across_blocks(rng, position, T, device):
    Hq, Hkv, D, rd = 4, 2, 64, 16
    cap = position + T + 7
    qg, k, v, qn, kn, kc, vc = qk_case(rng, T, Hq, Hkv, D, cap, np.float32, np.float32)
    table = scrambled(rng, cap, 32)
    if table.max() < len(table):  # the draw took exactly blocks 0..nb-1 (a pool with no block outside it)
        table[rng.integers(len(table))] = 2 * len(table)
    _, kc2, vc2, _ = A._qk_norm_rope_append(qg, k, v, qn, kn, kc, vc, position=position, rotary_dim=rd, theta=1e4,
                                            seed=rng.seed, block_tokens=32, block_table=table, device=device)
    _, kc1, vc1, _ = A._qk_norm_rope_append(qg, k, v, qn, kn, kc, vc, position=position, rotary_dim=rd, theta=1e4,
                                            seed=rng.seed, block_tokens=512, block_table=np.zeros(1, np.uint32), device=device)
    np.testing.assert_array_equal(kc2.view(np.uint16), kc1.view(np.uint16))
    np.testing.assert_array_equal(vc2.view(np.uint16), vc1.view(np.uint16))
    rows = slice(position, position + T)
    np.testing.assert_array_equal(vc2[:, rows], v.transpose(1, 0, 2).astype(BF16))
    keep = np.ones(cap, bool)
    keep[rows] = False
    np.testing.assert_array_equal(kc2[:, keep].view(np.uint16), kc[:, keep].view(np.uint16))
    # The raw pools: blocks outside the table are never written.
    kp, vp, t = A._page(kc.view(np.uint16), vc.view(np.uint16), 32, table, "test")
    _, kpo, vpo, _ = core.ops.qk_norm_rope(
        qg, k, v, qn, kn, kp, vp, t, position=position, rotary_dim=rd, theta=1e4, eps=1e-6, weight_offset=0.0,
        x_dtype="float32", w_dtype="float32")
    unmapped = np.setdiff1d(np.arange(kp.shape[0]), table)
    assert unmapped.size > 0
    assert (kpo[unmapped] == A.BF16_NAN).all() and (vpo[unmapped] == A.BF16_NAN).all()


def test_bad_paging_raises_clear_errors(rng):
    q, kc, vc, g = attn_case(rng, 1, 2, 1, 64, 70, np.float32)
    with pytest.raises(ValueError, match=r"block_tokens must be a power of two >= 32, got 48"):
        A.attention_decode(q[0], kc, vc, length=70, block_tokens=48)
    with pytest.raises(ValueError, match=r"block_table must be 3 or more"):
        A.attention_decode(q[0], kc, vc, length=70, block_tokens=32, block_table=[0, 1])
    with pytest.raises(ValueError, match=r"maps two logical blocks to one pool block"):
        A.attention_decode(q[0], kc, vc, length=70, block_tokens=32, block_table=[0, 1, 1])
    kp, vp, _ = A._page(kc.view(np.uint16), vc.view(np.uint16), 32, [0, 1, 2], "test")
    with pytest.raises(ValueError, match=r"block_table\[1\] = 7 is not a block of the pool \(3 blocks\)"):
        core.ops.attention(q, kp, vp, np.array([0, 7, 2], np.uint32), None, position=69, decode=True, dtype="float32")
    with pytest.raises(ValueError, match=r"positions up to 69 need 3 block table entries, the table has 2"):
        core.ops.attention(q, kp, vp, np.array([0, 1], np.uint32), None, position=69, decode=True, dtype="float32")
