#!/usr/bin/env python3
"""Counters of one engine step of the real Qwen3.6-35B-A3B config, on the counting device.

The engine encodes the real step (bfloat16 activations, as `load()` takes a bf16 checkpoint) and
counts what it dispatches and touches; nothing runs and no weights exist. Decode steps also print
the floor (every weight byte the token needs, read once) and bytes_touched / floor.

    python benchmarks/step_counters.py            # decode at 0 / 255 / 4095 / 32767, prefill 256 / 4096
    python benchmarks/step_counters.py --prefill  # chunks of 256 / 4096 at 0, and 4096 at 28672
"""
from __future__ import annotations

import argparse

from lily_py.backends.engine import count_step, decode_floor_bytes
from lily_py.config import ModelConfig
from lily_py.testing import REAL_TEXT_CONFIG

STEPS = [(1, 0), (1, 255), (1, 4095), (1, 32767), (256, 0), (4096, 0)]
PREFILL = [(256, 0), (4096, 0), (4096, 28672)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="store_true", help="prefill chunks only, with executed / useful")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    for tokens, pos in PREFILL if args.prefill else STEPS:
        st = count_step(cfg, tokens=tokens, position=pos)
        line = (f"tokens={tokens:5d} position={pos:6d}: dispatches {st['dispatches']} "
                f"barriers {st['barriers']} bytes_touched {st['bytes_touched'] / 1e6:.1f} MB "
                f"GFLOP executed {st['flops_executed'] / 1e9:.3f} useful {st['flops_useful'] / 1e9:.3f}")
        if tokens == 1:
            floor = decode_floor_bytes(cfg, position=pos)["total"]
            line += f" | floor {floor / 1e6:.1f} MB, ratio {st['bytes_touched'] / floor:.4f}"
        elif args.prefill:
            line += f" | executed / useful {st['flops_executed'] / st['flops_useful']:.3f}"
        print(line)


if __name__ == "__main__":
    main()
