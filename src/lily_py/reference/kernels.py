"""Kernel-level NumPy references: what each lily_py.ops function must compute.

Written for clarity, in float64 on the exact values the kernels see (activations as given,
weights dequantized by :mod:`lily_py.reference.quant` in float32), so a test measures only the
kernel's own rounding. Never imports the extension.
"""
from __future__ import annotations

import numpy as np

from . import quant


def quantized_matmul(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, *,
                     bits: int, group_size: int) -> np.ndarray:
    """``x @ dequantize(w, scales, biases).T`` in float64; ``x`` is ``[..., K]``, result ``[..., N]``."""
    wd = quant.dequantize(w, scales, biases, bits=bits, group_size=group_size).astype(np.float64)
    return np.asarray(x).astype(np.float64) @ wd.T


def int8_rows(x: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """x as ``qmm_m5i8`` quantizes it, per row and per ``group`` columns, in float32 as the kernel
    computes: ``s = max |x| / 127`` (0 for an all-zero group), codes ``rint(x / s)`` clamped to
    [-127, 127] (0 where s = 0). Returns ``(codes as float64, s [..., K / group] float64)``; the
    dequantized x is ``codes * repeat(s)``."""
    x = np.asarray(x).astype(np.float32)
    K = x.shape[-1]
    xs = x.reshape(x.shape[:-1] + (K // group, group))
    s = np.abs(xs).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.clip(np.rint(xs / s), -127, 127), 0).astype(np.float32)
    return q.reshape(x.shape).astype(np.float64), s[..., 0].astype(np.float64)


def quantize_i8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 activation scratch ``quantize_i8`` writes for bf16 rows x[rows, K] (shaders/m5/qmm_m5.metal,
    layout in shaders/common/args.h): ``(codes int8 [rows, K] with each 8 columns in the order
    0 2 4 6 1 3 5 7, scales float32 [rows, K / 32], sums float32 [rows, K / 32])``; the codes and
    scales are ``int8_rows``', the sums ``s * sum(codes)`` over the 32 columns (one fp32 rounding)."""
    x = np.asarray(x).astype(np.float32)
    rows, K = x.shape
    codes, s = int8_rows(x)
    perm = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    permuted = codes.reshape(rows, K // 8, 8)[:, :, perm].reshape(rows, K).astype(np.int8)
    sums = s.astype(np.float32) * codes.reshape(rows, K // 32, 32).sum(-1).astype(np.float32)
    return permuted, s.astype(np.float32), sums


def quantized_matmul_i8(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, *,
                        group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """What ``qmm_m5i8`` computes (float64; 4-bit weights): x rounded to int8 per row and 32 columns
    (``int8_rows``) times the dequantized weights, ``y = x_int8 @ (s_w q + b_w).T`` (the kernel: per
    weight group ``s_w (x_int8 . q) + b_w sum(x_int8)``). Returns ``(y, mag)``, mag the magnitude
    fp32 rounding of that sum is proportional to (both terms)."""
    codes, sx = int8_rows(x)
    xq = codes * np.repeat(sx, 32, axis=-1)
    q = quant.unpack(w, 4).astype(np.float64)
    sw = np.repeat(np.asarray(scales).astype(np.float64), group_size, axis=-1)
    bw = np.repeat(np.asarray(biases).astype(np.float64), group_size, axis=-1)
    y = xq @ (sw * q + bw).T
    mag = np.abs(xq) @ np.abs(sw * q).T + np.abs(xq) @ np.abs(bw).T
    return y, mag


def quantized_matmul_error_scale(x: np.ndarray, w: np.ndarray, scales: np.ndarray,
                                 biases: np.ndarray, *, bits: int, group_size: int) -> np.ndarray:
    """``sum_k |x[m, k]| * (|s q[n, k]| + |b|)`` per output: the magnitude that fp32 rounding error
    of any summation order of ``x @ dequant(w).T`` is proportional to (``[..., N]``, float64)."""
    q = quant.unpack(w, bits).astype(np.float64)
    k = q.shape[-1]
    s = np.repeat(np.abs(np.asarray(scales).astype(np.float64)), group_size, axis=-1)[..., :k]
    b = np.repeat(np.abs(np.asarray(biases).astype(np.float64)), group_size, axis=-1)[..., :k]
    mag = s * q + b
    return np.abs(np.asarray(x).astype(np.float64)) @ mag.T


def rms_norm(x: np.ndarray, weight: np.ndarray, *, eps: float, weight_offset: float = 0.0) -> np.ndarray:
    """``x * rsqrt(mean(x^2, -1) + eps) * (weight + weight_offset)`` in float64.

    ``weight_offset = 1`` is Hugging Face's zero-centred RMSNorm (``(1 + w)``); MLX-format
    checkpoints store the folded multiplier (offset 0)."""
    x64 = np.asarray(x).astype(np.float64)
    w64 = np.asarray(weight).astype(np.float64) + weight_offset
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + np.float64(np.float32(eps))) * w64


def residual_add(x: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """The new residual stream ``h = x + residual``: added in float32, stored in x's dtype."""
    return (np.asarray(x).astype(np.float32) + np.asarray(residual).astype(np.float32)).astype(x.dtype)


def embedding(ids: np.ndarray, table: np.ndarray, scales: np.ndarray, biases: np.ndarray, *,
              bits: int, group_size: int) -> np.ndarray:
    """Rows ``ids`` of the dequantized table (float32, exactly the values fp32 dequantization gives)."""
    ids = np.asarray(ids)
    rows = quant.dequantize(table[ids.reshape(-1)], scales[ids.reshape(-1)], biases[ids.reshape(-1)],
                            bits=bits, group_size=group_size)
    return rows.reshape(*ids.shape, rows.shape[-1])


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up = gate * sigmoid(gate) * up`` in float64."""
    g = np.asarray(gate).astype(np.float64)
    return g / (1.0 + np.exp(-g)) * np.asarray(up).astype(np.float64)


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``x * sigmoid(gate)`` in float64 (gate broadcasts, e.g. one value per row)."""
    return np.asarray(x).astype(np.float64) / (1.0 + np.exp(-np.asarray(gate).astype(np.float64)))


# ---- Gated DeltaNet (lily_py.ops.causal_conv1d / gated_delta / gated_delta_mixer) ------------

def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU in float64: ``x [T, C]``, ``weight [C, K]``, ``state [K-1, C]``.

    ``y[t, c] = silu(sum_j weight[c, j] * xx[t + j, c])`` with ``xx = concat(state, x)``; the new
    state is ``xx[-(K-1):]`` (values as given, in x's dtype). Returns ``(y float64, new_state)``."""
    K = weight.shape[1]
    xx = np.concatenate([np.asarray(state), np.asarray(x)], axis=0)
    x64, w64 = xx.astype(np.float64), np.asarray(weight).astype(np.float64)
    T = x.shape[0]
    acc = sum(x64[j:j + T] * w64[:, j] for j in range(K))
    return acc / (1.0 + np.exp(-acc)), xx[xx.shape[0] - (K - 1):].copy()


def conv1d_error_scale(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> np.ndarray:
    """``sum_j |w[c, j] xx[t + j, c]|`` per output: what fp32 rounding of the taps scales with."""
    K = weight.shape[1]
    xx = np.abs(np.concatenate([np.asarray(state), np.asarray(x)], axis=0).astype(np.float64))
    w64 = np.abs(np.asarray(weight).astype(np.float64))
    return sum(xx[j:j + x.shape[0]] * w64[:, j] for j in range(K))


def _gd_inputs(q, k, v, z, a, b):
    """The delta rule's inputs in float64: q and k L2-normalised (eps 1e-6), q scaled by Dk^-1/2,
    both repeated to the value heads; v, z, a, b converted."""
    q, k, v, z, a, b = (np.asarray(t).astype(np.float64) for t in (q, k, v, z, a, b))
    rep = v.shape[1] // q.shape[1]
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + np.float64(np.float32(1e-6)))
    q = q * np.float64(np.float32(q.shape[-1] ** -0.5))
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + np.float64(np.float32(1e-6)))
    return np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1), v, z, a, b


def gated_delta(q, k, v, z, a, b, A_log, dt_bias, norm_weight, state, *, eps: float):
    """The fused gated delta rule + gated RMSNorm in float64, token by token.

    q, k ``[T, Hk, Dk]`` and v ``[T, Hv, Dv]`` raw (after the conv; normalised here), z
    ``[T, Hv, Dv]``, a, b ``[T, Hv]``, A_log, dt_bias ``[Hv]``, norm_weight ``[Dv]``, state
    ``[Hv, Dk, Dv]`` (the reference layout). Returns ``(y [T, Hv, Dv], new_state [Hv, Dk, Dv])``.
    """
    f = lambda t: np.asarray(t).astype(np.float64)  # noqa: E731
    q, k, v, z, a, b = _gd_inputs(q, k, v, z, a, b)
    T = q.shape[0]
    decay = np.exp(-np.exp(f(A_log)) * np.logaddexp(0.0, a + f(dt_bias)))   # [T, Hv]
    beta = 1.0 / (1.0 + np.exp(-b))
    S = f(state).copy()
    o = np.empty(v.shape)
    for t in range(T):
        S *= decay[t][:, None, None]
        u = (v[t] - np.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
        S += k[t][:, :, None] * u[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    rms = np.sqrt(np.mean(o * o, -1, keepdims=True) + np.float64(np.float32(eps)))
    y = o / rms * f(norm_weight) * (z / (1.0 + np.exp(-z)))
    return y, S


def gated_delta_chunked_m5(q, k, v, z, a, b, A_log, dt_bias, norm_weight, state, *, eps: float,
                           chunk: int = 64, parts=None):
    """:func:`gated_delta` in the chunked (WY) form with the M5 route's half operands, float64.

    The tensor-op products of ``gd_chunk_wy_m5`` / ``gd_chunk_state_m5`` take half operands (fp32
    accumulation); everything else is exact here. Rounded to half, at the kernels' points: the
    normalised, scaled q (one copy, used by Q K^T and Q S), k in the Gram products K K^T and Q K^T
    (the solve's right-hand sides and W use k unrounded), P, and per chunk the state pass's
    operands: S (in W S and Q S), W = -T diag(b e^G) K (in W S), U = u + W S (in P U and the state
    update) and diag(tail) K (in the state update K^T diag(tail) U). The state itself and U's fp32
    value stay unrounded, but the rounded products feed back into the state. Same arguments and result as :func:`gated_delta`. ``parts``: the prompt
    split as the device split it (one dispatch each, route "auto"): a part of fewer than ``chunk``
    tokens runs token by token (the scan: exact, no half operands), a longer one in chunks from its
    own start; None: all T tokens in the chunked form (route "chunked", any T).
    """
    f = lambda t: np.asarray(t).astype(np.float64)  # noqa: E731
    h16 = lambda t: np.asarray(t).astype(np.float16).astype(np.float64)  # noqa: E731
    q, k, v, z, a, b = _gd_inputs(q, k, v, z, a, b)
    T = q.shape[0]
    qh, kh = h16(q), h16(k)
    g = -np.exp(f(A_log)) * np.logaddexp(0.0, a + f(dt_bias))              # [T, Hv]
    beta = 1.0 / (1.0 + np.exp(-b))
    S = f(state).copy()                                                      # [Hv, Dk, Dv]
    o = np.empty(v.shape)
    p0 = 0
    for n_part in (parts or [T]):
        if parts is not None and n_part < chunk:  # the scan
            for t in range(p0, p0 + n_part):
                S *= np.exp(g[t])[:, None, None]
                u = (v[t] - np.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
                S += k[t][:, :, None] * u[:, None, :]
                o[t] = np.einsum("hkv,hk->hv", S, q[t])
            p0 += n_part
            continue
        for s in range(p0, p0 + n_part, chunk):
            e = min(p0 + n_part, s + chunk)
            n = e - s
            qc, kc, khc = qh[s:e].transpose(1, 0, 2), k[s:e].transpose(1, 0, 2), kh[s:e].transpose(1, 0, 2)
            vc, bc = v[s:e].transpose(1, 0, 2), beta[s:e].T                  # [Hv, n, Dv], [Hv, n]
            G = np.cumsum(g[s:e].T, axis=1)                                  # [Hv, n]
            lower = np.tril(np.ones((n, n), dtype=bool))
            decay = np.where(lower, np.exp(np.where(lower, G[:, :, None] - G[:, None, :], 0.0)), 0.0)
            A = np.eye(n) + bc[:, :, None] * decay * ~np.eye(n, dtype=bool) * (khc @ khc.transpose(0, 2, 1))
            Tm = np.linalg.inv(A)                                            # (I + A)^-1
            eG = np.exp(G)
            Sh = h16(S)
            U = Tm @ (bc[:, :, None] * vc) + h16(-(Tm @ (bc[:, :, None] * eG[:, :, None] * kc))) @ Sh
            Uh = h16(U)
            P = h16(decay * (qc @ khc.transpose(0, 2, 1)))
            o[s:e] = (eG[:, :, None] * (qc @ Sh) + P @ Uh).transpose(1, 0, 2)
            tail = np.exp(G[:, -1:] - G)
            S = eG[:, -1, None, None] * S + h16(kc * tail[:, :, None]).transpose(0, 2, 1) @ Uh
        p0 += n_part
    rms = np.sqrt(np.mean(o * o, -1, keepdims=True) + np.float64(np.float32(eps)))
    y = o / rms * f(norm_weight) * (z / (1.0 + np.exp(-z)))
    return y, S


def gated_delta_mixer(x, in_proj, out_proj, conv_weight, A_log, dt_bias, norm_weight, conv_state,
                      state, *, Hk: int, Hv: int, Dk: int, Dv: int, eps: float, bits: int,
                      group_size: int, round_to=None):
    """The Gated DeltaNet token mixer of one layer in float64 from the kernel references above.

    ``in_proj`` / ``out_proj``: ``(w, scales, biases)`` in MLX's layout, in_proj rows
    ``qkv | z | b | a``. ``round_to``: the activation dtype the device stores intermediates in
    (the projection, the conv output, the normed output); each is rounded to it at the same
    point. Returns ``(out [T, hidden], conv_state, state [Hv, Dk, Dv])``."""
    rnd = (lambda t: t) if round_to is None else (lambda t: np.asarray(t).astype(round_to))  # noqa: E731
    T = x.shape[0]
    C, VD = 2 * Hk * Dk + Hv * Dv, Hv * Dv
    proj = rnd(quantized_matmul(x, *in_proj, bits=bits, group_size=group_size))
    qkv, new_conv = causal_conv1d(proj[:, :C], conv_weight, conv_state)
    qkv = rnd(qkv)
    z = proj[:, C:C + VD].reshape(T, Hv, Dv)
    bb, aa = proj[:, C + VD:C + VD + Hv], proj[:, C + VD + Hv:]
    q = qkv[:, :Hk * Dk].reshape(T, Hk, Dk)
    k = qkv[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk)
    v = qkv[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)
    o, S = gated_delta(q, k, v, z, aa, bb, A_log, dt_bias, norm_weight, state, eps=eps)
    o = rnd(o.reshape(T, VD))
    return quantized_matmul(o, *out_proj, bits=bits, group_size=group_size), new_conv, S
# ------------------------------------------------------------------------------ mixture of experts
def dequantized_magnitude(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, *, bits: int,
                          group_size: int) -> np.ndarray:
    """``|s| q + |b|`` per weight (float64, ``[..., N, K]``): what fp32 rounding in any
    dequantize-and-dot order is proportional to (see :func:`quantized_matmul_error_scale`)."""
    q = quant.unpack(w, bits).astype(np.float64)
    s = np.repeat(np.abs(np.asarray(scales).astype(np.float64)), group_size, axis=-1)
    b = np.repeat(np.abs(np.asarray(biases).astype(np.float64)), group_size, axis=-1)
    return s * q + b


def moe_logits(x: np.ndarray, router: np.ndarray, shared_gate: np.ndarray) -> np.ndarray:
    """Router logits ``[T, E + 1]`` in float64: ``x @ router.T`` then the shared-expert gate logit
    (the kernels' fused router matrix has the shared gate as row E)."""
    return np.asarray(x, np.float64) @ np.concatenate([router, shared_gate], 0).astype(np.float64).T


def moe_route(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Routing the kernels must reproduce: ``lily_py.reference.moe.route`` on the fp32 router
    logits (softmax over all experts in fp32, top-k with ties to the lowest index,
    renormalised), plus the shared gate ``sigmoid(logit E)``. ``logits``: ``[T, E + 1]``.
    Returns ``(ids [T, k], weights [T, k] float32, shared_gate [T] float64)``."""
    from .moe import route
    logits = np.asarray(logits)
    ids, weights = route(logits[:, :-1].astype(np.float32), top_k)
    return ids, weights, 1.0 / (1.0 + np.exp(-logits[:, -1].astype(np.float64)))


def moe(x, router, gate, up, down, shared_gate_proj, shared_up, shared_down, shared_gate, *, top_k,
        residual=None):
    """The MoE block in float64 on dense (dequantized) weights: ``router [E, H]``, stacked
    ``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]``, shared ``[Is, H]``, ``[Is, H]``,
    ``[H, Is]``, ``shared_gate [1, H]``. Same math as ``lily_py.reference.moe.moe_block``.
    Returns ``(out [T, H] float64, ids [T, k], weights [T, k])``."""
    x64 = np.asarray(x, np.float64)
    ids, weights, sgate = moe_route(moe_logits(x, router, shared_gate), top_k)
    out = np.zeros_like(x64) if residual is None else np.asarray(residual, np.float64).copy()
    for t in range(x64.shape[0]):
        for j in range(top_k):
            e = ids[t, j]
            h = swiglu(gate[e] @ x64[t], up[e] @ x64[t])
            out[t] += float(weights[t, j]) * (np.asarray(down[e], np.float64) @ h)
    hs = swiglu(x64 @ np.asarray(shared_gate_proj, np.float64).T, x64 @ np.asarray(shared_up, np.float64).T)
    out += sgate[:, None] * (hs @ np.asarray(shared_down, np.float64).T)
    return out, ids, weights


def moe_error_bound(x, mags: dict, dense: dict, *, top_k, residual=None) -> np.ndarray:
    """Bound ``[T, H]`` (float64) on |kernel - moe()| from fp32 rounding, for tokens whose routing
    agrees. ``mags``/``dense``: ``dequantized_magnitude`` / dequantized matrices under the keys
    router, gate, up, down, shared_gate_proj, shared_up, shared_down, shared_gate.
    With u = 2^-24 and e_K = 8 sqrt(K) u (the dot-product factor tests/kernels use for
    quantized_matmul):
      gate/up:   |dg| <= e_H |x|.|Wg|, |du| <= e_H |x|.|Wu|
      h:         |dh| <= 1.1 |dg| |u| + |silu(g)| |du| + 4 u |h|      (|silu'| <= 1.1)
      y = D h:   |dy| <= |D|.|dh| + e_I |D|.|h|
      weights:   logits |dl| <= e_H |x|.|Wr|; softmax + renormalisation + sigmoid:
                 |dw| <= w (4 max|dl| + (2E + 2k + 16) u)
      out:       sum_j (w_j |dy_j| + |dw_j| |y_j|) + (k + 2) u (sum_j w_j |y_j| + |residual|)."""
    u = 2.0 ** -24
    x64 = np.asarray(x, np.float64)
    T, H = x64.shape
    E = dense["router"].shape[0]
    eH = 8 * np.sqrt(H) * u
    ax = np.abs(x64)
    logits = moe_logits(x, dense["router"], dense["shared_gate"])
    ids, weights, sgate = moe_route(logits, top_k)
    dl = eH * (ax @ np.concatenate([mags["router"], mags["shared_gate"]], 0).T)
    wrel = 4 * dl.max(axis=1) + (2 * E + 2 * top_k + 16) * u

    def branch(t, Wg, Wu, Wd, Mg, Mu, Md):
        g = Wg @ x64[t]
        up_ = Wu @ x64[t]
        sig = 1.0 / (1.0 + np.exp(-g))
        silu = g * sig
        h = silu * up_
        dg, du = eH * (Mg @ ax[t]), eH * (Mu @ ax[t])
        dh = 1.1 * dg * np.abs(up_) + np.abs(silu) * du + 4 * u * np.abs(h)
        eI = 8 * np.sqrt(Wd.shape[1]) * u
        y = Wd @ h
        dy = Md @ dh + eI * (Md @ np.abs(h))
        return np.abs(y), dy

    bound = np.zeros((T, H))
    for t in range(T):
        total = np.zeros(H)
        slots = [(float(weights[t, j]), ids[t, j]) for j in range(top_k)]
        for w, e in slots:
            ay, dy = branch(t, dense["gate"][e], dense["up"][e], dense["down"][e],
                            mags["gate"][e], mags["up"][e], mags["down"][e])
            bound[t] += w * dy + w * wrel[t] * ay
            total += w * ay
        ay, dy = branch(t, dense["shared_gate_proj"], dense["shared_up"], dense["shared_down"],
                        mags["shared_gate_proj"], mags["shared_up"], mags["shared_down"])
        s = sgate[t]
        bound[t] += s * dy + s * (dl[t, -1] + 4 * u) * ay
        total += s * ay
        res = 0.0 if residual is None else np.abs(np.asarray(residual[t], np.float64))
        bound[t] += (top_k + 2) * u * (total + res)
    return bound
# ---------------------------------------------------------------------------------------------
# Attention family (shaders/attention.metal): RoPE, fused q/k norm + RoPE + KV append, attention.
# The KV cache the kernels use is bf16 [kv_heads, capacity, head_dim] (head-major, unlike
# reference.attention.KVCache's [capacity, kv_heads, head_dim]).

def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """``float32(1 / theta^(2i / rotary_dim))``, exactly as :func:`lily_py.reference.ops.rope_cos_sin`."""
    return (1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))).astype(np.float32)


def rope_angles(positions, rotary_dim: int, theta: float) -> np.ndarray:
    """``[T, rotary_dim / 2]`` float32 angles ``float32(position) * inv_freq`` (one fp32 product)."""
    return np.asarray(positions, dtype=np.float32)[:, None] * rope_inv_freq(rotary_dim, theta)[None, :]


def rope(x: np.ndarray, *, position: int, rotary_dim: int, theta: float) -> np.ndarray:
    """Partial rotate-half RoPE of ``x [T, heads, D]`` (token t at ``position + t``) in float64,
    from the float32 angles the kernels compute; features ``>= rotary_dim`` pass through."""
    x64 = np.asarray(x).astype(np.float64)
    T = x64.shape[0]
    ang = rope_angles(np.arange(position, position + T), rotary_dim, theta).astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = rotary_dim // 2
    a, b = x64[..., :half], x64[..., half:rotary_dim]
    return np.concatenate([a * c - b * s, b * c + a * s, x64[..., rotary_dim:]], axis=-1)


def qk_norm_rope(qg: np.ndarray, k: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, *, position: int,
                 rotary_dim: int, theta: float, eps: float, weight_offset: float = 0.0):
    """``(q, k)`` after per-head RMSNorm and partial RoPE, float64: ``q`` from the query half of
    ``qg [T, Hq, 2D]`` (``[T, Hq, D]``), ``k`` from ``k [T, Hkv, D]``. The values go to the cache
    unchanged (rounded to bf16 there)."""
    D = k.shape[-1]
    q = rms_norm(np.asarray(qg)[..., :D], q_norm, eps=eps, weight_offset=weight_offset)
    kn = rms_norm(k, k_norm, eps=eps, weight_offset=weight_offset)
    return (rope(q, position=position, rotary_dim=rotary_dim, theta=theta),
            rope(kn, position=position, rotary_dim=rotary_dim, theta=theta))


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, *, position: int,
              gate: np.ndarray | None = None):
    """Causal GQA attention over a head-major cache, float64, and the magnitudes its error scales with.

    ``q [T, Hq, D]``: token ``t`` sits at ``position + t`` and sees cache rows ``0 .. position + t``;
    ``k_cache, v_cache [Hkv, capacity, D]``; query head ``h`` uses KV head ``h // (Hq / Hkv)``.
    Scores ``q . k * float32(D ** -0.5)``; ``out = softmax(scores) v`` times ``sigmoid(gate)``
    when a gate ``[T, Hq, D]`` is given. Returns ``(out [T, Hq, D], score_mag [T, Hq, 1],
    value_mag [T, Hq, D])``: ``score_mag = max_j scale * sum_d |q_d k_jd|`` (what the fp32 error of
    a score is proportional to) and ``value_mag = sum_j p_j |v_jd|`` (times the gate).
    """
    q64 = np.asarray(q).astype(np.float64)
    k64 = np.asarray(k_cache).astype(np.float64)
    v64 = np.asarray(v_cache).astype(np.float64)
    T, Hq, D = q64.shape
    Hkv = k64.shape[0]
    g = Hq // Hkv
    scale = np.float64(np.float32(D ** -0.5))
    out = np.empty((T, Hq, D))
    smag = np.empty((T, Hq, 1))
    vmag = np.empty((T, Hq, D))
    for t in range(T):
        S = position + t + 1
        for h in range(Hq):
            kk, vv = k64[h // g, :S], v64[h // g, :S]
            s = kk @ q64[t, h] * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ vv
            smag[t, h] = (np.abs(kk) @ np.abs(q64[t, h])).max() * scale
            vmag[t, h] = p @ np.abs(vv)
    if gate is not None:
        sg = 1.0 / (1.0 + np.exp(-np.asarray(gate).astype(np.float64)))
        out *= sg
        vmag *= sg
    return out, smag, vmag
