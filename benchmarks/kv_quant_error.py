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
format's bytes per 256-value row beside bf16's instead (no model run). ``--outliers`` runs no model:
random keys of 256 channels, a few of them ``x`` times larger (real keys have such channels;
random weights do not), and queries with the same channel scales; per format and x, the error
of the scores q.k / 16 and of the attention output softmax(S) V (V quantized alike), relative
to the exact ones' rms.
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


def outliers(keys: int = 4096, queries: int = 64, d: int = 256, channels: int = 4, seed: int = 0) -> None:
    """The --outliers table (see the module docstring)."""
    scales = (1, 8, 32)
    print(f"{keys} keys x {d} channels, {channels} channels x times larger; {queries} queries; "
          "rms error relative to the exact scores / attention output\n")
    print("| KV cache | " + " | ".join(f"scores x{x} | output x{x}" for x in scales) + " |")
    print("|---|" + "---:|" * (2 * len(scales)))
    rows: dict[str, list[str]] = {"bf16": []}
    rows.update({n: [] for n in FORMATS})
    for x in scales:
        rng = np.random.default_rng([seed, x])
        ch = np.ones(d, np.float32)
        ch[rng.choice(d, channels, replace=False)] = x
        K = (rng.standard_normal((keys, d)) * ch).astype(np.float32)
        V = rng.standard_normal((keys, d)).astype(np.float32)
        Q = (rng.standard_normal((queries, d)) * ch / np.sqrt(ch.mean() * x)).astype(np.float32)
        S = Q.astype(np.float64) @ K.T.astype(np.float64) / np.sqrt(d)

        def attend(s, v):
            p = np.exp(s - s.max(-1, keepdims=True))
            return (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)

        O = attend(S, V)

        def rel(a, b):
            return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))

        import ml_dtypes
        for name, f in [("bf16", lambda t: t.astype(ml_dtypes.bfloat16).astype(np.float32))] + list(FORMATS.items()):
            Kq, Vq = f(K), f(V)
            Sq = Q.astype(np.float64) @ Kq.T.astype(np.float64) / np.sqrt(d)
            rows[name] += [f"{rel(Sq, S):.2e}", f"{rel(attend(Sq, Vq), O):.2e}"]
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(r) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--formats", type=int, nargs="*", help="indices into FORMATS (default all)")
    ap.add_argument("--bytes", action="store_true", help="bytes per row of each format only")
    ap.add_argument("--outliers", action="store_true", help="score error on keys with outlier channels")
    a = ap.parse_args()
    if a.outliers:
        outliers()
        return
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
