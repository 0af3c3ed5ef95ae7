"""Which 8-bit KV cache format: its logits error next to the bf16 cache's and mlx-lm's bf16 error.

On the NumPy reference with the engine's bf16 rounding points (benchmarks/bf16_error.py), the
checkpoint of tests/model/bf16_long.py (real head dimensions: head_dim 256, 2 KV heads; 3
DeltaNet layers and 1 attention layer) and its random ``--length``-token prompt. Each row stores
the K and V cache rows in one format of src/lily_py/reference/kvquant.py instead of bf16 and
compares the logits with the fp32 reference:

  mean|d|, nmse   over the last 64 positions (bf16_long.ROWS, the rows mlx-lm's fixture holds)
  all mean|d|     over every position of the prompt
  vs bf16 KV      mean |d| against the same run with the bf16 cache (the format's own share)
  greedy          argmax agreement over every position, with the fp32 reference and with the
                  bf16-cache run

The mlx-lm row is its bf16 forward of the same checkpoint and ids (tests/fixtures/bf16_long) against
the same fp32 rows; it exists for the fixture's lengths (1,024 and 4,096).

``python benchmarks/kv_quant_error.py [--length 4096] [--formats N ...]``; ``--bytes`` prints each
format's bytes per 256-value row beside bf16's instead (no model run).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "model"))

import bf16_error as E  # noqa: E402
import bf16_long as B  # noqa: E402
import lily_py  # noqa: E402
from lily_py.reference.kvquant import FORMATS, row_bytes  # noqa: E402

FIXTURE = os.path.join(HERE, "..", "tests", "fixtures", "bf16_long", "mlx.npz")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--formats", type=int, nargs="*", help="indices into FORMATS (default all)")
    ap.add_argument("--bytes", action="store_true", help="bytes per row of each format only")
    a = ap.parse_args()
    if a.bytes:
        print("| KV cache | bytes per 256-value row | of bf16 |\n|---|---:|---:|\n| bf16 | 512 | 1.000 |")
        for name in FORMATS:
            print(f"| {name} | {row_bytes(name)} | {row_bytes(name) / 512:.3f} |")
        return
    n, names = a.length, list(FORMATS)
    if a.formats is not None:
        names = [names[i] for i in a.formats]
    with tempfile.TemporaryDirectory() as tmp:
        model = lily_py.load(B.make(tmp), backend="reference", verbose=False,
                             kv_dtype="bfloat16")._backend.model
    ids = B.prompt(n).astype(np.int64)
    ref = E.forward(model, ids, ())
    base = E.forward(model, ids, set(E.ENGINE))
    R = B.ROWS
    print(f"logits vs the fp32 reference, {n:,}-token prompt (max |ref| {np.abs(ref).max():.1f}); "
          f"mean|d| and nmse over the last {R} positions\n")
    print("| KV cache | mean\\|d\\| | nmse | all mean\\|d\\| | vs bf16 KV | greedy = fp32 | greedy = bf16 KV |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def row(name, got, full=True):
        e = B.errors(got[-R:], ref[-R:])
        cells = [f"{e['mean_abs']:.4g}", f"{e['nmse']:.3g}"]
        if full:
            cells += [f"{np.abs(got - ref).mean():.4g}", f"{np.abs(got - base).mean():.3g}",
                      f"{(got.argmax(1) == ref.argmax(1)).mean():.2%}",
                      f"{(got.argmax(1) == base.argmax(1)).mean():.2%}"]
        else:
            cells += ["", "", "", ""]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)

    row("bf16 cache", base)
    for name in names:
        row(name, E.forward(model, ids, set(E.ENGINE), kvq=FORMATS[name]))
    if os.path.exists(FIXTURE) and f"bf16_{n}" in np.load(FIXTURE):
        row("mlx-lm bf16 (its whole forward, fixture)", np.load(FIXTURE)[f"bf16_{n}"], full=False)


if __name__ == "__main__":
    main()
