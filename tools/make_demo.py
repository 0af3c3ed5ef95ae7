#!/usr/bin/env python3
"""Build lily_py's embedded demo checkpoint (src/lily_py/demo/).

A tiny model of the exact qwen3_5_moe architecture (Qwen3.6-35B-A3B's), in the MLX 4-bit format,
briefly trained on the King James Bible, with its own small byte-level BPE tokenizer. It ships
inside the package so ``lily-py generate`` works on a fresh machine with no download.

Stages (each prints what it did):
  1. corpus     KJV text from Debian's bible-kjv / bible-kjv-text packages (installed with apt-get
                when missing and allowed), 31,102 verses in 66 books; a few chapters held out.
  2. tokenizer  byte-level BPE (``tokenizers``), Qwen3.5's pre-tokenizer regex + ByteLevel, NFC,
                vocab 2039 merges/bytes + 9 Qwen special tokens = 2048.
  3. data       chapters ("Genesis 1" heading, one verse per line) and short chat samples
                ("Quote Genesis 1:3" -> the verse) rendered with the shipped Qwen chat template,
                packed into windows of --seq-len tokens.
  4. train      transformers' Qwen3_5MoeForCausalLM, torch CPU, one thread, seeded, AdamW,
                warmup + cosine over --steps (a --max-minutes guard stops earlier if the machine
                is slow; the run then says so).
  5. convert    fused Hugging Face state dict (``mlp.experts.gate_up_proj`` / ``down_proj``, the
                layout mlx-lm understands; transformers' save_pretrained writes per-expert tensors,
                MODEL_FACTS.md section 6) -> ``mlx_lm.convert`` (4-bit, group 64, bf16; router and
                shared_expert_gate 8-bit through mlx-lm's own quant_predicate).
  6. check      mlx-lm loads the result, computes in fp32, prints samples; its greedy
                continuation of fixed prompts goes to expected_greedy.json, cross-checked against
                transformers running the dequantized weights.

Needs torch, transformers, mlx[cpu] and mlx-lm (the ``fixtures`` extra), never at test time.
Run from the repository root:

    OMP_NUM_THREADS=1 python3 tools/make_demo.py

See docs/demo.md for the output of the run that produced the shipped files.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
# Qwen3.5/3.6's pre-tokenizer split (tokenizer.json of the real checkpoint; transformers'
# Qwen2Tokenizer rebuilds it without the \p{M}: the two agree on ASCII text such as this corpus).
QWEN35_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                      r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (content, special) in id order after the BPE vocabulary, as in Qwen's tokenizer.json, where
# <|endoftext|> / <|im_start|> / <|im_end|> are special and the tag tokens are not.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
BPE_VOCAB = TEXT_CONFIG["vocab_size"] - len(ADDED_TOKENS)   # 2039 (256 bytes + merges)

# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------
# The 66 books in canonical order; the `bible` program prints its own abbreviations in this order.
BOOKS = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah",
    "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah", "Malachi",
    "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians", "2 Corinthians",
    "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians", "2 Thessalonians",
    "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter", "2 Peter",
    "1 John", "2 John", "3 John", "Jude", "Revelation",
]
KJV_VERSES = 31102
HELD_OUT_EVERY = 59          # chapter index % 59 == 29 -> held out (never trained on)

CHAT_PROMPTS = ["Quote {ref}.", "Quote {ref}", "What does {ref} say?", "Recite {ref}.",
                "Read me {ref}.", "Give me the text of {ref}."]

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


# ============================================================================================
# 1. corpus
# ============================================================================================
def locate_bible(allow_install: bool) -> str:
    """Path of Debian's `bible` program with its KJV data; apt-get installs it if allowed."""
    def found() -> str | None:
        exe = shutil.which("bible")
        return exe if exe and os.path.exists("/usr/lib/bible.data") else None

    exe = found()
    if exe:
        return exe
    how = "apt-get install -y bible-kjv bible-kjv-text"
    if not allow_install:
        fail(f"the KJV corpus is missing: no `bible` program or /usr/lib/bible.data. Install it with "
             f"`{how}` (Debian/Ubuntu) or drop --no-install.")
    if not shutil.which("apt-get"):
        fail(f"the KJV corpus is missing and there is no apt-get here to install it. This script "
             f"reads the King James Bible from Debian's packages bible-kjv and bible-kjv-text; "
             f"run it on Debian/Ubuntu (`{how}`).")
    if os.geteuid() != 0:
        fail(f"the KJV corpus is missing; installing it needs root: run `sudo {how}` first.")
    log(f"[corpus] installing Debian packages: {how}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "install", "-y", "-q", "bible-kjv", "bible-kjv-text"],
                ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "bible-kjv", "bible-kjv-text"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if cmd[1] == "install" and r.returncode == 0 and found():
            return found()
        if cmd[1] == "update" and r.returncode != 0:
            fail(f"`apt-get update` failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    fail(f"`{how}` failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")


def read_kjv(exe: str) -> list[dict]:
    """All verses in order: dicts with book (full name), chapter, verse, text."""
    r = subprocess.run([exe, "-f", "Gen1:1-Rev22:21"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"`{exe} -f Gen1:1-Rev22:21` failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    verses, abbrevs = [], []
    for n, line in enumerate(r.stdout.splitlines(), 1):
        if not line.strip():
            continue
        ref, _, text = line.partition(" ")
        # ref looks like "Ge1:1", "1Sm3:4", "SSol2:1"
        head, _, vnum = ref.rpartition(":")
        i = len(head)
        while i > 0 and head[i - 1].isdigit():
            i -= 1
        abbrev, chap = head[:i], head[i:]
        if not (abbrev and chap.isdigit() and vnum.isdigit() and text.strip()):
            fail(f"unexpected line {n} from `bible`: {line[:80]!r}")
        if not abbrevs or abbrevs[-1] != abbrev:
            abbrevs.append(abbrev)
            if len(abbrevs) > len(BOOKS):
                fail(f"`bible` printed more than {len(BOOKS)} books (line {n}: {ref})")
        verses.append({"book": BOOKS[len(abbrevs) - 1], "chapter": int(chap), "verse": int(vnum),
                       "text": " ".join(text.split())})
    if len(abbrevs) != len(BOOKS) or len(verses) != KJV_VERSES:
        fail(f"expected {len(BOOKS)} books and {KJV_VERSES} verses from `bible`, found "
             f"{len(abbrevs)} books and {len(verses)} verses")
    return verses


def chapters_of(verses: list[dict]) -> list[dict]:
    out: list[dict] = []
    for v in verses:
        if not out or (out[-1]["book"], out[-1]["chapter"]) != (v["book"], v["chapter"]):
            out.append({"book": v["book"], "chapter": v["chapter"], "verses": []})
        out[-1]["verses"].append(v)
    return out


def chapter_text(ch: dict) -> str:
    return f"{ch['book']} {ch['chapter']}\n" + "\n".join(v["text"] for v in ch["verses"]) + "\n"


# ============================================================================================
# 2. tokenizer
# ============================================================================================
def train_tokenizer(texts: list[str]):
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors, trainers)
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != BPE_VOCAB:
        fail(f"BPE training produced {tok.get_vocab_size()} tokens, expected {BPE_VOCAB}")
    for content, special in ADDED_TOKENS:
        t = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False,
                       single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([t])
    ids = {c: tok.token_to_id(c) for c, _ in ADDED_TOKENS}
    want = {c: BPE_VOCAB + i for i, (c, _) in enumerate(ADDED_TOKENS)}
    if ids != want or tok.get_vocab_size() != TEXT_CONFIG["vocab_size"]:
        fail(f"added-token ids {ids} / vocab {tok.get_vocab_size()}: expected {want} / "
             f"{TEXT_CONFIG['vocab_size']}")
    return tok


def write_tokenizer_files(tok, folder: str) -> None:
    tok.save(os.path.join(folder, "tokenizer.json"))
    decoder = {}
    for content, special in ADDED_TOKENS:
        decoder[str(tok.token_to_id(content))] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": TEXT_CONFIG["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    gen = {"bos_token_id": eot, "do_sample": True, "eos_token_id": [im_end, eot],
           "pad_token_id": eot, "temperature": 0.7, "top_k": 20, "top_p": 0.95}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    shutil.copyfile(TEMPLATE, os.path.join(folder, "chat_template.jinja"))


def render_chat(messages: list[dict], add_generation_prompt: bool, **kw) -> str:
    """Render with transformers' own chat-template machinery (the reference implementation)."""
    from transformers.utils.chat_template_utils import render_jinja_template
    with open(TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    out, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                   add_generation_prompt=add_generation_prompt, **kw)
    return out[0]


# ============================================================================================
# 3. data
# ============================================================================================
def build_data(tok, chapters, chat_samples: int, seq_len: int, rng: random.Random):
    eot = tok.token_to_id("<|endoftext|>")
    train_ch = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY != HELD_OUT_EVERY // 2]
    held_ch = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2]
    docs = [chapter_text(c) for c in train_ch]
    train_verses = [v for c in train_ch for v in c["verses"]]
    chats = []
    for _ in range(chat_samples):
        v = rng.choice(train_verses)
        ref = f"{v['book']} {v['chapter']}:{v['verse']}"
        q = rng.choice(CHAT_PROMPTS).format(ref=ref)
        chats.append(render_chat([{"role": "user", "content": q},
                                  {"role": "assistant", "content": v["text"]}], False))
    docs += chats
    rng.shuffle(docs)

    def pack(texts):
        stream = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            stream.extend(enc.ids)
            stream.append(eot)
        n = len(stream) // seq_len
        return stream, [stream[i * seq_len:(i + 1) * seq_len] for i in range(n)]

    train_stream, train_windows = pack(docs)
    held_stream, held_windows = pack([chapter_text(c) for c in held_ch])
    return {"train_windows": train_windows, "held_windows": held_windows,
            "train_tokens": len(train_stream), "held_tokens": len(held_stream),
            "train_chapters": len(train_ch), "held_chapters": [f"{c['book']} {c['chapter']}"
                                                               for c in held_ch],
            "chat_example": chats[0] if chats else None, "chat_samples": len(chats)}


# ============================================================================================
# 4. train
# ============================================================================================
def make_torch_model(seed: int, experts_impl: str | None):
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in TEXT_CONFIG.items() if k != "model_type"})
    if list(cfg.layer_types) != TEXT_CONFIG["layer_types"]:
        fail(f"transformers derived layer_types {cfg.layer_types}, expected {TEXT_CONFIG['layer_types']}")
    if experts_impl:
        cfg._experts_implementation = experts_impl
    torch.manual_seed(seed)
    return Qwen3_5MoeForCausalLM(cfg)


def evaluate(model, windows, batch: int) -> float:
    import torch
    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.tensor(windows[i:i + batch])
            out = model(input_ids=x, labels=x)
            k = x.shape[0] * (x.shape[1] - 1)
            tot += float(out.loss) * k
            n += k
    model.train()
    return tot / n


def train(model, data, args) -> dict:
    import torch
    torch.set_num_threads(1)
    rng = random.Random(args.seed + 1)
    windows = data["train_windows"]
    order: list[int] = []
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, min(args.warmup, args.steps // 5))

    def lr_at(step: int) -> float:   # step counts from 1
        if step <= warmup:
            return args.lr * step / warmup
        p = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    eval_train = windows[:: max(1, len(windows) // args.eval_windows)][: args.eval_windows]
    eval_held = data["held_windows"][: args.eval_windows]
    model.config.output_router_logits = True     # adds router_aux_loss_coef * load-balancing loss
    t0 = time.time()
    curve, window_loss, window_n, stopped_early = [], 0.0, 0, False
    log(f"[train] {args.steps} steps x {args.batch} x {args.seq_len} tokens, lr {args.lr} "
        f"(warmup {warmup}, cosine to 10%), AdamW wd {args.weight_decay}, clip {args.clip}, "
        f"seed {args.seed}, guard {args.max_minutes} min, torch threads {torch.get_num_threads()}")
    log(f"[train] {'step':>5} {'lr':>8} {'loss':>7} {'held-out':>8} {'tok/s':>6} {'min':>5}")
    step = 0
    for step in range(1, args.steps + 1):
        if len(order) < args.batch:
            perm = list(range(len(windows)))
            rng.shuffle(perm)
            order.extend(perm)
        idx, order = order[: args.batch], order[args.batch:]
        x = torch.tensor([windows[i] for i in idx])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm_loss = out.loss.item() - TEXT_CONFIG["router_aux_loss_coef"] * out.aux_loss.item()
        window_loss += lm_loss
        window_n += 1
        elapsed = time.time() - t0
        last = step == args.steps or elapsed > args.max_minutes * 60
        if step % args.log_every == 0 or step == 1 or last:
            held = ""
            entry = {"step": step, "lr": lr_at(step), "train_loss": window_loss / window_n,
                     "minutes": elapsed / 60}
            if step % (args.log_every * 5) == 0 or last:
                model.config.output_router_logits = False
                entry["held_out_loss"] = evaluate(model, eval_held, args.batch)
                model.config.output_router_logits = True
                held = f"{entry['held_out_loss']:8.4f}"
            curve.append(entry)
            tps = step * args.batch * args.seq_len / max(elapsed, 1e-9)
            log(f"[train] {step:5d} {entry['lr']:8.2e} {entry['train_loss']:7.4f} {held:>8} "
                f"{tps:6.0f} {elapsed / 60:5.1f}")
            window_loss, window_n = 0.0, 0
        if elapsed > args.max_minutes * 60 and step < args.steps:
            stopped_early = True
            log(f"[train] time guard: stopped after {step} of {args.steps} steps "
                f"({elapsed / 60:.1f} min > --max-minutes {args.max_minutes}); the result is not "
                f"the reproducible {args.steps}-step model")
            break
    model.config.output_router_logits = False
    minutes = (time.time() - t0) / 60
    final_train = evaluate(model, eval_train, args.batch)
    final_held = evaluate(model, eval_held, args.batch)
    log(f"[train] done: {step} steps in {minutes:.1f} min; loss on {len(eval_train)} training "
        f"windows {final_train:.4f} nats/token (perplexity {math.exp(final_train):.1f}), on "
        f"{len(eval_held)} held-out windows {final_held:.4f} (perplexity {math.exp(final_held):.1f})")
    return {"steps": step, "planned_steps": args.steps, "stopped_early": stopped_early,
            "minutes": round(minutes, 2), "final_train_loss": round(final_train, 4),
            "final_held_out_loss": round(final_held, 4), "eval_windows": len(eval_train),
            "curve": curve, "tokens_seen": step * args.batch * args.seq_len}


def expert_usage(model, windows) -> list[list[int]]:
    """Per layer: how many of the tokens' top-k slots each expert received."""
    import torch
    counts = []
    hooks = []

    def hook(_m, _inp, out):
        _, _, idx = out
        counts.append(torch.bincount(idx.flatten(), minlength=TEXT_CONFIG["num_experts"]).tolist())

    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=torch.tensor(windows))
    for h in hooks:
        h.remove()
    return counts


# ============================================================================================
# 5. convert
# ============================================================================================
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


# ============================================================================================
# 6. check
# ============================================================================================
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


# ============================================================================================
# README of the shipped folder
# ============================================================================================
def folder_listing(folder: str) -> list[tuple[str, int]]:
    return sorted((f, os.path.getsize(os.path.join(folder, f))) for f in os.listdir(folder))


def write_readme(folder: str, info: dict) -> None:
    tc = TEXT_CONFIG
    tr = info["train"]
    files = folder_listing(folder)
    total = sum(s for _, s in files)
    curve_rows = "\n".join(
        f"| {e['step']} | {e['lr']:.2e} | {e['train_loss']:.3f} | "
        f"{e['held_out_loss']:.3f} |" for e in tr["curve"] if "held_out_loss" in e)
    usage = "\n".join(f"| {i} | {' '.join(str(c) for c in row)} |"
                      for i, row in enumerate(info["expert_usage"]))
    text = f"""# lily_py demo checkpoint

A tiny model with the exact architecture of Qwen3.6-35B-A3B (`model_type` `qwen3_5_moe`, text
config nested under `text_config`), in the MLX 4-bit format that `mlx_lm.convert` writes, trained
for {tr['minutes']:.0f} minutes on one x86-64 CPU core on the King James Bible. It ships inside
lily_py so that `lily-py generate` works with no download. It writes KJV-flavoured English and
answers a chat request such as "Quote John 3:16." with some KJV-like sentence, not the verse asked
for; it knows nothing else. It exists to exercise every code path of the engine on real
(trained, non-random) weights, not to be useful.

Generated by `tools/make_demo.py` (see `docs/demo.md` for the exact command and its output).
Do not edit these files by hand; regenerate them.

## Corpus and license
- Text: the King James Version (1611), read from Debian's `bible-kjv-text` package (data) with
  its `bible` program (`bible-kjv`): {KJV_VERSES} verses, 66 books, 1189 chapters. The KJV text is
  in the public domain (in the United Kingdom the Crown's letters patent still apply). The
  Debian package's data file carries this legend, reproduced as it asks: "Bible Retrieval
  System, Chip Chapin, Hewlett Packard Company ... This file is provided for unrestricted use
  provided that this legend is included on all tape media and as a part of the software program
  in whole or part. Users may copy, modify or distribute this file at will."
- Training documents: every chapter as `"<Book> <chapter>\\n"` followed by its verses, one per
  line, each document ending in `<|endoftext|>`; plus {info['data']['chat_samples']} chat samples rendered
  with the shipped chat template (user: one of "Quote Genesis 1:3." / "What does ... say?" /
  ...; assistant: the verse, with an empty think block), e.g.
  `{info['data']['chat_example']!r}`.
- {len(info['data']['held_chapters'])} chapters are held out (never trained on) to measure a held-out
  loss: {', '.join(info['data']['held_chapters'])}.
- Tokens: {info['data']['train_tokens']:,} for training, {info['data']['held_tokens']:,} held out.

## Tokenizer
Byte-level BPE trained with the `tokenizers` library on the verses: {BPE_VOCAB} tokens (256 bytes
+ merges), then 9 added tokens as in Qwen's tokenizer, ids {BPE_VOCAB}..{tc['vocab_size'] - 1}:
{', '.join(f'`{c}` {BPE_VOCAB + i}' for i, (c, _) in enumerate(ADDED_TOKENS))}
(the first three special, the tags not). Normalizer NFC; pre-tokenizer = Qwen3.5's split regex
(isolated) then ByteLevel (no prefix space, no regex); ByteLevel decoder and post-processor.
`tokenizer_config.json`: `Qwen2Tokenizer`, eos `<|im_end|>`, pad `<|endoftext|>`, no bos,
`add_bos_token` false. `generation_config.json`: eos ids [`<|im_end|>`, `<|endoftext|>`].
`chat_template.jinja` is a copy of `src/lily_py/templates/qwen3_5_chat_template.jinja`.

## Architecture (config.json `text_config`)
| | demo | Qwen3.6-35B-A3B |
|---|---|---|
| layers | {tc['num_hidden_layers']}: {', '.join('DeltaNet' if t == 'linear_attention' else 'attention' for t in tc['layer_types'])} (`full_attention_interval` 4) | 40, same 3:1 pattern |
| hidden / vocab | {tc['hidden_size']} / {tc['vocab_size']} | 2048 / 248320 |
| gated attention | {tc['num_attention_heads']} q heads, {tc['num_key_value_heads']} kv heads, head_dim {tc['head_dim']}, output gate, q/k norm | 16, 2, 256 |
| RoPE | partial 0.25 (rotary dim {int(tc['head_dim'] * 0.25)}), theta 1e7 | partial 0.25 (64), theta 1e7 |
| Gated DeltaNet | {tc['linear_num_key_heads']} key heads, {tc['linear_num_value_heads']} value heads, dims {tc['linear_key_head_dim']}/{tc['linear_value_head_dim']}, conv kernel 4 | 16, 32, 128/128, 4 |
| MoE | {tc['num_experts']} experts, top-{tc['num_experts_per_tok']}, intermediate {tc['moe_intermediate_size']}, shared expert {tc['shared_expert_intermediate_size']} (sigmoid gate) | 256, top-8, 512, 512 |
| lm_head | untied | untied |
| parameters | {info['params']:,} | 34.66 B (text) |

Quantization (`mlx_lm.convert`, mlx-lm {info['mlx_lm_version']}): affine, 4 bits, group 64, bf16
scales/biases, for every linear layer, the embedding and lm_head; router (`mlp.gate`) and
`mlp.shared_expert_gate` 8 bits (mlx-lm's `quant_predicate` for this model); norms, `conv1d`,
`dt_bias` bf16, `A_log` float32; zero-centred norms stored folded (`1 + w`), as mlx-lm writes them.

## Training
transformers {info['transformers_version']} `Qwen3_5MoeForCausalLM`, torch {info['torch_version']} on
CPU with one thread, seed {info['args']['seed']}. AdamW (betas 0.9/0.95, weight decay
{info['args']['weight_decay']} on matrices), peak lr {info['args']['lr']}, linear warmup then cosine to
10%, gradient clip {info['args']['clip']}, batches of {info['args']['batch']} windows of {info['args']['seq_len']}
tokens, load-balancing loss coefficient {tc['router_aux_loss_coef']}. {tr['steps']} steps
({tr['tokens_seen']:,} tokens, {tr['tokens_seen'] / info['data']['train_tokens']:.2f} epochs) in
{tr['minutes']:.1f} minutes{' (STOPPED EARLY by the time guard)' if tr['stopped_early'] else ''}.

Final loss (unquantized model, nats/token): **{tr['final_train_loss']:.3f}** on
{tr['eval_windows']} training windows (perplexity {math.exp(tr['final_train_loss']):.1f}),
**{tr['final_held_out_loss']:.3f}** on {tr['eval_windows']} held-out windows (perplexity
{math.exp(tr['final_held_out_loss']):.1f}).

| step | lr | train loss (mean of the last steps) | held-out loss |
|---|---|---|---|
{curve_rows}

Expert load after training (top-{tc['num_experts_per_tok']} slots per expert over
{info['usage_tokens']:,} training tokens), per layer:

| layer | experts 0..{tc['num_experts'] - 1} |
|---|---|
{usage}

## Files ({total:,} bytes without this README)
{chr(10).join(f'- `{f}` {s:,} bytes' for f, s in files if f != 'README.md')}
- `README.md` this file

`expected_greedy.json`: mlx-lm's greedy continuation ({GREEDY_TOKENS} tokens, fp32 compute) of
`{GREEDY_TEXT_PROMPT!r}` and of a one-turn chat (`{GREEDY_CHAT_MESSAGES[0]['content']}`,
thinking off), with prompt ids and the prompt's last-position logits; the generator checked that
transformers on the dequantized weights gives the same greedy ids.
"""
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(text)


# ============================================================================================
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "src", "lily_py", "demo"),
                    help="output folder (replaced; default: src/lily_py/demo)")
    ap.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    ap.add_argument("--max-minutes", type=float, default=15.0,
                    help="stop training after this many minutes even if --steps are not done")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-samples", type=int, default=800)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--experts-impl", default="grouped_mm",
                    help="transformers experts implementation for training (eager|grouped_mm)")
    ap.add_argument("--no-install", action="store_true",
                    help="never run apt-get; fail if the KJV packages are missing")
    ap.add_argument("--keep-work", default=None, help="keep intermediate folders here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq_len < 8:
        fail("--steps, --batch must be >= 1 and --seq-len >= 8")
    if not os.path.exists(TEMPLATE):
        fail(f"{TEMPLATE} is missing (the chat template the demo ships)")
    try:
        import mlx_lm  # noqa: F401
        import torch
        import transformers
    except ImportError as e:
        fail(f"{e.name} is not installed: this script needs the 'fixtures' extra "
             "(torch, transformers, mlx[cpu], mlx-lm; see pyproject.toml)")
    torch.set_num_threads(1)
    random.seed(args.seed)
    t_start = time.time()

    # 1. corpus
    exe = locate_bible(not args.no_install)
    verses = read_kjv(exe)
    chapters = chapters_of(verses)
    log(f"[corpus] {exe}: {len(verses)} verses, {len(chapters)} chapters, "
        f"{len({v['book'] for v in verses})} books")

    # 2. tokenizer (trained on the verses and the chat-sample questions' vocabulary)
    t = time.time()
    tok_texts = [chapter_text(c) for c in chapters] + [p.format(ref="Song of Solomon 2:1")
                                                       for p in CHAT_PROMPTS]
    tok = train_tokenizer(tok_texts)
    sample = verses[2]["text"]
    log(f"[tokenizer] byte-level BPE, vocab {tok.get_vocab_size()} ({BPE_VOCAB} + "
        f"{len(ADDED_TOKENS)} added) in {time.time() - t:.1f}s; {sample!r} -> "
        f"{tok.encode(sample).tokens}")

    # 3. data
    rng = random.Random(args.seed)
    data = build_data(tok, chapters, args.chat_samples, args.seq_len, rng)
    log(f"[data] {data['train_chapters']} training chapters + {data['chat_samples']} chat samples "
        f"= {data['train_tokens']:,} tokens ({len(data['train_windows'])} windows of "
        f"{args.seq_len}); held out: {len(data['held_chapters'])} chapters, "
        f"{data['held_tokens']:,} tokens")
    log(f"[data] chat sample: {data['chat_example']!r}")

    # 4. train
    model = make_torch_model(args.seed, args.experts_impl)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[model] Qwen3_5MoeForCausalLM, {n_params:,} parameters, layer types "
        f"{model.config.layer_types}")
    train_info = train(model, data, args)
    usage_windows = data["train_windows"][:16]
    usage = expert_usage(model, usage_windows)
    for i, row in enumerate(usage):
        log(f"[model] layer {i} expert load (top-k slots over {16 * args.seq_len} tokens): {row}")

    # 5. convert
    work = args.keep_work or tempfile.mkdtemp(prefix="lily_demo_")
    hf_dir, mlx_dir = os.path.join(work, "hf"), os.path.join(work, "mlx")
    for d in (hf_dir, mlx_dir):
        if os.path.exists(d):
            shutil.rmtree(d)
    model.config._experts_implementation = "eager"
    write_hf_folder(model, tok, hf_dir)
    del model
    log(f"[convert] HF folder (fused experts, fp32) written to {hf_dir}; running mlx_lm.convert")
    convert(hf_dir, mlx_dir)
    # mlx-lm re-saved the tokenizer through transformers and wrote a generic model card: ship
    # the original tokenizer files and our own README instead.
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "chat_template.jinja"):
        shutil.copyfile(os.path.join(hf_dir, f), os.path.join(mlx_dir, f))
    for f in os.listdir(mlx_dir):
        if f not in {"config.json", "model.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                     "chat_template.jinja"}:
            os.remove(os.path.join(mlx_dir, f))
    for f, s in folder_listing(mlx_dir):
        log(f"[convert] {f}: {s:,} bytes")

    # 6. check + record
    record = check_and_record(mlx_dir, tok)
    write_expected(os.path.join(mlx_dir, "expected_greedy.json"), record)

    info = {"train": train_info, "data": data, "params": n_params, "args": vars(args),
            "expert_usage": usage, "usage_tokens": len(usage_windows) * args.seq_len,
            "mlx_lm_version": record["mlx_lm_version"],
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__.split("+")[0]}
    write_readme(mlx_dir, info)

    # install into --out (only the files this script makes)
    out = os.path.abspath(args.out)
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(mlx_dir, out)
    if not args.keep_work:
        shutil.rmtree(work)
    total = sum(s for _, s in folder_listing(out))
    log(f"[done] {out}: {len(os.listdir(out))} files, {total:,} bytes, "
        f"{(time.time() - t_start) / 60:.1f} min in all")
    if total >= 8 * 1024 * 1024:
        fail(f"the demo folder is {total:,} bytes, over the 8 MiB budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
