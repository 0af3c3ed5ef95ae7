"""Batched decode (issue 42): bytes per generated token by batch size, counted on the real config,
and on an NVIDIA GPU the step time, aggregate and per-stream tokens per second, and the time
between tokens of running streams while a prompt prefills between their steps.

    python benchmarks/batch_decode.py --counts [--position 256]
    python benchmarks/batch_decode.py --report benchmarks/data/h100_batch_decode_bf16.json
    python3 benchmarks/batch_decode.py --time [--layers 40] [--position 256] [--batches 1,2,4,8]
                                       [--prompt 4096] [--prefill-step 512] [--kv-dtype bfloat16|int8]
                                       [--kernels] [--json FILE]

``--counts`` runs anywhere (the counting device: nothing runs, no weights): the batched step's
dispatches, levels and bytes touched, the routed experts counted as ``min(256, 8 B)`` distinct
ones a layer (the bound: no two sequences share an expert), and beside it the expected count
under independent uniform routing, ``E (1 - (1 - k / E)^B)`` (docs/batching.md).

``--time`` needs a CUDA build (docs/gpu.md) and a GPU: a random-weight checkpoint of the real
shapes, ``Engine.time_step`` for one sequence and ``Engine.time_batch`` for B of them (one CUDA
graph of the step, median of the trials; the host sampler is not in either), and for the time
between tokens while a ``--prompt``-token prompt prefills, the batch step plus one prefill chunk
of ``--prefill-step`` tokens, averaged over the prompt's chunks. Numbers are the GPU's, not a
Mac's.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def expected_experts(B: int, E: int = 256, k: int = 8) -> float:
    """Distinct experts a layer when B tokens each pick k of E uniformly and independently."""
    return E * (1 - (1 - k / E) ** B)


def counts(position: int) -> list[dict]:
    from lily_py.backends.engine import count_batch_step
    from lily_py.config import ModelConfig
    from lily_py.testing import REAL_TEXT_CONFIG
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    E, k, layers = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    expert = layers * 3 * (H * I // 2 + 2 * I * (H // 64) * 2)  # 4-bit codes + bf16 scales, biases
    rows = []
    for B in (1, 2, 4, 8):
        st = count_batch_step(cfg, batch=B, position=position)
        bound = min(E, B * k)
        expected = st["bytes_touched"] - (bound - expected_experts(B, E, k)) * expert
        rows.append(dict(batch=B, dispatches=st["dispatches"], barriers=st["barriers"],
                         bytes=st["bytes_touched"], per_token=st["bytes_touched"] / B,
                         per_token_expected=expected / B))
    one = rows[0]["per_token"]
    print(f"real 35B config, batched decode at position {position}, counting device (bytes per generated "
          f"token; routed experts: bound min(256, 8 B) a layer | expected under uniform routing):")
    for r in rows:
        print(f"  B = {r['batch']}: dispatches {r['dispatches']:5d}  barriers {r['barriers']:4d}  "
              f"bytes/token {r['per_token'] / 2**20:8.1f} MiB ({r['per_token'] / one:.3f} of B = 1) | "
              f"expected {r['per_token_expected'] / 2**20:8.1f} MiB ({r['per_token_expected'] / one:.3f})")
    return rows


def timing(a) -> dict:
    import lily_py
    from lily_py.testing import make_checkpoint
    from lily_py.tools.bench import _config_dict
    info = lily_py.device_info("cuda")
    print(f"batch_decode: {info.get('device_name')}, lily_py {lily_py.__version__}, {time.strftime('%Y-%m-%d')}")
    print("command: python3 benchmarks/batch_decode.py " + " ".join(sys.argv[1:]))
    path = a.model
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="lily_batch_")
        path = make_checkpoint(tmp.name, _config_dict("real", a.layers), fmt="mlx", seed=0)
    batches = [int(b) for b in a.batches.split(",")]
    ctx = max(a.position, a.prompt) + 8
    m = lily_py.load(path, backend="cuda", context_length=ctx, prefill_chunk=max(a.prefill_step, max(batches)),
                     verbose=False, kv_dtype=a.kv_dtype)
    e = m._backend.engine
    out = dict(device=info.get("device_name"), layers=a.layers, kv_dtype=m.kv_dtype, position=a.position,
               date=time.strftime("%Y-%m-%d"), batches=[])
    chunk_us = []  # the prompt's prefill chunks, each at its position
    for p in range(0, a.prompt, a.prefill_step):
        t = e.time_step(min(a.prefill_step, a.prompt - p), p, repeats=1, trials=a.trials, per_dispatch=False)
        chunk_us.append(t["step_us"])
    chunk = sum(chunk_us) / len(chunk_us)
    base = None
    print(f"KV cache {m.kv_dtype}, {a.layers} layers, every sequence at position {a.position}; prefill chunk of "
          f"{a.prefill_step} tokens (a {a.prompt}-token prompt): {chunk:.0f} us on average")
    for B in batches:
        kw = dict(repeats=5 if a.kernels else 1, trials=a.trials, per_dispatch=a.kernels)
        t = e.time_step(1, a.position, **kw) if B == 1 else e.time_batch(B, a.position, **kw)
        us = t["step_us"]
        base = base or B / us
        row = dict(batch=B, step_us=us, step_us_min=t["step_us_min"], levels=t["levels"], nodes=t["nodes"],
                   aggregate_tok_s=B / us * 1e6, per_stream_tok_s=1e6 / us, vs_one=(B / us) / base,
                   between_tokens_while_prefilling_us=us + chunk)
        out["batches"].append(row)
        if a.kernels:
            from gpu_kernels import kernel_table
            kernel_table(f"B = {B}, per kernel (each dispatch alone):", t["dispatches"])
        print(f"  B = {B}: step {us:8.1f} us (min {t['step_us_min']:.1f})  levels {t['levels']:4d}  aggregate "
              f"{row['aggregate_tok_s']:7.1f} tok/s ({row['vs_one']:.2f}x B = 1)  per stream "
              f"{row['per_stream_tok_s']:6.1f} tok/s  between tokens while a prompt prefills "
              f"{row['between_tokens_while_prefilling_us']:8.1f} us")
    out["prefill_chunk_us"] = chunk
    return out


def report(path: str) -> None:
    """The timing table of a --json file (a run recorded on a GPU), as --time printed it."""
    with open(path) as f:
        t = json.load(f)["time"]
    print(f"{t['device']}, {t['date']}, {t['layers']} layers, KV cache {t['kv_dtype']}, every sequence at position "
          f"{t['position']}; one prefill chunk of the prompt between two steps: {t['prefill_chunk_us']:.0f} us")
    for r in t["batches"]:
        print(f"  B = {r['batch']}: step {r['step_us']:8.1f} us  levels {r['levels']:4d}  aggregate "
              f"{r['aggregate_tok_s']:6.1f} tok/s ({r['vs_one']:.2f}x B = 1)  per stream {r['per_stream_tok_s']:6.1f} tok/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", action="store_true", help="bytes per token on the counting device")
    p.add_argument("--time", action="store_true", help="time the steps on cuda")
    p.add_argument("--position", type=int, default=256)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--prefill-step", type=int, default=512)
    p.add_argument("--kv-dtype", default="bfloat16")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--model", default=None, help="checkpoint (default: random weights, real shapes)")
    p.add_argument("--kernels", action="store_true", help="--time: also each kernel alone, per batch size")
    p.add_argument("--json", default=None)
    p.add_argument("--report", default=None, help="print the timing table of a --json file")
    a = p.parse_args()
    if a.report:
        report(a.report)
        return
    if not (a.counts or a.time):
        p.error("give --counts, --time or both (or --report FILE)")
    result = {}
    if a.counts:
        result["counts"] = counts(a.position)
    if a.time:
        result["time"] = timing(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
