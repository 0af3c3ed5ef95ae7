"""Tokenizer loading, encode/decode, and the streaming detokenizer.

The streaming tests train small tokenizers here (tokenizers library, a few hundred tokens) so that
CJK characters and emoji are split across several byte-level tokens. Invariants checked:
  * "".join(pieces) + finalize() == tokenizer.decode(all ids), for text and for random id lists;
  * what was emitted is never revised: after every step it is a prefix of the final decode;
  * nothing is held back needlessly: once the bytes so far are complete UTF-8, everything is out;
  * each step is O(new text): the byte-level path never re-decodes, its pending bytes stay < 4.
Expected encode/decode results of the fixture tokenizer come from transformers (tests/fixtures/chat).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import unicodedata
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # keep BPE training to one core

import pytest  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from lily_py.tokenizer import StreamingDetokenizer, Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "chat"
TOK_DIR = FIXTURES / "tokenizer"
CASES = json.loads((FIXTURES / "cases.json").read_text(encoding="utf-8"))

# transformers' Qwen3_5Tokenizer pre-tokenizer regex (transformers/models/qwen3_5/tokenization_qwen3_5.py).
QWEN35_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"""
                r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

STREAM_TEXTS = [
    "Hello, world! Plain ASCII streams too.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "日本語のテキスト：こんにちは、元気ですか？",
    "한국어 문장입니다. 안녕하세요!",
    "emoji 😀🎉🚀 and skin tones 👍🏽👋🏿",
    "ZWJ family 👨‍👩‍👧‍👦, couple 👩‍❤️‍👨, rainbow flag 🏳️‍🌈, flags 🇫🇷🇯🇵🇺🇦",
    "combining marks: e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353 q\u0307\u0323 ᄀ\u1161\u11a8",
    "العربية עברית हिन्दी ภาษาไทย ελληνικά кириллица",
    "mixed: x² ≤ ∞ — “quotes” …\tTab\nnewline\r\nCRLF  spaces   end ",
    "<|im_start|>assistant\n<think>\n思考 🤔\n</think>\n\n答案<|im_end|>",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 astral plane 𠀀𠀁 and private use \ue000",
]

TRAIN_TEXTS = [
    "hello world, the quick brown fox jumps over the lazy dog. streaming text tokens.",
    "你好世界，今天天气很好。",
    "emoji 😀 family 👨‍👩‍👧‍👦",
]


def train_byte_level(vocab_size: int = 300) -> tokenizers.Tokenizer:
    """Qwen3.5-style byte-level BPE with a tiny vocabulary: most non-ASCII characters need several tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN_TEXTS * 4, trainer)
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.add_tokens([AddedToken("non byte ✓", special=False, normalized=False)])  # chars outside the byte alphabet
    return tok


@pytest.fixture(scope="module")
def bl() -> Tokenizer:
    return Tokenizer(train_byte_level(), special_tokens={"eos_token": "<|im_end|>"}, name="trained byte-level")


@pytest.fixture(scope="module")
def fixture_tok() -> Tokenizer:
    return Tokenizer.from_dir(TOK_DIR)


def byte_fallback_tokenizer() -> tokenizers.Tokenizer:
    """A Llama-style tokenizer (Metaspace pieces + <0xNN> byte fallback): exercises the window path."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [("▁", "h"), ("e", "l"), ("l", "o"), ("▁h", "el"), ("▁", "w"), ("▁w", "o"), ("l", "d")]
    for piece in ["▁", *"abcdehlorw!,", "你", "好", *("".join(m) for m in merges)]:
        vocab.setdefault(piece, len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                          fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def stream(tok: Tokenizer, ids, *, skip_special_tokens=False, check_prefix_against=None):
    """Feed ids one by one; returns (pieces, final piece) and checks the 'never revised' property."""
    det = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    pieces = []
    for k, tid in enumerate(ids):
        pieces.append(det.add(tid))
        if check_prefix_against is not None:
            emitted = "".join(pieces)
            assert check_prefix_against.startswith(emitted), (
                f"step {k}: emitted {emitted[-20:]!r} is not a prefix of the final text")
            assert det.text == emitted
    last = det.finalize()
    return pieces, last


def utf8_bytes_of(tok: Tokenizer, ids) -> bytes:
    """Bytes of a byte-level token sequence, computed independently of lily_py's table."""
    inv = {v: k for k, v in enumerate(_gpt2_bytes_to_unicode())}
    out = bytearray()
    for tid in ids:
        token = tok.id_to_token(tid)
        if all(c in inv for c in token):
            out.extend(inv[c] for c in token)
        else:
            out.extend(token.encode("utf-8"))
    return bytes(out)


def _gpt2_bytes_to_unicode() -> list[str]:
    # GPT-2's table written out: chars for bytes 0..255, printable Latin-1 kept, others from U+0100 on.
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = [], 0
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(0x100 + extra))
            extra += 1
    return table


# ------------------------------------------------------------------------------------------------
# Streaming: byte-level BPE (the Qwen path)


def test_trained_tokenizer_splits_characters(bl):
    # The test is only meaningful if many tokens end inside a multi-byte character.
    split = 0
    for text in STREAM_TEXTS:
        ids = bl.encode(text)
        for tid in ids:
            try:
                utf8_bytes_of(bl, [tid]).decode("utf-8")
            except UnicodeDecodeError:
                split += 1
    assert split >= 100, f"only {split} tokens split a character; use a smaller vocabulary"
    assert bl._byte_level


@pytest.mark.parametrize("text", STREAM_TEXTS, ids=range(len(STREAM_TEXTS)))
def test_stream_text_roundtrip(bl, text):
    ids = bl.encode(text)
    full = bl.decode(ids)
    assert full == unicodedata.normalize("NFC", text)  # the NFC normalizer composes e + U+0301
    pieces, last = stream(bl, ids, check_prefix_against=full)
    assert "".join(pieces) + last == full
    assert all("\ufffd" not in p for p in pieces + [last]), "a replacement char was emitted for valid text"
    # Nothing held back needlessly: whenever the bytes so far are complete UTF-8, all of it is out.
    emitted = ""
    for k, piece in enumerate(pieces):
        emitted += piece
        try:
            so_far = utf8_bytes_of(bl, ids[:k + 1]).decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert emitted == so_far, f"step {k}: held back {so_far[len(emitted):]!r}"
    assert last == ""


def test_stream_random_ids(bl):
    rng = random.Random(1234)
    special = sorted(bl.special_token_ids)
    byte_ids = [bl.token_to_id(c) for c in _gpt2_bytes_to_unicode()]
    lead = [b for b in range(256) if b >= 0xC0]
    cont = [b for b in range(0x80, 0xC0)]
    for trial in range(1500):
        n = rng.randint(0, 30)
        ids = []
        for _ in range(n):
            r = rng.random()
            if r < 0.1:
                ids.append(rng.choice(special))
            elif r < 0.35:  # UTF-8 lead / continuation bytes: incomplete and invalid sequences
                ids.append(byte_ids[rng.choice(lead if rng.random() < 0.4 else cont)])
            elif r < 0.5:
                ids.append(rng.choice(byte_ids))
            else:
                ids.append(rng.randrange(bl.vocab_size))
        for skip in (False, True):
            full = bl.decode(ids, skip_special_tokens=skip)
            pieces, last = stream(bl, ids, skip_special_tokens=skip, check_prefix_against=full)
            got = "".join(pieces) + last
            assert got == full, f"trial {trial} skip={skip} ids={ids}: {got!r} != {full!r}"


def test_stream_skip_special_tokens(bl):
    ids = bl.encode("<|im_start|>user\n你好<|im_end|><think>x</think>")
    pieces, last = stream(bl, ids, skip_special_tokens=True)
    assert "".join(pieces) + last == "user\n你好<think>x</think>"  # <think> is added but not special
    pieces, last = stream(bl, ids)
    assert "".join(pieces) + last == "<|im_start|>user\n你好<|im_end|><think>x</think>"


def test_stream_added_token_outside_byte_alphabet(bl):
    tid = bl.token_to_id("non byte ✓")
    ids = [bl.encode("a")[0], tid, *bl.encode("好")]
    pieces, last = stream(bl, ids)
    assert "".join(pieces) + last == bl.decode(ids) == "anon byte ✓好"


def test_byte_level_stream_is_constant_work_per_token(bl):
    class CountingBackend:
        """Forwards to the real tokenizer and counts decode calls."""

        def __init__(self, real):
            self.real, self.decoded_ids = real, 0

        def decode(self, ids, **kw):
            self.decoded_ids += len(ids)
            return self.real.decode(ids, **kw)

        def __getattr__(self, name):
            return getattr(self.real, name)

    counting = Tokenizer(train_byte_level())
    counting._backend = CountingBackend(counting.backend)
    ids = counting.encode("".join(STREAM_TEXTS) * 20)
    assert len(ids) > 5000
    det = counting.detokenizer()
    for tid in ids:
        det.add(tid)
        assert len(det._utf8.getstate()[0]) <= 3  # only an incomplete character is ever pending
    det.finalize()
    assert counting._backend.decoded_ids == 0
    assert det.text == counting.decode(ids)


# ------------------------------------------------------------------------------------------------
# Streaming: other decoders (window path)


def test_window_path_byte_fallback_text():
    tok = Tokenizer(byte_fallback_tokenizer())
    assert not tok._byte_level
    for text in ["hello world", "hello 你好 world!", "héllo 😀 wörld, 한국 👨‍👩‍👧", " lead space", "ab"]:
        ids = tok.encode(text)
        full = tok.decode(ids)
        assert full == text
        pieces, last = stream(tok, ids, check_prefix_against=full)
        assert "".join(pieces) + last == full
        assert all("\ufffd" not in p for p in pieces + [last])
    assert any(tok.id_to_token(i).startswith("<0x") for i in tok.encode("😀"))  # bytes were split


def test_window_path_random_ids_and_bounded_window():
    tok = Tokenizer(byte_fallback_tokenizer())
    rng = random.Random(99)
    for trial in range(800):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 20))]
        for skip in (False, True):
            full = tok.decode(ids, skip_special_tokens=skip)
            pieces, last = stream(tok, ids, skip_special_tokens=skip, check_prefix_against=full)
            assert "".join(pieces) + last == full, f"trial {trial} skip={skip} ids={ids}"
    # valid text: the decoded window stays short, so the total work is linear in the length
    ids = tok.encode("hello world 你好 " * 300)
    det = tok.detokenizer()
    longest = 0
    for tid in ids:
        det.add(tid)
        longest = max(longest, len(det.token_ids) - det._prefix)
    assert longest <= 8, longest
    det.finalize()
    assert det.text == tok.decode(ids)


def test_window_path_holds_incomplete_characters():
    # ByteLevel followed by another step is not the pure byte-level decoder, so it takes the
    # window path; characters split across tokens must be held until they are complete.
    backend = train_byte_level()
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("\u2581", " ")])
    tok = Tokenizer(backend)
    assert not tok._byte_level
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        full = tok.decode(ids)
        pieces, last = stream(tok, ids, check_prefix_against=full)
        assert "".join(pieces) + last == full
        assert all("\ufffd" not in p for p in pieces + [last])
    rng = random.Random(5)
    for trial in range(500):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 20))]
        full = tok.decode(ids)
        pieces, last = stream(tok, ids, check_prefix_against=full)
        assert "".join(pieces) + last == full, f"trial {trial} ids={ids}"


# ------------------------------------------------------------------------------------------------
# Detokenizer API


def test_detokenizer_api(bl):
    det = bl.detokenizer()
    assert isinstance(det, StreamingDetokenizer)
    ids = bl.encode("好😀")
    pieces = [det.add(t) for t in ids]
    assert det.text == "".join(pieces) and det.token_ids == ids
    det.finalize()
    assert det.finalize() == ""
    with pytest.raises(RuntimeError, match="finalize"):
        det.add(ids[0])
    det.reset()
    assert det.text == "" and det.token_ids == []
    assert "".join(det.add(t) for t in ids) + det.finalize() == "好😀"


def test_detokenizer_rejects_bad_ids(bl):
    det = bl.detokenizer()
    det.add(bl.encode("a")[0])
    with pytest.raises(ValueError, match=rf"token id {bl.vocab_size} at position 1 is not in the vocabulary"):
        det.add(bl.vocab_size)
    with pytest.raises(ValueError, match="token id -1"):
        det.add(-1)
    with pytest.raises(TypeError, match="must be an int"):
        det.add(1.0)
    with pytest.raises(ValueError, match=r"position 2"):
        bl.decode([0, 1, 10**6])


# ------------------------------------------------------------------------------------------------
# Loading and plain encode/decode against transformers


def test_fixture_tokenizer_matches_transformers(fixture_tok):
    assert fixture_tok.vocab_size == CASES["vocab_size"]
    for case in CASES["encode"]:
        assert fixture_tok.encode(case["text"]) == case["ids"], case["text"]
        assert fixture_tok.decode(case["ids"]) == case["decoded"]
    for case in CASES["decode"]:
        assert fixture_tok.decode(case["ids"]) == case["text"], case["ids"]
        assert fixture_tok.decode(case["ids"], skip_special_tokens=True) == case["text_skip_special"]
        pieces, last = stream(fixture_tok, case["ids"])
        assert "".join(pieces) + last == case["text"]


def test_from_dir_eos_and_special_tokens(fixture_tok):
    gen = json.loads((TOK_DIR / "generation_config.json").read_text())
    im_end, eot = fixture_tok.token_to_id("<|im_end|>"), fixture_tok.token_to_id("<|endoftext|>")
    assert gen["eos_token_id"] == [im_end, eot]
    assert fixture_tok.eos_token_ids == frozenset({im_end, eot})
    assert fixture_tok.token_to_id("no such token") is None
    assert fixture_tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert fixture_tok.token_to_id("<think>") not in fixture_tok.special_token_ids
    assert im_end in fixture_tok.special_token_ids


@pytest.fixture
def tok_dir(tmp_path) -> Path:
    shutil.copyfile(TOK_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path


def test_eos_token_id_int_and_config_union(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    assert tok.eos_token_ids == frozenset() and tok.chat_template is None
    eot = tok.token_to_id("<|endoftext|>")
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eot}))
    assert Tokenizer.from_dir(tok_dir).eos_token_ids == {eot}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert Tokenizer.from_dir(tok_dir).eos_token_ids == {eot, tok.token_to_id("<|im_end|>")}


def test_from_dir_errors(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        Tokenizer.from_dir(tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(empty)
    (empty / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(empty)

    (tok_dir / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*not valid JSON"):
        Tokenizer.from_dir(tok_dir)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<\|nope\|>' is not in the vocabulary"):
        Tokenizer.from_dir(tok_dir)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json \['eos_token'\]"):
        Tokenizer.from_dir(tok_dir)
    (tok_dir / "tokenizer_config.json").unlink()

    for body in ("[7]", '{"eos_token_id": "2"}', '{"eos_token_id": [1, -3]}', '{"eos_token_id": [true]}'):
        (tok_dir / "generation_config.json").write_text(body)
        with pytest.raises(ValueError, match=r"generation_config\.json"):
            Tokenizer.from_dir(tok_dir)
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**7}))
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id 10000000 is not in the vocabulary"):
        Tokenizer.from_dir(tok_dir)


def test_encode_rejects_non_text(fixture_tok):
    with pytest.raises(TypeError, match="expects a str"):
        fixture_tok.encode(b"bytes")
