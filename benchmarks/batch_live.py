"""The Batcher as ``lily-py serve`` drives it (issue 42), end to end on an NVIDIA GPU: aggregate
and per-stream tokens per second with the host's part included (each step encoded afresh, its
rows sampled on the device, two steps in flight, one host wait per step), and the time between
tokens of running streams while a long prompt arrives and is prefilled between their steps.

    python3 benchmarks/batch_live.py [--layers 40] [--position 256] [--batches 1,2,4,8]
                                     [--steps 24] [--prompt 4096] [--prefill-steps 128,512]
                                     [--while-batch 4] [--json FILE]
    python benchmarks/batch_live.py --report benchmarks/data/h100_batch_live_bf16.json

Needs a CUDA build (docs/gpu.md): a random-weight checkpoint of the real shapes, prompts of
random token ids, greedy sampling. For each B, B streams are prefilled to ``--position``, then
``--steps`` batched steps are timed from the first chunk to the last. Then, with
``--while-batch`` streams decoding, a ``--prompt``-token prompt is added, and the gaps between
two tokens of a running stream are recorded until its first token, for each ``--prefill-step``
(the budget of prompt tokens between two steps). Numbers are the GPU's, not a Mac's: its prefill
tiles emulate ``simdgroup_matrix`` with shuffles (docs/gpu.md), so the gaps here are long; what
carries over is that a gap is one step plus one ``prefill_step`` chunk.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def load(a):
    """A random-weight checkpoint of the real shapes (``--preset``), loaded on ``--backend``."""
    import lily_py
    from lily_py.testing import make_checkpoint
    from lily_py.tools.bench import _config_dict
    info = lily_py.device_info(a.backend)
    print(f"batch_live: {info.get('device_name')}, lily_py {lily_py.__version__}, {time.strftime('%Y-%m-%d')}")
    print("command: python3 benchmarks/batch_live.py " + " ".join(sys.argv[1:]), flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="lily_live_")
    path = make_checkpoint(tmp.name, _config_dict(a.preset, a.layers), fmt="mlx", seed=0)
    steps = [int(s) for s in a.prefill_steps.split(",")]
    m = lily_py.load(path, backend=a.backend, context_length=a.position + a.steps + a.prompt + 64,
                     prefill_chunk=max(steps), verbose=False)
    m.prompt_cache.max_bytes = 0     # random prompts: nothing to reuse, nothing to snapshot
    return m, info, tmp


def streams(m, b, n: int, position: int, rng, first: int = 0) -> None:
    from lily_py.batch import make_request
    for i in range(first, first + n):
        ids = rng.integers(3, m.config.vocab_size // 2, position).tolist()
        b.add(make_request(m, i, ids, {"max_tokens": m.context_length}))


def run_until(b, stamps: dict, done) -> None:
    while not done():
        now_chunks = b.step()
        now = time.perf_counter()
        for key, c in now_chunks:
            if c.token is not None:
                stamps.setdefault(key, []).append(now)


def throughput(m, a, B: int, rng) -> dict:
    from lily_py.batch import Batcher
    b = Batcher(m, B, a.position)
    try:
        streams(m, b, B, a.position, rng)
        run_until(b, {}, lambda: len(b._decoding) == B)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            b.step()
        dt = time.perf_counter() - t0
    finally:
        b.close()
    return dict(batch=B, steps=a.steps, seconds=dt, step_ms=dt / a.steps * 1e3,
                aggregate_tok_s=B * a.steps / dt, per_stream_tok_s=a.steps / dt)


def while_prefilling(m, a, step: int, rng) -> dict:
    """Gaps between tokens of --while-batch running streams while a --prompt prompt prefills."""
    from lily_py.batch import Batcher, make_request
    B = a.while_batch
    b = Batcher(m, B + 1, step)
    try:
        streams(m, b, B, a.position, rng)
        run_until(b, {}, lambda: len(b._decoding) == B)
        before: dict = {}
        run_until(b, before, lambda: len(before.get(0, [])) >= 6)
        b.add(make_request(m, "new", rng.integers(3, m.config.vocab_size // 2, a.prompt).tolist(),
                           {"max_tokens": 1}))
        t_add = time.perf_counter()
        during: dict = {}
        run_until(b, during, lambda: "new" in during)
        ttft = during["new"][0] - t_add
    finally:
        b.close()
    gaps_before = [y - x for k in range(B) for x, y in zip(before[k], before[k][1:])]
    gaps = [y - x for k in range(B) for x, y in zip([before[k][-1]] + during.get(k, []), during.get(k, []))]
    return dict(prefill_step=step, while_batch=B, prompt=a.prompt,
                gap_before_ms=statistics.median(gaps_before) * 1e3,
                gap_during_median_ms=statistics.median(gaps) * 1e3, gap_during_max_ms=max(gaps) * 1e3,
                tokens_during=sum(len(during.get(k, [])) for k in range(B)) / B, ttft_s=ttft)


def show(t: dict) -> None:
    # runs recorded before the Batcher sampled on the device carry no "sampling" entry
    print(f"{t['device']}, {t['date']}, {t['layers']} layers, KV cache {t['kv_dtype']}, streams at position "
          f"{t['position']}; greedy, {t.get('sampling', 'sampled on the host')}; {t['steps']} steps timed")
    base = None
    for r in t["throughput"]:
        base = base or r["aggregate_tok_s"]
        print(f"  B = {r['batch']}: step {r['step_ms']:6.2f} ms  aggregate {r['aggregate_tok_s']:6.1f} tok/s "
              f"({r['aggregate_tok_s'] / base:.2f}x B = 1)  per stream {r['per_stream_tok_s']:6.1f} tok/s")
    for r in t["while_prefilling"]:
        print(f"  {r['while_batch']} streams while a {r['prompt']}-token prompt prefills, prefill_step "
              f"{r['prefill_step']}: between tokens {r['gap_before_ms']:.1f} ms before, median "
              f"{r['gap_during_median_ms']:.1f} ms / max {r['gap_during_max_ms']:.1f} ms during "
              f"({r['tokens_during']:.0f} tokens each); the prompt's first token after {r['ttft_s']:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--backend", default="cuda", help="cuda (emu: a smoke run, with --preset)")
    p.add_argument("--preset", default="real", help="the checkpoint's shapes (lily_py.tools.bench)")
    p.add_argument("--position", type=int, default=256)
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--prefill-steps", default="128,512")
    p.add_argument("--while-batch", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--report", default=None, help="print the table of a --json file")
    a = p.parse_args()
    if a.report:
        with open(a.report) as f:
            show(json.load(f))
        return
    import numpy as np
    m, info, _tmp = load(a)
    rng = np.random.default_rng(0)
    out = dict(device=info.get("device_name"), date=time.strftime("%Y-%m-%d"), layers=a.layers,
               kv_dtype=m.kv_dtype, position=a.position, steps=a.steps,
               sampling="sampled on the device, two steps in flight", throughput=[], while_prefilling=[])
    for B in [int(x) for x in a.batches.split(",")]:
        out["throughput"].append(throughput(m, a, B, rng))
    for step in [int(x) for x in a.prefill_steps.split(",")]:
        out["while_prefilling"].append(while_prefilling(m, a, step, rng))
    show(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
