"""The error of the prefill attention's int8 scores, in the NumPy reference: the fp32 model on
tests/model/bf16_long.py's real-head-dims checkpoint with the int8 KV cache, with and without each
query row (token, head) quantized as the cache quantizes its rows (symmetric int8, scale = max |q| /
127: what attn_prefill_m5i8_q8 multiplies by K's codes), against the exact model's committed rows
(tests/fixtures/bf16_long/reference.npz). Everything else in fp32, so the lines isolate the two
quantizations from the engine's bf16 roundings.

    python benchmarks/int8_scores_error.py [--lengths 4096 32768]

About 5 s at 4,096 tokens and 150 s at 32,768 on 2 cores.
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
import lily_py.reference.attention as attention  # noqa: E402
from lily_py.reference.kvquant import int8_row  # noqa: E402


def rows(ckpt: str, n: int, q_int8: bool) -> np.ndarray:
    """The reference's last rows with the int8 KV cache, Q quantized per row or not."""
    exact = attention.attend
    if q_int8:
        attention.attend = lambda q, k, v, position: exact(int8_row(q), k, v, position)
    try:
        m = lily_py.load(ckpt, backend="reference", context_length=n, kv_dtype="int8", verbose=False)
        return B.last_rows(m._backend, B.prompt(n)).astype(np.float32)
    finally:
        attention.attend = exact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    a = ap.parse_args()
    refs = np.load(B.FIXTURE / "reference.npz")
    print("fp32 reference, real-head-dims checkpoint, last 64 rows vs the exact model: mean|d| (nmse), "
          "greedy tokens equal")
    with tempfile.TemporaryDirectory() as d:
        ckpt = B.make(d)
        for n in a.lengths:
            t = time.time()
            ref = refs[f"ref_{n}"]
            kv = rows(ckpt, n, False)
            both = rows(ckpt, n, True)

            def line(x, r):
                e = B.errors(x, r)
                return f"{e['mean_abs']:.2e} ({e['nmse']:.1e}) {B.greedy_same(x, r)}/{len(r)}"
            print(f"{n} tokens: int8 cache {line(kv, ref)} | int8 cache + int8 Q {line(both, ref)} | "
                  f"int8 Q's own share (vs the int8 cache) {line(both, kv)}", flush=True)
            print(f"  ({n} tokens: {time.time() - t:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
