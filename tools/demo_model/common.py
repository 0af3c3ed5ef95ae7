"""What every stage of the demo build shares: paths, the model's config (every feature of
Qwen3.6-35B-A3B, scaled down), the added tokens, the fixed prompts of the record, log and fail."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = os.path.join(REPO, "src", "lily_py", "templates", "qwen3_5_chat_template.jinja")

# --------------------------------------------------------------------------------------------
# The model. Every feature of Qwen3.6-35B-A3B, scaled down; every linear in-dim is a multiple
# of 64 so that mlx-lm quantizes all of them. Real-model values in the comments.
# --------------------------------------------------------------------------------------------
NUM_LAYERS = 4                       # 40; pattern 3 Gated DeltaNet : 1 full attention
TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 2048,              # 248320
    "hidden_size": 256,              # 2048
    "num_hidden_layers": NUM_LAYERS,
    "full_attention_interval": 4,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                    for i in range(NUM_LAYERS)],
    # gated full attention: q_proj emits query and gate per head; q width 2 x hidden, as real
    "num_attention_heads": 8,        # 16
    "num_key_value_heads": 2,        # 2
    "head_dim": 64,                  # 256; rotary dim = 64 * 0.25 = 16 (real: 64)
    "attn_output_gate": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    # Gated DeltaNet: value heads = 2 x key heads, as real
    "linear_num_key_heads": 2,       # 16
    "linear_num_value_heads": 4,     # 32
    "linear_key_head_dim": 64,       # 128
    "linear_value_head_dim": 64,     # 128
    "linear_conv_kernel_dim": 4,     # 4
    "mamba_ssm_dtype": "float32",
    # MoE on every layer: softmax router, top-k, renormalised; plus one sigmoid-gated shared expert
    "num_experts": 16,               # 256
    "num_experts_per_tok": 4,        # 8
    "moe_intermediate_size": 64,     # 512 (= hidden / 4, as here)
    "shared_expert_intermediate_size": 64,  # 512
    "router_aux_loss_coef": 0.01,    # used in training only (real config: 0.001)
    "output_router_logits": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,  # as real; the demo was trained on windows of --seq-len
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,    # 1e7, as real
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],  # real [11, 11, 10]; sums to rotary_dim / 2; text = plain RoPE
        "mrope_interleaved": True,
    },
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "mtp_num_hidden_layers": 0,      # real 1; neither transformers nor mlx-lm runs MTP
    "mtp_use_dedicated_embeddings": False,
    "dtype": "bfloat16",
}

# (content, special) in id order after the BPE vocabulary, as in Qwen's tokenizer.json, where
# <|endoftext|> / <|im_start|> / <|im_end|> are special and the tag tokens are not.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
BPE_VOCAB = TEXT_CONFIG["vocab_size"] - len(ADDED_TOKENS)   # 2039 (256 bytes + merges)

# Fixed prompts whose mlx-lm greedy continuation is recorded in expected_greedy.json.
GREEDY_TEXT_PROMPT = "And God said unto Moses,"
GREEDY_CHAT_MESSAGES = [{"role": "user", "content": "Quote Genesis 1:3."}]
GREEDY_TOKENS = 32

# Prompts shown with sampled output at the end of the run.
SAMPLE_TEXT_PROMPTS = ["In the beginning", "Psalms 23\n", "Blessed are the"]


def log(msg: str = "") -> None:
    print(msg, flush=True)


def fail(msg: str) -> "NoReturn":  # noqa: F821
    print(f"make_demo.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)
