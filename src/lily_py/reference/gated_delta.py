"""Gated DeltaNet token mixer in NumPy: causal conv1d with state, and the gated delta rule in a
recurrent (token by token) and a chunked form.

Shapes (real model): T tokens, Hk = 16 key heads, Hv = 32 value heads, Dk = Dv = 128,
conv channels C = 2*Hk*Dk + Hv*Dv = 8192, kernel K = 4. State ``S`` is float32
``[Hv, Dk, Dv]`` (Hugging Face's layout), conv state ``[K-1, C]`` (the last K-1 inputs).

Delta rule per value head h (uses key head ``h // (Hv/Hk)``), per token t:
    S <- exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T q_t
"""
from __future__ import annotations

import numpy as np

from .ops import silu


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU over ``x [T, C]`` with ``weight [C, K]``.

    ``state [K-1, C]`` holds the K-1 inputs before ``x`` (zeros at the start of a sequence).
    ``out[t, c] = silu(sum_j weight[c, j] * xx[t + j, c])`` with ``xx = concat(state, x)``.
    Returns ``(out [T, C], new_state [K-1, C])``.
    """
    K = weight.shape[1]
    xx = np.concatenate([state, x], axis=0)
    T = x.shape[0]
    out = np.zeros_like(x, dtype=np.float32)
    for j in range(K):
        out += xx[j:j + T] * weight[:, j]
    return silu(out), xx[xx.shape[0] - (K - 1):].copy()


def _expand_heads(x: np.ndarray, hv: int) -> np.ndarray:
    """[T, Hk, D] -> [T, Hv, D]: each key head serves Hv/Hk consecutive value heads."""
    return np.repeat(x, hv // x.shape[1], axis=1)


def recurrent_gated_delta(q, k, v, g, beta, state):
    """Token-by-token gated delta rule.

    q, k ``[T, Hk, Dk]`` (L2-normalised, q already scaled by Dk^-1/2), v ``[T, Hv, Dv]``,
    g ``[T, Hv]`` log-decay (<= 0), beta ``[T, Hv]``, state ``[Hv, Dk, Dv]`` float32.
    Returns ``(o [T, Hv, Dv], new_state)``.
    """
    hv = v.shape[1]
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    S = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(v.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", S, k[t])
        u = (v[t] - kv_mem) * beta[t][:, None]
        S += k[t][:, :, None] * u[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out, S


def chunked_gated_delta(q, k, v, g, beta, state, chunk_size: int = 64):
    """The same rule, a chunk of tokens at a time (what prefill kernels compute).

    Inside a chunk with cumulative log-decay ``G_i = g_1 + ... + g_i`` and incoming state S0,
    the updates ``u`` solve a unit lower-triangular system

        u_i + beta_i * sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S0^T k_i)

    and then
        o_i  = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j
        S_C  = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T.
    Only differences ``G_i - G_j`` with ``j <= i`` are exponentiated, so every factor is <= 1.
    """
    T, hv = v.shape[0], v.shape[1]
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    S = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, dtype=np.float32)
    for s in range(0, T, chunk_size):
        e = min(T, s + chunk_size)
        n = e - s
        qc = q[s:e].transpose(1, 0, 2)       # [Hv, n, Dk]
        kc = k[s:e].transpose(1, 0, 2)
        vc = v[s:e].transpose(1, 0, 2)       # [Hv, n, Dv]
        bc = beta[s:e].T                     # [Hv, n]
        G = np.cumsum(g[s:e].T.astype(np.float64), axis=1)   # [Hv, n]
        diff = G[:, :, None] - G[:, None, :]                 # G_i - G_j
        lower = np.tril(np.ones((n, n), dtype=bool))
        decay = np.where(lower, np.exp(np.where(lower, diff, 0.0)), 0.0).astype(np.float32)
        strict = decay * ~np.eye(n, dtype=bool)
        eG = np.exp(G).astype(np.float32)                    # [Hv, n]
        kk = kc @ kc.transpose(0, 2, 1)                      # [Hv, n, n]
        A = np.eye(n, dtype=np.float32) + bc[:, :, None] * strict * kk
        rhs = bc[:, :, None] * (vc - eG[:, :, None] * (kc @ S))
        u = np.linalg.solve(A, rhs).astype(np.float32)       # [Hv, n, Dv]
        qk = qc @ kc.transpose(0, 2, 1)
        o = eG[:, :, None] * (qc @ S) + (qk * decay) @ u
        out[s:e] = o.transpose(1, 0, 2)
        tail = np.exp(G[:, -1:] - G).astype(np.float32)      # [Hv, n]
        S = eG[:, -1, None, None] * S + (kc * tail[:, :, None]).transpose(0, 2, 1) @ u
    return out, S
