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
