"""Random-weight qwen3_5_moe checkpoints, for tests, benchmarks and examples.

``make_checkpoint(folder, text_config, fmt="mlx" | "hf", ...)`` writes a folder that
``lily_py.load`` (and mlx-lm / transformers) accept, with NumPy only: MLX 4-bit layout with the
8-bit router and shared-expert gate (as mlx-lm writes it), or Hugging Face layout (fused or
per-expert experts, ``model.`` or ``model.language_model.`` prefix, zero-centred norms).

Quantized weights are generated directly as random codes with per-group scales chosen for a
target standard deviation, so even the real model's shapes take seconds to write.
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Any

import ml_dtypes
import numpy as np

from .config import ModelConfig

# The real Qwen3.6-35B-A3B text config (MODEL_FACTS.md section 3).
REAL_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_conv_kernel_dim": 4, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "hidden_act": "silu", "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
}

# A small config with every feature of the real one, for fast tests.
TINY_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4, "num_experts": 6,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "hidden_act": "silu", "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
}

_DT = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}


def _cast(x, dt) -> np.ndarray:
    """x as dtype `dt`; to bf16 by our own round-to-nearest-even from the exact float64 value, so a
    checkpoint's bytes do not depend on the installed ml_dtypes: 0.6 rounds float64 through float32
    (twice, a tie of the second rounding one ulp off), 0.7 once (this function's result for every
    finite value above the bf16 subnormals; they and overflow still round twice, through float32)."""
    x = np.asarray(x)
    if dt is not ml_dtypes.bfloat16:
        return x.astype(dt)
    u = np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)
    # keep the sign, the exponent and the 7 top mantissa bits (bits 45..51); round on bits 0..44
    r = (u + np.uint64((1 << 44) - 1) + ((u >> np.uint64(45)) & np.uint64(1))) & ~np.uint64((1 << 45) - 1)
    f32 = r.view(np.float64).astype(np.float32)   # exact: 8 significant bits
    return (f32.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(ml_dtypes.bfloat16)


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical module -> (kind, logical shape). kind: "linear", "norm" (zero-centred),
    "vector", "conv", "experts"."""
    c = cfg
    H, V, E = c.hidden_size, c.vocab_size, c.num_experts
    I, Is = c.moe_intermediate_size, c.shared_expert_intermediate_size
    out: dict[str, tuple[str, tuple[int, ...]]] = {
        "embed_tokens": ("linear", (V, H)), "norm": ("norm", (H,)), "lm_head": ("linear", (V, H))}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm"] = ("norm", (H,))
        out[p + "post_attention_layernorm"] = ("norm", (H,))
        if c.is_full_attention(i):
            D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
            out[p + "self_attn.q_proj"] = ("linear", (2 * Hq * D, H))
            out[p + "self_attn.k_proj"] = ("linear", (Hkv * D, H))
            out[p + "self_attn.v_proj"] = ("linear", (Hkv * D, H))
            out[p + "self_attn.o_proj"] = ("linear", (H, Hq * D))
            out[p + "self_attn.q_norm"] = ("norm", (D,))
            out[p + "self_attn.k_norm"] = ("norm", (D,))
        else:
            a, Hv = p + "linear_attn.", c.linear_num_value_heads
            out[a + "in_proj_qkv"] = ("linear", (c.linear_conv_dim, H))
            out[a + "in_proj_z"] = ("linear", (c.linear_value_dim, H))
            out[a + "in_proj_b"] = ("linear", (Hv, H))
            out[a + "in_proj_a"] = ("linear", (Hv, H))
            out[a + "conv1d"] = ("conv", (c.linear_conv_dim, c.linear_conv_kernel_dim))
            out[a + "dt_bias"] = ("vector", (Hv,))
            out[a + "A_log"] = ("vector", (Hv,))
            out[a + "norm"] = ("gated_norm", (c.linear_value_head_dim,))
            out[a + "out_proj"] = ("linear", (H, c.linear_value_dim))
        m = p + "mlp."
        out[m + "gate"] = ("linear8", (E, H))
        out[m + "shared_expert.gate_proj"] = ("linear", (Is, H))
        out[m + "shared_expert.up_proj"] = ("linear", (Is, H))
        out[m + "shared_expert.down_proj"] = ("linear", (H, Is))
        out[m + "shared_expert_gate"] = ("linear8", (1, H))
        out[m + "experts.gate_proj"] = ("experts", (E, I, H))
        out[m + "experts.up_proj"] = ("experts", (E, I, H))
        out[m + "experts.down_proj"] = ("experts", (E, H, I))
    return out


def truncated(cfg: ModelConfig, weights, layers: int):
    """(config, weights) of the first ``layers`` decoder layers of a loaded checkpoint, the same
    arrays (nothing copied): a model whose logits are the residual stream after that layer seen
    through the final norm and lm_head (benchmarks/depth_oracle.py)."""
    import dataclasses
    if not 1 <= layers <= cfg.num_hidden_layers:
        raise ValueError(f"layers must be in [1, {cfg.num_hidden_layers}], got {layers}")
    return (dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers]),
            dataclasses.replace(weights, layers=weights.layers[:layers]))


# make_checkpoint(stable=True): the output projections' share of std, the number of embedding
# directions (token id modulo), and the router's logit gap for a direction's experts.
STABLE_OUT_SCALE = 0.25
STABLE_PROFILES = 64   # at most: num_experts // num_experts_per_tok when fewer (disjoint expert sets)
STABLE_ROUTER_GAP = 4.0
_STABLE_OUTPUTS = ("self_attn.o_proj", "linear_attn.out_proj", "shared_expert.down_proj")


def _stable_directions(cfg: ModelConfig, seed: int) -> np.ndarray:
    """``[STABLE_PROFILES, H]`` random +-1 / sqrt(H) directions (dense, so 4-bit groups keep them)."""
    rng = np.random.default_rng([seed, zlib.crc32(b"stable-directions")])
    H, P = cfg.hidden_size, max(1, min(STABLE_PROFILES, cfg.num_experts // cfg.num_experts_per_tok))
    return (rng.integers(0, 2, size=(P, H)) * 2.0 - 1.0).astype(np.float32) / np.sqrt(H)


def _stable_embedding(rng, cfg: ModelConfig, u: np.ndarray) -> np.ndarray:
    """Row t = 2 sqrt(H) u[t % P] + N(0, 1): the direction carries 4/5 of the row's energy."""
    V, H = cfg.vocab_size, cfg.hidden_size
    out = np.empty((V, H), np.float32)
    for r0 in range(0, V, 8192):  # in row blocks: the real vocabulary is 2 GB of float32
        r1 = min(V, r0 + 8192)
        out[r0:r1] = 2.0 * np.sqrt(H) * u[np.arange(r0, r1) % len(u)] + rng.standard_normal((r1 - r0, H), np.float32)
    return out


def _stable_router(rng, cfg: ModelConfig, u: np.ndarray, std: float) -> np.ndarray:
    """Router rows ``[E, H]``: each direction owns k experts (disjoint sets, drawn per layer by a
    permutation); expert j's row is g * its direction (none: 0) plus N(0, std / 4). A normed hidden
    state whose component along u[p] is the embedding's gives p's experts a logit about
    STABLE_ROUTER_GAP above every other expert."""
    E, H, k = cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok
    member = np.zeros((len(u), E), np.float32)
    perm = rng.permutation(E)
    for p in range(len(u)):
        member[p, perm[p * k:(p + 1) * k]] = 1.0
    # the normed hidden state's component along u[p] is about sqrt(H) * 2 / sqrt(5) (the embedding)
    g = STABLE_ROUTER_GAP / (np.sqrt(H) * 2.0 / np.sqrt(5.0))
    return g * member.T @ u + rng.standard_normal((E, H), np.float32) * (std / 4)


def _quantize_dense(w: np.ndarray, bits: int, group_size: int, sdt):
    """MLX affine quantization of given float weights (lily_py.reference.quant.quantize), scales
    and biases stored in ``sdt``."""
    from .reference.quant import quantize
    return quantize(w, bits=bits, group_size=group_size, scale_dtype=sdt)


def _random_quant(rng, shape, bits, group_size, std, sdt):
    """Random codes with scale/bias so that w = s*q + b has mean ~0 and the given std."""
    *lead, n, k = shape
    words = rng.integers(0, 2**32, size=(*lead, n, k * bits // 32), dtype=np.uint32)
    levels = (1 << bits) - 1
    unit = np.sqrt((levels + 1) ** 2 - 1) / np.sqrt(12.0)     # std of uniform codes 0..levels
    s = (std / unit) * rng.uniform(0.5, 1.5, size=(*lead, n, k // group_size))
    scales = _cast(s, sdt)
    biases = _cast(-s * levels / 2, sdt)
    return words, scales, biases


def _dense(rng, shape, std, dt):
    return _cast(rng.standard_normal(shape, dtype=np.float32) * std, dt)


def make_checkpoint(folder: str | os.PathLike, text_config: dict | None = None, *,
                    fmt: str = "mlx", bits: int = 4, group_size: int = 64, dtype: str = "bf16",
                    seed: int = 0, std: float = 0.05, expert_layout: str = "fused",
                    hf_prefix: str = "model.language_model.", nested: bool = True,
                    shards: int = 1, extra_tensors: dict[str, np.ndarray] | None = None,
                    quant_overrides: dict[str, tuple[int, int]] | None = None,
                    stable: bool = False) -> str:
    """Write a random-weight checkpoint; returns the folder. See the module docstring.

    ``quant_overrides`` (mlx only): a mixed-bit checkpoint, as ``mlx_lm.convert --quant-predicate``
    writes one: canonical module (``layers.3.self_attn.v_proj``, ``layers.1.mlp.experts.down_proj``
    for the stacked experts, ``embed_tokens``) -> (bits, group_size), stored with those widths and
    listed per module in the config's ``quantization``.

    ``stable`` (mlx only): weights under which deep comparisons measure the implementation, not
    chaos (docs/fixtures.md, "Stable checkpoints"): every layer's output projections (o_proj,
    out_proj, the experts' and the shared expert's down_proj) at ``STABLE_OUT_SCALE`` of ``std``,
    so the residual stream stays near the embedding at any depth; and routing with margin: each
    token's embedding carries one of ``STABLE_PROFILES`` directions (by token id), and each layer's
    router rows give the ``num_experts_per_tok`` experts that layer assigns that direction a
    logit ``STABLE_ROUTER_GAP`` above the rest."""
    overrides = dict(quant_overrides or {})
    if fmt not in ("mlx", "hf"):
        raise ValueError(f"fmt must be 'mlx' or 'hf', got {fmt!r}")
    if stable and fmt != "mlx":
        raise ValueError("stable=True writes MLX checkpoints only (fmt='mlx')")
    text = dict(TINY_TEXT_CONFIG if text_config is None else text_config)
    raw = {"model_type": "qwen3_5_moe", "text_config": text} if nested else \
        {"model_type": "qwen3_5_moe_text", **text}
    cfg = ModelConfig.from_dict(raw)
    directions = _stable_directions(cfg, seed) if stable else None
    dt = _DT[dtype]
    pending_gate = None
    tensors: dict[str, np.ndarray] = {}
    quant_block: dict[str, Any] = {}

    def name(canon: str) -> str:
        if fmt == "mlx":
            return ("language_model." + canon) if canon.startswith("lm_head") else \
                "language_model.model." + canon
        return canon if canon.startswith("lm_head") else hf_prefix + canon

    for canon, (kind, shape) in tensor_shapes(cfg).items():
        # one generator per tensor: the same tensor gets the same values in every format
        rng = np.random.default_rng([seed, zlib.crc32(canon.encode())])
        if kind in ("linear", "linear8"):
            b, g = overrides.pop(canon, (8 if kind == "linear8" else bits, group_size))
            sd = std if not canon.startswith(("embed", "lm_head")) else 1.0 if \
                canon.startswith("embed") else std
            if stable and canon.endswith(_STABLE_OUTPUTS):
                sd = std * STABLE_OUT_SCALE
            if stable and (canon == "embed_tokens" or canon.endswith(".mlp.gate")) and shape[-1] % g == 0:
                dense = _stable_embedding(rng, cfg, directions) if canon == "embed_tokens" else \
                    _stable_router(rng, cfg, directions, std)
                w, s, bi = _quantize_dense(dense, b, g, dt)
                tensors[name(canon) + ".weight"] = w
                tensors[name(canon) + ".scales"] = s
                tensors[name(canon) + ".biases"] = bi
                if (b, g) != (bits, group_size):
                    quant_block[name(canon)] = {"group_size": g, "bits": b}
            elif fmt == "mlx" and shape[-1] % g == 0:
                w, s, bi = _random_quant(rng, shape, b, g, sd, dt)
                tensors[name(canon) + ".weight"] = w
                tensors[name(canon) + ".scales"] = s
                tensors[name(canon) + ".biases"] = bi
                if (b, g) != (bits, group_size):
                    quant_block[name(canon)] = {"group_size": g, "bits": b}
            else:
                tensors[name(canon) + ".weight"] = _dense(rng, shape, sd, dt)
        elif kind == "experts":
            if fmt == "mlx":
                base = name(canon).replace(".experts.", ".switch_mlp.")
                b, g = overrides.pop(canon, (bits, group_size))
                esd = std * STABLE_OUT_SCALE if stable and canon.endswith("down_proj") else std
                if shape[-1] % g:       # mlx-lm leaves such modules unquantized
                    tensors[base + ".weight"] = _dense(rng, shape, esd, dt)
                    continue
                w, s, bi = _random_quant(rng, shape, b, g, esd, dt)
                tensors[base + ".weight"], tensors[base + ".scales"], tensors[base + ".biases"] = w, s, bi
                if (b, g) != (bits, group_size):
                    quant_block[base] = {"group_size": g, "bits": b}
            elif expert_layout == "fused":
                w = _dense(rng, shape, std, dt)
                if canon.endswith("gate_proj"):
                    pending_gate = w
                elif canon.endswith("up_proj"):
                    tensors[name(canon).replace("up_proj", "gate_up_proj")] = \
                        np.concatenate([pending_gate, w], 1)
                else:
                    tensors[name(canon)] = w
            else:
                w = _dense(rng, shape, std, dt)
                for e in range(shape[0]):
                    tensors[name(canon).replace(".experts.", f".experts.{e}.") + ".weight"] = w[e]
        elif kind == "norm":
            w = rng.normal(0.0, 0.1, size=shape).astype(np.float32)      # HF: zero-centred
            tensors[name(canon) + ".weight"] = _cast(w + 1.0 if fmt == "mlx" else w, dt)
        elif kind == "gated_norm":
            tensors[name(canon) + ".weight"] = _cast(rng.uniform(0.8, 1.2, size=shape), dt)
        elif kind == "conv":
            w = _cast(rng.normal(0, 0.3, size=shape), dt)
            tensors[name(canon) + ".weight"] = w[:, :, None] if fmt == "mlx" else w[:, None, :]
        elif kind == "vector":
            if canon.endswith("A_log"):
                tensors[name(canon)] = np.log(rng.uniform(1, 16, size=shape)).astype(np.float32)
            else:
                tensors[name(canon)] = _cast(rng.uniform(-1, 1, size=shape), dt)
    if overrides:
        raise ValueError(f"quant_overrides: no quantized module {sorted(overrides)[0]!r} in this model")
    for k, v in (extra_tensors or {}).items():
        tensors[k] = v
    if fmt == "mlx" and quant_block is not None:
        q = {"group_size": group_size, "bits": bits, "mode": "affine", **quant_block}
        raw["quantization"] = q
        raw["quantization_config"] = q
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    _write_safetensors(folder, tensors, shards, {"format": "mlx"} if fmt == "mlx" else {"format": "pt"})
    return os.fspath(folder)


def _write_safetensors(folder, tensors, shards, metadata):
    from safetensors.numpy import save_file
    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata=metadata)
        return
    parts = [names[i::shards] for i in range(shards)]
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(folder, fn), metadata=metadata)
        for k in part:
            weight_map[k] = fn
            total += tensors[k].nbytes
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
from ._devices import simulated_device  # noqa: E402,F401  (simulated Mac limits for tests)
