"""Strict validation of the qwen3_5_moe text configuration.

lily_py runs one architecture. ``ModelConfig.from_dict`` accepts a Hugging Face or MLX
``config.json`` of model_type ``qwen3_5_moe`` (text config nested under ``text_config``) or the
text-only ``qwen3_5_moe_text`` (fields at top level), checks every field the engine depends on,
and says what is wrong as ``field: expected ..., found ...``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
LINEAR = "linear_attention"
FULL = "full_attention"

# Fields that may be omitted; their defaults are transformers' Qwen3_5MoeTextConfig defaults
# (configuration_qwen3_5_moe.py) and those of the real checkpoint.
_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "max_position_embeddings": 32768,
    "full_attention_interval": 4,
}

_REQUIRED_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


@dataclass(frozen=True)
class QuantSpec:
    """bits and group size of one quantized tensor (MLX affine)."""
    bits: int
    group_size: int


@dataclass(frozen=True)
class QuantizationConfig:
    """The config's ``quantization`` block: a default and per-module overrides.

    Override keys are MLX module paths as written by mlx-lm, e.g.
    ``language_model.model.layers.0.mlp.gate``; ``overrides`` maps them after prefix
    normalisation to lily_py's canonical module names (``layers.0.mlp.gate``).
    """
    bits: int
    group_size: int
    mode: str = "affine"
    overrides: Mapping[str, QuantSpec] = field(default_factory=dict)

    def spec_for(self, module: str) -> QuantSpec:
        return self.overrides.get(module, QuantSpec(self.bits, self.group_size))


@dataclass(frozen=True)
class ModelConfig:
    """Validated text-model configuration. Shapes in comments are for the real 35B-A3B model."""
    vocab_size: int                      # 248320
    hidden_size: int                     # 2048
    num_hidden_layers: int               # 40
    num_attention_heads: int             # 16 query heads
    num_key_value_heads: int             # 2
    head_dim: int                        # 256
    linear_key_head_dim: int             # 128
    linear_value_head_dim: int           # 128
    linear_num_key_heads: int            # 16
    linear_num_value_heads: int          # 32
    linear_conv_kernel_dim: int          # 4
    num_experts: int                     # 256
    num_experts_per_tok: int             # 8
    moe_intermediate_size: int           # 512
    shared_expert_intermediate_size: int  # 512
    rms_norm_eps: float                  # 1e-6
    rope_theta: float                    # 1e7
    partial_rotary_factor: float         # 0.25 -> rotary_dim 64
    max_position_embeddings: int         # 262144
    tie_word_embeddings: bool            # False
    layer_types: tuple[str, ...]         # ("linear_attention",)*3 + ("full_attention",), x10
    quantization: QuantizationConfig | None = None
    model_type: str = "qwen3_5_moe"
    eos_token_id: tuple[int, ...] = ()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:      # 2048
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:    # 4096
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:     # 8192 = q | k | v channels of the conv1d
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"{path}: no config.json (is this a checkpoint folder?)")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=path)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: field 'model_type': expected one of {SUPPORTED_MODEL_TYPES} "
                f"(Qwen3.5/3.6 MoE, e.g. Qwen3.6-35B-A3B), found {model_type!r}. "
                "lily_py runs this one architecture only.")
        text = raw.get("text_config")
        prefix = "text_config."
        if text is None:
            text, prefix = raw, ""
        elif not isinstance(text, Mapping):
            raise ConfigError(f"{source}: field 'text_config': expected an object, found "
                              f"{type(text).__name__}")
        where = lambda k: f"{source}: field '{prefix}{k}'"  # noqa: E731

        def get_int(k: str, lo: int = 1) -> int:
            if k not in text:
                if k in _OPTIONAL_DEFAULTS:
                    return _OPTIONAL_DEFAULTS[k]
                raise ConfigError(f"{where(k)}: required, missing")
            v = text[k]
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{where(k)}: expected an integer, found {v!r}")
            if v < lo:
                raise ConfigError(f"{where(k)}: expected an integer >= {lo}, found {v}")
            return v

        ints = {k: get_int(k) for k in _REQUIRED_INTS}
        conv_k = get_int("linear_conv_kernel_dim", 2)
        max_pos = get_int("max_position_embeddings")

        eps = text.get("rms_norm_eps", _OPTIONAL_DEFAULTS["rms_norm_eps"])
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1e-1:
            raise ConfigError(f"{where('rms_norm_eps')}: expected a small positive number, found {eps!r}")

        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where('hidden_act')}: expected 'silu', found {act!r}")
        if text.get("attention_bias", False):
            raise ConfigError(f"{where('attention_bias')}: expected false, found true")
        if text.get("attn_output_gate", True) is not True:
            raise ConfigError(f"{where('attn_output_gate')}: expected true (gated attention), "
                              f"found {text.get('attn_output_gate')!r}")
        if text.get("norm_topk_prob", True) is not True:
            raise ConfigError(
                f"{where('norm_topk_prob')}: expected true (the model renormalises its top-k "
                f"routing weights), found {text.get('norm_topk_prob')!r}")
        for unsupported in ("mlp_only_layers",):
            if text.get(unsupported):
                raise ConfigError(f"{where(unsupported)}: expected empty (every layer is MoE), "
                                  f"found {text[unsupported]!r}")
        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        if not isinstance(tie, bool):
            raise ConfigError(f"{where('tie_word_embeddings')}: expected a boolean, found {tie!r}")

        # RoPE: rope_parameters (transformers 5), rope_scaling (older) or top-level rope_theta.
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{where('rope_parameters')}: expected an object, found {rope!r}")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            raise ConfigError(
                f"{where('rope_parameters.rope_theta')}: required, missing (libraries disagree on "
                "its default: transformers 1e4, mlx-lm 1e5, the real model 1e7)")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
            raise ConfigError(f"{where('rope_parameters.rope_theta')}: expected a number > 1, found {theta!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"{where('rope_parameters.rope_type')}: expected 'default', found {rope_type!r}")
        prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise ConfigError(f"{where('partial_rotary_factor')}: expected a number in (0, 1], found {prf!r}")
        rot = ints["head_dim"] * prf
        if rot != int(rot) or int(rot) % 2:
            raise ConfigError(f"{where('partial_rotary_factor')}: head_dim*factor must be an even "
                              f"integer, found {ints['head_dim']}*{prf} = {rot}")

        # Head and expert relations.
        h, kv = ints["num_attention_heads"], ints["num_key_value_heads"]
        if h % kv:
            raise ConfigError(f"{where('num_key_value_heads')}: expected a divisor of "
                              f"num_attention_heads ({h}), found {kv}")
        hk, hv = ints["linear_num_key_heads"], ints["linear_num_value_heads"]
        if hv % hk:
            raise ConfigError(f"{where('linear_num_value_heads')}: expected a multiple of "
                              f"linear_num_key_heads ({hk}), found {hv}")
        if ints["num_experts_per_tok"] > ints["num_experts"]:
            raise ConfigError(f"{where('num_experts_per_tok')}: expected <= num_experts "
                              f"({ints['num_experts']}), found {ints['num_experts_per_tok']}")

        layer_types = cls._layer_types(text, ints["num_hidden_layers"], where)
        quant = cls._quantization(raw, source)
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos_t: tuple[int, ...] = ()
        if isinstance(eos, int) and not isinstance(eos, bool):
            eos_t = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_t = tuple(eos)

        return cls(
            **ints,
            linear_conv_kernel_dim=conv_k,
            rms_norm_eps=float(eps),
            rope_theta=float(theta),
            partial_rotary_factor=float(prf),
            max_position_embeddings=max_pos,
            tie_word_embeddings=tie,
            layer_types=layer_types,
            quantization=quant,
            model_type=model_type,
            eos_token_id=eos_t,
        )

    @staticmethod
    def _layer_types(text: Mapping[str, Any], n_layers: int, where) -> tuple[str, ...]:
        lt = text.get("layer_types")
        if lt is not None:
            if not isinstance(lt, list) or len(lt) != n_layers:
                raise ConfigError(f"{where('layer_types')}: expected a list of {n_layers} entries "
                                  f"(num_hidden_layers), found {lt!r}")
            bad = [(i, t) for i, t in enumerate(lt) if t not in (LINEAR, FULL)]
            if bad:
                i, t = bad[0]
                raise ConfigError(f"{where(f'layer_types[{i}]')}: expected {LINEAR!r} or {FULL!r}, "
                                  f"found {t!r}")
            return tuple(lt)
        interval = text.get("full_attention_interval", _OPTIONAL_DEFAULTS["full_attention_interval"])
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"{where('full_attention_interval')}: expected an integer >= 1, "
                              f"found {interval!r}")
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))

    @staticmethod
    def _quantization(raw: Mapping[str, Any], source: str) -> QuantizationConfig | None:
        q = raw.get("quantization", raw.get("quantization_config"))
        if q is None:
            return None
        if not isinstance(q, Mapping):
            raise ConfigError(f"{source}: field 'quantization': expected an object, found {q!r}")
        method = q.get("quant_method")
        if method is not None and method != "mlx":
            raise ConfigError(f"{source}: field 'quantization_config.quant_method': {method!r} "
                              "checkpoints are not supported; lily_py reads MLX affine 4/8-bit "
                              "conversions (e.g. from mlx_lm.convert) and unquantized bf16/fp16/fp32")
        mode = q.get("mode", "affine")
        if mode != "affine":
            raise ConfigError(f"{source}: field 'quantization.mode': expected 'affine' (MLX affine "
                              f"quantization), found {mode!r}")

        def spec(obj: Any, key: str) -> QuantSpec:
            bits, gs = obj.get("bits"), obj.get("group_size")
            if bits not in (2, 3, 4, 5, 6, 8):
                raise ConfigError(f"{source}: field '{key}.bits': expected one of 2,3,4,5,6,8, "
                                  f"found {bits!r}")
            if gs not in (32, 64, 128):
                raise ConfigError(f"{source}: field '{key}.group_size': expected 32, 64 or 128, "
                                  f"found {gs!r}")
            return QuantSpec(bits, gs)

        default = spec(q, "quantization")
        overrides: dict[str, QuantSpec] = {}
        for k, v in q.items():
            if isinstance(v, Mapping):
                overrides[canonical_module_name(k)] = spec(v, f"quantization.{k}")
            elif v is False:
                # mlx-lm writes False for modules it left unquantized.
                continue
        return QuantizationConfig(default.bits, default.group_size, mode, overrides)

    def summary(self) -> str:
        n_full = len(self.full_attention_layers)
        return (f"qwen3_5_moe: {self.num_hidden_layers} layers ({self.num_hidden_layers - n_full} "
                f"Gated DeltaNet + {n_full} full attention), hidden {self.hidden_size}, "
                f"vocab {self.vocab_size}, experts {self.num_experts_per_tok}/{self.num_experts}"
                + (f", {self.quantization.bits}-bit g{self.quantization.group_size}"
                   if self.quantization else ", unquantized"))


_PREFIXES = (
    ("language_model.model.", ""),      # mlx-lm
    ("language_model.lm_head", "lm_head"),
    ("model.language_model.", ""),      # HF multimodal checkpoint
    ("model.", ""),                     # HF text-only
)


def canonical_module_name(name: str) -> str:
    """Map an HF or MLX tensor/module name to lily_py's canonical name (no model prefix).

    ``language_model.model.layers.3.mlp.gate`` -> ``layers.3.mlp.gate``;
    ``model.language_model.embed_tokens.weight`` -> ``embed_tokens.weight``;
    ``language_model.lm_head.weight`` -> ``lm_head.weight``.
    """
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def rotary_inv_freq(cfg: ModelConfig):
    """inv_freq[i] = theta^(-2i/rotary_dim), i < rotary_dim/2 (float64 for the reference)."""
    import numpy as np
    rd = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
