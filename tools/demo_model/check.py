"""Stage 6 of the demo build: mlx-lm loads the converted checkpoint and computes in float32;
its greedy continuation of fixed prompts (and the prompts' last logits) is the record in
expected_greedy.json, cross-checked against transformers running the dequantized weights."""
from __future__ import annotations

import json
import os

from .common import (GREEDY_CHAT_MESSAGES, GREEDY_TEXT_PROMPT, GREEDY_TOKENS, NUM_LAYERS,
                     SAMPLE_TEXT_PROMPTS, fail, log)
from .data import render_chat
from .train import make_torch_model


def mlx_load_fp32(folder: str):
    import mlx.core as mx
    from mlx_lm import load
    model, tokenizer = load(folder)
    # bf16 -> fp32 is exact: the weights and scales are the checkpoint's, the math becomes fp32.
    model.set_dtype(mx.float32)
    return model, tokenizer


def mlx_greedy(model, prompt_ids: list[int], n: int):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    ids = []
    for tok_id, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n):
        ids.append(int(tok_id))
    logits = model(mx.array([prompt_ids]))[0, -1].astype(mx.float32)
    mx.eval(logits)
    return ids, [float(x) for x in logits.tolist()]


def torch_from_mlx(folder: str):
    """transformers' model (fp32) holding the dequantized weights of the MLX checkpoint."""
    import mlx.core as mx
    import numpy as np
    import torch
    with open(os.path.join(folder, "config.json")) as f:
        cfg_q = json.load(f)["quantization"]
    raw = mx.load(os.path.join(folder, "model.safetensors"))
    weights = {}
    for k, v in raw.items():
        if k.endswith(".scales") or k.endswith(".biases"):
            continue
        base = k[: -len(".weight")] if k.endswith(".weight") else k
        if base + ".scales" in raw:
            spec = cfg_q.get(base, cfg_q)
            w = mx.dequantize(v, raw[base + ".scales"].astype(mx.float32),
                              raw[base + ".biases"].astype(mx.float32),
                              group_size=spec["group_size"], bits=spec["bits"])
        else:
            w = v.astype(mx.float32)
        weights[k] = torch.from_numpy(np.array(w, copy=True))
    sd = {}
    for k, w in weights.items():
        name = k.replace("language_model.model.", "model.").replace("language_model.lm_head",
                                                                    "lm_head")
        if name.endswith("conv1d.weight"):            # mlx [C, K, 1] -> HF [C, 1, K]
            w = w.permute(0, 2, 1).contiguous()
        if any(name.endswith(s) for s in (".input_layernorm.weight", ".post_attention_layernorm.weight",
                                           "model.norm.weight", ".q_norm.weight", ".k_norm.weight")):
            w = w - 1.0                                # mlx stores 1 + w (zero-centred in HF)
        sd[name] = w
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}.mlp."
        g, u = sd.pop(p + "switch_mlp.gate_proj.weight"), sd.pop(p + "switch_mlp.up_proj.weight")
        sd[p + "experts.gate_up_proj"] = torch.cat([g, u], dim=1)
        sd[p + "experts.down_proj"] = sd.pop(p + "switch_mlp.down_proj.weight")
    model = make_torch_model(0, None).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        fail(f"dequantized MLX weights do not fit transformers' model: missing {missing}, "
             f"unexpected {unexpected}")
    return model


def torch_greedy(model, prompt_ids: list[int], n: int):
    import torch
    ids = list(prompt_ids)
    first_logits = None
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            if first_logits is None:
                first_logits = logits.numpy().tolist()
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):], first_logits


def check_and_record(folder: str, tok) -> dict:
    import mlx.core as mx
    import numpy as np
    import mlx_lm
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_load_fp32(folder)
    im_end = tok.token_to_id("<|im_end|>")

    cases = {}
    chat_prompt = render_chat(GREEDY_CHAT_MESSAGES, True, enable_thinking=False)
    for name, prompt in (("text", GREEDY_TEXT_PROMPT), ("chat", chat_prompt)):
        ids = tok.encode(prompt, add_special_tokens=False).ids
        hf_ids = tokenizer.encode(prompt, add_special_tokens=False)
        if list(hf_ids) != ids:
            fail(f"{name} prompt: mlx-lm's tokenizer (transformers) encodes {hf_ids}, the "
                 f"tokenizers library {ids}")
        greedy, logits = mlx_greedy(model, ids, GREEDY_TOKENS)
        cases[name] = {"prompt": prompt, "prompt_ids": ids, "greedy_ids": greedy,
                       "greedy_text": tok.decode(greedy, skip_special_tokens=False),
                       "prompt_last_logits": logits}
        log(f"[check] mlx-lm greedy ({name}): {prompt!r} -> "
            f"{cases[name]['greedy_text']!r}")

    # An independent second oracle: transformers on the dequantized weights, full recompute.
    tmodel = torch_from_mlx(folder)
    for name, case in cases.items():
        t_ids, t_logits = torch_greedy(tmodel, case["prompt_ids"], GREEDY_TOKENS)
        a, b = np.array(case["prompt_last_logits"]), np.array(t_logits)
        rel = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        agree = next((i for i, (x, y) in enumerate(zip(t_ids, case["greedy_ids"])) if x != y), None)
        log(f"[check] transformers fp32 on dequantized weights ({name}): last-position logits "
            f"max|diff|/max|ref| = {rel:.2e}; greedy ids "
            + ("identical" if agree is None else f"differ from index {agree}"))
        if rel > 1e-3 or agree is not None:
            fail(f"mlx-lm and transformers disagree on the {name} case (logits rel {rel:.2e}, "
                 f"first differing greedy index {agree})")
        case["transformers_check"] = {"logits_max_rel_diff": float(f"{rel:.3g}"),
                                      "greedy_ids_identical": True}

    # Samples for the eye (seeded).
    log("[check] mlx-lm samples (temperature 0.7, top-p 0.95, seed 0):")
    mx.random.seed(0)
    sampler = make_sampler(temp=0.7, top_p=0.95)
    for p in SAMPLE_TEXT_PROMPTS:
        out = generate(model, tokenizer, p, max_tokens=60, sampler=sampler)
        log(f"  {p!r} -> {out!r}")
    for q in ("Quote John 3:16.", "What does Psalms 23:1 say?"):
        prompt = render_chat([{"role": "user", "content": q}], True, enable_thinking=False)
        out = generate(model, tokenizer, prompt, max_tokens=60, sampler=sampler)
        log(f"  chat {q!r} -> {out!r}")
    record = {
        "about": ("mlx-lm's greedy continuation of fixed prompts with this demo checkpoint, "
                  "computed in float32 (the checkpoint's bf16 weights, scales and biases cast to "
                  "fp32 after loading; 4-bit values unchanged). prompt_last_logits: the logits "
                  "at the prompt's last position (full prefill, no cache). Cross-checked against "
                  "transformers running the dequantized weights (transformers_check)."),
        "generator": "tools/make_demo.py",
        "mlx_lm_version": mlx_lm.__version__,
        "mlx_version": mx.__version__,
        "compute_dtype": "float32",
        "eos_token_ids": [im_end, tok.token_to_id("<|endoftext|>")],
        "num_greedy_tokens": GREEDY_TOKENS,
        **{k: v for k, v in cases["text"].items()},
        "chat": {"messages": GREEDY_CHAT_MESSAGES, "enable_thinking": False, **cases["chat"]},
    }
    return record


def write_expected(path: str, record: dict) -> None:
    """JSON with one key per line, but each logits vector on one line in float32's shortest
    round-trip form (parse as float64, cast to float32: the exact values mlx-lm computed)."""
    import numpy as np
    marks = {}

    def compact(obj):
        if isinstance(obj, dict):
            return {k: (mark(v, True) if k == "prompt_last_logits" else compact(v))
                    for k, v in obj.items()}
        if isinstance(obj, list) and obj and all(type(v) is int for v in obj):
            return mark(obj, False)
        return obj

    def mark(values, as_float32):
        key = f"@@list{len(marks)}@@"
        marks[key] = "[" + ", ".join(str(np.float32(v)) if as_float32 else str(v)
                                     for v in values) + "]"
        return key

    text = json.dumps(compact(record), indent=1)
    for key, arr in marks.items():
        text = text.replace(f'"{key}"', arr)
    back = json.loads(text)
    for case in (back, back["chat"]):
        got = np.array(case["prompt_last_logits"], dtype=np.float32)
        want = np.array([c for c in (record if case is back else record["chat"])["prompt_last_logits"]],
                        dtype=np.float32)
        if not np.array_equal(got, want):
            fail("expected_greedy.json: logits did not round-trip through JSON exactly")
    with open(path, "w") as f:
        f.write(text + "\n")
