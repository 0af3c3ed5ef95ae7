"""Engine benchmark: tokens/s and per-step counters (not a test).

    python benchmarks/engine.py [--device emu] [--prompt 64] [--decode 32] [--real-layers 0]
    python benchmarks/engine.py --counts      # 3. only (deterministic, no timings)
    python benchmarks/engine.py --kernels     # per-kernel decode table, counting device only

1. The bundled demo checkpoint on the device (default "emu", the CPU emulator of the Metal
   kernels; "metal" on a Mac): prefill and decode tokens/s, and the counters of one decode step
   and of the prefill step (dispatches, barriers, bytes bound, host waits).
2. Optionally (--real-layers N) a random-weight checkpoint with the real model's per-layer shapes
   and N layers (slow on the emulator: minutes per token at N >= 2).
3. The real 35B config's counters, computed by the encoder on the counting device (no weights,
   nothing allocated): decode at several context lengths and a 4096-token prefill chunk, next to
   Lily's published ~600 dispatches per token.

GFLOP executed / useful: the matrix work of the step (2 FLOPs per multiply-add of projections,
router, experts, attention and the delta rule) as the dispatched tiles run it (padding included;
the MoE tiled routes' bound over every routing) and as the math needs it (no padding, routed rows
only). The ratio is the waste of the kernels' tiling, not a timing.

bytes_bound is the sum of the byte ranges bound to every dispatch: the MoE kernels bind each
layer's whole expert stacks (they read only the routed experts' rows), so it is an upper bound of
the weight traffic, not the bytes read. bytes_touched is what the kernels read plus write (each
op's host code says so per dispatch: routed experts only, KV rows up to the position, a state
read and written counts twice). `--kernels` prints it per kernel for the real config with the
floor derived from the config (lily_py.backends.engine.decode_floor_bytes).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

import lily_py
from lily_py.backends.engine import count_kernels, count_step, decode_floor_bytes
from lily_py.config import ModelConfig
from lily_py.testing import REAL_TEXT_CONFIG, make_checkpoint

LILY_DISPATCHES_PER_TOKEN = 600  # published (Perplexity's Lily, M5 Max)


def fmt(st: dict) -> str:
    return (f"dispatches {st['dispatches']:>4}  barriers {st['barriers']:>4}  "
            f"bytes_bound {st['bytes_bound'] / 2**20:>10.1f} MiB  bytes_touched "
            f"{st['bytes_touched'] / 2**20:>9.1f} MiB  host waits in step "
            f"{st['waits_in_step']}  commits {st['commits']}\n"
            f"      GFLOP executed {st['flops_executed'] / 1e9:>10.3f}  useful {st['flops_useful'] / 1e9:>10.3f}"
            f"  (executed / useful {st['flops_executed'] / max(st['flops_useful'], 1):.3f})")


def kernel_table(cfg: ModelConfig, position: int, sample: dict | None) -> None:
    """Per-kernel totals of one decode step (counting device) and the floor from the config."""
    st, ks = count_kernels(cfg, position=position, sample=sample)
    floor = decode_floor_bytes(cfg, position=position)
    print(f"  per kernel, decode at position {position} ({'sampler ' + str(sample) if sample else 'greedy'}):")
    print(f"    {'kernel':<34} {'dispatches':>10} {'MB touched':>11} {'threadgroups':>12} {'threads':>10}")
    for name, d in sorted(ks.items(), key=lambda kv: -kv[1]["bytes_touched"]):
        print(f"    {name:<34} {d['dispatches']:>10} {d['bytes_touched'] / 1e6:>11.3f} {d['groups']:>12} "
              f"{d['threads']:>10}")
    print(f"    {'total':<34} {st['dispatches']:>10} {st['bytes_touched'] / 1e6:>11.3f}   "
          f"barriers {st['barriers']}")
    print("    floor from the config: " + ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in floor.items()))
    print(f"    bytes_touched / floor = {st['bytes_touched'] / floor['total']:.4f}")


def run_model(label: str, model, prompt: list[int], n_decode: int) -> None:
    t0 = time.perf_counter()
    logits = model.prefill(prompt)
    t_pre = time.perf_counter() - t0
    pre = model.stats()
    tok = int(np.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(model.decode(tok)))
    t_dec = time.perf_counter() - t0
    dec = model.stats()
    print(f"{label} on {model.backend}: prefill {len(prompt)} tokens {len(prompt) / t_pre:8.2f} tok/s, "
          f"decode {n_decode} tokens {n_decode / t_dec:8.2f} tok/s")
    print(f"  prefill step ({len(prompt)} tokens): {fmt(pre)}")
    print(f"  decode step (position {model.position - 1}): {fmt(dec)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="emu")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--real-layers", type=int, default=0)
    ap.add_argument("--kernels", action="store_true",
                    help="per-kernel table of the real config's decode step at 256, 4K and 32K "
                         "(counting device only: skips the demo run)")
    ap.add_argument("--counts", action="store_true",
                    help="only the real config's counters on the counting device (no demo run, no "
                         "timings: deterministic; docs quote it through tools/gendocs.py)")
    a = ap.parse_args()
    if a.kernels:
        cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
        full = dict(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05, seed=1, step=1,
                    valid_vocab=cfg.vocab_size)
        for pos in (255, 4095, 32767):
            kernel_table(cfg, pos, None)
        kernel_table(cfg, 255, full)
        return

    if not a.counts:
        run_demo(a)
    real_config_counts()


def run_demo(a) -> None:
    demo = lily_py.load(backend=a.device, context_length=a.prompt + a.decode + 1)
    prompt = (demo.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * a.prompt)[:a.prompt]
    run_model("demo checkpoint", demo, prompt, a.decode)

    if a.real_layers:
        n = a.real_layers
        raw = dict(REAL_TEXT_CONFIG, num_hidden_layers=n, layer_types=(
            ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * n)[:n])
        raw.pop("full_attention_interval")
        with tempfile.TemporaryDirectory() as d:
            make_checkpoint(d, raw, fmt="mlx", seed=0)
            m = lily_py.load(d, backend=a.device, context_length=64, prefill_chunk=64)
            run_model(f"real per-layer shapes, {n} layer(s)", m, list(range(100, 108)), 2)


def real_config_counts() -> None:
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    print(f"real 35B config (40 layers: 30 DeltaNet + 10 attention, 256 experts top-8, MLX 4-bit, "
          f"8-bit router), counting device, per step (Lily: ~{LILY_DISPATCHES_PER_TOKEN} "
          "dispatches per token):")
    for pos in (0, 4096, 32768):
        print(f"  decode at position {pos:>6}: {fmt(count_step(cfg, tokens=1, position=pos))}")
    for n in (256, 4096):
        print(f"  prefill chunk of {n:>4}:     {fmt(count_step(cfg, tokens=n, position=0))}")
    print(f"  prefill chunk of 4096 at position 28672 (the last chunk of a 32K prompt): "
          f"{fmt(count_step(cfg, tokens=4096, position=28672))}")


if __name__ == "__main__":
    main()
