"""Gated DeltaNet kernels (conv1d, the fused gated delta rule, the whole mixer) on the emulator
vs lily_py.reference.kernels (float64 on the exact inputs the kernels see).

Tolerances (u = 2^-24; bf16 outputs add rtol 2^-8 >= one bf16 rounding of |y|):
* conv1d: K products and K-1 adds in fp32 (<= (2K) u * sum_j |w x|) and SiLU (exp, a division,
  two products: <= 8 u |y|): atol = 2K u mag + 8 u |y| with mag = kernels.conv1d_error_scale.
  The new state is a copy: exact.
* gated_delta: per token every state element sees a decay product, a dot product of Dk terms
  (|k| = 1 after the L2 norm), u = beta (v - kv) and one rank-1 update. Roundings are
  independent, so a step adds ~sqrt(Dk) u M of error (M = max(|S|, |v|)) rather than the worst
  case Dk u M, and the transition S -> decay (I - beta k k^T) S has norm <= 1 (decay, beta in
  (0, 1), |k| = 1): old errors never grow and T steps add up as a random walk,
  rel_S = 16 sqrt((T + 1) Dk) u of M (observed: ~1/200 of it; a bf16 state, 2^-9 per step,
  fails it at once). o = S^T q with |q| = Dk^-1/2 errs by <= rel_S M; the gated norm divides
  by rms(o), so atol_y = rel_S M / rms(o) * |w silu(z)| per (token, head), plus 16 u |y| for the
  norm's own arithmetic. A wrong gate, head mapping, order or missing norm moves y by O(|y|).
* Equivalences (prefill == looped decode, chunk splits): the same fp32 operations in the same
  order per token, the state stored as fp32 between dispatches: bit-identical.
"""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

import lily_py._core as core
from kernel_checks import BF16_EPS, F32_EPS, assert_close, device, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py.ops.gated_delta import _causal_conv1d, _gated_delta, _gated_delta_decode, _gated_delta_mixer
from lily_py.testing import simulated_device
from lily_py.reference import gated_delta as ref_gd
from lily_py.reference import kernels as ref
from lily_py.reference import ops as ref_ops
from lily_py.reference import quant

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = [F32, BF16]
CONV_THREADS = 256  # kConvThreads (shaders/common/args_gated_delta.h)


def rand(rng, shape, dtype=F32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def out_rtol(dtype):
    return 2 * BF16_EPS if np.dtype(dtype) == BF16 else 0.0


def dname(t):
    return "bf16" if np.dtype(t) == BF16 else "f32"


# ------------------------------------------------------------------------------------- conv1d
def check_conv(rng, x, w, s, y, st):
    yr, sr = ref.causal_conv1d(x, w, s)
    K = w.shape[1]
    atol = 2 * K * F32_EPS * ref.conv1d_error_scale(x, w, s) + 8 * F32_EPS * np.abs(yr)
    assert_close(y, yr, atol=atol, rtol=out_rtol(x.dtype), what="conv1d y", seed=rng.seed)
    np.testing.assert_array_equal(st, sr)  # the state is a copy of inputs


# C = 37 (one partial threadgroup), 256 | 257 (both sides of the kConvThreads boundary).
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("C", [37, 256, 257])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=["wf32", "wbf16"])
def test_conv1d(rng, device, T, C, x_dtype, w_dtype):
    K = 4
    x, w, s = rand(rng, (T, C), x_dtype, 2.0), rand(rng, (C, K), w_dtype, 0.5), rand(rng, (K - 1, C), x_dtype, 2.0)
    y, st, stats = _causal_conv1d(x, w, s, device=device, seed=rng.seed)
    assert y.dtype == x_dtype and st.dtype == x_dtype
    assert stats["kernels"] == [f"conv1d_x{dname(x_dtype)}_w{dname(w_dtype)}"]
    assert stats["dispatches"] == 1 and stats["threads"] == -(-C // CONV_THREADS) * CONV_THREADS * T
    check_conv(rng, x, w, s, y, st)


@pytest.mark.parametrize("K", [2, 4, 5])
def test_conv1d_kernel_sizes_and_mlx_weight_layout(rng, K):
    T, C = 6, 50
    x, w, s = rand(rng, (T, C)), rand(rng, (C, K)), rand(rng, (K - 1, C))
    y, st = ops.causal_conv1d(x, w[:, :, None], s)  # MLX stores [C, K, 1]
    check_conv(rng, x, w, s, y, st)


def test_conv1d_chunks_equal_one_shot(rng):
    """Prefill in pieces (and T decode steps) == one prefill: bit-identical y and state."""
    T, C, K = 29, 70, 4
    x, w, s = rand(rng, (T, C), BF16), rand(rng, (C, K), BF16), rand(rng, (K - 1, C), BF16)
    y, st, _ = _causal_conv1d(x, w, s)
    for chunks in ([1] * T, [1, 2, 26], [13, 16], [28, 1]):
        yc, stc, stats = _causal_conv1d(x, w, s, chunks=chunks)
        assert stats["dispatches"] == len(chunks) and stats["barriers"] == len(chunks) - 1
        np.testing.assert_array_equal(yc.view(np.uint16), y.view(np.uint16), err_msg=str(chunks))
        np.testing.assert_array_equal(stc.view(np.uint16), st.view(np.uint16), err_msg=str(chunks))


def test_conv1d_bad_input(rng):
    x, w, s = rand(rng, (3, 8)), rand(rng, (8, 4)), rand(rng, (3, 8))
    with pytest.raises(ValueError, match=r"state must be \[K-1, C\]"):
        ops.causal_conv1d(x, w, s[:2])
    with pytest.raises(ValueError, match="conv weight must be"):
        ops.causal_conv1d(x, w[:7], s)
    with pytest.raises(ValueError, match="x's dtype"):
        ops.causal_conv1d(x, w, s.astype(BF16))
    with pytest.raises(ValueError, match="device"):
        ops.causal_conv1d(x, w, s, device="vulkan")


# -------------------------------------------------------------------------------- gated_delta
def make_gd(rng, T, Hk, Hv, Dk, Dv, x_dtype=F32, w_dtype=F32, state_scale=0.3):
    """Inputs shaped like the model's: conv outputs (silu-ish, O(1)), gates around their typical
    ranges (decay ~ exp(-exp(A_log) softplus(a + dt_bias)) in (0.3, 1))."""
    q, k = rand(rng, (T, Hk, Dk), x_dtype), rand(rng, (T, Hk, Dk), x_dtype)
    v, z = rand(rng, (T, Hv, Dv), x_dtype), rand(rng, (T, Hv, Dv), x_dtype)
    a, b = rand(rng, (T, Hv), x_dtype), rand(rng, (T, Hv), x_dtype, 2.0)
    A_log = (rng.uniform(-3, 0.5, Hv)).astype(np.float32)
    dt_bias = rand(rng, (Hv,), w_dtype)
    norm_w = (1 + rand(rng, (Dv,), F32, 0.2)).astype(w_dtype)
    S = rand(rng, (Hv, Dk, Dv), F32, state_scale)
    return q, k, v, z, a, b, A_log, dt_bias, norm_w, S


def check_gd(rng, args, y, S, *, what, eps=1e-6, growth=1.0):
    """``growth``: error amplification of the chunked form's triangular solves
    (tests/kernels/test_gated_delta_chunk.py); 1 for the scan."""
    q, k, v, z, a, b, A_log, dt_bias, norm_w, S0 = args
    T, Dk = q.shape[0], q.shape[2]
    yr, Sr = ref.gated_delta(q, k, v, z, a, b, A_log, dt_bias, norm_w, S0, eps=eps)
    # reference o (before the norm) for the rms in the y bound
    M = max(np.abs(Sr).max(), np.abs(S0).max(), np.abs(v.astype(np.float64)).max())
    rel_s = 16 * np.sqrt((T + 1) * Dk) * F32_EPS * growth  # see the module docstring
    assert_close(S, Sr, atol=rel_s * M, rtol=0, what=f"{what}: state", seed=rng.seed)
    z64 = z.astype(np.float64)
    gate = np.abs(norm_w.astype(np.float64) * z64 / (1 + np.exp(-z64)))
    # rms(o) per (t, h): recover it from y = o / rms * gate  ->  use the reference's o via S^T q.
    o_rms = _ref_o_rms(q, k, v, a, b, A_log, dt_bias, S0, eps)
    atol_y = rel_s * M / o_rms[..., None] * gate
    assert_close(y, yr, atol=atol_y, rtol=16 * F32_EPS + out_rtol(y.dtype), what=f"{what}: y", seed=rng.seed)
    return yr, Sr


def _ref_o_rms(q, k, v, a, b, A_log, dt_bias, S0, eps):
    ones = np.ones(v.shape[2])
    zbig = np.full(v.shape, 50.0)  # silu(50) = 50 exactly in float64 to 1e-20: y = 50 o / rms
    y, _ = ref.gated_delta(q, k, v, zbig, a, b, A_log, dt_bias, ones, S0, eps=eps)
    o_over_rms = y / 50.0
    # sum over Dv of (o / rms)^2 = Dv * mean(o^2) / (mean(o^2) + eps) -> rms = sqrt(mean(o^2) + eps)
    m = np.mean(o_over_rms ** 2, -1)  # = ms / (ms + eps)
    ms = m * eps / np.maximum(1 - m, 1e-300)
    return np.sqrt(ms + eps)


GD_SHAPES = [  # (Hk, Hv, Dk, Dv)
    (2, 4, 32, 16),     # Hv = 2 Hk, as in the model
    (3, 3, 24, 20),     # Hv = Hk, odd dims (masked rows and columns)
    (1, 3, 45, 33),     # Hv = 3 Hk; Dv = 33: a simdgroup with one live column
]


@pytest.mark.parametrize("shape", GD_SHAPES, ids=lambda s: "hk%d_hv%d_dk%d_dv%d" % s)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=["wf32", "wbf16"])
def test_gated_delta(rng, device, shape, x_dtype, w_dtype):
    Hk, Hv, Dk, Dv = shape
    T = 5
    args = make_gd(rng, T, Hk, Hv, Dk, Dv, x_dtype, w_dtype)
    y, S, stats = _gated_delta(*args, eps=1e-6, device=device, seed=rng.seed)
    assert y.dtype == x_dtype and S.dtype == F32 and S.shape == (Hv, Dk, Dv)
    assert stats["kernels"] == [f"gated_delta_x{dname(x_dtype)}_w{dname(w_dtype)}"]
    assert stats["dispatches"] == 1 and stats["barriers"] == 0
    assert stats["threads"] == Hv * -(-Dv // 4) * 32
    check_gd(rng, args, y, S, what=f"gated_delta {shape}")


def test_gated_delta_real_head_dims(rng, device):
    """Dk = Dv = 128 (1024 threads, every register slot live), Hv = 2 Hk, decode and a short scan."""
    args = make_gd(rng, 3, 1, 2, 128, 128, BF16, BF16)
    y, S, stats = _gated_delta(*args, device=device, seed=rng.seed)
    assert stats["threads"] == 2 * 1024
    check_gd(rng, args, y, S, what="gated_delta Dk=Dv=128")
    one = [t[:1] for t in args[:6]] + list(args[6:])
    y1, S1 = ops.gated_delta_step(*(t[0] for t in one[:6]), *one[6:], device=device)
    check_gd(rng, one, y1[None], S1, what="gated_delta_step Dk=Dv=128")


def test_gated_delta_matches_model_reference(rng):
    """The kernel equals the model-level reference (reference/gated_delta.py + ops.py in fp32):
    recurrent_gated_delta + gated_rms_norm, with the model's gate formulas."""
    T, Hk, Hv, Dk, Dv = 9, 2, 4, 32, 16
    q, k, v, z, a, b, A_log, dt_bias, norm_w, S0 = make_gd(rng, T, Hk, Hv, Dk, Dv)
    y, S = ops.gated_delta_scan(q, k, v, z, a, b, A_log, dt_bias, norm_w, S0, eps=1e-6)
    qn = ref_ops.l2_normalize(q) * np.float32(Dk ** -0.5)
    kn = ref_ops.l2_normalize(k)
    g = -np.exp(A_log) * ref_ops.softplus(a + dt_bias)
    o, Sr = ref_gd.recurrent_gated_delta(qn, kn, v, g, ref_ops.sigmoid(b), S0)
    yr = ref_ops.gated_rms_norm(o, z, norm_w, 1e-6)
    assert_close(S, Sr, atol=1e-5 * np.abs(Sr).max(), rtol=0, what="state vs model reference", seed=rng.seed)
    assert_close(y, yr, atol=1e-4, rtol=1e-4, what="y vs model reference", seed=rng.seed)


SMALL = (1, 2, 32, 16)  # Hk, Hv, Dk, Dv: few heads keep the long scans fast on the emulator


@pytest.mark.parametrize("T", [1, 7, 16, 33, 64, 300])
def test_prefill_from_nonzero_state(rng, T):
    args = make_gd(rng, T, *SMALL, BF16, BF16, state_scale=0.5)
    y, S, _ = _gated_delta(*args, seed=rng.seed)
    check_gd(rng, args, y, S, what=f"prefill T={T} from a nonzero state")


def test_prefill_equals_looped_decode(rng):
    T = 40
    args = make_gd(rng, T, 2, 4, 32, 16, BF16, BF16)
    y, S, _ = _gated_delta(*args)
    yd, Sd, stats = _gated_delta(*args, chunks=[1] * T)
    assert stats["dispatches"] == T and stats["barriers"] == T - 1
    np.testing.assert_array_equal(yd.view(np.uint16), y.view(np.uint16))
    np.testing.assert_array_equal(Sd, S)
    # and through the single-token function, state round-tripping through NumPy each step
    st = args[-1]
    for t in range(T):
        yt, st = ops.gated_delta_step(*(x[t] for x in args[:6]), *args[6:9], st)
        np.testing.assert_array_equal(yt.view(np.uint16), y[t].view(np.uint16), err_msg=f"step {t}")
    np.testing.assert_array_equal(st, S)


def test_chunk_boundary_invariance(rng):
    """Split the prompt anywhere: same outputs and state, bit for bit."""
    T = 50
    args = make_gd(rng, T, 2, 4, 32, 16, F32, BF16)
    y, S, _ = _gated_delta(*args)
    cuts = sorted(set(int(c) for c in rng.integers(1, T, 3)))
    for chunks in ([1, T - 1], [T - 1, 1], [16, 16, 18], list(np.diff([0, *cuts, T]))):
        yc, Sc, stats = _gated_delta(*args, chunks=chunks)
        assert stats["dispatches"] == len(chunks)
        np.testing.assert_array_equal(yc, y, err_msg=str(chunks))
        np.testing.assert_array_equal(Sc, S, err_msg=str(chunks))


def test_drift_512_decode_steps_bf16(rng, record_property):
    """512 decode steps (one dispatch each) with bf16 activations vs the fp32 model reference
    (reference/gated_delta.recurrent_gated_delta on the same bf16 inputs) and the float64 one.
    The fp32 state must not drift: the error stays at the level of fp32 rounding, bounded by
    check_gd's rel_S, and the last 128 steps are no worse than 4x the first 128."""
    T, (Hk, Hv, Dk, Dv) = 512, (2, 4, 64, 16)
    args = make_gd(rng, T, Hk, Hv, Dk, Dv, BF16, BF16, state_scale=0.5)
    q, k, v, z, a, b, A_log, dt_bias, norm_w, S0 = args
    # one dispatch per token, like decode, the state kept on the device between steps
    y, S, stats = _gated_delta(*args, chunks=[1] * T, seed=rng.seed)
    assert stats["dispatches"] == T
    yr, Sr = check_gd(rng, args, y, S, what="512-step drift")
    f = lambda t: t.astype(np.float32)  # noqa: E731
    qn = ref_ops.l2_normalize(f(q)) * np.float32(Dk ** -0.5)
    g = -np.exp(A_log) * ref_ops.softplus(f(a) + f(dt_bias))
    o32, S32 = ref_gd.recurrent_gated_delta(qn, ref_ops.l2_normalize(f(k)), f(v), g, ref_ops.sigmoid(f(b)), S0)
    y32 = ref_ops.gated_rms_norm(o32, f(z), f(norm_w), 1e-6)
    s_err32 = float(np.abs(S - S32).max() / np.abs(S32).max())
    s_err64 = float(np.abs(S - Sr).max() / np.abs(Sr).max())
    y_err = np.abs(y.astype(np.float64) - yr).max(axis=(1, 2)) / np.abs(yr).max()
    y_err32 = float(np.abs(y.astype(np.float64) - y32).max() / np.abs(y32).max())
    record_property("drift_state_rel_err_vs_fp32_ref", s_err32)
    record_property("drift_state_rel_err_vs_f64", s_err64)
    record_property("drift_y_rel_err_vs_fp32_ref", y_err32)
    print(f"\n512-step drift (bf16 activations): state max|err|/max|S| = {s_err32:.2e} vs the fp32 "
          f"reference, {s_err64:.2e} vs float64; y max|err|/max|y| = {y_err32:.2e} vs fp32 reference "
          f"(bf16 output rounding 2^-9 = {2**-9:.2e})")
    assert s_err32 < 1e-5 and s_err64 < 1e-5
    assert y_err[-128:].max() <= 4 * y_err[:128].max() + 1e-6


def test_gated_delta_bad_input(rng):
    args = list(make_gd(rng, 2, 2, 4, 16, 8))
    bad = list(args)
    bad[2] = rand(rng, (2, 3, 8))  # Hv = 3 not a multiple of Hk = 2
    with pytest.raises(ValueError, match="multiple of key heads"):
        ops.gated_delta_scan(*bad)
    bad = list(args)
    bad[9] = args[9].transpose(0, 2, 1).copy()
    with pytest.raises(ValueError, match=r"state must be float32 \[4, 16, 8\]"):
        ops.gated_delta_scan(*bad)
    bad = list(args)
    bad[3] = args[3].astype(BF16)
    with pytest.raises(ValueError, match="z must have the dtype of q"):
        ops.gated_delta_scan(*bad)
    big = list(make_gd(rng, 1, 1, 1, 130, 8))
    with pytest.raises(ValueError, match="<= 128"):
        ops.gated_delta_scan(*big)


# ------------------------------------------------------------------------------------- mixer
def make_mixer(rng, T, hidden, Hk, Hv, Dk, Dv, x_dtype, s_dtype, *, bits=4, gs=64, K=4):
    C = 2 * Hk * Dk + Hv * Dv

    def lin(n, k_, scale=0.08):
        return quant.quantize(rand(rng, (n, k_), F32, scale), bits=bits, group_size=gs, scale_dtype=s_dtype)
    w_dtype = s_dtype
    return dict(
        x=rand(rng, (T, hidden), x_dtype),
        in_proj_qkv=lin(C, hidden), in_proj_z=lin(Hv * Dv, hidden), in_proj_b=lin(Hv, hidden),
        in_proj_a=lin(Hv, hidden), out_proj=lin(hidden, Hv * Dv),
        conv_weight=rand(rng, (C, K), w_dtype, 0.5), A_log=rng.uniform(-3, 0.5, Hv).astype(np.float32),
        dt_bias=rand(rng, (Hv,), w_dtype), norm_weight=(1 + rand(rng, (Dv,), F32, 0.2)).astype(w_dtype),
        conv_state=rand(rng, (K - 1, C), x_dtype), state=rand(rng, (Hv, Dk, Dv), F32, 0.3))


# T = 1 (decode: qmv1, the conv fused into gated_delta_decode) | 2 (conv1d + the scan: both sides
# of the decode switch), T = 8 | 9 (both sides of the qmv/qmm switch, kQmvMaxRows = 8) and
# T = 63 | 64 | 97 (both sides of the chunked route's switch, kGdChunkMinTokens = 64: from 64 the
# conv runs inside the chunked route's prep, gd_chunk_prep_conv; 97: a partial second chunk).
@pytest.mark.parametrize("T", [1, 2, 8, 9, 63, 64, 97])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
def test_gated_delta_mixer(rng, device, T, x_dtype):
    """The whole mixer against the float64 reference composed of the kernel references, with the
    device's intermediate roundings (proj, conv out, normed o) applied at the same points.
    f32: each stage adds at most its own bound above (qmm 8 sqrt(K) u mag, conv, gated delta),
    ~1e-5 relative in total: atol 1e-4 max|out|. bf16: a stage's last-bit rounding flip (2^-8
    relative of one intermediate) propagates through at most a sum of K products into out:
    atol 2^-6 max|out|."""
    Hk, Hv, Dk, Dv, hidden = 2, 4, 32, 16, 128
    s_dtype = BF16 if x_dtype == BF16 else F32
    m = make_mixer(rng, T, hidden, Hk, Hv, Dk, Dv, x_dtype, s_dtype)
    dims = dict(num_key_heads=Hk, num_value_heads=Hv, head_k_dim=Dk, head_v_dim=Dv)
    out, cs, S, stats = _gated_delta_mixer(*m.values(), **dims, eps=1e-6, device=device, seed=rng.seed)
    # Per DeltaNet layer: fused in_proj, conv1d, gated_delta, out_proj; a barrier before each consumer.
    # One token: the conv runs inside gated_delta_decode, its gated norm after it (4 dispatches, 3 barriers).
    # the projections' route: qmv1 | qmv (<= 8 rows) | qmm (32 x 32 tiles) | qmm_bf16 (64 x 64, bf16 x, >= 33 rows)
    route = "qmv1" if T == 1 else "qmv" if T <= 8 else "qmm_bf16" if T >= 33 and x_dtype == BF16 else "qmm"
    xs, ss = dname(x_dtype), dname(s_dtype)
    if T == 1:
        # Dv = 16 is less than a lane's 32 codes, so out_proj cannot fold the gated norm (qmv1_gated:
        # test_gated_delta_mixer_folds_the_gated_norm); nor could it with these bf16 norm weights.
        assert stats["dispatches"] == 4 and stats["barriers"] == 3
        # small projections (in_proj 2 Hk Dk + 2 Hv Dv + 2 Hv = 200 rows, out_proj 128; one split at
        # K = 128 and 64): 1 row per qmv1 threadgroup (qmv1_rows: 25 and 16 simdgroups at 8 rows, < 1024)
        assert stats["kernels"] == [f"{route}_b4_x{xs}_s{ss}_r1", f"gated_delta_decode_x{xs}_w{ss}",
                                    f"gd_chunk_norm_x{xs}_w{ss}", f"{route}_b4_x{xs}_s{ss}_r1"]
    elif T < 64:
        assert stats["dispatches"] == 4 and stats["barriers"] == 3
        assert stats["kernels"] == [f"{route}_b4_x{xs}_s{ss}", f"conv1d_x{xs}_w{ss}", f"gated_delta_x{xs}_w{ss}",
                                    f"{route}_b4_x{xs}_s{ss}"]
    else:  # chunked: in_proj, prep (conv fused), wy, state, norm, out_proj
        assert stats["dispatches"] == 6 and stats["barriers"] == 5
        assert stats["kernels"] == [f"{route}_b4_x{xs}_s{ss}", f"gd_chunk_prep_conv_x{xs}_w{ss}", "gd_chunk_wy_f32",
                                    "gd_chunk_state_f32", f"gd_chunk_norm_x{xs}_w{ss}", f"{route}_b4_x{xs}_s{ss}"]
    in_proj = tuple(np.concatenate([m[n][i] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")])
                    for i in range(3))
    outr, csr, Sr = ref.gated_delta_mixer(
        m["x"], in_proj, m["out_proj"], m["conv_weight"], m["A_log"], m["dt_bias"], m["norm_weight"],
        m["conv_state"], m["state"], Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, eps=1e-6, bits=4, group_size=64,
        round_to=x_dtype if x_dtype == BF16 else None)
    # bf16: the flips of different tokens' intermediates reach the state and, through it, later
    # outputs as a random walk: 2^-7 sqrt(T) (T <= 9: the earlier fixed 2^-6 bound and more; T = 97,
    # chunked: seen 2.1x the fixed bound, about half of this one)
    tol = max(2.0 ** -6, 2.0 ** -7 * np.sqrt(T)) if x_dtype == BF16 else 1e-4
    assert_close(out, outr, atol=tol * np.abs(outr).max(), rtol=out_rtol(x_dtype), what=f"mixer T={T} out",
                 seed=rng.seed)
    # State: f32 keeps a tenth of the output's bound. bf16: every token's increment k u^T is built
    # from bf16 activations, and a one-ulp rounding flip of v (2^-8 relative) moves the increment
    # by up to 2^-8 of its size; over T tokens such flips add up, so the state gets the output's
    # bound (seen: 2.3e-3 max|S| at T=9, seed 566154014486500385, against 2^-6 = 1.6e-2).
    s_tol = tol if x_dtype == BF16 else tol / 10
    assert_close(S, Sr, atol=s_tol * np.abs(Sr).max(), rtol=0, what="mixer state", seed=rng.seed)
    if x_dtype == F32:
        assert_close(cs, csr, atol=1e-5 * np.abs(csr).max(), rtol=0, what="mixer conv state", seed=rng.seed)


@pytest.mark.parametrize("tensor_ops", [False, True], ids=["simdgroup", "m5"])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
@pytest.mark.parametrize("T", [64, 97])
def test_gated_delta_mixer_fused_conv_equals_conv1d_then_chunked(rng, T, x_dtype, tensor_ops):
    """The chunked route's prep with the conv fused (gd_chunk_prep_conv, the engine's prefill) is
    bit for bit conv1d followed by the chunked rule on its output (same taps in the same order,
    the conv output rounded to x's dtype at the same point): the mixer's out, conv window and state
    equal those of in_proj, conv1d, the chunked rule and out_proj run as separate ops. With
    tensor ops (M5) on both sides: gd_chunk_prep_conv_q16 vs gd_chunk_prep_q16."""
    from lily_py.ops.qmm import _quantized_matmul
    Hk, Hv, Dk, Dv, hidden = 2, 4, 32, 16, 128
    s_dtype = BF16 if x_dtype == BF16 else F32
    m = make_mixer(rng, T, hidden, Hk, Hv, Dk, Dv, x_dtype, s_dtype)
    dims = dict(num_key_heads=Hk, num_value_heads=Hv, head_k_dim=Dk, head_v_dim=Dv)
    C = 2 * Hk * Dk + Hv * Dv
    with simulated_device(tensor_ops=tensor_ops):
        out, cs, S, stats = _gated_delta_mixer(*m.values(), **dims, eps=1e-6, seed=rng.seed)
        prep = "gd_chunk_prep_conv_q16" if tensor_ops else "gd_chunk_prep_conv"
        assert stats["kernels"][1] == f"{prep}_x{dname(x_dtype)}_w{dname(s_dtype)}", stats["kernels"]
        assert "conv1d" not in " ".join(stats["kernels"])
        in_proj = [np.concatenate([m[n][i] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")])
                   for i in range(3)]
        mm = dict(bits=4, group_size=64)
        proj, st0 = _quantized_matmul(m["x"], *in_proj, **mm)
        qkv, cs_ref, _ = _causal_conv1d(np.ascontiguousarray(proj[:, :C]), m["conv_weight"], m["conv_state"])
        VD = Hv * Dv
        q = qkv[:, :Hk * Dk].reshape(T, Hk, Dk)
        k = qkv[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk)
        v = qkv[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)
        z = proj[:, C:C + VD].reshape(T, Hv, Dv)
        b, a = proj[:, C + VD:C + VD + Hv], proj[:, C + VD + Hv:]
        o, S_ref, gst = _gated_delta(q, k, v, np.ascontiguousarray(z), np.ascontiguousarray(a),
                                     np.ascontiguousarray(b), m["A_log"], m["dt_bias"], m["norm_weight"], m["state"],
                                     route="chunked")
        out_ref, _ = _quantized_matmul(o.reshape(T, VD), *m["out_proj"], **mm)
    assert gst["kernels"][0] == f"{prep.replace('_conv', '')}_x{dname(x_dtype)}_w{dname(s_dtype)}"
    assert stats["kernels"][0] == st0["kernels"][0]
    for what, got, want in (("out", out, out_ref), ("conv window", cs, cs_ref), ("state", S, S_ref)):
        diff = np.flatnonzero(np.asarray(got, np.float64) != np.asarray(want, np.float64))
        assert diff.size == 0, (f"{what}: {diff.size} elements differ, first at flat index {diff[0]}: "
                                f"{np.asarray(got).flat[diff[0]]!r} vs {np.asarray(want).flat[diff[0]]!r} (seed {rng.seed})")


def test_gated_delta_mixer_bad_input(rng):
    m = make_mixer(rng, 1, 128, 2, 4, 32, 16, F32, F32)
    m["in_proj_z"] = m["in_proj_b"]
    with pytest.raises(ValueError, match="in_proj_z must have 64 rows"):
        ops.gated_delta_mixer(*m.values(), num_key_heads=2, num_value_heads=4, head_k_dim=32, head_v_dim=16)


@pytest.mark.parametrize("w_dtype", [F32, BF16], ids=["wf32", "wbf16"])
def test_gated_delta_mixer_real_dims_decode(rng, w_dtype):
    """One decode step of a real DeltaNet layer (hidden 2048, Hk 16, Hv 32, Dk = Dv = 128, bf16
    activations and scales). With the float32 conv and norm weights the engine keeps: 3 dispatches,
    2 barriers (the numbers docs/kernels-deltanet.md quotes): the conv fused into the rule, the
    gated norm into out_proj (qmv1_gated, 8 rows per threadgroup). With bf16 norm weights (no
    qmv1_gated for those) the norm is its own dispatch: 4 and 3 (MSL 3.1 orders nothing between
    the rule's threadgroups)."""
    m = make_mixer(rng, 1, 2048, 16, 32, 128, 128, BF16, BF16)
    for n in ("conv_weight", "dt_bias", "norm_weight"):
        m[n] = m[n].astype(w_dtype)
    dims = dict(num_key_heads=16, num_value_heads=32, head_k_dim=128, head_v_dim=128)
    out, cs, S, stats = _gated_delta_mixer(*m.values(), **dims, seed=rng.seed)
    if w_dtype == F32:
        assert stats["dispatches"] == 3 and stats["barriers"] == 2
        assert stats["kernels"] == ["qmv1_b4_xbf16_sbf16", "gated_delta_decode_xbf16_wf32",
                                    "qmv1_gated_b4_sbf16_ybf16"]
    else:
        assert stats["dispatches"] == 4 and stats["barriers"] == 3
        assert stats["kernels"] == ["qmv1_b4_xbf16_sbf16", "gated_delta_decode_xbf16_wbf16",
                                    "gd_chunk_norm_xbf16_wbf16", "qmv1_b4_xbf16_sbf16"]
    in_proj = tuple(np.concatenate([m[n][i] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")])
                    for i in range(3))
    outr, _, Sr = ref.gated_delta_mixer(
        m["x"], in_proj, m["out_proj"], m["conv_weight"], m["A_log"], m["dt_bias"], m["norm_weight"],
        m["conv_state"], m["state"], Hk=16, Hv=32, Dk=128, Dv=128, eps=1e-6, bits=4, group_size=64, round_to=BF16)
    assert_close(out, outr, atol=2.0 ** -6 * np.abs(outr).max(), rtol=2 * BF16_EPS, what="real-dims mixer out",
                 seed=rng.seed)
    # The state's increment k u^T is built from bf16 activations (projection outputs rounded to
    # bf16 on both sides). Device and reference sum the projections in different orders, so a sum
    # within an fp32 rounding error of a bf16 rounding boundary can round one ulp (2^-8 relative)
    # apart — in v, or in k before its L2 norm, which moves a whole row of the increment. Same
    # bound as the small mixer test's bf16 state: 2^-6 max|S| (seen: up to 1.1e-4 max|S|).
    assert_close(S, Sr, atol=2.0 ** -6 * np.abs(Sr).max(), rtol=0, what="real-dims mixer state", seed=rng.seed)


def test_qmv1_gated_support_rule():
    """Where out_proj folds the gated norm: 4 or 8 bits; Dv a power of two, a multiple of a lane's
    codes (32 at 4 bits, 16 at 8) and at most 32 lanes of them; K a multiple of Dv; 8 or 1 rows."""
    sup = core.ops.qmv1_gated_supported
    assert sup(2048, 4096, 128, 4) and sup(2048, 4096, 128, 8)       # the real out_proj
    assert sup(256, 256, 64, 4)                                       # the demo's (1 row)
    assert sup(128, 128, 16, 8) and not sup(128, 128, 16, 4)          # 16 < a 4-bit lane's 32 codes
    assert not sup(128, 192, 48, 4) and not sup(128, 96, 96, 8)       # not powers of two
    assert not sup(2048, 4096, 128, 6) and not sup(2048, 4096, 128, 3)  # widths without the kernel
    assert not sup(128, 200, 64, 4) and not sup(0, 128, 64, 4)        # K not a multiple of Dv; no rows
    assert not sup(248320, 4096, 128, 4)                              # lm_head-sized N: 16 rows


# (Hk, Hv, Dk, Dv, hidden, bits): a head on 1, 2 or 4 lanes of a 4-bit block (Dv = 32, 64, 128; 32
# codes a lane), on 1 and 8 lanes of an 8-bit one (Dv = 16, 128; 16 codes a lane); K = Hv Dv from
# 128 to 640 (a partial last block: 640 = 1024 - 384); out_proj on 1 row per threadgroup (these N).
FOLD_SHAPES = [(2, 4, 32, 32, 128, 4), (2, 4, 32, 64, 192, 4), (1, 5, 32, 128, 64, 4), (2, 8, 32, 16, 128, 8),
               (1, 2, 32, 128, 128, 8)]


@pytest.mark.parametrize("shape", FOLD_SHAPES, ids=lambda s: "hk%d_hv%d_dk%d_dv%d_h%d_b%d" % s)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
def test_gated_delta_mixer_folds_the_gated_norm(rng, device, shape, x_dtype):
    """One token with float32 norm weights: out_proj applies the gated RMSNorm itself (qmv1_gated),
    3 dispatches and 2 barriers instead of 4 and 3. Its x is the very row gd_chunk_norm would write
    (one expression, rounded to the activation dtype) and its products are qmv1's, so the mixer's
    output equals the separate ops (in_proj, gated_delta_decode with its norm, out_proj) up to the
    order of |o_h|^2's sum: fp32, a few ulp of inv_rms, atol 1e-6 max|out|; bf16, a row element
    that rounds one ulp apart (2^-8 relative) moves out by at most 2^-8 |w_j x_j|: atol 2^-8 max|out|.
    Against the float64 reference too, with test_gated_delta_mixer's bounds."""
    from lily_py.ops.qmm import _quantized_matmul
    Hk, Hv, Dk, Dv, hidden, bits = shape
    s_dtype = BF16 if x_dtype == BF16 else F32
    m = make_mixer(rng, 1, hidden, Hk, Hv, Dk, Dv, x_dtype, s_dtype, bits=bits)
    for n in ("conv_weight", "dt_bias", "norm_weight"):
        m[n] = m[n].astype(F32)
    dims = dict(num_key_heads=Hk, num_value_heads=Hv, head_k_dim=Dk, head_v_dim=Dv)
    out, cs, S, stats = _gated_delta_mixer(*m.values(), **dims, bits=bits, eps=1e-6, device=device, seed=rng.seed)
    xs, ss = dname(x_dtype), dname(s_dtype)
    assert stats["dispatches"] == 3 and stats["barriers"] == 2
    assert stats["kernels"] == [f"qmv1_b{bits}_x{xs}_s{ss}_r1", f"gated_delta_decode_x{xs}_wf32",
                                f"qmv1_gated_b{bits}_s{ss}_y{xs}_r1"], stats["kernels"]
    # the separate ops: in_proj, the rule + gd_chunk_norm, out_proj on the normed row
    C, VD = 2 * Hk * Dk + Hv * Dv, Hv * Dv
    in_proj = [np.concatenate([m[n][i] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")])
               for i in range(3)]
    proj, _ = _quantized_matmul(m["x"], *in_proj, bits=bits, group_size=64, device=device)
    p = proj[0]
    y, cs2, S2, st2 = _gated_delta_decode(
        p[:Hk * Dk].reshape(Hk, Dk), p[Hk * Dk:2 * Hk * Dk].reshape(Hk, Dk), p[2 * Hk * Dk:C].reshape(Hv, Dv),
        p[C:C + VD].reshape(Hv, Dv), p[C + VD + Hv:], p[C + VD:C + VD + Hv], m["conv_weight"], m["conv_state"],
        m["A_log"], m["dt_bias"], m["norm_weight"], m["state"], eps=1e-6, device=device)
    assert st2["kernels"][1] == f"gd_chunk_norm_x{xs}_wf32"
    out2, _ = _quantized_matmul(y.reshape(1, VD), *m["out_proj"], bits=bits, group_size=64, device=device)
    for what, got, want in (("state", S, S2), ("conv window", cs, cs2)):
        diff = np.flatnonzero(np.asarray(got, np.float64) != np.asarray(want, np.float64))
        assert diff.size == 0, f"{what}: {diff.size} elements differ, first at flat index {diff[0]} (seed {rng.seed})"
    tol = 2.0 ** -8 if x_dtype == BF16 else 1e-6
    assert_close(out, out2, atol=tol * np.abs(out2).max(), rtol=0, what=f"folded vs separate {shape}", seed=rng.seed)
    outr, _, _ = ref.gated_delta_mixer(
        m["x"], tuple(in_proj), m["out_proj"], m["conv_weight"], m["A_log"], m["dt_bias"], m["norm_weight"],
        m["conv_state"], m["state"], Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, eps=1e-6, bits=bits, group_size=64,
        round_to=x_dtype if x_dtype == BF16 else None)
    assert_close(out, outr, atol=(2.0 ** -6 if x_dtype == BF16 else 1e-4) * np.abs(outr).max(),
                 rtol=out_rtol(x_dtype), what=f"folded mixer {shape} vs reference", seed=rng.seed)


def test_gated_delta_is_order_independent(rng):
    """No races: forward, reverse, shuffled and 'ahead' thread orders give the same bits (state and y)."""
    args = make_gd(rng, 6, 2, 4, 40, 36)
    runs = [_gated_delta(*args, order=o, seed=rng.seed)[:2] for o in ("forward", "reverse", "shuffle", "ahead")]
    for y, S in runs[1:]:
        np.testing.assert_array_equal(y, runs[0][0])
        np.testing.assert_array_equal(S, runs[0][1])
    x, w, s = rand(rng, (9, 300)), rand(rng, (300, 4)), rand(rng, (3, 300))
    convs = [_causal_conv1d(x, w, s, order=o, seed=rng.seed)[:2] for o in ("forward", "reverse", "ahead")]
    for c in convs[1:]:
        np.testing.assert_array_equal(convs[0][0], c[0])
        np.testing.assert_array_equal(convs[0][1], c[1])


# ------------------------------------------------------------------------- gated_delta_decode
DEC_THREADS, DEC_COLS_PER_SIMD = 256, 2  # kGdDecodeThreads, kGdDecodeColsPerSimd


def dec_grid(Dv, limit=1024):
    """(threads per threadgroup, threadgroups per value head) the host picks (gated_delta.cpp)."""
    threads = min(DEC_THREADS, limit // 32 * 32, -(-Dv // DEC_COLS_PER_SIMD) * 32)
    return threads, -(-Dv // (threads // 32 * DEC_COLS_PER_SIMD))


def make_dec(rng, Hk, Hv, Dk, Dv, x_dtype=F32, w_dtype=F32, K=4):
    """One token's conv inputs (q, k, v before the conv), gates, conv weight and window, state."""
    C = 2 * Hk * Dk + Hv * Dv
    q, k, v = rand(rng, (Hk, Dk), x_dtype), rand(rng, (Hk, Dk), x_dtype), rand(rng, (Hv, Dv), x_dtype)
    z = rand(rng, (Hv, Dv), x_dtype)
    a, b = rand(rng, (Hv,), x_dtype), rand(rng, (Hv,), x_dtype, 2.0)
    w = rand(rng, (C, K), w_dtype, 0.5)
    cs = rand(rng, (K - 1, C), x_dtype, 2.0)
    A_log = rng.uniform(-3, 0.5, Hv).astype(np.float32)
    dt_bias = rand(rng, (Hv,), w_dtype)
    norm_w = (1 + rand(rng, (Dv,), F32, 0.2)).astype(w_dtype)
    S = rand(rng, (Hv, Dk, Dv), F32, 0.3)
    return q, k, v, z, a, b, w, cs, A_log, dt_bias, norm_w, S


def check_dec(rng, d, y, cs, S, *, what):
    """The fused step == conv1d (the device kernel: the fused conv sums the same fp32 taps in the
    same order and rounds the same way, so it is compared bit for bit through the rule's inputs)
    then the rule, against the float64 reference with check_gd's bounds; the new window is an
    exact copy."""
    q, k, v, z, a, b, w, cs0, A_log, dt_bias, norm_w, S0 = d
    Hk, Dk = q.shape
    Hv, Dv = v.shape
    x = np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)])[None]
    qkv, cs_dev = ops.causal_conv1d(x, w, cs0)
    _, cs_ref = ref.causal_conv1d(x, w, cs0)
    np.testing.assert_array_equal(cs.view(np.uint8), cs_ref.view(np.uint8), err_msg=f"{what}: conv window")
    np.testing.assert_array_equal(cs.view(np.uint8), cs_dev.view(np.uint8), err_msg=f"{what}: conv window")
    qc = qkv[:, :Hk * Dk].reshape(1, Hk, Dk)
    kc = qkv[:, Hk * Dk:2 * Hk * Dk].reshape(1, Hk, Dk)
    vc = qkv[:, 2 * Hk * Dk:].reshape(1, Hv, Dv)
    check_gd(rng, (qc, kc, vc, z[None], a[None], b[None], A_log, dt_bias, norm_w, S0), y[None], S, what=what)


DEC_SHAPES = GD_SHAPES + [
    (2, 4, 32, 40),     # Dv = 40: 20 simdgroups -> 256 threads, 3 threadgroups per head (last partial)
    (1, 2, 128, 128),   # real head dims: 8 threadgroups of 256 threads per head, float4 state loads
]


@pytest.mark.parametrize("shape", DEC_SHAPES, ids=lambda s: "hk%d_hv%d_dk%d_dv%d" % s)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["xf32", "xbf16"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=["wf32", "wbf16"])
def test_gated_delta_decode(rng, device, shape, x_dtype, w_dtype):
    Hk, Hv, Dk, Dv = shape
    d = make_dec(rng, Hk, Hv, Dk, Dv, x_dtype, w_dtype)
    y, cs, S, stats = _gated_delta_decode(*d, device=device, seed=rng.seed)
    assert y.dtype == x_dtype and cs.dtype == x_dtype and S.shape == (Hv, Dk, Dv)
    names = f"x{dname(x_dtype)}_w{dname(w_dtype)}"
    assert stats["kernels"] == [f"gated_delta_decode_{names}", f"gd_chunk_norm_{names}"]
    threads, blocks = dec_grid(Dv)
    # the rule, a barrier, then the gated norm (one simdgroup per head): MSL 3.1 orders no device
    # memory between the rule's threadgroups, so the norm over a head's columns is its own dispatch
    assert stats["dispatches"] == 2 and stats["barriers"] == 1
    assert stats["threads"] == Hv * blocks * threads + Hv * 32
    check_dec(rng, d, y, cs, S, what=f"gated_delta_decode {shape}")


@pytest.mark.parametrize("K", [2, 5])
def test_gated_delta_decode_kernel_sizes(rng, K):
    d = make_dec(rng, 2, 4, 32, 16, K=K)
    y, cs, S, _ = _gated_delta_decode(*d, seed=rng.seed)
    check_dec(rng, d, y, cs, S, what=f"gated_delta_decode K={K}")


def test_gated_delta_decode_real_model_dims(rng):
    """The real layer: Hk 16, Hv 32, Dk = Dv = 128 (GQA: value heads 2h, 2h+1 share key head h),
    bf16: 8 threadgroups of 256 threads per value head = 256 threadgroups, 2048 simdgroups."""
    d = make_dec(rng, 16, 32, 128, 128, BF16, BF16)
    y, cs, S, stats = _gated_delta_decode(*d, seed=rng.seed)
    assert stats["threads"] == 32 * 8 * 256 + 32 * 32
    check_dec(rng, d, y, cs, S, what="gated_delta_decode real dims")


def test_gated_delta_decode_matches_the_unfused_kernels(rng):
    """Fused step vs conv1d + gated_delta_step on the device, over 12 decode steps carrying the
    conv window and the state: the windows are identical; y and the state agree within the
    scan's own bound (the two kernels map key rows to lanes differently: not bit for bit)."""
    Hk, Hv, Dk, Dv, steps = 2, 4, 32, 20, 12
    d = list(make_dec(rng, Hk, Hv, Dk, Dv, BF16, BF16))
    cs_f, S_f, cs_u, S_u = d[7], d[11], d[7], d[11]
    for t in range(steps):
        q, k, v = rand(rng, (Hk, Dk), BF16), rand(rng, (Hk, Dk), BF16), rand(rng, (Hv, Dv), BF16)
        z, a, b = rand(rng, (Hv, Dv), BF16), rand(rng, (Hv,), BF16), rand(rng, (Hv,), BF16, 2.0)
        y_f, cs_f, S_f, _ = _gated_delta_decode(q, k, v, z, a, b, d[6], cs_f, *d[8:11], S_f, seed=rng.seed)
        x = np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)])[None]
        qkv, cs_u = ops.causal_conv1d(x, d[6], cs_u)
        y_u, S_u = ops.gated_delta_step(qkv[0, :Hk * Dk].reshape(Hk, Dk), qkv[0, Hk * Dk:2 * Hk * Dk].reshape(Hk, Dk),
                                        qkv[0, 2 * Hk * Dk:].reshape(Hv, Dv), z, a, b, *d[8:11], S_u)
        np.testing.assert_array_equal(cs_f.view(np.uint16), cs_u.view(np.uint16), err_msg=f"step {t}")
        rel = 16 * np.sqrt((t + 2) * Dk) * F32_EPS
        assert_close(S_f, S_u, atol=rel * np.abs(S_u).max(), rtol=0, what=f"state step {t}", seed=rng.seed)
        assert_close(y_f, y_u, atol=2 * BF16_EPS * np.abs(y_u.astype(np.float32)).max(), rtol=2 * BF16_EPS,
                     what=f"y step {t}", seed=rng.seed)


@pytest.mark.parametrize("limit", [32, 96, 128])
def test_gated_delta_decode_fits_a_lower_pipeline_limit(rng, limit):
    """The grid comes from the pipeline's thread limit: under 32 / 96 / 128 threads the head is
    split over more threadgroups (Dv = 128: 64 / 22 / 16 per head) with the same results."""
    d = make_dec(rng, 1, 2, 128, 128)
    y0, cs0, S0, st0 = _gated_delta_decode(*d, seed=rng.seed)
    with simulated_device(max_threads={"gated_delta_decode_xf32_wf32": limit}):
        y, cs, S, stats = _gated_delta_decode(*d, seed=rng.seed)
    threads, blocks = dec_grid(128, limit)
    assert (threads, blocks) == {32: (32, 64), 96: (96, 22), 128: (128, 16)}[limit]
    assert stats["threads"] == 2 * blocks * threads + 2 * 32 and st0["threads"] == 2 * 8 * 256 + 2 * 32
    check_dec(rng, d, y, cs, S, what=f"gated_delta_decode under a {limit}-thread limit")
    np.testing.assert_array_equal(cs, cs0)
    with simulated_device(max_threads={"gated_delta_decode_xf32_wf32": 16}):
        with pytest.raises(ValueError, match="below one simdgroup"):
            _gated_delta_decode(*d)


def test_gated_delta_decode_is_order_independent(rng):
    """No races between the threadgroups of a head: forward, reverse, shuffled and 'ahead' orders
    give the same bits."""
    d = make_dec(rng, 2, 4, 40, 36)
    runs = [_gated_delta_decode(*d, order=o, seed=rng.seed)[:4] for o in ("forward", "reverse", "shuffle", "ahead")]
    for r in runs[1:]:
        for got, want in zip(r, runs[0]):
            np.testing.assert_array_equal(got, want)


def test_gated_delta_decode_bad_input(rng):
    d = list(make_dec(rng, 2, 4, 16, 8))
    bad = list(d)
    bad[2] = rand(rng, (3, 8))
    with pytest.raises(ValueError, match="multiple of key heads"):
        ops.gated_delta_decode(*bad)
    bad = list(d)
    bad[7] = d[7][:2]
    with pytest.raises(ValueError, match=r"conv_state must be \[K-1, C\]"):
        ops.gated_delta_decode(*bad)
    bad = list(d)
    bad[3] = d[3].astype(BF16)
    with pytest.raises(ValueError, match="z must have the dtype of q"):
        ops.gated_delta_decode(*bad)
    big = list(make_dec(rng, 1, 1, 130, 8))
    with pytest.raises(ValueError, match="<= 128"):
        ops.gated_delta_decode(*big)
