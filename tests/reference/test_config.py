"""ModelConfig: accepted layouts, derived layer kinds, and errors that name field/expected/found."""
import copy
import dataclasses
import json

import pytest

from lily_py.config import FULL, LINEAR, ModelConfig, canonical_module_name
from lily_py.errors import ConfigError
from lily_py.testing import REAL_TEXT_CONFIG, TINY_TEXT_CONFIG


def nested(text=None, **top):
    return {"model_type": "qwen3_5_moe", "text_config": copy.deepcopy(text or TINY_TEXT_CONFIG), **top}


def test_real_config_values():
    c = ModelConfig.from_dict(nested(REAL_TEXT_CONFIG))
    assert c.full_attention_layers == tuple(range(3, 40, 4))
    assert (c.rotary_dim, c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim) == (64, 2048, 4096, 8192)
    assert c.rope_theta == 1e7
    assert "30 Gated DeltaNet + 10 full attention" in c.summary()


def test_top_level_text_config_equals_nested():
    top = {"model_type": "qwen3_5_moe_text", **copy.deepcopy(TINY_TEXT_CONFIG)}
    a, b = ModelConfig.from_dict(top), ModelConfig.from_dict(nested())
    assert (a.model_type, b.model_type) == ("qwen3_5_moe_text", "qwen3_5_moe")
    assert dataclasses.replace(a, model_type="x") == dataclasses.replace(b, model_type="x")


def test_layer_types_list_wins_over_interval():
    t = dict(TINY_TEXT_CONFIG, num_hidden_layers=5,
             layer_types=[FULL, LINEAR, LINEAR, FULL, LINEAR])
    c = ModelConfig.from_dict(nested(t))
    assert c.full_attention_layers == (0, 3)
    t = dict(TINY_TEXT_CONFIG, num_hidden_layers=6, full_attention_interval=2)
    assert ModelConfig.from_dict(nested(t)).full_attention_layers == (1, 3, 5)


def test_from_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(nested()))
    assert ModelConfig.from_file(tmp_path).hidden_size == TINY_TEXT_CONFIG["hidden_size"]
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(model_type="llama"), r"'model_type': expected one of .* found 'llama'"),
    (lambda d: d["text_config"].pop("hidden_size"), r"'text_config.hidden_size': required, missing"),
    (lambda d: d["text_config"].update(num_experts="8"), r"'text_config.num_experts': expected an integer, found '8'"),
    (lambda d: d["text_config"].update(num_key_value_heads=3), r"num_key_value_heads': expected a divisor of num_attention_heads \(4\), found 3"),
    (lambda d: d["text_config"].update(linear_num_value_heads=3), r"linear_num_value_heads': expected a multiple of linear_num_key_heads \(2\), found 3"),
    (lambda d: d["text_config"].update(num_experts_per_tok=7), r"num_experts_per_tok': expected <= num_experts \(6\), found 7"),
    (lambda d: d["text_config"].update(layer_types=[LINEAR] * 3), r"layer_types': expected a list of 4 entries"),
    (lambda d: d["text_config"].update(layer_types=[LINEAR, "sliding", LINEAR, FULL]), r"layer_types\[1\]': expected .* found 'sliding'"),
    (lambda d: d["text_config"].update(hidden_act="gelu"), r"hidden_act': expected 'silu', found 'gelu'"),
    (lambda d: d["text_config"].update(rope_parameters={"rope_type": "default"}), r"rope_theta': required, missing"),
    (lambda d: d["text_config"].update(rope_parameters={"rope_theta": 1e6, "rope_type": "yarn"}), r"rope_type': expected 'default', found 'yarn'"),
    (lambda d: d["text_config"].update(norm_topk_prob=False), r"norm_topk_prob': expected true"),
    (lambda d: d["text_config"].update(attn_output_gate=False), r"attn_output_gate': expected true"),
    (lambda d: d.update(quantization={"bits": 4, "group_size": 64, "mode": "mxfp4"}), r"quantization.mode': expected 'affine' .* found 'mxfp4'"),
    (lambda d: d.update(quantization={"bits": 7, "group_size": 64}), r"quantization.bits': expected one of 2,3,4,5,6,8, found 7"),
    (lambda d: d.update(text_config=[1]), r"'text_config': expected an object"),
])
def test_errors_name_field_expected_found(mutate, message):
    d = nested()
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(d)


def test_quantization_overrides_are_canonical():
    q = {"group_size": 64, "bits": 4, "mode": "affine",
         "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
         "language_model.model.layers.0.mlp.shared_expert_gate": {"group_size": 64, "bits": 8},
         "language_model.model.layers.1.linear_attn.in_proj_b": False}
    c = ModelConfig.from_dict(nested(quantization=q))
    assert c.quantization.spec_for("layers.0.mlp.gate").bits == 8
    assert c.quantization.spec_for("layers.0.mlp.shared_expert_gate").bits == 8
    assert c.quantization.spec_for("layers.1.mlp.gate").bits == 4


@pytest.mark.parametrize("name, canon", [
    ("language_model.model.layers.3.mlp.gate.weight", "layers.3.mlp.gate.weight"),
    ("language_model.lm_head.scales", "lm_head.scales"),
    ("model.language_model.embed_tokens.weight", "embed_tokens.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_canonical_names(name, canon):
    assert canonical_module_name(name) == canon
