"""Where do the engine and the NumPy fp32 reference part, layer by layer? (issue 40, docs/bf16-error.md)

The reference runs the checkpoint once and keeps the residual stream after every layer (its
``residuals`` hook) and every token's router margin (the gap between the k-th and the (k+1)-th
router probability: a flip needs a change that large). For each depth d the engine runs the same
checkpoint truncated to its first d layers (``lily_py.testing.truncated``: the same weights, mapped
once), so its logits are the residual stream after layer d seen through the final norm and
lm_head; the reference's are ``lm_head(norm(residual_d))``. Printed per depth: the logits' mean and
max |d| relative to the reference's mean |logit| and max |logit|, argmax agreement, and the
smallest router margin of the layers up to d.

    python benchmarks/depth_oracle.py --make real --stable --depths 1,2,4,8,16,40 --tokens 64 \
        --backend cuda --activations float32 --kv-dtype float32

``--make real|tiny`` writes a random checkpoint (``--stable``: make_checkpoint(stable=True), routing
with margin) to ``--out`` first; ``--model`` takes an existing one. Slow on a CPU at the real widths
(the NumPy model dequantizes every used expert): meant for the H200 machine (docs/gpu.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from lily_py.backends import make_backend
from lily_py.checkpoint import load_weights
from lily_py.reference import moe as ref_moe
from lily_py.reference.model import ReferenceModel
from lily_py.reference.ops import rms_norm
from lily_py.testing import REAL_TEXT_CONFIG, TINY_TEXT_CONFIG, make_checkpoint, truncated


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


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    d = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    return {"mean_abs": float(d.mean()), "mean_rel": float(d.mean() / np.abs(ref).mean()),
            "max_rel": float(d.max() / np.abs(ref).max()),
            "argmax_equal": int((got.argmax(-1) == ref.argmax(-1)).sum()), "rows": int(ref.shape[0])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (else --make)")
    p.add_argument("--make", choices=["real", "tiny"], help="write a random checkpoint first")
    p.add_argument("--stable", action="store_true", help="make_checkpoint(stable=True)")
    p.add_argument("--layers", type=int, default=None, help="layers of the made checkpoint")
    p.add_argument("--out", default="/tmp/depth_oracle_ckpt", help="where --make writes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depths", default="1,2,4,8,16,40")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--backend", default="emu")
    p.add_argument("--activations", default="float32")
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.make:
        t = time.time()
        base = dict(REAL_TEXT_CONFIG if a.make == "real" else TINY_TEXT_CONFIG)
        if a.layers:
            base["num_hidden_layers"] = a.layers
        a.model = make_checkpoint(a.out, base, seed=a.seed, stable=a.stable)
        print(f"checkpoint {a.make}{' stable' if a.stable else ''}: {time.time() - t:.1f} s", flush=True)
    if not a.model:
        sys.exit("--model or --make")
    cfg, w = load_weights(a.model)
    depths = [d for d in (int(x) for x in a.depths.split(",")) if d <= cfg.num_hidden_layers]
    ids = np.random.default_rng(a.seed + 1).integers(0, cfg.vocab_size, size=a.tokens)
    t = time.time()
    residuals, gaps = reference_pass(cfg, w, ids, a.kv_dtype)
    print(f"reference: {len(residuals)} layers x {a.tokens} tokens in {time.time() - t:.1f} s", flush=True)
    rows = []
    for d in depths:
        ref = w.lm_head.matmul(rms_norm(residuals[d - 1], w.norm, cfg.rms_norm_eps))
        cd, wd = truncated(cfg, w, d)
        eng = make_backend(a.backend, cd, wd, context_length=max(256, a.tokens), prefill_chunk=max(64, a.tokens),
                           verbose=False, activations=a.activations, kv_dtype=a.kv_dtype)
        got = eng.forward(np.asarray(ids), all_logits=True)
        r = compare(ref, got)
        r.update(depth=d, min_router_margin=float(min(g.min() for g in gaps[:d])),
                 margins_below_1e_3=int(sum(int((g < 1e-3).sum()) for g in gaps[:d])))
        rows.append(r)
        print(f"depth {d:3d}: logits mean|d| {r['mean_abs']:.3e} ({r['mean_rel']:.2e} of mean|logit|), "
              f"max|d| {r['max_rel']:.2e} of max|logit|, argmax {r['argmax_equal']}/{r['rows']}; "
              f"router margin min {r['min_router_margin']:.2e}, {r['margins_below_1e_3']} below 1e-3", flush=True)
        del eng
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "backend": a.backend, "activations": a.activations,
                       "kv_dtype": a.kv_dtype, "tokens": a.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
