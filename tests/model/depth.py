"""The depth oracle's pieces (issue 40), shared by benchmarks/depth_oracle.py and
tests/model/test_depth_oracle_real.py: the fp32 NumPy reference's residual stream after every layer
and its router margins, the comparison of two sets of logits, and mlx-lm's bf16 logits with its
decoder layers cut to a depth."""
from __future__ import annotations

import os
import sys

import numpy as np

from lily_py.reference import moe as ref_moe
from lily_py.reference.model import ReferenceModel
from lily_py.reference.ops import rms_norm


def reference_pass(cfg, weights, ids, kv_dtype):
    """(residual after each layer [L][T, H], router margin per layer [L][T]) of one prefill."""
    gaps: list[np.ndarray] = []
    route = ref_moe.route

    def spy(logits, top_k):
        z = logits.astype(np.float64)
        p = np.exp(z - z.max(-1, keepdims=True))
        p = np.sort(p / p.sum(-1, keepdims=True), -1)[:, ::-1]
        gaps.append((p[:, top_k - 1] - p[:, top_k]).astype(np.float32))
        return route(logits, top_k)

    ref_moe.route = spy
    try:
        model = ReferenceModel(cfg, weights, kv_dtype="int8" if kv_dtype == "int8" else None)
        residuals: list[np.ndarray] = []
        model.hidden_states(np.asarray(ids, np.int64), model.new_state(), residuals)
    finally:
        ref_moe.route = route
    return residuals, gaps


def mlx_depth_logits(folder: str, ids: np.ndarray, depths: list[int]) -> dict[int, np.ndarray]:
    """mlx-lm's bf16 logits of one uncached prefill of ``ids`` with its decoder layers cut to the
    first d, for each depth d (the final norm and lm_head as the model has them)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
    import mlx.core as mx
    from make_fixtures import mlx_load_bf16
    from pathlib import Path

    model = mlx_load_bf16(Path(folder))
    inner = model.language_model.model
    layers, fa_idx = list(inner.layers), inner.fa_idx
    out = {}
    for d in depths:
        inner.layers = layers[:d]
        inner.fa_idx = fa_idx if d > fa_idx else None  # no attention layer among the first d
        out[d] = np.array(model(mx.array(np.asarray(ids, np.int32))[None])[0].astype(mx.float32))
    inner.layers, inner.fa_idx = layers, fa_idx
    return out


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    d = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    return {"ref_mean_abs": float(np.abs(ref).mean()), "mean_abs": float(d.mean()), "mean_rel": float(d.mean() / np.abs(ref).mean()),
            "max_rel": float(d.max() / np.abs(ref).max()),
            "argmax_equal": int((got.argmax(-1) == ref.argmax(-1)).sum()), "rows": int(ref.shape[0])}


def reference_logits(cfg, weights, residual: np.ndarray) -> np.ndarray:
    """The logits of a residual stream: the final norm and lm_head."""
    return weights.lm_head.matmul(rms_norm(residual, weights.norm, cfg.rms_norm_eps))
