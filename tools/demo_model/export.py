"""Stage 5 of the demo build: the trained model as the fused Hugging Face layout of the real
checkpoint (``mlp.experts.gate_up_proj`` / ``down_proj``), converted by ``mlx_lm.convert`` to MLX
4-bit (group 64, bf16; router and shared_expert_gate 8-bit by mlx-lm's quant_predicate)."""
from __future__ import annotations

import json
import os

from .common import NUM_LAYERS, TEXT_CONFIG, fail
from .data import write_tokenizer_files


def hf_state_dict(model) -> dict:
    """The fused Hugging Face layout of the real checkpoint: model.language_model.* + lm_head."""
    out = {}
    for k, v in model.state_dict().items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        elif not k.startswith("lm_head."):
            fail(f"unexpected parameter {k}")
        out[k] = v.detach().to("cpu").float().contiguous()
    for i in range(NUM_LAYERS):
        p = f"model.language_model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" not in out or p + "down_proj" not in out:
            fail(f"layer {i}: fused experts {p}gate_up_proj/down_proj missing from the state dict")
    return out


def write_hf_folder(model, tok, folder: str) -> None:
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    save_file(hf_state_dict(model), os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    text = dict(TEXT_CONFIG, bos_token_id=eot, eos_token_id=eot, pad_token_id=None)
    config = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe",
              "text_config": text, "tie_word_embeddings": False}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    write_tokenizer_files(tok, folder)


def convert(hf_folder: str, mlx_folder: str) -> None:
    from mlx_lm import convert as mlx_convert
    mlx_convert(hf_folder, mlx_folder, quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16")
