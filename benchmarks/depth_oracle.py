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

``--mlx`` also runs mlx-lm in bfloat16 (as it runs a bf16 checkpoint: ``mlx_load_bf16`` of
tests/fixtures/make_fixtures.py) on the same checkpoint and ids, its decoder layers cut to the first
d, and prints its error beside the engine's: the bound issue 40 sets the engine's bf16 path (needs
``mlx`` and ``mlx-lm``; on the GPU machine MLX's CUDA backend, ``mlx-cuda-13``: docs/gpu.md).

``--make real|tiny`` writes a random checkpoint (``--stable``: make_checkpoint(stable=True), routing
with margin) to ``--out`` first; ``--model`` takes an existing one. Slow on a CPU at the real widths
(the NumPy model dequantizes every used expert): meant for the H200 machine (docs/gpu.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from lily_py.backends import make_backend
from lily_py.checkpoint import load_weights
from lily_py.testing import REAL_TEXT_CONFIG, TINY_TEXT_CONFIG, make_checkpoint, truncated

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model"))
from depth import compare, mlx_depth_logits, reference_logits, reference_pass  # noqa: E402


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


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
    p.add_argument("--mlx", action="store_true", help="also mlx-lm in bf16, its layers cut to each depth")
    p.add_argument("--mlx-fixture", default=None,
                   help="with --mlx: write mlx-lm's errors per depth there (tests/fixtures/depth_oracle/"
                        "mlx_bf16.json holds the real stable checkpoint's, seed 0, 32 tokens)")
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
    mlx = {}
    if a.mlx:
        t = time.time()
        mlx = mlx_depth_logits(a.model, ids, depths)
        print(f"mlx-lm bf16: {len(depths)} depths in {time.time() - t:.1f} s", flush=True)
    rows = []
    for d in depths:
        ref = reference_logits(cfg, w, residuals[d - 1])
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
        if d in mlx:
            m = r["mlx_bf16"] = compare(ref, mlx[d])
            print(f"           mlx-lm bf16: mean|d| {m['mean_abs']:.3e} ({m['mean_rel']:.2e} of mean|logit|), "
                  f"max|d| {m['max_rel']:.2e} of max|logit|, argmax {m['argmax_equal']}/{m['rows']}", flush=True)
        del eng
    if a.mlx_fixture and mlx:
        with open(a.mlx_fixture, "w") as f:
            json.dump({"what": "mlx-lm bf16 (mlx_load_bf16) logits vs the fp32 NumPy reference, per depth",
                       "command": " ".join(sys.argv), "config": "real" if a.make == "real" else a.model,
                       "stable": a.stable, "seed": a.seed, "tokens": a.tokens,
                       "mlx": _version("mlx"), "mlx_lm": _version("mlx-lm"),
                       "depths": {str(r["depth"]): r["mlx_bf16"] for r in rows}}, f, indent=1)
            f.write("\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "backend": a.backend, "activations": a.activations,
                       "kv_dtype": a.kv_dtype, "tokens": a.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
