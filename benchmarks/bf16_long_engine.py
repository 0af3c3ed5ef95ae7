"""The engine's bf16 error on a long prompt against mlx-lm's (issue 26, item 0), at a length the
test tier cannot afford: the emulator (default bf16 activations) and mlx-lm's committed bf16 rows
(tests/fixtures/bf16_long), each against the fp32 NumPy reference, over the last 64 positions of
tests/model/bf16_long.py's prompt on its real-head-dims checkpoint. The same measure as
tests/model/test_bf16_long_prompts.py (which runs 1,024 tokens).

``python benchmarks/bf16_long_engine.py [--length 4096] [--chunk 4096] [--kv-dtype int8]``; 4,096
tokens take about 12 minutes on the emulator (2 cores). mlx-lm's rows exist for 1,024 and 4,096.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096, choices=[1024, 4096])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--kv-dtype", choices=["bfloat16", "int8"], default=None)
    a = ap.parse_args()
    n = a.length
    mlx = np.load(B.FIXTURE / "mlx.npz")
    with tempfile.TemporaryDirectory() as d:
        ckpt = B.make(d)
        ids = B.prompt(n)
        ref = B.last_rows(lily_py.load(ckpt, backend="reference", context_length=n, kv_dtype="bfloat16")._backend, ids)
        t0 = time.time()
        m = lily_py.load(ckpt, backend="emu", context_length=n, prefill_chunk=a.chunk, kv_dtype=a.kv_dtype)
        eng = B.errors(B.last_rows(m._backend, ids), ref)
        dt = time.time() - t0
    mx = B.errors(mlx[f"bf16_{n}"], ref)
    print(f"{n} tokens, chunk {a.chunk}, {m.kv_dtype} KV cache: engine bf16 mean|d| "
          f"{eng['mean_abs']:.4e} nmse {eng['nmse']:.4e} | mlx-lm bf16 mean|d| {mx['mean_abs']:.4e} "
          f"nmse {mx['nmse']:.4e} (emulator {dt:.0f} s)")


if __name__ == "__main__":
    main()
