"""The MoE tiled route's M1-M4 bf16 tiles (moe_gate_up_bf16 / moe_down_bf16, shaders/moe_prefill_bf16.metal:
qmm_bf16's design) on the emulator, vs a float64 NumPy reference of their exact semantics.

Semantics given the bf16 operands: in the 64- and 32-row tiles the gathered x rows (already bf16)
and the dequantized gate / up weights (s * q + b in fp32) are rounded to bf16, products are exact
in fp32 and summed in fp32, h = silu(g) * u in fp32 is rounded to bf16 with the dequantized down
weights, y = w_r * (h . down) in fp32. Rows in few-row tiles keep the fp32 operands (matvec
kernels). `tiles_ref` computes both variants in float64: `rounded=True` (the semantics above) and
`rounded=False` (the fp32-operand kernels' semantics).

Bounds (u = 2^-24 fp32, b = 2^-8 bf16 unit roundoff; derived as for qmm_bf16 in
tests/kernels/test_quantized_matmul.py):
* a dot product over K in fp32: 8 sqrt(K) u sum |a_k w_k|; rounding an operand to bf16 adds
  2.01 b sum |a_k w_k| (b relative per operand, 0.01 b for the fp32 dequantization under it);
* h: |dh| <= 1.1 |u_gate_up| e_g + |silu(g)| e_u (|silu'| <= 1.1), and its rounding to bf16 adds
  b |h| (also in the exact comparison: the kernel rounds its fp32 h, which can sit on the other side
  of a rounding boundary than the float64 h);
* y: sum_k |dh_k| |d_k| + the dot product's own bound over K = I; out = sum of w_j y_j rounded to
  bf16 (rtol b).
The elementwise bound against the exact semantics is thus loose about h's rounding; a missing or
extra rounding is caught by counting: the kernel's bf16 output must equal the bf16-rounded exact
reference in all but a small fraction of elements (<= 1/8 of those where the rounded and unrounded
references round to different bf16 values). Numbers printed with -s.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kernel_checks import assert_close, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py.reference import kernels as ref
from lily_py.testing import simulated_device
from test_moe import BF16, FEW_MAX_ROWS, _random_quant, make_block, quantized

U32, UB = 2.0 ** -24, 2.0 ** -8


def bf(a):
    return np.asarray(a, np.float32).astype(BF16).astype(np.float64)


def silu(v):
    return v / (1.0 + np.exp(-v))


def tiles_ref(x, ids, wts, expert, shared, E):
    """Float64 output of the expert part (no residual) for the kernel's own routing, rounded and
    unrounded semantics, plus the two bounds' per-element magnitudes.
    expert(e) / shared: (gate [I, H], up [I, H], down [H, I]) dense fp32 dequantized matrices."""
    T, H = x.shape
    k = ids.shape[1]
    out = {True: np.zeros((T, H)), False: np.zeros((T, H))}
    b_exact, b_f32 = np.zeros((T, H)), np.zeros((T, H))
    for e in range(E + 1):
        if e < E:
            toks, slots = np.nonzero(ids == e)
            order = np.argsort(toks, kind="stable")
            toks, slots = toks[order], slots[order]
        else:
            toks, slots = np.arange(T), np.full(T, k)
        c = len(toks)
        if c == 0:
            continue
        wg, wu, wd = (np.asarray(m, np.float64) for m in (expert(e) if e < E else shared))
        rem = c % 64
        few = np.zeros(c, bool)
        if 0 < rem <= FEW_MAX_ROWS:
            few[c - rem:] = True  # the group's last rows in token order: a few-row (fp32) tile
        K1, K2 = wg.shape[1], wd.shape[1]
        for sel, rounded in ((~few, True), (few, False)):
            if not sel.any():
                continue
            t, wr = toks[sel], wts[toks[sel], slots[sel]][:, None]
            X = x[t]
            for r in (True, False):  # the rounded semantics apply only to the tile rows
                rr = r and rounded
                g_, u_, d_ = (bf(m) if rr else m for m in (wg, wu, wd))
                g, u = X @ g_.T, X @ u_.T
                h = silu(g) * u
                hr = bf(h) if rr else h
                out[r][t] += wr * (hr @ d_.T)
            # bounds (magnitudes with the unrounded weights, 1.01 for the rounded ones)
            ag, au, ad = np.abs(X) @ np.abs(wg.T) * 1.01, np.abs(X) @ np.abs(wu.T) * 1.01, np.abs(wd.T) * 1.01
            g, u = X @ wg.T, X @ wu.T
            h = silu(g) * u
            for bound, rho in ((b_exact, 0.0), (b_f32, 2.01 * UB)):
                rho1 = rho if rounded else 0.0
                eg, eu = (8 * np.sqrt(K1) * U32 + rho1) * ag, (8 * np.sqrt(K1) * U32 + rho1) * au
                dh = 1.1 * np.abs(u) * eg + 1.1 * np.abs(h / np.where(u == 0, 1, u)) * eu + eg * eu
                if rounded:
                    dh += 1.01 * UB * (np.abs(h) + dh)
                ah = np.abs(h) + dh
                bound[t] += wr * (dh @ ad + (8 * np.sqrt(K2) * U32 + rho1) * (ah @ ad))
    return out, b_exact, b_f32


def run_and_check(rng, x, W, k, E, expert, shared, what, *, want_tiles, orders=("forward", "reverse")):
    out, ids, weights, stats = ops._moe(x, *ops.moe_weights(W), top_k=k, seed=rng.seed)
    assert stats["route"] == "tiled" and stats["host_syncs"] == 0
    kinds = ["moe_gate_up_bf16_64_b4_xbf16_sbf16", "moe_gate_up_bf16_32_b4_xbf16_sbf16",
             "moe_gate_up_few_b4_xbf16_sbf16", "moe_down_bf16_64_b4_sbf16", "moe_down_bf16_32_b4_sbf16",
             "moe_down_few_b4_sbf16", "moe_combine_xbf16"]
    assert stats["kernels"][3:] == kinds, stats["kernels"]
    for kind in want_tiles:  # the tile kinds this case must exercise
        assert stats["tiles"][kind] > 0, (what, stats["tiles"])
    x64 = x.astype(np.float64)
    refs, b_exact, b_f32 = tiles_ref(x64, ids, weights.astype(np.float64), expert, shared, E)
    o = out.astype(np.float64)
    assert_close(o, refs[True], atol=b_exact, rtol=UB, what=what + " vs exact bf16-tile semantics", seed=rng.seed)
    assert_close(o, refs[False], atol=b_f32, rtol=UB, what=what + " vs fp32-operand reference", seed=rng.seed)
    miss = int((out != refs[True].astype(np.float32).astype(BF16)).sum())
    split = int((refs[True].astype(np.float32).astype(BF16) != refs[False].astype(np.float32).astype(BF16)).sum())
    err = np.abs(o - refs[False])
    rel = np.sqrt(np.mean(err ** 2) / np.mean(refs[False] ** 2))
    print(f"\n{what}: tiles {stats['tiles']}; outputs != bf16(exact ref): {miss} of {out.size}; "
          f"bf16(exact) != bf16(fp32-operand ref): {split}; max err / bound vs exact "
          f"{(np.abs(o - refs[True]) / (b_exact + UB * np.abs(refs[True]))).max():.3g}, vs fp32 "
          f"{(err / (b_f32 + UB * np.abs(refs[False]))).max():.3g}; RMS err vs fp32 ref / RMS out {rel:.3g}")
    assert split > 0 and miss <= split / 8, (what, miss, split)
    for order in orders:  # every thread order, same bits
        o2 = ops._moe(x, *ops.moe_weights(W), top_k=k, order=order, seed=rng.seed)[0]
        np.testing.assert_array_equal(o2.view(np.uint16), out.view(np.uint16), err_msg=f"{what} order {order!r}")
    return ids, stats


def small_block(rng, E, H, I, Is, gs, load):
    W, x_of = make_block(rng, E=E, H=H, I=I, Is=Is, gs=gs, load=load)
    dense = {n: getattr(W, n).dense() if n.startswith("shared") else np.stack(
        [getattr(W, n).expert(e).dense() for e in range(E)]) for n in
        ("gate_proj", "up_proj", "down_proj", "shared_gate_proj", "shared_up_proj", "shared_down_proj")}
    expert = lambda e: (dense["gate_proj"][e], dense["up_proj"][e], dense["down_proj"][e])  # noqa: E731
    shared = (dense["shared_gate_proj"], dense["shared_up_proj"], dense["shared_down_proj"])
    return W, x_of, expert, shared


# Odd sizes: T = 17 (one 32-row tile: the shared group; experts in few-row tiles), 33 | 32 (64 |
# 32-row remainder), 97, 130 (64 + 64-row remainder / 64 + few); skewed load puts T rows on expert
# 0 too; H, I and Is multiples of the group size (>= 32: an even number of 16-wide K steps, so the
# 4-bit word loads alternate with register halves), I != Is both ways, groups 32, 64 and 128.
@pytest.mark.parametrize("T,E,H,I,Is,gs,k,load,tiles", [
    (17, 7, 64, 32, 32, 32, 2, "uniform", ["32"]),
    (32, 9, 96, 32, 64, 32, 2, "skewed", ["32"]),
    (33, 9, 160, 96, 32, 32, 2, "skewed", ["64"]),
    (97, 5, 128, 128, 256, 128, 2, "skewed", ["64"]),  # a 32-row tile too on some draws, not all
    (130, 11, 64, 64, 128, 64, 3, "uniform", ["64", "few"]),
])
def test_bf16_tiles_odd_sizes(rng, T, E, H, I, Is, gs, k, load, tiles):
    W, x_of, expert, shared = small_block(rng, E, H, I, Is, gs, load)
    x = x_of(T).astype(BF16)
    run_and_check(rng, x, W, k, E, expert, shared, f"bf16 tiles T={T} E={E} H={H} I={I} Is={Is} gs={gs}",
                  want_tiles=tiles)


def test_route_switch_bf16_vs_fp32_and_tensor_ops(rng):
    """Both sides of the switch: fp32 activations keep the fp32 tiles (moe_*_mm*), bf16 ones take
    the bf16 tiles, and a tensor-op device takes the M5 kinds whatever the dtype."""
    W, x_of, _, _ = small_block(rng, 7, 64, 32, 32, 32, "skewed")
    x = x_of(40)
    names = lambda xx: ops._moe(xx, *ops.moe_weights(W), top_k=2, seed=rng.seed)[3]["kernels"]  # noqa: E731
    assert names(x)[3:5] == ["moe_gate_up_mm64_b4_xf32_sbf16", "moe_gate_up_mm32_b4_xf32_sbf16"]
    assert names(x)[6:8] == ["moe_down_mm64_b4_sbf16", "moe_down_mm32_b4_sbf16"]
    assert names(x.astype(BF16))[3:5] == ["moe_gate_up_bf16_64_b4_xbf16_sbf16", "moe_gate_up_bf16_32_b4_xbf16_sbf16"]
    assert names(x.astype(BF16))[6:8] == ["moe_down_bf16_64_b4_sbf16", "moe_down_bf16_32_b4_sbf16"]
    with simulated_device(tensor_ops=True):
        assert names(x.astype(BF16))[3:5] == ["moe_gate_up_m5_64_b4_xbf16_sbf16", "moe_gate_up_m5_32_b4_xbf16_sbf16"]
        assert names(x.astype(BF16))[6:8] == ["moe_down_m5_64_b4_sbf16", "moe_down_m5_32_b4_sbf16"]


@pytest.mark.parametrize("T,tiles", [(20, ["32"]), (40, ["64"])])
def test_bf16_tiles_real_shapes(rng, T, tiles):
    """The real block (H 2048, 256 experts of I 512, top-8, shared expert 512, group 64), router
    skewed so expert 0 and the shared group hold all T rows (T = 20: 32-row tiles, 40: 64-row
    tiles); the other experts' rows in few-row tiles. Routing must equal the reference's (the
    router runs fp32 operands)."""
    E, H, I, Is, k, gs = 256, 2048, 512, 512, 8, 64
    r = rng.standard_normal((E, H)).astype(np.float32) * 0.05
    r[0] = 0.05 + rng.standard_normal(H).astype(np.float32) * 0.01
    W = SimpleNamespace(
        router=quantized(rng, (E, H), 8, gs, fill=r), shared_expert_gate=quantized(rng, (1, H), 8, gs, scale=0.05),
        gate_proj=_random_quant(rng, (E, I, H), gs), up_proj=_random_quant(rng, (E, I, H), gs),
        down_proj=_random_quant(rng, (E, H, I), gs), shared_gate_proj=_random_quant(rng, (Is, H), gs),
        shared_up_proj=_random_quant(rng, (Is, H), gs), shared_down_proj=_random_quant(rng, (H, Is), gs))
    x = (rng.standard_normal((T, H)) * 0.5 + 0.5).astype(np.float32).astype(BF16)
    expert = lambda e: (W.gate_proj.expert(e).dense(), W.up_proj.expert(e).dense(),  # noqa: E731
                        W.down_proj.expert(e).dense())
    shared = (W.shared_gate_proj.dense(), W.shared_up_proj.dense(), W.shared_down_proj.dense())
    ids, _ = run_and_check(rng, x, W, k, E, expert, shared, f"bf16 tiles real shapes T={T}", want_tiles=tiles,
                            orders=())  # thread orders: the odd-size cases (minutes here)
    assert (ids[:, 0] == 0).all()
    # the router's choice is the reference's (logits of the bf16 x rounded to bf16, as the kernels do)
    logits = ref.moe_logits(x.astype(np.float64), W.router.dense(), W.shared_expert_gate.dense())
    rids, _, _ = ref.moe_route(logits.astype(np.float32).astype(BF16).astype(np.float64), k)
    # The kernel's fp32 logits (within ~1e-6 relative of the float64 ones) round to the same bf16
    # values except where a logit sits within 1e-5 relative of a rounding midpoint; only logits whose
    # bf16 value is within 2 ulps of the k-th / (k+1)-th can move the choice: tokens with such a
    # logit are left out (they must be rare).
    lg = logits[:, :-1]
    lb = lg.astype(np.float32).astype(BF16).astype(np.float64)
    srt = -np.sort(-lb, axis=1)
    vk, vk1 = srt[:, k - 1:k], srt[:, k:k + 1]
    near = (np.abs(lb - vk) <= 2 * UB * np.abs(vk)) | (np.abs(lb - vk1) <= 2 * UB * np.abs(vk1))
    ulp = np.spacing(lb.astype(np.float32).astype(BF16)).astype(np.float64)
    mid = np.abs(np.abs(lg - lb) - ulp / 2) < 1e-5 * np.abs(lg)
    tie = (near & mid).any(axis=1)
    assert tie.sum() <= max(1, T // 10)
    np.testing.assert_array_equal(ids[~tie], rids[~tie], err_msg=f"routing differs (seed {rng.seed})")
