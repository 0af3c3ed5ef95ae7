"""Where a live batched step's host time goes (docs/batching.md, "The host's part"), on cuda:
for each B, the wall time of Engine.decode_batch (encode, GPU, wait, logits to the host), its
encode time (stats encode_ns), a greedy argmax of B rows on the host, the Batcher's path (each
row sampled on the device, two steps in flight: Engine.submit_batch / complete_batch) per step,
and the same step as one CUDA graph (Engine.time_batch / time_step). Random-weight checkpoint of
the real shapes.

    python3 tools/gpu/batch_host.py [--layers 40] [--position 256] [--batches 1,2,4,8]
    python tools/gpu/batch_host.py --backend emu --preset tiny --layers 4 --position 40  # smoke
"""
import argparse
import statistics
import tempfile
import time

import numpy as np

import lily_py
from lily_py.batch import Batcher, make_request
from lily_py.testing import make_checkpoint
from lily_py.tools.bench import _config_dict

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=40)
p.add_argument("--position", type=int, default=256)
p.add_argument("--batches", default="1,2,4,8")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--backend", default="cuda", help="cuda (emu with --preset tiny: a smoke run)")
p.add_argument("--preset", default="real")
a = p.parse_args()
tmp = tempfile.TemporaryDirectory()
m = lily_py.load(make_checkpoint(tmp.name, _config_dict(a.preset, a.layers), fmt="mlx", seed=0),
                 backend=a.backend, context_length=a.position + 4 * a.steps + 64, verbose=False)
m.prompt_cache.max_bytes = 0
e = m._backend.engine
rng = np.random.default_rng(0)
print(f"{lily_py.device_info(a.backend).get('device_name')}, {a.layers} layers, position {a.position}")
for B in [int(x) for x in a.batches.split(",")]:
    b = Batcher(m, B, a.position)
    for i in range(B):
        b.add(make_request(m, i, rng.integers(3, m.config.vocab_size // 2, a.position).tolist(), {}))
    while len(b._decoding) < B:
        b.step()
    b._drain([])   # nothing in flight: decode_batch runs alone
    seqs = np.array([r.seq for r in b._decoding], dtype=np.uint32)
    toks = np.array([r.tok for r in b._decoding], dtype=np.uint32)
    wall, enc, pick = [], [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        logits, st = e.decode_batch(seqs, toks)
        t1 = time.perf_counter()
        toks = np.argmax(logits, axis=-1).astype(np.uint32)
        t2 = time.perf_counter()
        wall.append(t1 - t0)
        enc.append(st["encode_ns"] * 1e-9)
        pick.append(t2 - t1)
    samplings = [r.sampling for r in b._decoding]
    n = np.array([r.sub for r in b._decoding], dtype=np.uint32)
    e.submit_batch(seqs, toks, samplings, n)
    t0 = time.perf_counter()
    for k in range(1, a.steps + 1):
        e.submit_batch(seqs, None, samplings, n + k)
        e.complete_batch()
    piped = (time.perf_counter() - t0) / a.steps
    e.complete_batch()
    b.close()
    graph = float("nan")   # only cuda times a step as one graph
    if a.backend == "cuda":
        graph = (e.time_step(1, a.position, repeats=1, trials=3, per_dispatch=False) if B == 1
                 else e.time_batch(B, a.position, repeats=1, trials=3, per_dispatch=False))["step_us"]
    med = lambda x: statistics.median(x) * 1e6  # noqa: E731
    print(f"  B = {B}: decode_batch {med(wall):8.0f} us (encode {med(enc):6.0f} us)  argmax of {B} rows "
          f"{med(pick):6.0f} us  | sampled on the device, two in flight {piped * 1e6:8.0f} us a step  | "
          f"graph {graph:8.0f} us")
