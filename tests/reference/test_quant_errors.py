"""Bad quantization input: a width or group size nobody supports, one the engine's kernels do not
take, a shape that contradicts the declared bits, an override for a module that does not exist.
Each is a ConfigError or CheckpointError that names the tensor (or config field) and the numbers."""
import json
import os
import shutil

import pytest

import lily_py
from lily_py.checkpoint import load_weights
from lily_py.errors import CheckpointError, ConfigError
from lily_py.testing import make_checkpoint


def _edit_config(folder, fn):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    fn(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture
def ckpt(tiny_mlx, tmp_path):
    return shutil.copytree(tiny_mlx, tmp_path / "c")


@pytest.mark.parametrize("key,value,match", [
    ("bits", 7, r"'quantization.bits': expected one of 2,3,4,5,6,8, found 7"),
    ("group_size", 48, r"'quantization.group_size': expected 32, 64 or 128, found 48"),
])
def test_width_or_group_nobody_supports(ckpt, key, value, match):
    _edit_config(ckpt, lambda c: c["quantization"].update({key: value}))
    with pytest.raises(ConfigError, match=match):
        load_weights(ckpt)


def test_override_width_nobody_supports_names_the_module(ckpt):
    mod = "language_model.model.layers.1.mlp.switch_mlp.up_proj"
    _edit_config(ckpt, lambda c: c["quantization"].update({mod: {"bits": 1, "group_size": 64}}))
    with pytest.raises(ConfigError, match=rf"'quantization.{mod}.bits': expected one of .* found 1"):
        load_weights(ckpt)


def test_override_for_a_module_that_does_not_exist(ckpt):
    _edit_config(ckpt, lambda c: c["quantization"].update(
        {"language_model.model.layers.7.mlp.switch_mlp.down_proj": {"bits": 6, "group_size": 32}}))
    with pytest.raises(ConfigError, match=r"config.json: field 'quantization': an override \(6-bit group 32\) "
                                          r"for module 'layers.7.mlp.switch_mlp.down_proj', which the checkpoint "
                                          r"does not have .*nearest module is 'layers.\d.mlp.switch_mlp.down_proj'"):
        load_weights(ckpt)


def test_override_for_a_skipped_module_is_fine(tmp_path):
    """mlx-lm writes overrides for the vision tower too: a module a skip rule covers exists."""
    import numpy as np
    p = make_checkpoint(tmp_path / "v", fmt="mlx", seed=3,
                        extra_tensors={"vision_tower.blocks.0.attn.qkv.weight": np.zeros((4, 4), np.float32)})
    _edit_config(p, lambda c: c["quantization"].update(
        {"vision_tower.blocks.0.attn.qkv": {"bits": 8, "group_size": 64}}))
    load_weights(p)


def test_shape_contradicting_the_declared_bits(ckpt):
    # the tensors are 4-bit group 64; the config now says 8-bit
    _edit_config(ckpt, lambda c: c["quantization"].update(bits=8))
    with pytest.raises(CheckpointError, match=r"model.safetensors: embed_tokens: the config's quantization default "
                                              r"says 8-bit group 64, but the packed weight \[\d+, \d+\] and scales "
                                              r"\[\d+, \d+\] do not fit in-dim \d+ \(the shapes imply 4-bit group 64\)"):
        load_weights(ckpt)


def test_group_contradicting_the_declared_group(ckpt):
    _edit_config(ckpt, lambda c: c["quantization"].update(group_size=32))
    with pytest.raises(CheckpointError, match=r"says 4-bit group 32, .*the shapes imply 4-bit group 64"):
        load_weights(ckpt)


def test_engine_takes_every_mlx_width_and_refuses_others():
    """Every MLX affine width is an engine width; a width outside them (7 bits: no MLX width) is
    refused by the engine's spec check with the widths it takes."""
    from lily_py import _core
    from lily_py.backends.engine import REAL_QUANT, engine_spec
    from lily_py.config import ModelConfig
    from lily_py.testing import TINY_TEXT_CONFIG
    support = _core.engine_quant_support()
    assert support["bits"] == [2, 3, 4, 5, 6, 8] and support["expert_bits"] == [2, 3, 4, 5, 6, 8]
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(TINY_TEXT_CONFIG)})
    quant = dict(REAL_QUANT, mixer=dict(REAL_QUANT["mixer"], bits=7))
    with pytest.raises(Exception, match=r"bits=7 unsupported \(2/3/4/5/6/8\)"):
        _core.Engine(engine_spec(cfg, quant, context_length=16, prefill_chunk=1), "count")
