"""Stages 1-3 of the demo build: the King James Bible from Debian's packages (the corpus), a
byte-level BPE tokenizer trained on it, and the training / held-out windows (chapters and short
chat samples rendered with the shipped chat template)."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess

from .common import ADDED_TOKENS, BPE_VOCAB, TEMPLATE, TEXT_CONFIG, fail, log

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

# Qwen3.5/3.6's pre-tokenizer split (tokenizer.json of the real checkpoint; transformers'
# Qwen2Tokenizer rebuilds it without the \p{M}: the two agree on ASCII text such as this corpus).
QWEN35_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                      r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# 1. corpus
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


# 2. tokenizer
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


# 3. data
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
