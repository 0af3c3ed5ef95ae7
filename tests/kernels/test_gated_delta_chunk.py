"""The chunked (WY) form of the gated delta rule (shaders/gated_delta_chunk.metal) on the emulator
vs the recurrent NumPy reference (lily_py.reference.kernels.gated_delta, float64 on the kernel's
inputs), and the route switch between it and the per-token scan.

Tolerance: the scan's bound (tests/kernels/test_gated_delta.py: a random walk of sqrt(Dk) u M per
token, rel_S = 16 sqrt((T + 1) Dk) u of M = max(|S|, |v|)), times the growth of the chunked form:
per chunk it solves (I + A) T = I by forward substitution (A_ij = b_i exp(G_i - G_j) k_i.k_j,
strictly lower) and multiplies by T, so rounding errors of u and W are amplified by at most
kappa = max_chunks ||(I + A)^-1||_inf (computed here in float64 from the same inputs; ~1-3 for
these inputs). Everything else in the chunk is sums of products bounded like the scan's. A wrong
decay, a missing beta, a dropped chunk or a bad transpose moves y by O(|y|), far outside it.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kernel_checks import F32_EPS, device, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py.ops.gated_delta import _gated_delta
from test_gated_delta import BF16, F32, check_gd, make_gd

CHUNK = 64  # kGdChunk (shaders/common/args_gated_delta.h)
CHUNK_KERNELS = ["gd_chunk_prep_xf32_wf32", "gd_chunk_wy_f32", "gd_chunk_state_f32", "gd_chunk_norm_xf32_wf32"]


def growth(args) -> float:
    """kappa: the largest infinity norm of the chunks' (I + A)^-1, float64."""
    q, k, v, z, a, b, A_log, dt_bias, norm_w, S0 = args
    T, Hk, Dk = k.shape
    Hv = v.shape[1]
    k64 = k.astype(np.float64)
    kn = k64 / np.sqrt((k64 ** 2).sum(-1, keepdims=True) + 1e-6)
    x = a.astype(np.float64) + dt_bias.astype(np.float64)
    softplus = np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))
    g = -np.exp(A_log.astype(np.float64)) * softplus            # [T, Hv]
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    worst = 1.0
    for h in range(Hv):
        kh = kn[:, h // (Hv // Hk)]
        for s in range(0, T, CHUNK):
            e = min(T, s + CHUNK)
            G = np.cumsum(g[s:e, h])
            n = e - s
            A = np.tril(beta[s:e, h, None] * np.exp(G[:, None] - G[None, :]) * (kh[s:e] @ kh[s:e].T), -1)
            Tinv = np.linalg.inv(np.eye(n) + A)
            worst = max(worst, float(np.abs(Tinv).sum(1).max()))
    return worst


def check_chunked(rng, args, y, S, what):
    return check_gd(rng, args, y, S, what=what, growth=growth(args))


@pytest.mark.parametrize("shape", [(1, 2, 16, 8), (2, 2, 24, 40), (2, 4, 32, 16)],
                         ids=lambda s: "hk%d_hv%d_dk%d_dv%d" % s)
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("w_dtype", [F32, BF16], ids=["wf32", "wbf16"])
@pytest.mark.parametrize("x_dtype", [F32, BF16], ids=["xf32", "xbf16"])
def test_chunked_matches_reference(rng, device, shape, T, w_dtype, x_dtype):
    """Forced chunked route at every T, including partial chunks (padded rows) and T < 64; float32
    and bfloat16 activations (qkv, z, a, b in, y out: the reference runs on the bf16 inputs
    exactly, y gets one bf16 rounding more, check_gd's rtol 2^-7)."""
    args = make_gd(rng, T, *shape, x_dtype, w_dtype)
    y, S, stats = _gated_delta(*args, route="chunked", device=device)
    assert y.dtype == x_dtype and S.dtype == F32
    wn = "wbf16" if w_dtype == BF16 else "wf32"
    xn = "xbf16" if x_dtype == BF16 else "xf32"
    assert stats["kernels"] == [k.replace("wf32", wn).replace("xf32", xn) for k in CHUNK_KERNELS]
    assert stats["dispatches"] == 4 and stats["barriers"] == 3
    Hk, Hv, Dk, Dv = shape
    assert stats["flops_useful"] == 6 * T * Hv * Dk * Dv
    assert stats["flops_executed"] > stats["flops_useful"]
    check_chunked(rng, args, y, S, f"chunked T={T} {shape}")


def test_route_switch(rng):
    """ops.gated_delta_route: the scan below 64 tokens, chunked from 64 (head dims multiples of 8
    up to 128); both sides agree with the reference and with each other."""
    shape = (2, 4, 32, 16)
    assert ops.gated_delta_route(63, 32, 16) == "scan"
    assert ops.gated_delta_route(64, 32, 16) == "chunked"
    assert ops.gated_delta_route(4096, 128, 128) == "chunked"
    assert ops.gated_delta_route(4096, 45, 32) == "scan" and ops.gated_delta_route(4096, 32, 20) == "scan"
    assert ops.gated_delta_route(1, 128, 128) == "scan"
    for T, kernels in ((63, ["gated_delta_xf32_wf32"]), (64, CHUNK_KERNELS)):
        args = make_gd(rng, T, *shape, F32, F32)
        y, S, stats = _gated_delta(*args, route="auto")
        assert stats["kernels"] == kernels, T
        check_chunked(rng, args, y, S, f"auto route T={T}")
        ys, Ss, _ = _gated_delta(*args, route="scan")
        yc, Sc, _ = _gated_delta(*args, route="chunked")
        # scan and chunked forms each within the bound of the reference: within twice of each other
        check_chunked(rng, args, ys, Ss, f"scan T={T}")
        check_chunked(rng, args, yc, Sc, f"chunked T={T}")


def test_chunked_continues_from_a_split_prompt(rng):
    """Prompt split where a dispatch boundary falls inside a 64-token chunk on either side (the
    state carried in device memory between dispatches), and a short tail on the scan route."""
    T = 200
    args = make_gd(rng, T, 1, 2, 32, 16, F32, F32, state_scale=0.5)
    y, S, _ = _gated_delta(*args, route="chunked")
    check_chunked(rng, args, y, S, "one dispatch")
    for parts in ([63, 137], [65, 135], [128, 72], [190, 10]):
        yp, Sp, stats = _gated_delta(*args, chunks=parts, route="auto")
        chunked = sum(p >= CHUNK for p in parts)
        assert stats["dispatches"] == 4 * chunked + (len(parts) - chunked), parts
        check_chunked(rng, args, yp, Sp, f"parts {parts}")


@pytest.mark.parametrize("T,parts", [(4096, [2047, 2049]), (8192, [8192])], ids=["4096_split", "8192"])
def test_long_prompts_real_head_dims(rng, T, parts, record_property):
    """Long prompts with the real head dims (Dk = Dv = 128; one head keeps the emulator fast):
    the chunked form equals the recurrent reference within the derived bound over 4096 and 8192
    tokens; 4096 split off the chunk grid (2047 = 31 * 64 + 63) so chunks straddle the dispatch
    boundary on both sides, 8192 in one dispatch (128 full chunks)."""
    args = make_gd(rng, T, 1, 1, 128, 128, F32, F32, state_scale=0.5)
    t0 = time.perf_counter()
    y, S, stats = _gated_delta(*args, chunks=parts, route="auto")
    record_property("emulator_seconds", round(time.perf_counter() - t0, 1))
    assert stats["kernels"] == CHUNK_KERNELS * len(parts)
    check_chunked(rng, args, y, S, f"T={T} parts {parts}")


def test_chunked_bad_input(rng):
    args = make_gd(rng, 70, 1, 1, 20, 16, F32, F32)
    with pytest.raises(ValueError, match="multiples of 8"):
        _gated_delta(*args, route="chunked")
    with pytest.raises(ValueError, match="route"):
        _gated_delta(*make_gd(rng, 3, 1, 1, 16, 16), route="fast")
