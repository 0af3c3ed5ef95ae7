"""Mixed-bit checkpoints (per-module bits and group sizes, ``mlx_lm.convert --quant-predicate``)
on the engine: the split route of fused projections whose parts disagree (docs/mixed-bits.md).

The fixture (tests/fixtures/mixed_bits/, made by tests/fixtures/make_mixed_bits.py with mlx-lm)
is a checkpoint ``mlx_lm.convert`` wrote with a custom predicate: attention q / k / v in three
quantizations, layer 0's DeltaNet in_proj parts in four, layer 1's router apart from its
shared-expert gate, layer 2's MoE down stage at group 32 beside gate/up at group 64, and 8-bit
o_proj / out_proj / lm_head. mlx-lm's fp32 logits and greedy tokens on it are committed.

Tolerances: the reference against mlx-lm as in tests/reference/test_oracles.py (RTOL 1e-4 of the
logit range: both dequantize the same codes exactly and compute in fp32). The engine (fp32
activations) against the reference as in tests/model/test_engine.py for a checkpoint with an
attention layer (2^-7 of the logit range: its KV cache is bf16).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lily_py
from lily_py.backends.engine import (_tensors, checkpoint_quant, count_kernels, count_step,
                                     decode_floor_bytes, engine_spec)
from lily_py.checkpoint import load_weights
from lily_py.errors import CheckpointError
from lily_py.sizes import config_recipe, human, mixed, needs, weight_bytes
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint

from engine_backend import ENGINE, require_emulator, require_engine
from tolerances import assert_close

require_engine()

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "mixed_bits"
CKPT = FIX / "mlx"
RTOL = 1e-4
# The fused projections of the fixture that take the split route, and their runs of parts.
SPLIT = {"layers.0.in_proj": ["qkv", "z", "b", "a"], "layers.1.router": ["router", "shared_expert_gate"],
         "layers.3.qkv_proj": ["q", "k", "v"]}
FUSED = ["layers.1.in_proj", "layers.2.in_proj", "layers.0.router", "layers.2.router", "layers.3.router"]


@pytest.fixture(scope="module")
def expected():
    return np.load(FIX / "expected.npz")


def _engine_weights(cfg, w) -> set[str]:
    return {name.rsplit(".", 1)[0] for name, *_ in _tensors(cfg, w)}


def test_fixture_is_a_mixed_conversion_whose_fused_parts_disagree():
    raw = json.loads((CKPT / "config.json").read_text())
    per_module = {k for k, v in raw["quantization"].items() if isinstance(v, dict)}
    assert "language_model.model.layers.3.self_attn.q_proj" in per_module
    cfg, w = load_weights(CKPT)
    names = _engine_weights(cfg, w)
    for fused, parts in SPLIT.items():
        assert fused not in names
        assert {f"{fused}:{p}" for p in parts} <= names, fused
    assert set(FUSED) <= names
    q = checkpoint_quant(w)["quant_overrides"]
    assert q["layers.3.qkv_proj:q"]["bits"] == 8 and q["layers.3.qkv_proj:k"]["group_size"] == 32
    assert q["layers.2.experts.down"]["group_size"] == 32 and "layers.2.experts.gate" not in q


def test_reference_agrees_with_mlx_lm(expected):
    ref = lily_py.load(CKPT, backend="reference", context_length=64, kv_dtype="bfloat16")
    prompt = expected["prompt"].tolist()
    want = expected["logits"]
    scale = float(np.abs(want).max())
    assert_close(ref.prefill(prompt, all_logits=True), want, atol=RTOL * scale, rtol=RTOL,
                 what="reference vs mlx-lm prefill")
    ref.reset()
    logits = ref.prefill(prompt)
    for step, tok in enumerate(expected["greedy"].tolist()):
        assert_close(logits, expected["greedy_logits"][step], atol=RTOL * scale, rtol=RTOL,
                     what=f"reference vs mlx-lm greedy step {step}")
        assert int(np.argmax(logits)) == tok, f"greedy step {step}"
        logits = ref.decode(tok)


@pytest.mark.parametrize("chunk", [1, 5, 12])
def test_engine_greedy_equals_reference(expected, chunk):
    """Chunks of 1 (decode routes: qmv1 with the norm folded into every block), 5 (qmv) and 12
    (qmm tiles, MoE tiled) tokens; then 16 greedy decode steps, all on the split route."""
    emu = lily_py.load(CKPT, backend=ENGINE, context_length=64, prefill_chunk=chunk, activations="float32")
    ref = lily_py.load(CKPT, backend="reference", context_length=64)
    prompt = expected["prompt"].tolist()
    got, want = emu.prefill(prompt), ref.prefill(prompt)
    scale = float(np.abs(want).max())
    tokens = []
    for step in range(len(expected["greedy"])):
        assert_close(got, want, atol=2.0 ** -7 * scale, rtol=0, what=f"engine vs reference step {step}")
        tok = int(np.argmax(got))
        assert tok == int(np.argmax(want)), f"step {step}"
        tokens.append(tok)
        got, want = emu.decode(tok), ref.decode(tok)
    assert tokens == expected["greedy"].tolist()


def test_engine_greedy_equals_reference_on_the_m5_path(expected):
    """With tensor ops (simulated M5) the split blocks of a 12-token chunk take qmm_m5 (half
    operands: <= 2^-10 relative per product, below the bf16 KV cache's 2^-9 the tolerance is
    derived for) and the MoE the m5 tiles, the down stage at its own group size."""
    from lily_py.testing import simulated_device
    require_emulator("simulated tensor ops (the M5 path)")
    with simulated_device(tensor_ops=True):
        emu = lily_py.load(CKPT, backend=ENGINE, context_length=64, prefill_chunk=12, activations="float32")
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    assert {"qmm_m5_b8_xf32_sbf16", "qmm_m5_b4_xf32_sbf16", "moe_down_m5_64_b4_sbf16"} <= kernels, sorted(kernels)
    ref = lily_py.load(CKPT, backend="reference", context_length=64)
    prompt = expected["prompt"].tolist()
    got, want = emu.prefill(prompt), ref.prefill(prompt)
    assert_close(got, want, atol=2.0 ** -7 * float(np.abs(want).max()), rtol=0, what="M5 path prefill")
    emu.reset()
    assert emu.generate_text(prompt, max_tokens=16).tokens == expected["greedy"].tolist()


@pytest.mark.parametrize("tensor_ops", [False, True])
@pytest.mark.parametrize("chunk", [64, 4096])
def test_long_prompt_in_chunks_on_both_matmul_paths(expected, chunk, tensor_ops):
    """An 84-token prompt (the fixture's prompt and greedy tokens, three times) in chunks of 64
    and at once: the DeltaNet chunked route, the tiled matmuls (simdgroup qmm, or qmm_m5 with
    tensor ops) on every run of the split projections, the MoE's tiled route; then greedy decode."""
    from lily_py.testing import simulated_device
    ids = (expected["prompt"].tolist() + expected["greedy"].tolist()) * 3
    if tensor_ops:
        require_emulator("simulated tensor ops (the M5 path)")
        with simulated_device(tensor_ops=True):
            emu = lily_py.load(CKPT, backend=ENGINE, context_length=128, prefill_chunk=chunk,
                               activations="float32")
    else:
        emu = lily_py.load(CKPT, backend=ENGINE, context_length=128, prefill_chunk=chunk, activations="float32")
    ref = lily_py.load(CKPT, backend="reference", context_length=128)
    got, want = emu.prefill(ids), ref.prefill(ids)
    scale = float(np.abs(want).max())
    for step in range(4):
        assert_close(got, want, atol=2.0 ** -7 * scale, rtol=0, what=f"chunk {chunk}, step {step}")
        tok = int(np.argmax(want))
        assert int(np.argmax(got)) == tok, step
        got, want = emu.decode(tok), ref.decode(tok)


def test_split_route_dispatch_counts():
    """Each fused projection whose parts form n runs costs n - 1 dispatches more than the fused
    route; one token adds no barrier (the blocks write disjoint ranges of the output), a chunk of
    several tokens one barrier per extra block (their output rows interleave)."""
    cfg, w = load_weights(CKPT)
    mixed_q = checkpoint_quant(w)
    uniform = {k: v for k, v in mixed_q.items() if k != "quant_overrides"}
    extra = sum(len(parts) - 1 for parts in SPLIT.values())
    assert extra == 6
    for tokens in (1, 5, 12):
        a = count_step(cfg, tokens=tokens, quant=mixed_q)
        b = count_step(cfg, tokens=tokens, quant=uniform)
        assert a["dispatches"] - b["dispatches"] == extra, tokens
        assert a["barriers"] - b["barriers"] == (0 if tokens == 1 else extra), tokens
    # the emulator runs what the counting device counts
    emu = lily_py.load(CKPT, backend=ENGINE, context_length=64, prefill_chunk=12, activations="float32")
    for ids in ([3] * 12, [4]):
        emu.prefill(ids)
        st = emu._backend.last_stats
        want = count_step(cfg, tokens=len(ids), position=emu._backend.position - len(ids), quant=mixed_q,
                          prefill_chunk=12, context_length=64, activations="float32")
        assert (st["dispatches"], st["barriers"]) == (want["dispatches"], want["barriers"])


def test_real_config_split_counts():
    """The real 35B config with v_proj at 8 bits in mlx-lm's "more bits" layers (its mixed
    recipes' v_proj rule at the widths the kernels take): each such attention layer's qkv_proj
    splits into q+k | v, one dispatch more per decode token."""
    from lily_py.backends.engine import REAL_QUANT
    from lily_py.config import ModelConfig
    from lily_py.testing import REAL_TEXT_CONFIG
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": REAL_TEXT_CONFIG})
    n = cfg.num_hidden_layers
    more = [i for i in cfg.full_attention_layers
            if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2]
    assert more
    q8 = dict(REAL_QUANT["mixer"], bits=8)
    quant = dict(REAL_QUANT, quant_overrides={f"layers.{i}.qkv_proj:v": q8 for i in more})
    a, b = count_step(cfg, quant=quant, position=100), count_step(cfg, position=100)
    assert a["dispatches"] - b["dispatches"] == len(more)
    assert a["barriers"] == b["barriers"]
    # the decode floor counts each weight at its own width (the 8-bit v rows: twice the code
    # bytes), and the split route stays within the bound tests/model/test_engine.py holds the
    # uniform checkpoint to at 256 context
    st, _ = count_kernels(cfg, position=255, quant=quant)
    floor = decode_floor_bytes(cfg, position=255, quant=quant)["total"]
    v_codes = cfg.num_key_value_heads * cfg.head_dim * cfg.hidden_size // 2   # 4-bit bytes of one v_proj
    assert floor - decode_floor_bytes(cfg, position=255)["total"] == len(more) * v_codes
    assert floor <= st["bytes_touched"] <= 1.03 * floor


def _mixed(tmp_path, overrides):
    return make_checkpoint(tmp_path / "m", dict(TINY_TEXT_CONFIG), fmt="mlx", seed=7, std=0.08,
                           quant_overrides=overrides)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_a_module_at_every_other_width_runs(tmp_path, bits):
    """One projection (attention q) and one MoE down stage at a width of their own: the split route
    and the expert kernels take it, and the engine matches the reference."""
    p = _mixed(tmp_path, {"layers.3.self_attn.q_proj": (bits, 64), "layers.1.mlp.experts.down_proj": (bits, 64),
                          "layers.1.mlp.shared_expert.down_proj": (bits, 64)})
    emu = lily_py.load(p, backend=ENGINE, context_length=16, activations="float32")
    ref = lily_py.load(p, backend="reference", context_length=16)
    got, want = emu.prefill([1, 2, 3]), ref.prefill([1, 2, 3])
    assert_close(got, want, atol=2.0 ** -7 * float(np.abs(want).max()), rtol=0, what=f"{bits}-bit modules")


def test_moe_stage_whose_matrices_disagree_names_both(tmp_path):
    p = _mixed(tmp_path, {"layers.2.mlp.experts.up_proj": (4, 32)})
    with pytest.raises(CheckpointError, match=r"layers.2.mlp.switch_mlp.up_proj is 4-bit group 32 but "
                                              r"layers.2.mlp.switch_mlp.gate_proj is 4-bit group 64; the engine's "
                                              r"MoE kernels read .* in one dispatch"):
        lily_py.load(p, backend=ENGINE, context_length=16)


@pytest.mark.parametrize("overrides,msg", [
    ({"layers.1.mlp.shared_expert.gate_proj": (5, 64), "layers.1.mlp.shared_expert.up_proj": (5, 64)},
     r"layers.1.mlp.shared_expert.gate_proj is 5-bit but layers.1.mlp.switch_mlp.gate_proj is 4-bit; the "
     r"engine's MoE kernels take the shared expert at its own width for routed/shared bits 2/6, 3/6, 4/6, 4/8"),
    ({"layers.1.mlp.shared_expert.gate_proj": (6, 64)},
     r"layers.1.mlp.shared_expert.up_proj is 4-bit group 64 but layers.1.mlp.shared_expert.gate_proj is 6-bit "
     r"group 64; .* the shared ones too"),
    ({"layers.1.mlp.shared_expert.down_proj": (6, 32)},
     r"layers.1.mlp.shared_expert.down_proj is 6-bit group 32 but layers.1.mlp.switch_mlp.down_proj is 4-bit "
     r"group 64; .* the shared expert may differ in bits only"),
], ids=["pair_not_built", "shared_gate_up_differ", "shared_group_size"])
def test_shared_expert_width_the_kernels_cannot_read_is_refused(tmp_path, overrides, msg):
    """The shared expert may have its own width (tests/model/test_engine_widths.py: routed 3-bit,
    shared 6-bit), but only for the built pairs, with its gate and up alike, in the stage's group size."""
    p = _mixed(tmp_path, overrides)
    with pytest.raises(CheckpointError, match=msg):
        lily_py.load(p, backend=ENGINE, context_length=16)


def test_engine_spec_refuses_bad_overrides():
    cfg, w = load_weights(CKPT)
    q = checkpoint_quant(w)
    bad = [({"layers.9.o_proj": q["mixer"]}, r"quant_overrides: the model has no weight .* 'layers.9.o_proj'"),
           ({"layers.3.qkv_proj:x": q["mixer"]}, r"no weight .* 'layers.3.qkv_proj:x'"),
           ({"layers.0.qkv_proj:q": q["mixer"]}, r"no weight .* 'layers.0.qkv_proj:q'"),  # a DeltaNet layer
           ({"layers.1.experts.gate": dict(q["experts_q"], group_size=96)},
            r"layers.1.experts.gate: group_size=96 unsupported \(32/64/128\)"),
           ({"layers.1.shared.down": dict(q["experts_q"], group_size=32)},
            r"layers.1.shared.down is 4-bit group 32 but layers.1.experts.down is 4-bit group 64"),
           ({"layers.1.shared.gate": dict(q["experts_q"], bits=5), "layers.1.shared.up": dict(q["experts_q"], bits=5)},
            r"layers.1.shared.up is 5-bit group 64 but layers.1.experts.gate is 4-bit group 64: the MoE kernels "
            r"take the shared expert at its own width for routed/shared bits 2/6, 3/6, 4/6, 4/8"),
           ({"layers.1.shared.gate": dict(q["experts_q"], bits=6)},
            r"layers.1.shared.up is 4-bit group 64 but layers.1.experts.gate is 4-bit group 64: one MoE kernel "
            r"reads both \(the routed matrices of a stage must agree")]
    for overrides, msg in bad:
        spec = engine_spec(cfg, dict(q, quant_overrides=overrides), context_length=16, prefill_chunk=4)
        with pytest.raises(ValueError, match=msg):
            lily_py._core.Engine(spec, "count")


def test_info_and_plan_count_the_mixed_checkpoints_bytes():
    """The engine's weight bytes (split weights included) are the checkpoint's quantized tensors
    plus the float32 vectors, and what lily_py.sizes (lily-py info, docs/memory.md) computes from
    the config's per-module widths."""
    cfg, w = load_weights(CKPT)
    real = sum(np.asarray(p).nbytes for *_, parts in _tensors(cfg, w) for p in parts)
    emu = lily_py.load(CKPT, backend=ENGINE, context_length=64)
    assert emu._backend.engine.weight_bytes == real
    assert weight_bytes(cfg, config_recipe(cfg)) == real
    out = subprocess.run([sys.executable, "-m", "lily_py.cli", "info", str(CKPT), "--context", "64"],
                         capture_output=True, text=True, check=True).stdout
    n = needs(cfg, config_recipe(cfg), 64)
    assert f"weights {human(real)} " in out and f"({n['total']} bytes)" in out
    # the widths besides the default: 8-bit g64 (q, three 8-bit routers and four shared gates),
    # 8-bit g128 (z, o_proj, lm_head), 8-bit g32 (out_proj), 4-bit g32 (k, b, two down)
    assert ("quantization: 4-bit g64 by default; per module: 4-bit g32 x4, 8-bit g32 x1, "
            "8-bit g64 x8, 8-bit g128 x3") in out


def test_sizes_mixed_recipes_are_mlx_lms():
    """lily_py.sizes.mixed (docs/memory.md's mixed 3/4 row) gives every module the width mlx-lm's
    own mixed_3_4 / mixed_4_6 predicate gives it (recorded by make_mixed_bits.py on 40 layers)."""
    recorded = json.loads((FIX / "recipes.json").read_text())
    for name, (low, high) in (("mixed_3_4", (3, 4)), ("mixed_4_6", (4, 6))):
        ours = mixed(low, high, 40)
        got = {module: list(ours(module)) for module in recorded[name]}
        assert got == recorded[name], name


def test_split_weights_are_served_from_the_aligned_checkpoints_pages(tmp_path, expected):
    """After `lily-py align`, the runs of the split route (one tensor, or agreeing parts back to
    back) are bound at their file offsets like any other weight, and the model still runs."""
    from lily_py.tools.align import align_checkpoint
    dst = tmp_path / "aligned"
    align_checkpoint(CKPT, dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((CKPT / name).read_bytes())
    require_emulator("weights='map' (buffers over the checkpoint's pages; cuda copies weights to device memory)")
    emu = lily_py.load(dst, backend=ENGINE, context_length=64, activations="float32", weights="map")
    placed = {d["name"]: d for d in emu._backend.engine.weight_sources()}
    split = [n for n in placed if ":" in n]
    assert len(split) == 3 * sum(len(parts) for parts in SPLIT.values())
    # (a tensor whose size is not a multiple of 16 bytes goes last in the aligned layout and may be
    # copied, as in a uniform checkpoint: tests/model/test_zero_copy.py)
    unmapped = [n for n in split if placed[n]["file"] is None]
    assert all(placed[n]["bytes"] % 16 for n in unmapped), unmapped
    assert not [n for n in unmapped if n.endswith(".weight")], unmapped
    ref = lily_py.load(CKPT, backend="reference", context_length=64)
    prompt = expected["prompt"].tolist()
    want = ref.prefill(prompt)
    assert_close(emu.prefill(prompt), want, atol=2.0 ** -7 * float(np.abs(want).max()), rtol=0,
                 what="aligned, mapped split weights")


@pytest.mark.parametrize("tokens,position", [(1, 5), (5, 0), (12, 3)])
def test_split_route_plan_has_no_hazard_and_needs_every_barrier(tokens, position):
    """The emulator's plan check (every `device` binding counts as written, tests/model/
    test_step_barriers.py): the runs of one token side by side are free of hazards, and each
    barrier of the plan, those between the runs of a chunk included, orders something."""
    import lily_py._core as core
    m = lily_py.load(CKPT, backend="emu", context_length=64, prefill_chunk=12)
    e = m._backend.engine
    st = e.check(tokens, position)
    unneeded = []
    for k in range(st["barriers"]):
        try:
            e.check(tokens, position, skip_barrier=k)
        except core.EmulatorError as ex:
            assert "hazard between dispatches with no barrier between them" in str(ex)
        else:
            unneeded.append(k)
    assert unneeded == []
