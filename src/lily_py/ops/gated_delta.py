"""Gated DeltaNet kernels over NumPy arrays (re-exported by :mod:`lily_py.ops`).

* :func:`causal_conv1d` - depthwise causal conv (kernel K, 4 in the model) + SiLU with its rolling
  state of the last K-1 inputs (decode: T = 1; prefill: any T, continuing from ``state``).
* :func:`gated_delta_scan` / :func:`gated_delta_step` - the fused gated delta rule over T tokens
  (one token): L2-normed q/k, decay and beta gates, the fp32 state update with the state in
  registers, the output and the gated RMSNorm - one dispatch.
* :func:`gated_delta_decode` - one decode token with the conv fused into the rule (the engine's
  decode kernel): conv window in, new window out, each value head split over threadgroups by
  value columns - one dispatch.
* :func:`gated_delta_mixer` - the whole DeltaNet token mixer of a layer: fused input projection
  (quantized matmul), conv1d, gated delta, output projection - 4 dispatches (one token: 3, the
  conv fused into the rule).

States use the reference layout (``lily_py.reference.gated_delta``): recurrent state float32
``[Hv, Dk, Dv]``, conv state ``[K-1, C]``; the device keeps the recurrent state as
``[Hv, Dv, Dk]`` (coalesced for its thread mapping) and these functions transpose. NumPy
oracles: ``lily_py.reference.kernels.causal_conv1d / gated_delta / gated_delta_mixer``.
"""
from __future__ import annotations

import numpy as np

from ._common import _BITS, _check_device, _core, _float_array, _from_core

__all__ = ["causal_conv1d", "gated_delta_scan", "gated_delta_step", "gated_delta_decode", "gated_delta_mixer",
           "gated_delta_route"]

_MAX_HEAD_DIM = 128  # kGdMaxDk / kGdMaxDv (shaders/common/args_gated_delta.h)


def _same(ref_name: str, ref_dtype: str, pairs, fn: str):
    for what, (a, name) in pairs:
        if name != ref_dtype:
            raise ValueError(f"{fn}: {what} must have the dtype of {ref_name} ({ref_dtype}), got {name}")


def _f32_vector(a, what: str, n: int, fn: str) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != (n,) or not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
        raise ValueError(f"{fn}: {what} must be a float array of shape [{n}], got {a.dtype} {list(a.shape)}")
    return np.ascontiguousarray(a.astype(np.float32))


def _state_f32(state, shape, fn: str) -> np.ndarray:
    if not isinstance(state, np.ndarray) or state.dtype != np.float32 or state.shape != shape:
        raise ValueError(f"{fn}: state must be float32 {list(shape)} (layout [Hv, Dk, Dv]), got "
                         f"{getattr(state, 'dtype', type(state).__name__)} {list(getattr(state, 'shape', ()))}")
    return np.ascontiguousarray(state.transpose(0, 2, 1))  # -> device layout [Hv, Dv, Dk]


def _conv_weight(weight, C: int, fn: str):
    wc, w_name = _float_array(weight, "conv weight", fn)
    if wc.ndim == 3 and wc.shape[0] == C and 1 in wc.shape[1:]:
        wc = wc.reshape(C, -1)  # MLX [C, K, 1] or Hugging Face [C, 1, K]
    if wc.ndim != 2 or wc.shape[0] != C or not 2 <= wc.shape[1] <= 8:
        raise ValueError(f"{fn}: conv weight must be [C={C}, K] with 2 <= K <= 8, got {list(weight.shape)}")
    return np.ascontiguousarray(wc), w_name


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray, *, device: str = "emu"):
    """Depthwise causal conv + SiLU with state: returns ``(y, new_state)``.

    ``x``: ``[T, C]`` float32 or bfloat16. ``weight``: ``[C, K]`` (or MLX's ``[C, K, 1]``), float32
    or bfloat16. ``state``: ``[K-1, C]`` in x's dtype, the K-1 inputs before ``x`` (zeros at the
    start of a sequence). ``y[t, c] = silu(sum_j weight[c, j] * xx[t + j, c])`` with
    ``xx = concat(state, x)``; ``new_state = xx[-(K-1):]``. Taps summed in float32; ``y`` in x's dtype.
    """
    y, st, _ = _causal_conv1d(x, weight, state, device=device)
    return y, st


def _causal_conv1d(x, weight, state, *, chunks=None, device="emu", order="shuffle", seed=0, fp_traps=True):
    """:func:`causal_conv1d` with the run's stats; ``chunks`` splits T into one dispatch per chunk
    (the state carried on the device between them)."""
    fn = "causal_conv1d"
    xc, x_name = _float_array(x, "x", fn)
    if xc.ndim != 2 or 0 in xc.shape:
        raise ValueError(f"{fn}: x must be [T, C] with T, C > 0, got {list(x.shape)}")
    T, C = xc.shape
    wc, w_name = _conv_weight(weight, C, fn)
    K = wc.shape[1]
    sc, s_name = _float_array(state, "state", fn)
    if sc.shape != (K - 1, C) or s_name != x_name:
        raise ValueError(f"{fn}: state must be [K-1, C] = {[K - 1, C]} of x's dtype ({x_name}), got "
                         f"{state.dtype} {list(state.shape)}")
    _check_device(device, fn)
    y, st, stats = _core().ops.conv1d(xc, wc, sc, chunks=list(chunks or []), x_dtype=x_name, w_dtype=w_name,
                                      device=device, order=order, seed=seed, fp_traps=fp_traps)
    return _from_core(y, x_name), _from_core(st, x_name), stats


def gated_delta_scan(q, k, v, z, a, b, A_log, dt_bias, norm_weight, state, *, eps: float = 1e-6,
                     device: str = "emu"):
    """The gated delta rule + gated RMSNorm over T tokens, in order: returns ``(y, new_state)``.

    ``q``, ``k``: ``[T, Hk, Dk]`` and ``v``: ``[T, Hv, Dv]``, the conv outputs (normalised in the
    kernel: ``q, k <- x * rsqrt(sum(x^2) + 1e-6)``, ``q *= Dk^-1/2``); ``z``: ``[T, Hv, Dv]`` output
    gate; ``a``, ``b``: ``[T, Hv]`` (``decay = exp(-exp(A_log) * softplus(a + dt_bias))``,
    ``beta = sigmoid(b)``). Activations float32 or bfloat16, all the same dtype. ``A_log``,
    ``dt_bias``: ``[Hv]``; ``norm_weight``: ``[Dv]`` (plain multiplier); dt_bias and norm_weight
    float32 or bfloat16 (same dtype), A_log any float (used as float32). ``state``: float32
    ``[Hv, Dk, Dv]``. Hv must be a multiple of Hk (value head h uses key head ``h // (Hv/Hk)``);
    Dk, Dv <= 128. ``y = rmsnorm(S^T q) * norm_weight * silu(z)`` ``[T, Hv, Dv]`` in the
    activation dtype; ``new_state`` float32 ``[Hv, Dk, Dv]``. The state stays float32 in registers
    for the whole scan; one dispatch.
    """
    y, st, _ = _gated_delta(q, k, v, z, a, b, A_log, dt_bias, norm_weight, state, eps=eps, device=device)
    return y, st


def gated_delta_route(tokens: int, head_k_dim: int, head_v_dim: int) -> str:
    """The engine's route for the delta rule over ``tokens`` tokens: ``"scan"`` (one dispatch,
    token by token) or ``"chunked"`` (the WY form over 64-token chunks, 4 dispatches; from 64
    tokens when both head dims are multiples of 8, at most 128)."""
    return str(_core().ops.gated_delta_route(int(tokens), int(head_k_dim), int(head_v_dim)))


def gated_delta_step(q, k, v, z, a, b, A_log, dt_bias, norm_weight, state, *, eps: float = 1e-6,
                     device: str = "emu"):
    """One decode step of :func:`gated_delta_scan`: ``q``, ``k`` ``[Hk, Dk]``, ``v``, ``z``
    ``[Hv, Dv]``, ``a``, ``b`` ``[Hv]``; returns ``(y [Hv, Dv], new_state [Hv, Dk, Dv])``."""
    y, st = gated_delta_scan(*(np.asarray(t)[None] for t in (q, k, v, z, a, b)), A_log, dt_bias,
                             norm_weight, state, eps=eps, device=device)
    return y[0], st


def gated_delta_decode(q, k, v, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, *,
                       eps: float = 1e-6, device: str = "emu"):
    """One decode token of the DeltaNet core with the conv fused: returns
    ``(y [Hv, Dv], new_conv_state [K-1, C], new_state [Hv, Dk, Dv])``.

    ``q``, ``k``: ``[Hk, Dk]`` and ``v``: ``[Hv, Dv]`` are the token's conv *inputs* (the q | k | v
    columns of the projection); the kernel applies the causal conv + SiLU against ``conv_state``
    (``[K-1, C]``, C = 2 Hk Dk + Hv Dv, x's dtype; weight ``[C, K]`` as :func:`causal_conv1d`),
    rounds the conv output to the activation dtype, then runs :func:`gated_delta_step` on it.
    The same result as ``causal_conv1d`` followed by ``gated_delta_step``, in two dispatches: the
    rule, whose value heads are split over threadgroups by value columns, then the gated norm."""
    y, cs, st, _ = _gated_delta_decode(q, k, v, z, a, b, conv_weight, conv_state, A_log, dt_bias,
                                          norm_weight, state, eps=eps, device=device)
    return y, cs, st


def _gated_delta_decode(q, k, v, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, *,
                        eps=1e-6, device="emu", order="shuffle", seed=0, fp_traps=True):
    """:func:`gated_delta_decode` plus the run's stats."""
    fn = "gated_delta_decode"
    qc, x_name = _float_array(q, "q", fn)
    vc, v_name = _float_array(v, "v", fn)
    if qc.ndim != 2 or vc.ndim != 2 or 0 in qc.shape or 0 in vc.shape:
        raise ValueError(f"{fn}: q must be [Hk, Dk] and v [Hv, Dv], got {list(q.shape)} and {list(v.shape)}")
    (Hk, Dk), (Hv, Dv) = qc.shape, vc.shape
    if Hv % Hk:
        raise ValueError(f"{fn}: value heads Hv={Hv} must be a multiple of key heads Hk={Hk}")
    if Dk > _MAX_HEAD_DIM or Dv > _MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head dims Dk={Dk}, Dv={Dv} must be <= {_MAX_HEAD_DIM}")
    kc, k_name = _float_array(k, "k", fn)
    zc, z_name = _float_array(z, "z", fn)
    ac, a_name = _float_array(a, "a", fn)
    bc, b_name = _float_array(b, "b", fn)
    _same("q", x_name, [("k", (kc, k_name)), ("v", (vc, v_name)), ("z", (zc, z_name)), ("a", (ac, a_name)),
                        ("b", (bc, b_name))], fn)
    for what, arr, shape in (("k", kc, (Hk, Dk)), ("z", zc, (Hv, Dv)), ("a", ac, (Hv,)), ("b", bc, (Hv,))):
        if arr.shape != shape:
            raise ValueError(f"{fn}: {what} must be {list(shape)}, got {list(arr.shape)}")
    C = 2 * Hk * Dk + Hv * Dv
    wc, w_name = _conv_weight(conv_weight, C, fn)
    K = wc.shape[1]
    csc, cs_name = _float_array(conv_state, "conv_state", fn)
    if csc.shape != (K - 1, C) or cs_name != x_name:
        raise ValueError(f"{fn}: conv_state must be [K-1, C] = {[K - 1, C]} of q's dtype ({x_name})")
    al = _f32_vector(A_log, "A_log", Hv, fn)
    dc, d_name = _float_array(dt_bias, "dt_bias", fn)
    nc, n_name = _float_array(norm_weight, "norm_weight", fn)
    if dc.shape != (Hv,) or nc.shape != (Dv,) or d_name != w_name or n_name != w_name:
        raise ValueError(f"{fn}: dt_bias [Hv={Hv}] and norm_weight [Dv={Dv}] must have conv_weight's dtype ({w_name})")
    st = _state_f32(state, (Hv, Dk, Dv), fn)
    if not float(eps) > 0:
        raise ValueError(f"{fn}: eps must be > 0, got {eps!r}")
    _check_device(device, fn)
    x = np.concatenate([qc.reshape(-1), kc.reshape(-1), vc.reshape(-1)])
    y, cs, st, stats = _core().ops.gated_delta_decode(
        x, zc.reshape(-1), ac, bc, wc, csc, al, dc, nc, st, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, eps=float(eps),
        x_dtype=x_name, w_dtype=w_name, device=device, order=order, seed=seed, fp_traps=fp_traps)
    return _from_core(y, x_name).reshape(Hv, Dv), _from_core(cs, x_name), st.transpose(0, 2, 1).copy(), stats


def _gated_delta(q, k, v, z, a, b, A_log, dt_bias, norm_weight, state, *, eps=1e-6, chunks=None,
                 route="scan", device="emu", order="shuffle", seed=0, fp_traps=True):
    """:func:`gated_delta_scan` with the run's stats; ``chunks`` splits T into one dispatch per chunk
    (``[1] * T`` = T decode steps; the state stays on the device between them). ``route``: "scan"
    (the token-by-token kernel), "chunked" (the WY form over 64-token chunks, 4 dispatches per
    part; head dims multiples of 8) or "auto" (the engine's switch, ``ops.gated_delta_route``)."""
    fn = "gated_delta"
    qc, x_name = _float_array(q, "q", fn)
    if qc.ndim != 3 or 0 in qc.shape:
        raise ValueError(f"{fn}: q must be [T, Hk, Dk], got {list(q.shape)}")
    T, Hk, Dk = qc.shape
    vc, v_name = _float_array(v, "v", fn)
    if vc.ndim != 3 or vc.shape[0] != T or 0 in vc.shape:
        raise ValueError(f"{fn}: v must be [T, Hv, Dv] with T = {T}, got {list(v.shape)}")
    Hv, Dv = vc.shape[1:]
    if Hv % Hk:
        raise ValueError(f"{fn}: value heads Hv={Hv} must be a multiple of key heads Hk={Hk}")
    if Dk > _MAX_HEAD_DIM or Dv > _MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head dims Dk={Dk}, Dv={Dv} must be <= {_MAX_HEAD_DIM}")
    kc, k_name = _float_array(k, "k", fn)
    zc, z_name = _float_array(z, "z", fn)
    ac, a_name = _float_array(a, "a", fn)
    bc, b_name = _float_array(b, "b", fn)
    _same("q", x_name, [("k", (kc, k_name)), ("v", (vc, v_name)), ("z", (zc, z_name)), ("a", (ac, a_name)),
                        ("b", (bc, b_name))], fn)
    for what, arr, shape in (("k", kc, (T, Hk, Dk)), ("z", zc, (T, Hv, Dv)), ("a", ac, (T, Hv)), ("b", bc, (T, Hv))):
        if arr.shape != shape:
            raise ValueError(f"{fn}: {what} must be {list(shape)}, got {list(arr.shape)}")
    al = _f32_vector(A_log, "A_log", Hv, fn)
    dc, w_name = _float_array(dt_bias, "dt_bias", fn)
    nc, n_name = _float_array(norm_weight, "norm_weight", fn)
    if dc.shape != (Hv,) or nc.shape != (Dv,) or n_name != w_name:
        raise ValueError(f"{fn}: dt_bias must be [Hv={Hv}] and norm_weight [Dv={Dv}] of one dtype, got "
                         f"{dt_bias.dtype} {list(dt_bias.shape)} and {norm_weight.dtype} {list(norm_weight.shape)}")
    st = _state_f32(state, (Hv, Dk, Dv), fn)
    if not float(eps) > 0:
        raise ValueError(f"{fn}: eps must be > 0, got {eps!r}")
    _check_device(device, fn)
    qkv = np.concatenate([qc.reshape(T, -1), kc.reshape(T, -1), vc.reshape(T, -1)], axis=1)
    y, st, stats = _core().ops.gated_delta(
        qkv, zc.reshape(T, -1), ac, bc, al, dc, nc, st, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, eps=float(eps),
        chunks=list(chunks or []), route=route, x_dtype=x_name, w_dtype=w_name, device=device, order=order, seed=seed,
        fp_traps=fp_traps)
    return _from_core(y, x_name).reshape(T, Hv, Dv), st.transpose(0, 2, 1).copy(), stats


def gated_delta_mixer(x, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, conv_weight, A_log,
                      dt_bias, norm_weight, conv_state, state, *, num_key_heads: int, num_value_heads: int,
                      head_k_dim: int, head_v_dim: int, bits: int = 4, group_size: int = 64,
                      eps: float = 1e-6, device: str = "emu"):
    """The Gated DeltaNet token mixer of one layer on the device: returns ``(out, conv_state, state)``.

    ``x``: ``[T, hidden]`` normed hidden states (float32 or bfloat16; T = 1 for decode). Each
    projection is a tuple ``(w, scales, biases)`` in MLX's affine layout with the same ``bits`` and
    ``group_size``: ``in_proj_qkv [C, hidden]`` (C = 2 Hk Dk + Hv Dv), ``in_proj_z [Hv Dv, hidden]``,
    ``in_proj_b``/``in_proj_a`` ``[Hv, hidden]``, ``out_proj [hidden, Hv Dv]``; the four input
    projections are concatenated by rows here (the engine does it once at load) and run as one
    quantized matmul. Then conv1d, the fused gated delta rule and out_proj: 4 dispatches, 3 barriers.
    ``conv_weight [C, K]``, ``A_log``, ``dt_bias [Hv]``, ``norm_weight [Dv]`` as in
    :func:`causal_conv1d` / :func:`gated_delta_scan`; ``conv_state [K-1, C]`` in x's dtype;
    ``state`` float32 ``[Hv, Dk, Dv]``.
    """
    out, cs, st, _ = _gated_delta_mixer(
        x, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, conv_weight, A_log, dt_bias, norm_weight,
        conv_state, state, num_key_heads=num_key_heads, num_value_heads=num_value_heads, head_k_dim=head_k_dim,
        head_v_dim=head_v_dim, bits=bits, group_size=group_size, eps=eps, device=device)
    return out, cs, st


def _gated_delta_mixer(x, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, conv_weight, A_log, dt_bias,
                       norm_weight, conv_state, state, *, num_key_heads, num_value_heads, head_k_dim, head_v_dim,
                       bits=4, group_size=64, eps=1e-6, device="emu", order="shuffle", seed=0, fp_traps=True):
    fn = "gated_delta_mixer"
    Hk, Hv, Dk, Dv = (int(v) for v in (num_key_heads, num_value_heads, head_k_dim, head_v_dim))
    if min(Hk, Hv, Dk, Dv) <= 0 or Hv % Hk or Dk > _MAX_HEAD_DIM or Dv > _MAX_HEAD_DIM:
        raise ValueError(f"{fn}: need Hv a multiple of Hk and 0 < Dk, Dv <= {_MAX_HEAD_DIM}; got Hk={Hk} Hv={Hv} "
                         f"Dk={Dk} Dv={Dv}")
    if bits not in _BITS or group_size not in (32, 64, 128):
        raise ValueError(f"{fn}: bits must be one of {_BITS} and group_size 32, 64 or 128, got {bits}, {group_size}")
    xc, x_name = _float_array(x, "x", fn)
    if xc.ndim != 2 or 0 in xc.shape:
        raise ValueError(f"{fn}: x must be [T, hidden], got {list(x.shape)}")
    C = 2 * Hk * Dk + Hv * Dv

    def lin(p, what):
        if not isinstance(p, (tuple, list)) or len(p) != 3:
            raise ValueError(f"{fn}: {what} must be a tuple (w, scales, biases)")
        w, s, b = p
        if not isinstance(w, np.ndarray) or w.dtype != np.uint32 or w.ndim != 2:
            raise ValueError(f"{fn}: {what} weight must be a 2-D uint32 array")
        sc, s_name = _float_array(s, f"{what} scales", fn)
        bc, b_name = _float_array(b, f"{what} biases", fn)
        if s_name != b_name:
            raise ValueError(f"{fn}: {what} scales and biases must have the same dtype")
        return np.ascontiguousarray(w), sc, bc, s_name

    ins = [lin(p, n) for p, n in ((in_proj_qkv, "in_proj_qkv"), (in_proj_z, "in_proj_z"), (in_proj_b, "in_proj_b"),
                                  (in_proj_a, "in_proj_a"))]
    ow, os_, ob, o_name = lin(out_proj, "out_proj")
    s_name = ins[0][3]
    if any(p[3] != s_name for p in ins) or o_name != s_name:
        raise ValueError(f"{fn}: every projection's scales must have one dtype")
    rows = [C, Hv * Dv, Hv, Hv]
    for (w, _, _, _), r, n in zip(ins, rows, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        if w.shape[0] != r:
            raise ValueError(f"{fn}: {n} must have {r} rows, got {w.shape[0]}")
    in_w, in_s, in_b = (np.ascontiguousarray(np.concatenate([p[i] for p in ins], axis=0)) for i in range(3))
    wc, w_name = _conv_weight(conv_weight, C, fn)
    K = wc.shape[1]
    csc, cs_name = _float_array(conv_state, "conv_state", fn)
    if csc.shape != (K - 1, C) or cs_name != x_name:
        raise ValueError(f"{fn}: conv_state must be [K-1, C] = {[K - 1, C]} of x's dtype ({x_name})")
    al = _f32_vector(A_log, "A_log", Hv, fn)
    dc, d_name = _float_array(dt_bias, "dt_bias", fn)
    nc, n_name = _float_array(norm_weight, "norm_weight", fn)
    if d_name != w_name or n_name != w_name:
        raise ValueError(f"{fn}: dt_bias and norm_weight must have conv_weight's dtype ({w_name})")
    st = _state_f32(state, (Hv, Dk, Dv), fn)
    _check_device(device, fn)
    out, cs, st, stats = _core().ops.gated_delta_mixer(
        xc, in_w, in_s, in_b, ow, os_, ob, wc, al, dc, nc, csc, st, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, eps=float(eps),
        bits=bits, group_size=group_size, x_dtype=x_name, scale_dtype=s_name, w_dtype=w_name, device=device,
        order=order, seed=seed, fp_traps=fp_traps)
    return _from_core(out, x_name), _from_core(cs, x_name), st.transpose(0, 2, 1).copy(), stats
