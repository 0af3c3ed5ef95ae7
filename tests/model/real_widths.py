"""The real model's widths on long prompts (issue 26, item 4), shared by
tests/model/test_real_widths_long.py and benchmarks/real_widths_long.py: a random-weight MLX 4-bit
checkpoint with the real config's hidden size (2,048), vocabulary (248,320), 256 experts (top 8),
16 query / 2 KV heads of head_dim 256 and 16 / 32 DeltaNet heads of 128, with 4 of its 40 layers
(3 Gated DeltaNet + 1 gated attention: full_attention_interval 4), bf16 scales; and its prompts.
The whole 40 layers would be a 20 GB random checkpoint and a reference no CPU finishes at 128K;
these 4 layers are each of the real layers' shapes.
"""
from __future__ import annotations

import numpy as np

from lily_py.testing import REAL_TEXT_CONFIG, make_checkpoint

CONFIG = dict(REAL_TEXT_CONFIG, num_hidden_layers=4)
SEED, STD = 13, 0.05


def make(folder) -> str:
    return make_checkpoint(folder, CONFIG, fmt="mlx", seed=SEED, std=STD)


def describe() -> str:
    c = CONFIG
    return (f"hidden {c['hidden_size']}, vocab {c['vocab_size']:,}, {c['num_experts']} experts top "
            f"{c['num_experts_per_tok']}, {c['num_attention_heads']}/{c['num_key_value_heads']} heads of "
            f"{c['head_dim']}, {c['num_hidden_layers']} layers")


def prompt(n: int) -> np.ndarray:
    """``n`` random token ids (seeded by ``n``)."""
    return np.random.default_rng(n + 1).integers(0, CONFIG["vocab_size"], n).astype(np.uint32)
