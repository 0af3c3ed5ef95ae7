"""Checkpoint loading: layouts, accounting of every tensor, and clear errors."""
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

import lily_py
from lily_py.checkpoint import SafetensorsFile, load_weights
from lily_py.errors import CheckpointError
from lily_py.reference.quant import dequantize, quantize, unpack
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint
from lily_py.weights import DenseLinear, QuantLinear, StackedLinear


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def rewrite(folder, fn):
    """Apply fn(tensors: dict, config: dict) to a single-file checkpoint and save it back."""
    from safetensors.numpy import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    fn(tensors, cfg)
    save_file(tensors, path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


# ---- quantization format --------------------------------------------------------------------

def test_unpack_is_lsb_first():
    # word 0x76543210 holds 4-bit values 0,1,...,7 from the least significant nibble up.
    w = np.array([[0x76543210, 0xFEDCBA98]], dtype=np.uint32)
    assert unpack(w, 4).tolist() == [list(range(16))]
    assert unpack(np.array([[0x04030201]], np.uint32), 8).tolist() == [[1, 2, 3, 4]]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_roundtrip(bits, group_size):
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 3 * 128)).astype(np.float32)
    w, s, b = quantize(x, bits=bits, group_size=group_size)
    y = dequantize(w, s, b, bits=bits, group_size=group_size)
    # affine quantization error is at most half a step per element (+ fp32 rounding)
    step = np.repeat(s, group_size, axis=-1)
    assert np.all(np.abs(y - x) <= 0.5 * step + 1e-6), np.argwhere(np.abs(y - x) > 0.5 * step + 1e-6)[0]


def test_dequantize_shape_errors():
    w = np.zeros((4, 8), np.uint32)
    with pytest.raises(ValueError, match="cover"):
        dequantize(w, np.zeros((4, 3), np.float32), np.zeros((4, 3), np.float32), bits=4, group_size=64)
    with pytest.raises(ValueError, match="uint32"):
        dequantize(w.astype(np.int32), np.zeros((4, 1)), np.zeros((4, 1)), bits=4, group_size=64)


# ---- layouts ---------------------------------------------------------------------------------

def test_mlx_layout(tiny_mlx):
    cfg, w = load_weights(tiny_mlx)
    assert (w.format, w.norm_convention) == ("mlx", "folded")
    moe = w.layers[0].moe
    assert isinstance(moe.gate_proj, QuantLinear) and moe.gate_proj.shape == (6, 64, 128)
    assert (moe.gate_proj.bits, moe.gate_proj.group_size) == (4, 64)
    # the router and shared-expert gate are 8-bit, from the config's per-module overrides
    assert moe.router.bits == 8 and moe.shared_expert_gate.bits == 8
    # in_proj_b/a have in-dim 128 (quantized); conv1d [C, K, 1] -> [C, K]
    dn = w.layers[0].mixer
    assert dn.conv1d.shape == (cfg.linear_conv_dim, 4) and dn.conv1d.dtype == np.float32


def test_weights_are_memory_mapped_not_copied(tiny_mlx):
    _, w = load_weights(tiny_mlx)
    q = w.layers[0].moe.gate_proj
    base = q.w
    while base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap), "packed expert weights should be views of the file map"


def test_hf_fused_and_per_expert_give_identical_logits(tmp_path):
    a = make_checkpoint(tmp_path / "fused", fmt="hf", dtype="f32", expert_layout="fused", seed=5)
    b = make_checkpoint(tmp_path / "per", fmt="hf", dtype="f32", expert_layout="per_expert",
                        hf_prefix="model.", seed=5)
    _, wb = load_weights(b)
    assert isinstance(wb.layers[0].moe.gate_proj, StackedLinear)
    ids = np.random.default_rng().integers(0, 320, 9)
    la = lily_py.load(a, backend="reference").prefill(ids, all_logits=True)
    lb = lily_py.load(b, backend="reference").prefill(ids, all_logits=True)
    np.testing.assert_array_equal(la, lb)


def test_norm_convention_hf_vs_mlx(tmp_path):
    """The same random weights written both ways: the HF file stores w, MLX stores 1 + w; the
    loader must hand the model the same effective multiplier (and conv1d in the same layout)."""
    t = dict(TINY_TEXT_CONFIG, hidden_size=100)          # 100 % 64 != 0: MLX leaves linears dense
    hf = make_checkpoint(tmp_path / "hf", t, fmt="hf", dtype="f32", seed=9)
    mlx = make_checkpoint(tmp_path / "mlx", t, fmt="mlx", dtype="f32", seed=9)
    _, whf = load_weights(hf)
    _, wmlx = load_weights(mlx)
    assert whf.norm_convention == "zero-centred" and wmlx.norm_convention == "folded"
    np.testing.assert_allclose(whf.norm, wmlx.norm, rtol=0, atol=1e-6)
    np.testing.assert_allclose(whf.layers[3].mixer.q_norm, wmlx.layers[3].mixer.q_norm, atol=1e-6)
    np.testing.assert_array_equal(whf.layers[0].mixer.conv1d, wmlx.layers[0].mixer.conv1d)
    # the gated DeltaNet norm is a plain weight in both formats: no +1
    np.testing.assert_array_equal(whf.layers[0].mixer.norm, wmlx.layers[0].mixer.norm)
    raw_hf = SafetensorsFile(os.path.join(hf, "model.safetensors"))
    stored = raw_hf.array(raw_hf.tensors["model.language_model.norm.weight"])
    np.testing.assert_allclose(whf.norm, stored + 1.0, atol=1e-6)


def test_sharded_checkpoint_matches_single_file(tmp_path):
    one = make_checkpoint(tmp_path / "one", fmt="mlx", seed=3)
    three = make_checkpoint(tmp_path / "three", fmt="mlx", seed=3, shards=3)
    assert len(load_weights(three)[1].files) == 3
    ids = [5, 7, 11, 13]
    np.testing.assert_array_equal(lily_py.load(one, backend="reference").prefill(ids),
                                  lily_py.load(three, backend="reference").prefill(ids))


def test_bf16_tensors_are_read_as_bf16(tiny_mlx):
    sf = SafetensorsFile(os.path.join(tiny_mlx, "model.safetensors"))
    ref = sf.tensors["language_model.model.norm.weight"]
    assert sf.array(ref).dtype == ml_dtypes.bfloat16


def test_skip_rules_vision_and_mtp(tmp_path):
    extra = {"model.visual.blocks.0.attn.qkv.weight": np.ones((4, 4), np.float32),
             "mtp.layers.0.mlp.gate.weight": np.ones((2, 2), np.float32),
             "mtp.fc.weight": np.ones((2, 2), np.float32)}
    p = make_checkpoint(tmp_path / "c", fmt="hf", dtype="f32", extra_tensors=extra)
    _, w = load_weights(p)
    assert w.skipped == {"vision tower": 1, "multi-token-prediction head (MTP)": 2}


# ---- errors ----------------------------------------------------------------------------------

def test_unknown_tensor_is_an_error_naming_it(tmp_path):
    p = make_checkpoint(tmp_path / "c", fmt="hf", dtype="f32",
                        extra_tensors={"model.layers.0.mlp.mystery.weight": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"neither used .* model.layers.0.mlp.mystery.weight"):
        load_weights(p)


def test_missing_tensor(tiny_hf, tmp_path):
    p = copy_ckpt(tiny_hf, tmp_path / "c")
    rewrite(p, lambda t, c: t.pop("model.language_model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.1.linear_attn.A_log'"):
        load_weights(p)


def test_wrong_shape_names_file_tensor_expected_found(tiny_hf, tmp_path):
    p = copy_ckpt(tiny_hf, tmp_path / "c")
    name = "model.language_model.layers.3.self_attn.k_proj.weight"
    rewrite(p, lambda t, c: t.__setitem__(name, np.ones((64, 128), np.float32)))
    with pytest.raises(CheckpointError, match=rf"'{name}': expected shape \[128, 128\], found \[64, 128\]"):
        load_weights(p)


def test_config_disagrees_with_tensors(tiny_mlx, tmp_path):
    p = copy_ckpt(tiny_mlx, tmp_path / "c")
    # claim 5 layers: layer 4's tensors are missing
    rewrite(p, lambda t, c: c["text_config"].update(num_hidden_layers=5))
    with pytest.raises(CheckpointError, match="missing tensor 'layers.4."):
        load_weights(p)
    p2 = copy_ckpt(tiny_mlx, tmp_path / "c2")
    rewrite(p2, lambda t, c: c["text_config"].update(num_hidden_layers=3))
    with pytest.raises(CheckpointError, match=r"neither used .*layers\.3\."):
        load_weights(p2)


def test_quant_override_that_does_not_fit(tiny_mlx, tmp_path):
    p = copy_ckpt(tiny_mlx, tmp_path / "c")
    rewrite(p, lambda t, c: c["quantization"].update(
        {"language_model.model.layers.0.mlp.gate": {"bits": 4, "group_size": 64}}))
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.gate: the config's quantization override says 4-bit"):
        load_weights(p)


def test_truncated_file(tiny_mlx, tmp_path):
    p = copy_ckpt(tiny_mlx, tmp_path / "c")
    f = os.path.join(p, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"truncated: tensor .* ends at byte \d+, file has \d+ bytes"):
        load_weights(p)
    with open(f, "r+b") as fh:
        fh.truncate(5)
    with pytest.raises(CheckpointError, match="truncated"):
        load_weights(p)


def test_garbage_header(tmp_path):
    d = tmp_path / "c"
    make_checkpoint(d, fmt="hf", dtype="f32")
    with open(d / "model.safetensors", "wb") as fh:
        fh.write((20).to_bytes(8, "little") + b"{not json at all....." + b"\0" * 64)
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        load_weights(d)


def test_missing_shard(tmp_path):
    p = make_checkpoint(tmp_path / "c", fmt="mlx", shards=2)
    os.remove(os.path.join(p, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="missing from"):
        load_weights(p)


def test_no_weights_and_not_a_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5_moe", "text_config": TINY_TEXT_CONFIG}))
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):
        load_weights(tmp_path)
    with pytest.raises(CheckpointError, match="no such folder"):
        lily_py.load(str(tmp_path / "does-not-exist"))
    with pytest.raises(CheckpointError, match="is a file"):
        lily_py.load(str(tmp_path / "config.json"))


def test_linear_matmul_in_blocks_equals_dense(monkeypatch):
    import lily_py.weights as W
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 128)).astype(np.float32)
    w, s, b = quantize(rng.standard_normal((77, 128)), bits=4, group_size=64)
    lin = QuantLinear(w, s, b, 4, 64)
    full = x @ dequantize(w, s, b, bits=4, group_size=64).T
    monkeypatch.setattr(W, "BLOCK_ELEMENTS", 128 * 10)     # 10 rows per block, ragged tail
    # fp32 dot products of length 128 with |terms| ~ 2: rounding differences ~1e-5 absolute
    np.testing.assert_allclose(lin.matmul(x), full, rtol=1e-5, atol=1e-4)
    d = DenseLinear(rng.standard_normal((77, 128)).astype(ml_dtypes.bfloat16))
    np.testing.assert_allclose(d.matmul(x), x @ d.array.astype(np.float32).T, rtol=1e-5, atol=1e-4)


def test_make_checkpoint_rounds_bf16_once_from_the_exact_value():
    """make_checkpoint's bf16 tensors do not depend on the installed ml_dtypes: testing._cast rounds
    the float64 value to the nearest bf16, ties to even, in one step. Values just above a bf16
    halfway point (by less than float32 can hold) round up, where float64 -> float32 -> bf16 (ml_dtypes
    0.6) meets an exact tie and rounds to even, down."""
    from lily_py.testing import _cast
    rng = np.random.default_rng(11)
    # random magnitudes over many binades, both signs, and float32 inputs too
    x = rng.uniform(-1, 1, 40_001) * np.exp2(rng.integers(-60, 60, 40_001))
    for v in (x, x.astype(np.float32)):
        got = _cast(v, ml_dtypes.bfloat16)
        assert got.dtype == ml_dtypes.bfloat16 and got.shape == v.shape
        g = got.astype(np.float64)
        # the two bf16 neighbours of each value: g is the nearer one (ties: the even mantissa)
        ulp = np.exp2(np.floor(np.log2(np.abs(g))) - 7)
        err = np.abs(v.astype(np.float64) - g)
        bad = np.flatnonzero(err > ulp / 2)
        assert bad.size == 0, f"first bad index {bad[:1]}: {v[bad[:1]]} -> {g[bad[:1]]}"
    # halfway between the bf16 values 1 + 2^-7 k and 1 + 2^-7 (k + 1), k even, plus 2^-40
    k = np.arange(0, 128, 2)
    above = 1 + (k + 0.5) * 2.0 ** -7 + 2.0 ** -40
    assert np.array_equal(_cast(above, ml_dtypes.bfloat16).astype(np.float64), 1 + (k + 1) * 2.0 ** -7)
    # exact ties round to even
    tie = 1 + (k + 0.5) * 2.0 ** -7
    assert np.array_equal(_cast(tie, ml_dtypes.bfloat16).astype(np.float64), 1 + k * 2.0 ** -7)
    assert np.array_equal(_cast(np.float64([0.0, -0.0]), ml_dtypes.bfloat16).view(np.uint16), [0, 0x8000])
    assert _cast(np.float64([0.25]), np.float16).dtype == np.float16
