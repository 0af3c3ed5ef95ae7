"""The engine's error on long prompts against mlx-lm's and between its KV caches (issue 26, items
0, 2 and 4), at lengths the test tier cannot afford: the engine (default bf16 activations) and
mlx-lm's committed bf16 rows (tests/fixtures/bf16_long), each against the fp32 NumPy reference,
over the last 64 positions of tests/model/bf16_long.py's prompt on its real-head-dims checkpoint.
The same measure as tests/model/test_bf16_long_prompts.py.

    python benchmarks/bf16_long_engine.py [--backend emu|cuda|metal] [--lengths 4096 ...]
                                          [--chunk 4096] [--kv-dtype bfloat16 int8]

The reference rows come from tests/fixtures/bf16_long/reference.npz where it has the length
(tests/fixtures/make_bf16_long_ref.py), else are computed here up to --reference-max tokens;
beyond that only the caches are compared with each other. mlx-lm's rows exist for 1,024, 3,072, 4,096,
8,192 and 32,768 tokens. 4,096 tokens take about 12 minutes on the emulator (2 cores), seconds on cuda.
Per length and KV cache it prints the errors against the reference and mlx-lm's, and with both
caches the int8 cache's difference from the bf16 one: mean |d|, and the rows whose greedy token
(argmax) is the same.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "model"))

import bf16_long as B  # noqa: E402
import lily_py  # noqa: E402


def greedy_same(a: np.ndarray, b: np.ndarray) -> str:
    return f"{B.greedy_same(a, b)}/{len(a)}"


def fmt(e: dict) -> str:
    return f"mean|d| {e['mean_abs']:.4e} nmse {e['nmse']:.4e}"


def fmt_vs(got: np.ndarray, ref: np.ndarray) -> str:
    """The 64 rows' errors, greedy agreement, and the last row's mean |d| alone (one row is noisy:
    docs/bf16-error.md)."""
    last = float(np.abs(got[-1].astype(np.float64) - ref[-1]).mean())
    return f"{fmt(B.errors(got, ref))} greedy = reference {greedy_same(got, ref)} last row {last:.3e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="emu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--length", type=int, dest="lengths_one", help="one length (same as --lengths N)")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--kv-dtype", nargs="+", choices=["bfloat16", "int8", "float32"], default=None,
                    help="the KV caches to run (default: the engine's default only)")
    ap.add_argument("--reference-max", type=int, default=4096,
                    help="compute the reference rows up to this length when the fixture lacks them")
    a = ap.parse_args()
    lengths = [a.lengths_one] if a.lengths_one else a.lengths
    mlx = np.load(B.FIXTURE / "mlx.npz")
    fixed = B.FIXTURE / "reference.npz"
    refs = dict(np.load(fixed)) if fixed.exists() else {}
    mlx_err = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt = B.make(d)
        for n in lengths:
            ids = B.prompt(n)
            ref = refs.get(f"ref_{n}")
            if ref is None and n <= a.reference_max:
                ref = B.last_rows(lily_py.load(ckpt, backend="reference", context_length=n,
                                               kv_dtype="bfloat16", verbose=False)._backend, ids)
            if ref is not None and f"bf16_{n}" in mlx:
                mlx_err[n] = fmt_vs(mlx[f"bf16_{n}"], ref)
            rows = {}
            for kv in a.kv_dtype or [None]:
                t0 = time.time()
                m = lily_py.load(ckpt, backend=a.backend, context_length=n, prefill_chunk=a.chunk, kv_dtype=kv,
                                 verbose=False)
                rows[m.kv_dtype] = got = B.last_rows(m._backend, ids)
                dt = time.time() - t0
                line = f"{n} tokens, chunk {a.chunk}, {m.kv_dtype} KV cache, {a.backend}:"
                if ref is not None:
                    line += f" engine bf16 {fmt_vs(got, ref)}"
                else:
                    line += " (no reference rows at this length)"
                if n in mlx_err:
                    line += f" | mlx-lm bf16 {mlx_err[n]}"
                print(line + f" ({dt:.0f} s)", flush=True)
                del m
            if len(rows) == 2:
                e = B.errors(rows["int8"], rows["bfloat16"])
                print(f"{n} tokens: int8 cache vs bf16 cache mean|d| {e['mean_abs']:.4e} max_rel {e['max_rel']:.3e} "
                      f"greedy same {greedy_same(rows['int8'], rows['bfloat16'])}", flush=True)


if __name__ == "__main__":
    main()
