"""Side by side: lily_py (reference and emulator backends) vs mlx-lm on the same checkpoint.

    python benchmarks/compare_mlx_lm.py [--model PATH] [--tokens N]

Default model: the bundled demo. mlx-lm must be installed (`pip install ".[fixtures]"`); on Linux
it runs on the CPU, so this compares CPU paths only — the numbers that matter (Metal vs MLX on a
Mac) come from the same script there with `--backends metal`. Prints one row per engine: prefill
and decode tokens/s and whether the greedy tokens agree with mlx-lm's.
"""
from __future__ import annotations

import argparse
import os
import time

import lily_py


def run_mlx(path, prompt_ids, n, dtype):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, _ = load(path)
    if dtype == "float32":     # the precision of lily_py's reference and activations
        model.set_dtype(mx.float32)
    for _ in generate_step(mx.array(prompt_ids[:4]), model, max_tokens=2):   # warm-up
        pass
    t0 = time.perf_counter()
    tokens, t_first = [], None
    for tok, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n):
        tokens.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    return tokens, len(prompt_ids) / (t_first - t0), (n - 1) / (t1 - t_first)


def run_lily(path, backend, prompt_ids, n):
    m = lily_py.load(path, backend=backend)
    r = m.generate_text(list(prompt_ids), max_tokens=n)
    return r.tokens, r.stats.prefill_tokens_per_second, r.stats.decode_tokens_per_second


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--backends", default="reference,emu")
    ap.add_argument("--mlx-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="mlx-lm compute dtype (float32 = lily_py's precision, for agreement)")
    a = ap.parse_args()
    path = a.model or lily_py.demo_path()
    tok = lily_py.load(path).tokenizer
    prompt = tok.encode("And God said unto Moses, " * 8)
    rows = []
    try:
        mlx_tokens, p, d = run_mlx(path, prompt, a.tokens, a.mlx_dtype)
        rows.append((f"mlx-lm {a.mlx_dtype}", p, d, "-"))
    except ImportError as e:
        mlx_tokens = None
        print(f"mlx-lm not installed ({e}); lily_py rows only")
    for b in a.backends.split(","):
        toks, p, d = run_lily(path, b, prompt, a.tokens)
        same = "-" if mlx_tokens is None else str(toks == mlx_tokens[:len(toks)])
        rows.append((f"lily_py {b}", p, d, same))
    print(f"model {os.path.basename(os.path.normpath(path))}, prompt {len(prompt)} tokens, "
          f"{a.tokens} greedy tokens, {os.cpu_count()} cores")
    print(f"{'engine':<20}{'prefill tok/s':>15}{'decode tok/s':>15}  greedy == mlx-lm")
    for name, p, d, same in rows:
        print(f"{name:<20}{p:>15.1f}{d:>15.1f}  {same}")


if __name__ == "__main__":
    main()
