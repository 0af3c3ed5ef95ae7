"""Mixture-of-experts block in NumPy: softmax router, top-k, renormalise, SwiGLU experts and the
sigmoid-gated shared expert. Only the selected experts' weights are ever dequantized."""
from __future__ import annotations

import numpy as np

from .ops import sigmoid, silu, softmax


def route(router_logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts (fp32), top-k, renormalised to sum 1.

    Ties go to the lowest expert index (stable sort), the rule kernels follow too.
    Returns ``(experts [T, k] int64, weights [T, k] float32)``.
    """
    probs = softmax(router_logits.astype(np.float32), axis=-1)
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    wts = np.take_along_axis(probs, idx, axis=-1)
    return idx, (wts / wts.sum(-1, keepdims=True)).astype(np.float32)


def swiglu_mlp(x, gate_proj, up_proj, down_proj) -> np.ndarray:
    return down_proj.matmul(silu(gate_proj.matmul(x)) * up_proj.matmul(x))


def moe_block(x: np.ndarray, w, top_k: int) -> np.ndarray:
    """``x [T, H]`` -> ``[T, H]``."""
    experts, weights = route(w.router.matmul(x), top_k)
    out = np.zeros_like(x, dtype=np.float32)
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)
        y = swiglu_mlp(x[rows], w.gate_proj.expert(e), w.up_proj.expert(e), w.down_proj.expert(e))
        out[rows] += weights[rows, slot][:, None] * y
    shared = swiglu_mlp(x, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj)
    return out + sigmoid(w.shared_expert_gate.matmul(x)) * shared
