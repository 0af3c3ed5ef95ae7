"""The int8 KV cache (``kv_dtype="int8"``) in the whole model on the engine: its pools hold
head_dim + 4 bytes a row (codes and a float32 scale), grow by blocks like the bf16 ones, and the
engine matches the reference model whose cache quantizes each appended row the same way
(lily_py.reference.kvquant.int8_row): logits across block edges in prefill and decode, greedy
tokens after prefill chunks of 1, 17 and 4096 on both activation dtypes, snapshot and restore
bit-identical. The format's own error against the bf16 cache is benchmarks/kv_quant_error.py's."""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint
from tolerances import assert_close
from engine_backend import ENGINE, require_engine

require_engine()

B = 32
INT8 = {"kv_dtype": "int8", "kv_block_tokens": B}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kv_int8"), dict(TINY_TEXT_CONFIG), fmt="mlx", seed=5, std=0.08)


def block_bytes(m):
    c = m.config
    layers = sum(c.is_full_attention(i) for i in range(c.num_hidden_layers))
    return 2 * layers * c.num_key_value_heads * B * (c.head_dim + 4)  # K and V, codes + scale


def close(a, r, what):
    assert_close(a, r, atol=2.0 ** -7 * float(np.abs(r).max()), rtol=0, what=what)


# Fixed ids where logits are compared with the reference: on these random-weight checkpoints about
# one prompt in 8 puts a MoE router near-tie at some position, where rounding flips a top-k choice
# and that row jumps past any rounding bound (tests/model/test_kv_paging.py says more).
FIXED = 20261204


def test_int8_pools_grow_and_match_the_int8_reference(ckpt):
    rng = np.random.default_rng(FIXED)
    emu = lily_py.load(ckpt, backend=ENGINE, context_length=400, prefill_chunk=23, activations="float32", **INT8)
    ref = lily_py.load(ckpt, backend="reference", context_length=400, kv_dtype="int8")
    assert emu.kv_dtype == "int8"
    bb = block_bytes(emu)
    assert emu.stats()["kv_bytes"] == bb and emu.stats()["kv_bytes_in_use"] == 0
    ids = rng.integers(0, emu.config.vocab_size, size=75).tolist()  # chunks of 23 cross 32 and 64
    close(emu.prefill(ids, all_logits=True), ref.prefill(ids, all_logits=True), "int8 prefill across blocks")
    assert emu.stats()["kv_bytes_in_use"] == 3 * bb and emu.stats()["kv_bytes"] == 4 * bb
    for t in rng.integers(0, emu.config.vocab_size, size=30).tolist():  # decode across 96
        close(emu.decode(t), ref.decode(t), f"int8 decode at {emu.position}")
    assert emu.stats()["kv_bytes_in_use"] == 4 * bb


def test_int8_cache_differs_from_bf16_by_its_rounding(ckpt):
    """The int8 engine is closer to the int8 reference than to the float32 one: the cache is
    really quantized (a kernel that ignored the codes' rounding would not be)."""
    ids = np.random.default_rng(FIXED + 1).integers(0, TINY_TEXT_CONFIG["vocab_size"], size=60).tolist()
    emu = lily_py.load(ckpt, backend=ENGINE, context_length=128, prefill_chunk=64, activations="float32", **INT8)
    got = emu.prefill(ids)
    r8 = lily_py.load(ckpt, backend="reference", context_length=128, kv_dtype="int8").prefill(ids)
    r32 = lily_py.load(ckpt, backend="reference", context_length=128, kv_dtype="bfloat16").prefill(ids)
    d8, d32 = np.abs(got - r8).max(), np.abs(got - r32).max()
    assert d8 < d32 / 4, (d8, d32)


@pytest.mark.parametrize("activations", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [1, 17, 4096])
def test_greedy_equals_the_int8_reference(ckpt, activations, chunk):
    emu = lily_py.load(ckpt, backend=ENGINE, context_length=300, prefill_chunk=chunk, activations=activations, **INT8)
    ref = lily_py.load(ckpt, backend="reference", context_length=300, kv_dtype="int8")
    prompt = [(7 * i + 3) % emu.config.vocab_size for i in range(41)]
    n = 32 if activations == "float32" else 8  # bf16 activations drift from the fp32 reference
    a = emu.generate_text(prompt, max_tokens=n)
    b = ref.generate_text(prompt, max_tokens=n)
    assert a.tokens == b.tokens and len(a.tokens) == n


def test_snapshot_restore_is_bit_identical(ckpt, rng):
    """A snapshot holds the filled int8 blocks (codes and scales); restoring it and replaying gives
    the same logits bit for bit."""
    emu = lily_py.load(ckpt, backend=ENGINE, context_length=200, prefill_chunk=16, activations="float32", **INT8)
    be = emu._backend
    ids = rng.integers(0, emu.config.vocab_size, size=70).tolist()
    emu.prefill(ids[:40])
    snap = be.snapshot()
    assert be.snapshot_nbytes(snap) == 2 * block_bytes(emu) + (be.engine.state_bytes - be.engine.kv_bytes)
    first = emu.prefill(ids[40:], all_logits=True)
    be.restore(snap)
    emu._history = list(ids[:40])
    np.testing.assert_array_equal(emu.prefill(ids[40:], all_logits=True), first)


def test_bad_kv_dtype_and_head_dims_are_refused(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"kv_dtype must be one of \('bfloat16', 'int8', 'float32'\) or None, got 'fp8'"):
        lily_py.load(ckpt, backend=ENGINE, context_length=64, kv_dtype="fp8")
    cfg = dict(TINY_TEXT_CONFIG, head_dim=32)
    odd = make_checkpoint(tmp_path / "d32", cfg, fmt="mlx", seed=1)
    with pytest.raises(lily_py.BackendError, match=r"kv_dtype int8 needs head_dim 64, 128 or 256.*got 32"):
        lily_py.load(odd, backend=ENGINE, context_length=64, kv_dtype="int8")
    # the default (bf16) cache has no head_dim restriction
    m = lily_py.load(odd, backend=ENGINE, context_length=64, kv_block_tokens=B)
    assert m.kv_dtype == "bfloat16"
    layers = sum(m.config.is_full_attention(i) for i in range(m.config.num_hidden_layers))
    assert m._backend.engine.kv_bytes == 2 * layers * m.config.num_key_value_heads * B * 2 * 32  # bf16 rows


def test_int8_is_one_argument_away_on_both_backends(ckpt):
    """kv_dtype=None is the bf16 cache on the engine and on the reference (the anchors' default);
    kv_dtype="int8" is the same int8 computation on either backend: the int8 engine's logits are
    the int8 reference's, closer to it than to the bf16-cache reference."""
    ids = np.random.default_rng(FIXED + 2).integers(0, TINY_TEXT_CONFIG["vocab_size"], size=70).tolist()
    default = lily_py.load(ckpt, backend=ENGINE, context_length=128, prefill_chunk=32, activations="float32")
    ref_default = lily_py.load(ckpt, backend="reference", context_length=128)
    assert default.kv_dtype == ref_default.kv_dtype == "bfloat16"
    engine = lily_py.load(ckpt, backend=ENGINE, context_length=128, prefill_chunk=32, activations="float32",
                          kv_dtype="int8", kv_block_tokens=B)
    assert engine.kv_dtype == "int8"
    assert engine._backend.engine.kv_bytes == block_bytes(engine)  # one block of int8 rows
    got = engine.prefill(ids, all_logits=True)
    r8 = lily_py.load(ckpt, backend="reference", context_length=128, kv_dtype="int8").prefill(ids, all_logits=True)
    r16 = ref_default.prefill(ids, all_logits=True)
    close(got, r8, "int8 engine vs int8 reference")
    assert np.abs(got - r8).max() < np.abs(got - r16).max() / 4


@pytest.mark.parametrize("position", [255, 131071])
def test_decode_bytes_of_the_real_config_against_the_int8_floor(position):
    """A decode step of the real config with the int8 cache, on the counting device: it reads the
    KV rows at head_dim + 4 bytes (the bf16 step minus exactly (2D - (D + 4)) bytes per row read and
    written), and moves at most 1.03x the bytes it cannot avoid with that cache (issue 26's bound at
    128K)."""
    from lily_py.backends.engine import count_kernels, decode_floor_bytes
    from lily_py.config import ModelConfig
    from lily_py.testing import REAL_TEXT_CONFIG
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": REAL_TEXT_CONFIG})
    s8, k8 = count_kernels(cfg, position=position, kv_dtype="int8")
    s16, _ = count_kernels(cfg, position=position, kv_dtype="bfloat16")
    layers = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    D, kvh = cfg.head_dim, cfg.num_key_value_heads
    rows = layers * 2 * kvh * ((position + 1) + 1)  # K and V: every row read, the new one written
    assert s16["bytes_touched"] - s8["bytes_touched"] == rows * (2 * D - (D + 4))
    floor = decode_floor_bytes(cfg, position=position, kv_dtype="int8")["total"]
    print(f"position {position}: int8 KV bytes_touched {s8['bytes_touched']}, floor {floor}, "
          f"ratio {s8['bytes_touched'] / floor:.4f}")
    assert floor <= s8["bytes_touched"] <= 1.03 * floor
    assert "attn_decode_vec_q8_e8_bf16" in k8 and "qk_norm_rope_q8_xbf16_wf32" in k8


def test_greedy_on_the_m5_path_equals_the_int8_reference(ckpt):
    """Simulated tensor ops: prefill attention takes attn_prefill_m5_q8 (half operands)."""
    from engine_backend import require_emulator
    from lily_py.testing import simulated_device
    require_emulator("simulated tensor ops (the M5 path)")
    with simulated_device(tensor_ops=True):
        emu = lily_py.load(ckpt, backend=ENGINE, context_length=300, prefill_chunk=17, activations="float32", **INT8)
    ref = lily_py.load(ckpt, backend="reference", context_length=300, kv_dtype="int8")
    prompt = [(5 * i + 1) % emu.config.vocab_size for i in range(45)]
    a = emu.generate_text(prompt, max_tokens=24)
    assert a.tokens == ref.generate_text(prompt, max_tokens=24).tokens
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    assert {"attn_prefill_m5_q8_d64_f32", "attn_decode_vec_q8_e2_f32", "qk_norm_rope_q8_xf32_wf32"} <= kernels, \
        sorted(kernels)
