"""The engine on long prompts with the real model's widths (issue 26, item 4): the real config's
hidden size, vocabulary, experts, head counts and head dims (tests/model/real_widths.py: 4 of its
40 layers, 3 Gated DeltaNet + 1 attention), a random-weight 4-bit checkpoint, the last 64
positions of a random prompt.

    python benchmarks/real_widths_long.py [--backend cuda] [--lengths 4096 32768 131072]
                                          [--reference-max 4096]

Per length: the engine as loaded by default (bf16 activations, the bf16 KV cache, chunks of 4,096)
and with fp32 activations (the bf16 cache), each against the fp32 NumPy reference where one is
computed (up to --reference-max tokens: minutes at 4K on 16 cores, hours at 128K on any CPU), and
the default against the fp32 engine at every length: mean |d|, nmse and the rows whose greedy
token is the same. The fp32 engine is the 128K oracle; the 4K line shows how close it is to the
reference at these widths.
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
import real_widths as RW  # noqa: E402
import lily_py  # noqa: E402


def line(what: str, got: np.ndarray, ref: np.ndarray) -> str:
    e = B.errors(got, ref)
    return f"{what}: mean|d| {e['mean_abs']:.4e} nmse {e['nmse']:.4e} greedy same {B.greedy_same(got, ref)}/{len(got)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--reference-max", type=int, default=4096)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        ck = RW.make(os.path.join(tmp, "ckpt"))
        print(f"checkpoint: {RW.describe()} ({time.time() - t:.0f} s)", flush=True)
        for n in a.lengths:
            ids = RW.prompt(n)
            t = time.time()
            dflt = B.last_rows(lily_py.load(ck, backend=a.backend, context_length=n, prefill_chunk=4096)._backend, ids)
            f32 = B.last_rows(lily_py.load(ck, backend=a.backend, context_length=n, prefill_chunk=4096,
                                           activations="float32", kv_dtype="bfloat16")._backend, ids)
            assert np.isfinite(dflt).all() and np.isfinite(f32).all()
            out = [line(f"{n} tokens, {a.backend}: default vs fp32 engine", dflt, f32)]
            if n <= a.reference_max:
                ref = B.last_rows(lily_py.load(ck, backend="reference", context_length=n,
                                               kv_dtype="bfloat16")._backend, ids)
                out += [line(f"{n} tokens: fp32 engine vs reference", f32, ref),
                        line(f"{n} tokens: default engine vs reference", dflt, ref)]
            print("\n".join(out) + f" ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
