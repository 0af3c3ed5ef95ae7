"""The engine's spec, made from a model config: what ``lily_py._core.Engine`` is told at load
(shapes, quantization classes, activation and KV cache dtypes; csrc/core/model_spec.h), and the
bytes of one KV cache row.

The engine backend (:mod:`.engine`) builds its engine from it; :mod:`lily_py.sizes` plans memory
from it before anything loads. It imports only the config, so both can import it.
"""
from __future__ import annotations

from ..config import ModelConfig

# All-logits steps write at most this many rows of logits (the logits buffer is [rows, vocab]).
LOGIT_ROWS = 64

# The KV cache's element type (None: default_kv_dtype); "int8": codes and a float32 scale per row
# and KV head (shaders/common/kv_blocks.h, lily_py.reference.kvquant.int8_row_codes); "float32":
# the rows as computed, unrounded (4 head_dim bytes a row)
KV_DTYPES = (None, "bfloat16", "int8", "float32")
# head_dims the int8 cache's attention routes take (csrc/core/engine_spec.cpp)
KV_INT8_HEAD_DIMS = (64, 128, 256)


def default_kv_dtype(cfg: ModelConfig) -> str:
    """What ``kv_dtype=None`` means: "bfloat16", the model's precision, on every backend, as
    mlx-lm, llama.cpp and Lily keep their caches by default (so the reference backend is exact
    and comparisons with them are at matched numerics). The int8 cache (half the bytes; head_dim
    64, 128 or 256) is one argument away: ``kv_dtype="int8"``, and so is the float32 one (twice
    the bytes, no rounding of K and V): ``kv_dtype="float32"`` (docs/memory.md)."""
    return "bfloat16"


def resolve_kv_dtype(cfg: ModelConfig, kv_dtype: str | None) -> str:
    """The KV cache a load with ``kv_dtype`` gets: itself when given, else the default for ``cfg``."""
    return kv_dtype or default_kv_dtype(cfg)


# The quantization the real Qwen3.6-35B-A3B MLX 4-bit checkpoint uses (mlx-lm's conversion):
# 4-bit group 64 everywhere, 8-bit router and shared-expert gate, bfloat16 scales.
REAL_QUANT = {
    "embed": {"bits": 4, "group_size": 64, "scale_dtype": "bfloat16"},
    "lm_head": {"bits": 4, "group_size": 64, "scale_dtype": "bfloat16"},
    "mixer": {"bits": 4, "group_size": 64, "scale_dtype": "bfloat16"},
    "experts_q": {"bits": 4, "group_size": 64, "scale_dtype": "bfloat16"},
    "router": {"bits": 8, "group_size": 64, "scale_dtype": "bfloat16"},
}


ACTIVATIONS = ("bfloat16", "float32")


def checkpoint_activations(quant: dict) -> str:
    """The activation dtype MLX computes a checkpoint in: the dtype of its embedding's scales
    (the embedding's output, hence the residual stream, has it): bfloat16 for the real bf16
    checkpoints, float32 for a float32 conversion."""
    return quant["embed"]["scale_dtype"]


def engine_spec(cfg: ModelConfig, quant: dict, *, context_length: int, prefill_chunk: int,
                activations: str = "float32", kv_block_tokens: int | None = None,
                kv_dtype: str | None = None) -> dict:
    """The dict ``lily_py._core.Engine`` takes (csrc/core/model_spec.h). ``kv_dtype`` None: the
    default for ``cfg`` (``resolve_kv_dtype``), as everywhere in this module."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    return {
        "vocab": cfg.vocab_size, "hidden": cfg.hidden_size,
        "full_attention": [1 if cfg.is_full_attention(i) else 0 for i in range(cfg.num_hidden_layers)],
        "q_heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rotary_dim": cfg.rotary_dim, "rope_theta": float(cfg.rope_theta),
        "lin_k_heads": cfg.linear_num_key_heads, "lin_v_heads": cfg.linear_num_value_heads,
        "lin_k_dim": cfg.linear_key_head_dim, "lin_v_dim": cfg.linear_value_head_dim,
        "conv_kernel": cfg.linear_conv_kernel_dim, "experts": cfg.num_experts,
        "top_k": cfg.num_experts_per_tok, "moe_inter": cfg.moe_intermediate_size,
        "shared_inter": cfg.shared_expert_intermediate_size, "eps": float(cfg.rms_norm_eps),
        **quant,
        "context_length": int(context_length), "prefill_chunk": int(prefill_chunk),
        "logit_rows": int(min(prefill_chunk, LOGIT_ROWS)), "activations": activations,
        **({} if kv_block_tokens is None else {"kv_block_tokens": int(kv_block_tokens)}),
        "kv_dtype": resolve_kv_dtype(cfg, kv_dtype),
    }


def kv_row_bytes(cfg: ModelConfig, kv_dtype: str | None = None) -> int:
    """Bytes of one KV cache row (one position of one KV head, K or V): 2 head_dim (bfloat16),
    head_dim + 4 with ``kv_dtype="int8"`` (codes and a float32 scale) or 4 head_dim with
    ``kv_dtype="float32"`` (csrc gpu::kv_row_bytes); None: the default for ``cfg``."""
    kv = resolve_kv_dtype(cfg, kv_dtype)
    return cfg.head_dim + 4 if kv == "int8" else (4 if kv == "float32" else 2) * cfg.head_dim
