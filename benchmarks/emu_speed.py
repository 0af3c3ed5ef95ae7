"""Emulator speed on realistic shapes (not a test; run: python benchmarks/emu_speed.py [--races]).

Prints GPU threads emulated per second for each case (best of `--repeat` warm runs, one OS
thread). The emulator runs every GPU thread as a fiber, so speed depends on how often a kernel
synchronises (barriers, simd collectives) as much as on its arithmetic. --races runs the cases
under the race detector (its snapshot scans cost per fiber segment and per threadgroup).
"""
from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from lily_py import ops
from lily_py.reference import quant

BF16 = np.dtype(ml_dtypes.bfloat16)


def best(fn, repeat):
    times, stats = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        stats = fn()
        times.append(time.perf_counter() - t0)
    return min(times), stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--races", action="store_true", help="run under the emulator's race detector")
    a = ap.parse_args()
    from lily_py import _core
    _core.emu.set_races_default(a.races)
    rng = np.random.default_rng(0)

    def q(n, k):
        return quant.quantize(rng.standard_normal((n, k)).astype(np.float32), bits=4, group_size=64,
                              scale_dtype=BF16)

    w2k = q(2048, 2048)
    w512 = q(512, 512)
    x1, x8 = rng.standard_normal((1, 2048)).astype(BF16), rng.standard_normal((8, 2048)).astype(BF16)
    x64 = rng.standard_normal((64, 512)).astype(BF16)
    h = rng.standard_normal((64, 2048)).astype(BF16)
    g, u = rng.standard_normal((64, 512)).astype(BF16), rng.standard_normal((64, 512)).astype(BF16)
    cases = [
        ("qmv 4-bit M=1  N=2048 K=2048", 1 * 2048 * 2048,
         lambda: ops._quantized_matmul(x1, *w2k, bits=4, group_size=64)[1]),
        ("qmv 4-bit M=8  N=2048 K=2048", 8 * 2048 * 2048,
         lambda: ops._quantized_matmul(x8, *w2k, bits=4, group_size=64)[1]),
        ("qmm 4-bit M=64 N=512  K=512 ", 64 * 512 * 512,
         lambda: ops._quantized_matmul(x64, *w512, bits=4, group_size=64)[1]),
        ("rms_norm rows=64 D=2048     ", 0, lambda: ops._rms_norm(h, np.ones(2048, BF16))[2]),
        ("swiglu 64 x 512             ", 0, lambda: ops._elementwise("swiglu", g, u)[1]),
    ]
    for name, macs, fn in cases:
        t, st = best(fn, a.repeat)
        line = f"{name}  {st['threads']:>7d} threads  {t * 1e3:8.1f} ms  {st['threads'] / t:10.3g} threads/s"
        if macs:
            line += f"  {macs / t:10.3g} MAC/s"
        print(line)

if __name__ == "__main__":
    main()
