"""The float32 KV cache (``kv_dtype="float32"``) in the whole model: K and V rows as the KV write
computes them, 4 head_dim bytes a row, on the engine (every attention route: vec / single / split
decode, mma / simd prefill, on a head_dim 64 and an odd head_dim 40 checkpoint) and the reference
backend (whose cache never rounds: float32 there is the bf16 option's computation, bit for bit).

Tolerance (logits, engine with float32 activations and the float32 cache against the float32
reference): both sides then compute the same function in float32 and differ only in rounding
order. test_engine.py derives it for the DeltaNet layers: each fp32 dot product of length
K <= 2 * hidden errs by ~sqrt(K) 2^-24 of its absolute sum, a few 1e-6 of the logit scale through
the layers (measured there 4e-7 .. 1.6e-6). Attention adds its kernels' fp32 bound
(tests/kernels/test_attention.py: (8 sqrt(D) smag + 64 + 2 blocks + 2 splits) 2^-24 of vmag, at
most ~1e-5 of the values here) and nothing for the cache. We allow atol = 2^-14 (6.1e-5) of
max|ref|: 23x above the worst measured here (max |d| / max |ref| 8e-7 .. 2.6e-6 over prefill and
decode, both checkpoints). The bf16 cache rounds every K and V element by up to 2^-9 relative and
lands at 3.2e-4 .. 1.5e-3 of the scale on the same ids, 5-24x outside this bound; the test asserts
it is at least 16x farther from the reference than the float32 cache (measured 225x and 665x;
test_f32_cache_agrees_with_the_fp32_reference prints both under -s)."""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
from lily_py.backends.engine import kv_row_bytes
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint
from tolerances import assert_close
from engine_backend import ENGINE, require_emulator, require_engine

require_engine()

B = 32
F32KV = {"kv_dtype": "float32", "kv_block_tokens": B}
# On these random-weight checkpoints about one prompt in 8 puts a MoE router near-tie at some
# position, where a rounding flips a top-k choice (tests/model/test_kv_paging.py): fixed ids.
FIXED = 20261204
CONFIGS = {
    # head_dim 64: vec decode, mma prefill; one attention layer (layer 3)
    "d64": dict(TINY_TEXT_CONFIG),
    # head_dim 40 (rotary 10), 8 query heads on 2 KV heads: single / split decode, simd prefill;
    # attention layers 1 and 3
    "d40": dict(TINY_TEXT_CONFIG, head_dim=40, num_attention_heads=8, full_attention_interval=2),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(f"kv_f32_{request.param}"), CONFIGS[request.param], fmt="mlx",
                           seed=5, std=0.08)


@pytest.fixture(scope="module")
def ckpt64(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kv_f32_d64"), CONFIGS["d64"], fmt="mlx", seed=5, std=0.08)


def block_bytes(cfg):
    """K and V of every attention layer, one block of float32 rows."""
    layers = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    return 4 * cfg.head_dim * 2 * cfg.num_key_value_heads * layers * B


def scale_of(r):
    return float(np.abs(r).max())


def close(a, r, what):
    assert_close(a, r, atol=2.0 ** -14 * scale_of(r), rtol=0, what=what)


def test_f32_cache_agrees_with_the_fp32_reference(ckpt):
    """Prefill (all positions, chunks of 23 across 32-token blocks) and decode steps (the d40
    checkpoint crosses 256 keys: single -> split) within the fp32 bound; the bf16 cache, same
    engine and ids, is at least 16x farther from the reference. The pools grow by float32 blocks."""
    rng = np.random.default_rng(FIXED)
    load = dict(backend=ENGINE, context_length=400, prefill_chunk=23, activations="float32")
    emu = lily_py.load(ckpt, **load, **F32KV)
    b16 = lily_py.load(ckpt, **load, kv_dtype="bfloat16", kv_block_tokens=B)
    ref = lily_py.load(ckpt, backend="reference", context_length=400, kv_dtype="float32")
    cfg = emu.config
    assert emu.kv_dtype == ref.kv_dtype == "float32"
    bb = block_bytes(cfg)
    assert emu.stats()["kv_bytes"] == bb and emu.stats()["kv_bytes_in_use"] == 0
    n = 250 if cfg.head_dim == 40 else 75
    ids = rng.integers(0, cfg.vocab_size, size=n).tolist()
    r = ref.prefill(ids, all_logits=True)
    got, other = emu.prefill(ids, all_logits=True), b16.prefill(ids, all_logits=True)
    close(got, r, f"f32 cache prefill (head_dim {cfg.head_dim})")
    d32, d16 = [np.abs(got - r).max() / scale_of(r)], [np.abs(other - r).max() / scale_of(r)]
    assert emu.stats()["kv_bytes_in_use"] == -(-n // B) * bb
    for t in rng.integers(0, cfg.vocab_size, size=12).tolist():
        r = ref.decode(t)
        got, other = emu.decode(t), b16.decode(t)
        close(got, r, f"f32 cache decode at {emu.position}")
        d32.append(np.abs(got - r).max() / scale_of(r))
        d16.append(np.abs(other - r).max() / scale_of(r))
    print(f"head_dim {cfg.head_dim}: max|d| / max|ref| against the fp32 reference: f32 cache prefill "
          f"{d32[0]:.2e} decode {max(d32[1:]):.2e}; bf16 cache prefill {d16[0]:.2e} decode {max(d16[1:]):.2e}")
    assert max(d16[0], max(d16[1:])) > 16 * max(d32), (d32, d16)
    assert d16[0] > 16 * d32[0]
    assert emu.stats()["kv_bytes_in_use"] == -(-(n + 12) // B) * bb
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    if cfg.head_dim == 64:
        want = {"qk_norm_rope_kvf32_xf32_wf32", "attn_decode_vec_kvf32_e2_f32", "attn_prefill_mma_kvf32_f32"}
    else:
        want = {"qk_norm_rope_kvf32_xf32_wf32", "attn_decode_kvf32_f32", "attn_decode_split_kvf32_f32",
                "attn_prefill_kvf32_f32"}
    assert want <= kernels, sorted(kernels)
    assert not any(k.startswith(("attn_", "qk_norm_rope")) and "kvf32" not in k and "combine" not in k
                   for k in kernels), sorted(kernels)


@pytest.mark.parametrize("activations", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [1, 17, 4096])
def test_greedy_equals_the_reference(ckpt64, activations, chunk):
    emu = lily_py.load(ckpt64, backend=ENGINE, context_length=300, prefill_chunk=chunk, activations=activations,
                       **F32KV)
    ref = lily_py.load(ckpt64, backend="reference", context_length=300, kv_dtype="float32")
    prompt = [(7 * i + 3) % emu.config.vocab_size for i in range(41)]
    n = 32 if activations == "float32" else 8  # bf16 activations drift from the fp32 reference
    a = emu.generate_text(prompt, max_tokens=n)
    assert a.tokens == ref.generate_text(prompt, max_tokens=n).tokens and len(a.tokens) == n
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    x = "f32" if activations == "float32" else "bf16"
    # bf16 activations (M1-M4): mma with fp32 K / V tiles, where the bf16 cache takes the bf16 tiles
    want = {f"qk_norm_rope_kvf32_x{x}_wf32", f"attn_decode_vec_kvf32_e2_{x}"}
    assert want | ({f"attn_prefill_mma_kvf32_{x}"} if chunk > 1 else set()) <= kernels, sorted(kernels)


def test_reference_float32_is_unrounded(ckpt64):
    """The reference's cache keeps the float32 rows it computes: "float32" and "bfloat16" (which the
    reference does not round either: it is the anchors' exact model) give the same logits."""
    ids = np.random.default_rng(FIXED + 1).integers(0, TINY_TEXT_CONFIG["vocab_size"], size=40).tolist()
    r32 = lily_py.load(ckpt64, backend="reference", context_length=64, kv_dtype="float32")
    r16 = lily_py.load(ckpt64, backend="reference", context_length=64)
    np.testing.assert_array_equal(r32.prefill(ids, all_logits=True), r16.prefill(ids, all_logits=True))
    st = r32._backend.model.new_state()
    assert all(not c.quantize for c in st.kv.values())


def test_kv_bytes_per_block_and_sizes(ckpt, tmp_path, capsys):
    """4 head_dim bytes a row: a block is 4 * head_dim * 2 (K and V) * kv heads * layers * block
    tokens, in the engine, lily_py.sizes and lily-py info."""
    m = lily_py.load(ckpt, backend=ENGINE, context_length=200, activations="float32", **F32KV)
    cfg = m.config
    assert m._backend.engine.kv_bytes == block_bytes(cfg) == m.stats()["kv_bytes"]
    assert kv_row_bytes(cfg, "float32") == 4 * cfg.head_dim == 2 * kv_row_bytes(cfg)
    from lily_py import sizes
    from lily_py._core import plan_memory
    from lily_py.backends.engine import REAL_QUANT, engine_spec
    ctx = 1000  # one 1024-token block
    assert sizes.kv_bytes(cfg, ctx, kv_dtype="float32") == 2 * sizes.kv_bytes(cfg, ctx) == block_bytes(cfg) * 1024 // B
    spec = dict(context_length=ctx, prefill_chunk=64, activations="float32")
    p32 = plan_memory(engine_spec(cfg, REAL_QUANT, kv_dtype="float32", **spec))
    p16 = plan_memory(engine_spec(cfg, REAL_QUANT, **spec))
    assert p32["state_bytes"] - p16["state_bytes"] == sizes.kv_bytes(cfg, ctx)  # the KV pools double
    recipe = sizes.uniform(4)
    n32, n16 = (sizes.needs(cfg, recipe, ctx, 64, kv_dtype=k) for k in ("float32", None))
    assert n32["kv_cache"] == 2 * n16["kv_cache"] and n32["state"] == n16["state"]
    from lily_py.cli import main
    assert main(["info", ckpt, "--context", "1000", "--kv-dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"KV cache (float32) {sizes.human(n32['kv_cache'])}" in out, out


def test_snapshot_restore_round_trip(ckpt64, rng):
    """A snapshot holds the filled float32 blocks; restoring it and replaying gives the same logits
    bit for bit, and a restore to a shorter snapshot releases the other blocks."""
    emu = lily_py.load(ckpt64, backend=ENGINE, context_length=200, prefill_chunk=16, activations="float32", **F32KV)
    be = emu._backend
    ids = rng.integers(0, emu.config.vocab_size, size=110).tolist()
    emu.prefill(ids[:40])
    snap = be.snapshot()
    bb = block_bytes(emu.config)
    assert be.snapshot_nbytes(snap) == 2 * bb + (be.engine.state_bytes - be.engine.kv_bytes)
    first = emu.prefill(ids[40:], all_logits=True)
    assert emu.stats()["kv_bytes"] == 4 * bb
    be.restore(snap)
    emu._history = list(ids[:40])
    assert emu.stats()["kv_bytes"] == 2 * bb
    np.testing.assert_array_equal(emu.prefill(ids[40:], all_logits=True), first)


def test_bad_kv_dtype_lists_float32(ckpt64):
    for backend in (ENGINE, "reference"):
        with pytest.raises(ValueError, match=r"kv_dtype must be one of \('bfloat16', 'int8', 'float32'\) or None, "
                                             r"got 'fp8'"):
            lily_py.load(ckpt64, backend=backend, context_length=64, kv_dtype="fp8")
    from lily_py._core import Engine
    from lily_py.backends.engine import REAL_QUANT, engine_spec
    spec = engine_spec(lily_py.load(ckpt64, backend="reference", context_length=64).config, REAL_QUANT,
                       context_length=64, prefill_chunk=8)
    with pytest.raises(ValueError, match=r"kv_dtype: unsupported KV cache dtype 'fp8' \(expected bfloat16, int8 "
                                         r"or float32\)"):
        Engine(dict(spec, kv_dtype="fp8"), "count")


def test_greedy_on_the_m5_path_takes_mma(ckpt64):
    """Simulated tensor ops: the bf16 cache's prefill takes attn_prefill_m5 (half operands); the
    float32 cache takes the fp32 mma route and stays on the reference's greedy tokens."""
    from lily_py.testing import simulated_device
    require_emulator("simulated tensor ops (the M5 path)")
    with simulated_device(tensor_ops=True):
        emu = lily_py.load(ckpt64, backend=ENGINE, context_length=300, prefill_chunk=17, activations="float32",
                           **F32KV)
    ref = lily_py.load(ckpt64, backend="reference", context_length=300, kv_dtype="float32")
    prompt = [(5 * i + 1) % emu.config.vocab_size for i in range(45)]
    assert emu.generate_text(prompt, max_tokens=24).tokens == ref.generate_text(prompt, max_tokens=24).tokens
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    assert {"attn_prefill_mma_kvf32_f32", "attn_decode_vec_kvf32_e2_f32", "qk_norm_rope_kvf32_xf32_wf32"} <= kernels
    assert not any(k.startswith("attn_prefill_m5") for k in kernels), sorted(kernels)


def test_decode_bytes_of_the_real_config():
    """A decode step of the real config with the float32 cache on the counting device reads and
    writes exactly 2 head_dim more bytes per KV row than with the bf16 cache."""
    from lily_py.backends.engine import count_kernels
    from lily_py.config import ModelConfig
    from lily_py.testing import REAL_TEXT_CONFIG
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": REAL_TEXT_CONFIG})
    position = 255
    s32, k32 = count_kernels(cfg, position=position, kv_dtype="float32")
    s16, _ = count_kernels(cfg, position=position, kv_dtype="bfloat16")
    layers = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    D, kvh = cfg.head_dim, cfg.num_key_value_heads
    rows = layers * 2 * kvh * ((position + 1) + 1)  # K and V: every row read, the new one written
    assert s32["bytes_touched"] - s16["bytes_touched"] == rows * (4 * D - 2 * D)
    assert "attn_decode_vec_kvf32_e8_bf16" in k32 and "qk_norm_rope_kvf32_xbf16_wf32" in k32
