"""Gated full attention (GQA, q/k RMSNorm, partial RoPE, output gate) in NumPy."""
from __future__ import annotations

import numpy as np

from .ops import apply_partial_rope, rms_norm, rope_cos_sin, sigmoid, softmax


def attention_layer(x, w, cfg, cache: dict, position: int) -> np.ndarray:
    """One gated-attention mixer over ``x [T, H]`` starting at absolute ``position``.

    ``cache`` holds ``k``/``v`` arrays ``[P, Hkv, D]`` of the P earlier positions; this call
    appends the new keys/values (post-norm, post-RoPE, as the engine caches them).
    """
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
    cache["k"] = k if cache.get("k") is None else np.concatenate([cache["k"], k])
    cache["v"] = v if cache.get("v") is None else np.concatenate([cache["v"], v])
    out = attend(q, cache["k"], cache["v"], position)
    return w.o_proj.matmul(out.reshape(T, Hq * D) * sigmoid(gate))


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, position: int) -> np.ndarray:
    """Causal softmax attention of ``q [T, Hq, D]`` (absolute positions position..position+T-1)
    over ``k, v [P+T, Hkv, D]``; query head ``h`` uses KV head ``h // (Hq/Hkv)``."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    kk = np.repeat(k, group, axis=1).transpose(1, 2, 0)      # [Hq, D, S]
    vv = np.repeat(v, group, axis=1).transpose(1, 0, 2)      # [Hq, S, D]
    scores = (q.transpose(1, 0, 2) @ kk) * np.float32(D ** -0.5)   # [Hq, T, S]
    key_pos = np.arange(k.shape[0])
    query_pos = position + np.arange(T)
    scores = np.where(key_pos[None, None, :] <= query_pos[None, :, None], scores, -np.inf)
    return (softmax(scores) @ vv).transpose(1, 0, 2).astype(np.float32)   # [T, Hq, D]
