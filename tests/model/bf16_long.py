"""The long-prompt bf16 error setup shared by tests/model/test_bf16_long_prompts.py and its fixture
generator (tests/fixtures/make_bf16_long.py): a random-weight checkpoint with the real head
dimensions, its random prompts, the rows compared and the error metrics.

Checkpoint: hidden 512, 4 layers (3 Gated DeltaNet, 1 gated attention: full_attention_interval 4),
attention head_dim 256 with 4 query / 2 KV heads, DeltaNet heads of Dk = Dv = 128 (2 key, 4 value
heads), 8 experts top-2, 4-bit MLX quantization with bf16 scales (the real checkpoint's), written by
``lily_py.testing.make_checkpoint`` (deterministic for a seed; the fixture records the weights'
sha256 so a drift of the generator is caught, not compared against stale numbers).

Rows: the logits of the last ``ROWS`` positions of an ``n``-token prompt (one row is noisy: a
router choice that flips at that token dominates it; 64 rows give a stable mean).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint

CONFIG = dict(TINY_TEXT_CONFIG, hidden_size=512, vocab_size=512, head_dim=256,
              num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
              shared_expert_intermediate_size=128, max_position_embeddings=262144)
SEED, STD = 9, 0.06
ROWS = 64
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bf16_long"


def make(folder) -> str:
    """The checkpoint, written into ``folder``; or the folder LILY_BF16_LONG_CKPT names (a copy of
    an earlier make()). The fixtures belong to these exact tensors (weights_sha256): make_checkpoint
    is deterministic for a seed and rounds to bf16 itself (testing._cast), so other numpy /
    ml_dtypes versions write the same tensors."""
    given = os.environ.get("LILY_BF16_LONG_CKPT")
    return given if given else make_checkpoint(folder, CONFIG, fmt="mlx", seed=SEED, std=STD)


def weights_sha256(folder) -> str:
    """sha256 over the checkpoint's tensors (sorted names, dtype, shape, bytes), not the file: the
    safetensors header's layout differs between library versions (the H200 machine's wrote other
    bytes for the same tensors)."""
    from safetensors.numpy import load_file
    h = hashlib.sha256()
    for name, t in sorted(load_file(str(Path(folder, "model.safetensors"))).items()):
        h.update(f"{name}|{t.dtype.str}|{t.shape}|".encode())
        h.update(np.ascontiguousarray(t).tobytes())
    return h.hexdigest()


def prompt(n: int) -> np.ndarray:
    """``n`` random token ids (seeded by ``n``)."""
    return np.random.default_rng(n).integers(0, CONFIG["vocab_size"], n).astype(np.uint32)


def errors(got: np.ndarray, ref: np.ndarray) -> dict:
    """Over the compared rows: mean |d|, max |d| / max |ref|, and sum d^2 / sum ref^2 (float64)."""
    g, r = got.astype(np.float64), ref.astype(np.float64)
    d = g - r
    return {"mean_abs": float(np.abs(d).mean()), "max_rel": float(np.abs(d).max() / np.abs(r).max()),
            "nmse": float(np.sum(d * d) / np.sum(r * r))}


def greedy_same(got: np.ndarray, ref: np.ndarray) -> int:
    """The compared rows whose greedy token (argmax) is the same in both."""
    return int(np.sum(got.argmax(-1) == ref.argmax(-1)))


def last_rows(backend, ids: np.ndarray) -> np.ndarray:
    """A lily_py backend's logits of the last ROWS positions: the prompt up to them in one call
    (the backend's own prefill chunks), then the last ROWS tokens with all logits."""
    backend.forward(ids[:-ROWS], all_logits=False)
    return backend.forward(ids[-ROWS:], all_logits=True)
