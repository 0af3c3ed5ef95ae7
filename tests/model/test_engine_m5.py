"""The engine on the M5 path: the emulator reporting Metal 4 tensor ops
(lily_py.testing.simulated_device(tensor_ops=True)), so every 4-bit quantized matmul of more than
8 rows takes qmm_m5 (matmul2d, half operands, fp32 accumulation) instead of the simdgroup qmm, the
MoE's 64- and 32-row tiles take moe_*_m5, prefill attention (head_dim 64 / 128 / 256) takes
attn_prefill_m5 and the DeltaNet chunked route (64 tokens or more) takes gd_chunk_wy_m5 and
gd_chunk_state_m5 (shaders/m5/).

Greedy tokens on the bundled demo must equal the reference's for 32 steps after a prompt of 100
tokens prefilled in chunks of 64 and 4096 (qmm_m5 in every prefill step, qmv in decode). The
prompt's logits stay within the attention tolerance of tests/model/test_engine.py
(2^-7 * max|ref|): the half rounding of x and the weights errs by <= 2^-10 relative per product,
below the bf16 KV cache's 2^-9 that tolerance was derived for.
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
from lily_py.testing import simulated_device

from tolerances import assert_close

N_PROMPT = 100
_REF: dict = {}


def _prompt(model):
    ids = model.tokenizer.encode("In the beginning God created the heaven and the earth. " * 20)[:N_PROMPT]
    assert len(ids) == N_PROMPT
    return ids


def _reference():
    if not _REF:
        ref = lily_py.load(backend="reference", context_length=256)
        prompt = _prompt(ref)
        _REF["logits"] = ref.prefill(prompt)
        ref.reset()
        _REF["tokens"] = ref.generate_text(prompt, max_tokens=32).tokens
        _REF["prompt"] = prompt
    return _REF


@pytest.mark.parametrize("chunk", [64, 4096])
def test_demo_greedy_on_the_m5_path(chunk):
    ref = _reference()
    with simulated_device(tensor_ops=True):
        emu = lily_py.load(backend="emu", context_length=256, prefill_chunk=chunk)
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    assert any(k.startswith("qmm_m5_") for k in kernels), sorted(kernels)
    # every qmm on M5, the all-logits lm_head of bf16 activations included (fp32 logits from bf16 x:
    # qmm_m5's *_yf32 variant)
    assert not any(k.startswith(("qmm_b4_", "qmm_b8_")) for k in kernels), sorted(kernels)
    assert "qmm_m5_b4_xbf16_sbf16_yf32" in kernels, sorted(kernels)
    # the 8-bit router + shared gate of the bf16 demo: qmm_m5 too (x exact in half; fp32 x keeps qmm)
    assert any(k.startswith("qmm_m5_b8_xbf16_") for k in kernels), sorted(kernels)
    # the default (bf16) KV cache with bf16 activations: the M5 attention
    assert "attn_prefill_m5_d64_bf16" in kernels, sorted(kernels)
    assert not any(k.startswith("attn_prefill_mma_") for k in kernels), sorted(kernels)
    assert any(k.startswith("moe_gate_up_m5_64_b4_") for k in kernels), sorted(kernels)
    assert "moe_down_m5_32_b4_sbf16" in kernels, sorted(kernels)
    assert not any(k.startswith(("moe_gate_up_mm", "moe_down_mm")) for k in kernels), sorted(kernels)
    assert {"gd_chunk_wy_m5_f32", "gd_chunk_state_m5_f32"} <= kernels, sorted(kernels)
    assert not kernels & {"gd_chunk_wy_f32", "gd_chunk_state_f32"}, sorted(kernels)
    # the engine's chunked prep: conv1d fused, q as half
    assert any(k.startswith("gd_chunk_prep_conv_q16_") for k in kernels), sorted(kernels)
    logits = emu.prefill(ref["prompt"])
    assert_close(logits, ref["logits"], atol=2.0 ** -7 * float(np.abs(ref["logits"]).max()), rtol=0,
                 what=f"demo prefill logits on the M5 path (chunks of {chunk})")
    emu.reset()
    got = emu.generate_text(ref["prompt"], max_tokens=32)
    assert got.tokens == ref["tokens"]


def test_without_tensor_ops_the_engine_keeps_the_simdgroup_qmm():
    emu = lily_py.load(backend="emu", context_length=256, prefill_chunk=64)
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    assert not any(k.startswith(("qmm_m5_", "attn_prefill_m5_", "moe_gate_up_m5_", "moe_down_m5_", "gd_chunk_prep_q16_",
                                     "gd_chunk_prep_conv_q16_"))
                   for k in kernels)
    assert not kernels & {"gd_chunk_wy_m5_f32", "gd_chunk_state_m5_f32"}
    assert {"gd_chunk_wy_f32", "gd_chunk_state_f32"} <= kernels, sorted(kernels)
    assert any(k.startswith("gd_chunk_prep_conv_x") for k in kernels), sorted(kernels)
    assert any(k.startswith("qmm_b4_") for k in kernels)
    # bf16 activations at the demo's head_dim: the M1-M4 bf16 attention tiles (on the default bf16
    # cache), not the M5 kernel
    assert any(k.startswith("attn_prefill_tiles_d") for k in kernels), sorted(kernels)


_GREEDY: dict = {}


@pytest.fixture(scope="module")
def real_dims_ckpt(tmp_path_factory):
    from lily_py.testing import make_checkpoint
    from test_engine import _real_head_dims_config
    return make_checkpoint(tmp_path_factory.mktemp("m5_real_dims"), _real_head_dims_config(), fmt="mlx",
                           seed=9, std=0.06)


def _greedy_case(which, real_dims_ckpt):
    """(load, prompt, the reference's 32 greedy tokens) for the demo (100-token prompt) or the
    real-head-dims checkpoint (80 tokens); the reference runs once per case."""
    path, n = (None, 100) if which == "demo" else (real_dims_ckpt, 80)
    load = (lambda **kw: lily_py.load(**kw)) if path is None else (lambda **kw: lily_py.load(path, **kw))
    if which not in _GREEDY:
        probe = load(backend="reference", context_length=256)
        prompt = (list(range(3, 40)) * 8)[:n] if path else \
            probe.tokenizer.encode("In the beginning God created the heaven and the earth. " * 20)[:n]
        _GREEDY[which] = (prompt, probe.generate_text(prompt, max_tokens=32).tokens)
    return (load, *_GREEDY[which])


@pytest.mark.parametrize("chunk", [1, 64, 4096])
@pytest.mark.parametrize("which", ["demo", "real_head_dims"])
def test_greedy_after_chunked_prefill_on_the_m5_path(real_dims_ckpt, which, chunk):
    """Greedy tokens identical to the reference for 32 steps after a prompt prefilled in chunks of
    1, 64 and 4096 on the M5 path, on the demo (head_dim 64) and on a random-weight checkpoint with
    the real head dimensions (head_dim 256, 2 KV heads: attn_prefill_m5_d256_bf16 on the default
    bf16 KV cache with bf16 activations; DeltaNet Dk = Dv =
    128: gd_chunk_*_m5 on the 64- and 80-token prefill steps, the scan for one token)."""
    load, prompt, want = _greedy_case(which, real_dims_ckpt)
    with simulated_device(tensor_ops=True):
        emu = load(backend="emu", context_length=256, prefill_chunk=chunk)
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    D = emu.config.head_dim
    assert (f"attn_prefill_m5_d{D}_f32" in kernels or f"attn_prefill_m5_d{D}_bf16" in kernels) == (chunk > 1), \
        sorted(kernels)
    assert ({"gd_chunk_wy_m5_f32", "gd_chunk_state_m5_f32"} <= kernels) == (chunk > 1), sorted(kernels)
    got = emu.generate_text(prompt, max_tokens=32)
    assert got.tokens == want


@pytest.mark.parametrize("chunk", [1, 64, 4096])
@pytest.mark.parametrize("which", ["demo", "real_head_dims"])
def test_greedy_on_the_int8_opt_in(real_dims_ckpt, which, chunk):
    """The int8 opt-in (simulated_device(tensor_ops=True, tensor_int8=True); LILY_TENSOR_INT8=1 on a
    Mac; docs/int8.md, "int8 activations on the tensor ops"): with prefill chunks of 64
    and 4096 (the whole 100- or 80-token prompt) every bf16-x 4-bit projection of more than 8 rows
    takes qmm_m5i8 (after quantize_i8 of its x), the 8-bit router and lm_head's fp32 logits keep qmm_m5, and the MoE 64-row
    tiles (the shared expert's group holds every row of the step: 64, or 80 and 100 > 32) take
    moe_gate_up_m5i8 / moe_down_m5i8, and the prefill attention on the int8 cache
    attn_prefill_m5i8_q8 (S on int8); with chunks of 1 no step has a tile and nothing takes int8.
    Greedy tokens identical to the reference for 32 steps after the prompt (its precision against
    mlx-lm's bf16 error, which it exceeds on one checkpoint: docs/int8.md, "int8
    activations on the tensor ops")."""
    load, prompt, want = _greedy_case(which, real_dims_ckpt)
    with simulated_device(tensor_ops=True, tensor_int8=True):
        emu = load(backend="emu", context_length=256, prefill_chunk=chunk)
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    int8 = {"moe_gate_up_m5i8_64_b4_xbf16_sbf16", "moe_down_m5i8_64_b4_sbf16"}
    if chunk > 1:
        assert any(k.startswith("qmm_m5i8_b4_xbf16_") for k in kernels), sorted(kernels)
        assert not any(k.startswith("qmm_m5_b4_xbf16_") and not k.endswith("_yf32") for k in kernels), sorted(kernels)
        assert int8 <= kernels, sorted(kernels)
        assert {"quantize_i8_xbf16", "quantize_i8_xf32"} <= kernels, sorted(kernels)  # x's and h's codes
        assert not {"moe_gate_up_m5_64_b4_xbf16_sbf16", "moe_down_m5_64_b4_sbf16"} & kernels, sorted(kernels)
        D = emu.config.head_dim  # the default bf16 KV cache: the M5 attention (scores on int8 need kv_dtype="int8")
        assert f"attn_prefill_m5_d{D}_bf16" in kernels, sorted(kernels)
        assert not any(k.startswith("attn_prefill_m5i8_") for k in kernels), sorted(kernels)
    else:
        assert not any("m5i8" in k for k in kernels), sorted(kernels)
    got = emu.generate_text(prompt, max_tokens=32)
    assert got.tokens == want


def _attn_prefill_executed(cfg, T, route):
    """Executed attention FLOPs of a prefill of T tokens at position 0 (every attention layer):
    each threadgroup's rows (rows / group tokens: 32 rows for mma and the bf16 tiles, 16 for m5)
    against whole key blocks (32 keys: mma and m5, 2048 / head_dim: the bf16 tiles) up to its last
    token; S and P V."""
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows, block = {"mma": (32, 32), "m5": (16, 32), "tiles": (32, 2048 // D)}[route]
    qt = rows // (Hq // Hkv)
    per_layer = sum(-(-min(t0 + qt, T) // block) * 4 * rows * block * D for t0 in range(0, T, qt)) * Hkv
    return per_layer * sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))


def test_real_config_prefill_4096_flops_with_tensor_ops():
    """The real 35B config, one prefill chunk of 4096 tokens, on the counting device with and
    without tensor ops. Useful FLOPs are the same; executed FLOPs differ exactly by the attention
    route (bf16 tiles' 32 rows x 8-key blocks -> 16 rows x 32-key blocks), the router's tiles and the DeltaNet chunked
    route (the Gram products as full 64 x 64 squares and O per 32 value columns on matmul2d: the M5
    split of ops.gated_delta_chunk_flops, tests/kernels/test_gated_delta_chunk_m5.py): every 4-bit
    projection has M = 4096 and N a multiple of 64 (q|gate 8192, k and v 512, o 2048, DeltaNet
    in_proj 12352 and out_proj 2048), so the 64 x 64 qmm_m5 tiles pad nothing, like the simdgroup
    tiles; the 8-bit router + shared gate (N = E + 1 = 257, bf16 x) moves from qmm's 32-wide tiles
    (288 columns executed, fp32 simdgroup matrices) to qmm_m5's 64-wide ones (320 columns, tensor
    ops); the MoE tiles are the same on both routes."""
    from lily_py.backends.engine import count_step
    from lily_py.config import ModelConfig
    from lily_py.testing import REAL_TEXT_CONFIG
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    off = count_step(cfg, tokens=4096)
    with simulated_device(tensor_ops=True):
        m5 = count_step(cfg, tokens=4096)
    print(f"real config, prefill 4096: without tensor ops flops_executed {off['flops_executed']} "
          f"flops_useful {off['flops_useful']}; M5 flops_executed {m5['flops_executed']} "
          f"flops_useful {m5['flops_useful']} (executed / useful {m5['flops_executed'] / m5['flops_useful']:.4f})")
    assert m5["flops_useful"] == off["flops_useful"]
    # bf16 activations (the checkpoint's): the bf16 tiles (8-key blocks at head_dim 256) without
    # tensor ops, m5 (16 rows x 32-key blocks) with them
    tiles, m5_attn = _attn_prefill_executed(cfg, 4096, "tiles"), _attn_prefill_executed(cfg, 4096, "m5")
    print(f"attention executed FLOPs at 4096: bf16 tiles {tiles}, m5 {m5_attn}, "
          f"fp32 mma {_attn_prefill_executed(cfg, 4096, 'mma')}")
    import lily_py._core as core
    n_gd = sum(not cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    gd = [core.ops.gated_delta_chunk_flops(4096, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                           cfg.linear_value_head_dim, t) for t in (False, True)]
    print(f"DeltaNet chunked route at 4096, per layer ({n_gd} layers): fp32 {gd[0]}, M5 {gd[1]}")
    L, T, H, N = cfg.num_hidden_layers, 4096, cfg.hidden_size, cfg.num_experts + 1
    router_qmm = 2 * T * (-(-N // 32) * 32) * H * L  # qmm_b8: 32 x 32 tiles (fp32 simdgroup matrices)
    router_m5 = 2 * T * (-(-N // 64) * 64) * H * L   # qmm_m5_b8: 64 x 64 tiles (tensor ops)
    print(f"router + shared gate executed FLOPs at 4096: qmm {router_qmm}, qmm_m5 {router_m5}, "
          f"useful {2 * T * N * H * L}")
    assert m5["flops_executed"] == off["flops_executed"] - tiles + m5_attn - router_qmm + router_m5 + n_gd * (
        gd[1]["tensor"] + gd[1]["alu"] - gd[0]["tensor"] - gd[0]["alu"])
    # the bf16 tiles' 8-key blocks waste less; m5 and mma share 32-key blocks, and at position 0
    # m5's 2-token threadgroups end in the same block as the 4-token ones of mma: equal here
    assert tiles < m5_attn == _attn_prefill_executed(cfg, 4096, "mma")
    assert (m5["dispatches"], m5["barriers"]) == (off["dispatches"], off["barriers"])
