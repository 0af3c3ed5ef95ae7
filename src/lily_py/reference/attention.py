"""Gated full attention (GQA, q/k RMSNorm, partial RoPE, output gate) in NumPy."""
from __future__ import annotations

import numpy as np

from .kvquant import int8_row
from .ops import apply_partial_rope, rms_norm, rope_cos_sin, sigmoid, softmax

# Bound on the float32 score block (query block x keys x heads) of one attention step.
SCORE_BLOCK_ELEMENTS = 1 << 24


class KVCache:
    """Append-only K/V buffers ``[capacity, Hkv, D]`` (post-norm, post-RoPE keys) with a length.

    Rows below ``length`` are never written again, so a shallow copy of the cache (``fork``) is
    a valid snapshot: a fork only writes rows at or beyond its own length, and the buffers grow
    by reallocation (doubling), never in place.
    """

    def __init__(self, k=None, v=None, length: int = 0, quantize: bool = False):
        self.k, self.v, self.length, self.quantize = k, v, length, quantize

    def fork(self) -> "KVCache":
        return KVCache(self.k, self.v, self.length, self.quantize)

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        if self.quantize:  # the int8 cache: each row's values become codes * scale (float32)
            k, v = int8_row(k), int8_row(v)
        n = self.length + k.shape[0]
        if self.k is None or n > self.k.shape[0]:
            cap = max(n, 2 * (0 if self.k is None else self.k.shape[0]), 16)
            nk = np.empty((cap,) + k.shape[1:], np.float32)
            nv = np.empty((cap,) + v.shape[1:], np.float32)
            if self.length:
                nk[:self.length] = self.k[:self.length]
                nv[:self.length] = self.v[:self.length]
            self.k, self.v = nk, nv
        self.k[self.length:n] = k
        self.v[self.length:n] = v
        self.length = n


def attention_layer(x, w, cfg, cache: KVCache, position: int) -> np.ndarray:
    """One gated-attention mixer over ``x [T, H]`` starting at absolute ``position``; appends
    the new keys/values to ``cache``."""
    T = x.shape[0]
    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qg = w.q_proj.matmul(x).reshape(T, Hq, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, Hq * D)
    k = w.k_proj.matmul(x).reshape(T, Hkv, D)
    v = w.v_proj.matmul(x).reshape(T, Hkv, D)
    q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
    k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(np.arange(position, position + T), cfg.rotary_dim, cfg.rope_theta)
    q = apply_partial_rope(q, cos, sin)
    k = apply_partial_rope(k, cos, sin)
    cache.append(k, v)
    out = attend(q, cache.k[:cache.length], cache.v[:cache.length], position)
    return w.o_proj.matmul(out.reshape(T, Hq * D) * sigmoid(gate))


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, position: int) -> np.ndarray:
    """Causal softmax attention of ``q [T, Hq, D]`` (absolute positions position..position+T-1)
    over ``k, v [S, Hkv, D]``; query head ``h`` uses KV head ``h // (Hq/Hkv)``. Queries are
    processed in blocks so the score matrix stays bounded."""
    T, Hq, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    g = Hq // Hkv
    kt = k.transpose(1, 2, 0)[:, None]                   # [Hkv, 1, D, S]
    vt = v.transpose(1, 0, 2)[:, None]                   # [Hkv, 1, S, D]
    qg = q.reshape(T, Hkv, g, D).transpose(1, 2, 0, 3)   # [Hkv, g, T, D]
    out = np.empty((Hkv, g, T, D), np.float32)
    block = max(1, min(T, SCORE_BLOCK_ELEMENTS // max(1, Hq * S)))
    key_pos = np.arange(S)
    scale = np.float32(D ** -0.5)
    for s in range(0, T, block):
        e = min(T, s + block)
        scores = (qg[:, :, s:e] @ kt) * scale            # [Hkv, g, tb, S]
        causal = key_pos[None, :] <= (position + np.arange(s, e))[:, None]
        scores = np.where(causal, scores, -np.inf)
        out[:, :, s:e] = softmax(scores) @ vt
    return out.transpose(2, 0, 1, 3).reshape(T, Hq, D)
