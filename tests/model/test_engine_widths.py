"""Random-weight checkpoints at every MLX affine width the engine did not take before (2, 3, 5 and
6 bits), one mixed recipe of them, and routed experts at 3 bits with the rest at 6 (the shared
expert at its own width), on the engine against the reference (issue 25 item 1):
greedy decode after prefill chunks of 1, 64 and 4096 tokens, on both matmul paths (M1-M4
simdgroup tiles, and the M5 path with tensor ops, where these widths take the fp32 tiles).

Tolerance as tests/model/test_mixed_bits.py (fp32 activations, bf16 KV cache: 2^-7 of the logit
range), and the greedy tokens equal at each of 32 steps (fixed seeds: the runs are deterministic).
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint

from engine_backend import ENGINE, require_emulator, require_engine
from tolerances import assert_close

require_engine()

STEPS = 32
PROMPT = [int(t) for t in np.random.default_rng(11).integers(3, 320, 84)]  # 84 tokens: 64 + 20 (vocab 320)
MIXED = {"layers.3.self_attn.q_proj": (5, 64), "layers.3.self_attn.v_proj": (6, 32),
         "layers.0.linear_attn.in_proj_z": (2, 64), "layers.1.mlp.experts.down_proj": (6, 64),
         "layers.1.mlp.shared_expert.down_proj": (6, 64), "layers.2.mlp.experts.gate_proj": (5, 64),
         "layers.2.mlp.experts.up_proj": (5, 64), "layers.2.mlp.shared_expert.gate_proj": (5, 64),
         "layers.2.mlp.shared_expert.up_proj": (5, 64), "lm_head": (6, 64), "embed_tokens": (5, 32)}
# Routed experts 3-bit, everything else (the shared expert included) 6-bit: the recipe for a 24 GB
# Mac (issue 41 item 4); the MoE kernels read the shared expert at its own width.
ROUTED3 = {f"layers.{i}.mlp.experts.{m}": (3, 64) for i in range(4) for m in ("gate_proj", "up_proj", "down_proj")}
WIDTHS = {"2bit": dict(bits=2), "3bit": dict(bits=3), "5bit": dict(bits=5), "6bit": dict(bits=6),
          "mixed": dict(bits=3, quant_overrides=MIXED), "routed3_shared6": dict(bits=6, quant_overrides=ROUTED3)}
MOE_WIDTH = {"routed3_shared6": "b3s6"}  # the expert kernels' width tag (default: b<bits>)


@pytest.fixture(scope="module", params=list(WIDTHS))
def ckpt(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), dict(TINY_TEXT_CONFIG), fmt="mlx", seed=5,
                           std=0.08, group_size=64, **WIDTHS[request.param])
    return request.param, path


def _load(path, chunk, tensor_ops):
    from lily_py.testing import simulated_device
    kw = dict(backend=ENGINE, context_length=128, prefill_chunk=chunk, activations="float32")
    if tensor_ops:
        require_emulator("simulated tensor ops (the M5 path)")
        with simulated_device(tensor_ops=True):
            return lily_py.load(path, **kw)
    return lily_py.load(path, **kw)


@pytest.mark.parametrize("tensor_ops", [False, True], ids=["m1_m4", "m5"])
@pytest.mark.parametrize("chunk", [1, 64, 4096])
def test_engine_greedy_equals_reference(ckpt, chunk, tensor_ops):
    name, path = ckpt
    emu = _load(path, chunk, tensor_ops)
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    bits = WIDTHS[name]["bits"]
    moe = MOE_WIDTH.get(name, f"b{bits}")
    assert any(k.startswith(f"moe_gate_up_mv_{moe}_") for k in kernels), sorted(kernels)
    assert any(k.startswith(f"moe_down_mv_{moe}_") for k in kernels), sorted(kernels)
    if chunk > 1:  # the prompt's chunks take the expert kernels of the shared width too
        assert any(k.startswith(f"moe_gate_up_mm64_{moe}_") for k in kernels), sorted(kernels)
    if chunk > 1:  # the prompt's chunks take the fp32 tiles at these widths, on either path
        assert any(k.startswith(f"qmm_b{bits}_") for k in kernels), sorted(kernels)
    ref = lily_py.load(path, backend="reference", context_length=128)
    got, want = emu.prefill(PROMPT), ref.prefill(PROMPT)
    scale = float(np.abs(want).max())
    tokens = []
    for step in range(STEPS):
        assert_close(got, want, atol=2.0 ** -7 * scale, rtol=0, what=f"{name} chunk {chunk} step {step}")
        tok = int(np.argmax(want))
        assert int(np.argmax(got)) == tok, f"{name} chunk {chunk}: greedy token differs at step {step}"
        tokens.append(tok)
        got, want = emu.decode(tok), ref.decode(tok)
    assert len(set(tokens)) > 3, f"{name}: a degenerate greedy run {tokens}"


@pytest.mark.parametrize("recipe", ["3-bit", "mixed 3/4 (mixed_3_4)"], ids=["3bit", "mixed_3_4"])
def test_bytes_touched_at_3_bits_against_the_floor(recipe):
    """A decode step of the real config at 256 context moves at most 1.03x the bytes it cannot
    avoid (decode_floor_bytes, every weight at its own width), as the 4-bit checkpoint does
    (tests/model/test_engine.py): decode stays bandwidth-bound at these widths. The recipes are
    mlx-lm's `-q --q-bits 3` and `--quant-predicate mixed_3_4` (lily_py.sizes.engine_quant)."""
    from lily_py.backends.engine import count_kernels, decode_floor_bytes
    from lily_py.config import ModelConfig
    from lily_py.sizes import engine_quant
    from lily_py.testing import REAL_TEXT_CONFIG
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": REAL_TEXT_CONFIG})
    q = engine_quant(cfg, recipe)
    st, ks = count_kernels(cfg, position=255, quant=q)
    floor = decode_floor_bytes(cfg, position=255, quant=q)["total"]
    floor4 = decode_floor_bytes(cfg, position=255)["total"]
    print(f"{recipe}: bytes_touched {st['bytes_touched']}, floor {floor} ({floor / floor4:.3f} of 4-bit's), "
          f"ratio {st['bytes_touched'] / floor:.4f}")
    assert floor < 0.9 * floor4
    assert floor <= st["bytes_touched"] <= 1.03 * floor
    assert any(k.startswith("moe_gate_up_mv_b3_") for k in ks) and any(k.startswith("qmv1_b3_") for k in ks)
