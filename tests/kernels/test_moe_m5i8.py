"""The MoE 64-row tiles with int8 activations (shaders/m5/moe_m5.metal: moe_gate_up_m5i8 /
moe_down_m5i8) on the emulator under simulated_device(tensor_ops=True, tensor_int8=True), vs
float64 references.

What the kernels compute (their header comment): in a 64-row tile, x (gate / up) and h (down) are
quantized per row and 32 columns as lily_py.reference.kernels.int8_rows does (s = max |v| / 127,
codes rint(v / s)) by quantize_i8 (x beside the router, h between the gate/up and down kinds); the
weight codes, their products and sums are exact; the rescale per 64-wide step
s_w (s_xa D_a + s_xb D_b) + b_w (s_xa C_a + s_xb C_b) (= x_int8 . w), SwiGLU and the routing weight
are fp32. The 32-row, 16-row and few-row tiles keep the half-operand kernels of test_moe_m5.py. Taken
for 4-bit experts with groups of 64 (or 128), H and I = Is multiples of 64.

Bounds, derived (e_x = s_x / 2, e_h = s_h / 2 per element: half the int8 step of its row's group):
  gate/up:  |dg| <= |Wg|.e_x, |du| <= |Wu|.e_x        (x is bf16 and quantized once)
  h:        |dh| <= 1.1 |dg| (|u| + |du|) + |silu(g)| |du|     (|silu'| <= 1.1)
  y = D h:  |dy| <= |D|.(dh + e_h), s_h from max(|h| + dh) over the row's group of 32
  out:      sum_j |w_j| |dy_j|, plus the fp32 bound of test_moe.py, plus test_moe_m5.py's half term
            (for the rows of the other tiles; both terms are added for every slot, whatever its
            tile: looser, still valid), plus one bf16 rounding of out.
That bound catches gross errors (a wrong row, feature or tile). The sharp check runs where every
slot is in a 64-row tile (full and partly filled tiles): the kernel's bf16 output against the bf16
rounding of a float64 reference of the int8 semantics themselves (x's codes are the reference's
exactly; h's can differ by one where the kernel's fp32 h sits on the other side of a rounding
boundary): equal in nearly every element, which a wrong scale, bias term, stage or code would
break, while the plain float64 MoE (no int8) rounds to the same value far less often.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_checks import assert_close, rng  # noqa: F401  (fixture)
from lily_py import ops
from lily_py.reference import kernels as ref
from lily_py.testing import simulated_device
from test_moe import KEYS, TILE32_MAX_ROWS, expected_tiles, make_block, parts
from test_moe_m5 import half_bound

BF16 = ml_dtypes.bfloat16
BF16_U = 2.0 ** -8
I8_KINDS = ["moe_gate_up_m5i8_64_b4_xbf16_sbf16", "moe_gate_up_m5_32_b4_xbf16_sbf16", "moe_gate_up_few_b4_xbf16_sbf16",
            "quantize_i8_xf32",
            "moe_down_m5i8_64_b4_sbf16", "moe_down_m5_32_b4_sbf16", "moe_down_few_b4_sbf16", "moe_combine_xbf16"]
# the router (qmm_m5, fp32 operands), x's codes beside it, softmax / top-k, plan
I8_HEAD = ["qmm_m5_b8_xbf16_sbf16", "quantize_i8_xbf16", "moe_route_xbf16", "moe_plan"]
M5_BF16_KINDS = ["moe_gate_up_m5_64_b4_xbf16_sbf16", "moe_gate_up_m5_32_b4_xbf16_sbf16",
                 "moe_gate_up_few_b4_xbf16_sbf16", "moe_down_m5_64_b4_sbf16", "moe_down_m5_32_b4_sbf16",
                 "moe_down_few_b4_sbf16", "moe_combine_xbf16"]


def run(rng, W, x, top_k, *, int8=True, **kw):
    with simulated_device(tensor_ops=True, tensor_int8=int8):
        return ops._moe(x, *ops.moe_weights(W), top_k=top_k, seed=rng.seed, **kw)


def silu(v):
    return v / (1.0 + np.exp(-v))


def group_step(v, group=32):
    """Half the int8 step of each element's row group of `group` columns: max |v| / 254, repeated."""
    a = np.abs(v).reshape(v.shape[:-1] + (-1, group)).max(-1)
    return np.repeat(a / 254.0, group, axis=-1)


def slot_matrices(dense, ids, t, j):
    k = ids.shape[1]
    if j < k:
        return tuple(dense[n][ids[t, j]] for n in ("gate", "up", "down"))
    return dense["shared_gate_proj"], dense["shared_up"], dense["shared_down"]


def int8_bound(x, dense, ids, weights):
    """The int8 term of the docstring's bound, [T, H] float64 (every slot, whatever its tile)."""
    x64 = np.asarray(x, np.float64)
    T, H = x64.shape
    ex = group_step(x64)
    out = np.zeros((T, H))
    for t in range(T):
        for j in range(ids.shape[1] + 1):
            Wg, Wu, Wd = (np.asarray(m, np.float64) for m in slot_matrices(dense, ids, t, j))
            g, u = Wg @ x64[t], Wu @ x64[t]
            dg, du = np.abs(Wg) @ ex[t], np.abs(Wu) @ ex[t]
            h = silu(g) * u
            dh = 1.1 * dg * (np.abs(u) + du) + np.abs(silu(g)) * du
            eh = group_step(np.abs(h) + dh)
            out[t] += abs(float(weights[t, j])) * (np.abs(Wd) @ (dh + eh))
    return out


def int8_semantics(x, dense, ids, weights):
    """float64 output of the int8 tiles' semantics for every slot (no residual)."""
    x32 = np.asarray(x, np.float32)
    q, s = ref.int8_rows(x32)
    xq = q * np.repeat(s, 32, axis=-1)
    T, H = x32.shape
    out = np.zeros((T, H))
    for t in range(T):
        for j in range(ids.shape[1] + 1):
            Wg, Wu, Wd = (np.asarray(m, np.float64) for m in slot_matrices(dense, ids, t, j))
            h = silu(Wg @ xq[t]) * (Wu @ xq[t])
            hq, sh = ref.int8_rows(h.astype(np.float32)[None])
            out[t] += float(weights[t, j]) * (Wd @ (hq[0] * np.repeat(sh[0], 32)))
    return out


def in_64_tiles(ids, E):
    """[T, k + 1] bool: whether each slot's row sits in a 64-row tile of its group (rows of a group
    in token order; 64-row tiles first, a remainder of more than 32 rows is one more)."""
    T, k = ids.shape
    flag = np.zeros((T, k + 1), bool)
    for e in range(E + 1):
        toks, slots = (np.nonzero(ids == e) if e < E else (np.arange(T), np.full(T, k)))
        order = np.argsort(toks, kind="stable")
        toks, slots = toks[order], slots[order]
        c = len(toks)
        full = 64 * (c // 64) + (64 if c % 64 > TILE32_MAX_ROWS else 0)
        flag[toks[:full], slots[:full]] = True
    return flag


def bf16_x(x):
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(BF16))


# Expert 0 and the shared group hold T rows (skewed load): 17 (a 32-row tile: no int8), 40
# (64-row), 73 (64 + a 16-row tile of 9), 97 (64 + 64), 130 (2 x 64 + a few-row tile of 2).
@pytest.mark.parametrize("T", [17, 40, 73, 97, 130])
def test_int8_on_the_64_row_tiles_only(rng, T):
    E, k = 7, 2
    W, x_of = make_block(rng, E=E, H=128, I=64, gs=64, load="skewed")
    x = bf16_x(x_of(T, k))
    out, ids, weights, stats = run(rng, W, x, k)
    o5, i5, w5, s5 = run(rng, W, x, k, int8=False)
    assert stats["kernels"] == I8_HEAD + I8_KINDS, stats["kernels"]
    assert s5["kernels"][3:] == M5_BF16_KINDS, s5["kernels"]
    assert [s5["kernels"][0]] + s5["kernels"][1:3] == [I8_HEAD[0]] + I8_HEAD[2:]
    np.testing.assert_array_equal(ids, i5)
    np.testing.assert_array_equal(weights, w5)
    for key in ("flops_useful", "flops_executed", "tiles", "host_syncs"):
        assert stats[key] == s5[key], key
    # the two quantize_i8 dispatches and the barrier after h's
    assert (stats["dispatches"], stats["barriers"]) == (s5["dispatches"] + 2, s5["barriers"] + 1)
    assert stats["tiles"] == expected_tiles(ids, E, m5=True)
    # tokens with no slot in a 64-row tile ran exactly the kernels of the half route
    flag = in_64_tiles(ids, E)
    none = ~flag.any(axis=1)
    np.testing.assert_array_equal(out[none].astype(np.float32), o5[none].astype(np.float32),
                                  err_msg=f"rows outside 64-row tiles differ from the half route (seed {rng.seed})")
    assert (stats["tiles"]["64"] > 0) == flag.any()
    if flag.any():
        assert not np.array_equal(out[~none], o5[~none]), "the 64-row tiles did not take int8"
    dense, mags = parts(W)
    xf = x.astype(np.float32)
    want, rids, _ = ref.moe(xf, *(dense[key] for key in KEYS), top_k=k)
    # bf16 router logits: a near-tie may route a token differently from the float64 reference
    ok = (ids == rids).all(axis=1)
    assert (~ok).sum() <= max(1, T // 20), f"{(~ok).sum()} tokens routed differently (seed {rng.seed})"
    bound = (ref.moe_error_bound(xf, mags, dense, top_k=k) + half_bound(xf, dense, ids, weights)
             + int8_bound(xf, dense, ids, weights))
    assert_close(out[ok].astype(np.float64), want[ok], atol=bound[ok], rtol=1.01 * BF16_U, what=f"moe int8 T={T}",
                 seed=rng.seed)


@pytest.mark.parametrize("T", [64, 40])
@pytest.mark.parametrize("shape", [dict(E=5, H=192, I=128, gs=64), dict(E=3, H=256, I=128, gs=128),
                                   dict(E=4, H=2048, I=512, gs=64)],
                         ids=["H192_I128", "H256_I128_gs128", "model_H2048_I512"])
def test_int8_semantics_where_every_row_is_in_a_64_row_tile(rng, shape, T):
    """top-1 with a skewed load and T = 64 or 40: expert 0 and the shared group hold every token, one
    64-row tile each (full, or 40 of 64 rows: the masked rows stage zeros), so every slot runs the
    int8 kernels."""
    k = 1
    W, x_of = make_block(rng, load="skewed", **shape)
    x = bf16_x(x_of(T, k))
    out, ids, weights, stats = run(rng, W, x, k)
    assert stats["kernels"] == I8_HEAD + I8_KINDS, stats["kernels"]
    assert (ids[:, 0] == 0).all() and stats["tiles"]["64"] == 2 and stats["tiles"]["32"] == stats["tiles"]["few"] == 0
    assert in_64_tiles(ids, shape["E"]).all()
    dense, mags = parts(W)
    xf = x.astype(np.float32)
    got = out.astype(np.float64)
    sem = int8_semantics(xf, dense, ids, weights)
    fp32 = ref.moe_error_bound(xf, mags, dense, top_k=k)
    full = fp32 + int8_bound(xf, dense, ids, weights)
    assert_close(got, sem, atol=full, rtol=1.01 * BF16_U, what="moe int8 vs its semantics", seed=rng.seed)
    # Tighter: the kernel's bf16 output is the bf16 rounding of the semantics wherever neither the
    # fp32 sums nor a flipped h code move it across a bf16 rounding boundary; the plain float64 MoE
    # (no int8) rounds to it far less often.
    rounds = lambda v: v.astype(np.float32).astype(BF16).astype(np.float64)  # noqa: E731
    want, _, _ = ref.moe(xf, *(dense[key] for key in KEYS), top_k=k)
    same_sem, same_plain = (got == rounds(sem)).mean(), (got == rounds(want)).mean()
    print(f"\n{shape}: out == bf16(int8 semantics) {same_sem:.1%}, == bf16(float64 MoE) {same_plain:.1%}")
    assert same_sem >= 0.97, f"only {same_sem:.1%} of out is the int8 semantics rounded (seed {rng.seed})"
    assert same_plain <= same_sem - 0.3, f"the int8 semantics do not explain out better than no int8 (seed {rng.seed})"


@pytest.mark.parametrize("case", ["fp32_x", "groups_32", "I_ne_Is"])
def test_what_int8_does_not_take_keeps_the_half_tiles(rng, case):
    """int8 is for bf16 activations, groups of 64 or 128 and I = Is: otherwise tensor_int8 changes
    nothing (same kernels, same output). (H and I multiples of 64 follow from the group size.)"""
    shape = {"fp32_x": dict(H=128, I=64, gs=64), "groups_32": dict(H=96, I=64, gs=32),
             "I_ne_Is": dict(H=128, I=64, Is=128, gs=64)}[case]
    W, x_of = make_block(rng, E=7, load="skewed", **shape)
    x = x_of(97, 2) if case == "fp32_x" else bf16_x(x_of(97, 2))
    out, _, _, stats = run(rng, W, x, 2)
    o5, _, _, s5 = run(rng, W, x, 2, int8=False)
    assert stats["kernels"] == s5["kernels"] and not any("i8" in kn for kn in stats["kernels"]), stats["kernels"]
    assert any(kn.startswith("moe_gate_up_m5_64_") for kn in stats["kernels"])
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(o5, np.float32))


@pytest.mark.parametrize("order", ["reverse", "shuffle", "ahead"])
def test_int8_result_independent_of_thread_order(rng, order):
    # H = 192, I = 128: gate/up walks 3 K steps, down 2 (step s + 1 staged while step s runs)
    W, x_of = make_block(rng, E=7, H=192, I=128, gs=64, load="skewed")
    x = bf16_x(x_of(97, 2))
    a = run(rng, W, x, 2, order="forward")
    b = run(rng, W, x, 2, order=order)
    assert a[3]["kernels"] == I8_HEAD + I8_KINDS
    for u, v in zip(a[:3], b[:3]):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32),
                                      err_msg=f"order {order!r} differs from 'forward': a race")
