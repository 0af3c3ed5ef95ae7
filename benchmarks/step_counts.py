"""Counters of one engine step of the real 35B config on the counting device (deterministic).

    python benchmarks/step_counts.py

Per step: dispatches, barriers, bytes touched, GFLOP executed / useful; for decode steps the
floor of the bytes from the config (lily_py.backends.engine.decode_floor_bytes) and the ratio.
Activations as load() gives a real checkpoint (bfloat16), greedy (no sampler dispatches).
docs/decode.md and docs/prefill.md quote it through tools/gendocs.py.
"""
from lily_py.backends.engine import count_step, decode_floor_bytes
from lily_py.config import ModelConfig
from lily_py.testing import REAL_TEXT_CONFIG

cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
for T, pos in [(1, 0), (1, 255), (1, 4095), (1, 32767), (256, 0), (4096, 0)]:
    st = count_step(cfg, tokens=T, position=pos)
    line = (f"tokens={T:5d} position={pos:6d}: dispatches {st['dispatches']} barriers {st['barriers']} "
            f"bytes_touched {st['bytes_touched']/1e6:.1f} MB GFLOP executed {st['flops_executed']/1e9:.3f} "
            f"useful {st['flops_useful']/1e9:.3f}")
    if T == 1:
        fl = decode_floor_bytes(cfg, position=pos)["total"]
        line += f" | floor {fl/1e6:.1f} MB, ratio {st['bytes_touched']/fl:.4f}"
    print(line)

# Levels the device sampler adds to a decode step, per route (each a dispatch after a barrier).
import lily_py._core as core
from lily_py.backends.engine import REAL_QUANT, engine_spec

ROUTES = [("greedy (temperature 0)", dict(temperature=0.0)),
          ("temperature only", dict(temperature=0.7)),
          ("small-k: top_k 20, top_p 0.95, min_p 0.05", dict(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05)),
          ("bucket: top_p 0.95 (no top-k)", dict(temperature=0.7, top_p=0.95)),
          ("bucket: min_p 0.05 (no top-k)", dict(temperature=0.7, min_p=0.05)),
          ("bucket: top_k 100, top_p 0.95", dict(temperature=0.7, top_k=100, top_p=0.95))]
for pos in (0, 4095):
    eng = core.Engine(engine_spec(cfg, REAL_QUANT, context_length=pos + 1, prefill_chunk=1), "count")
    base = eng.count(1, pos)
    for name, params in ROUTES:
        sample = dict(dict(top_k=0, top_p=1.0, min_p=0.0), **params, seed=3, step=1, valid_vocab=0)
        st = eng.count(1, pos, sample=sample)
        print(f"decode at position {pos:4d}, sampler {name}: +{st['dispatches'] - base['dispatches']} "
              f"dispatches, +{st['barriers'] - base['barriers']} barriers")

# The floor of a decode token's bytes (decode_floor_bytes), by part, at position 255.
fl = decode_floor_bytes(cfg, position=255)
print("floor at position 255: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in fl.items()))
