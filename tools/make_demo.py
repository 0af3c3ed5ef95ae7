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

This file runs the stages in order; each lives in tools/demo_model/ (``common``: the model's
config, tokens and fixed prompts; ``data``: stages 1-3; ``train``: 4; ``export``: 5; ``check``: 6;
``readme``: the shipped folder's README).

Needs torch, transformers, mlx[cpu] and mlx-lm (the ``fixtures`` extra), never at test time.
Run from the repository root:

    OMP_NUM_THREADS=1 python3 tools/make_demo.py

See docs/demo.md for the output of the run that produced the shipped files.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

from demo_model.check import check_and_record, write_expected
from demo_model.common import ADDED_TOKENS, BPE_VOCAB, REPO, TEMPLATE, fail, log
from demo_model.data import (CHAT_PROMPTS, build_data, chapter_text, chapters_of, locate_bible,
                             read_kjv, train_tokenizer)
from demo_model.export import convert, write_hf_folder
from demo_model.readme import folder_listing, write_readme
from demo_model.train import expert_usage, make_torch_model, train


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
