"""Tokenizer, chat template and streaming detokenizer for lily_py.

``Tokenizer.from_dir(path)`` reads a checkpoint folder the way transformers does:

* ``tokenizer.json`` (required) -> a ``tokenizers.Tokenizer``; encode / decode go straight to it;
* ``tokenizer_config.json`` (optional) -> named special tokens (``eos_token``, ...) and, when there is
  no ``chat_template.jinja``, ``chat_template`` (a string, or a list of ``{"name", "template"}``);
* ``chat_template.jinja`` (optional) -> the chat template; it wins over ``tokenizer_config.json``;
* ``generation_config.json`` (optional) -> ``eos_token_id`` (an int or a list of ints).

``Tokenizer.detokenizer()`` returns a ``StreamingDetokenizer``: feed it token ids one at a time and
it returns the text that became final. For byte-level BPE tokenizers (Qwen's) it keeps the bytes of
each token and runs an incremental UTF-8 decoder, so each step costs O(bytes of the new token) and
the concatenated pieces equal ``Tokenizer.decode`` of all ids exactly. Other decoders fall back to
decoding a short window of recent tokens (TGI / mlx-lm style), which is exact for the usual
decoders but not proven for every one.

Nothing here imports ``lily_py._core``.
"""

from __future__ import annotations

import codecs
import json
import operator
import os
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

from .chat_template import SPECIAL_TOKEN_NAMES, ChatTemplateError, render_chat_template

__all__ = ["ChatTemplateError", "StreamingDetokenizer", "Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"


@lru_cache(maxsize=1)
def _byte_level_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the char each byte is written as in a byte-level vocab.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes
    are written as chr(256 + n), n counting them in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + n)] = b
            n += 1
    return table


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text: {exc}") from exc


def _token_content(value: Any, *, where: str) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a token string or {{'content': str, ...}}, got {value!r}")


def check_text(text: str, what: str = "the text") -> None:
    """ValueError saying where ``text`` is not valid Unicode: a lone surrogate, which no UTF-8
    encodes (the tokenizer would refuse it with "TextInputSequence must be str"). Python makes one
    of every byte it could not decode with ``surrogateescape`` (command-line arguments, pipes),
    U+DC80..U+DCFF for bytes 0x80..0xFF: the message names that byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        byte = f" (the byte 0x{c - 0xDC00:02x}, not valid UTF-8, as Python keeps it)" \
            if 0xDC80 <= c <= 0xDCFF else ""
        raise ValueError(f"{what} contains a lone surrogate U+{c:04X} at index {e.start}{byte}; "
                         "text must be valid Unicode") from None


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template.

    Attributes:
        vocab_size: number of ids the tokenizer knows, added tokens included (not the model's
            padded embedding size: Qwen3.6 has 248,320 rows, fewer of them are tokens).
        eos_token_ids: ids that end generation (generation_config.json ``eos_token_id`` plus
            tokenizer_config.json ``eos_token``).
        special_tokens: named special tokens from tokenizer_config.json (``{"eos_token": ...}``),
            exactly what the chat template sees as ``eos_token`` etc.
        chat_template: the template source, or None.
        name: where the tokenizer came from (used in error messages).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        name: str = "<in-memory tokenizer>",
        chat_template_origin: str | None = None,
    ) -> None:
        if not isinstance(backend, tokenizers.Tokenizer):
            raise TypeError(f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}")
        self._backend = backend
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # A dict of named templates (tokenizer_config.json may hold a list of {name, template}):
        # "default" is the template, "tool_use" is used when tools are given (as in transformers).
        templates = dict(chat_template) if isinstance(chat_template, Mapping) else {}
        if templates and "default" not in templates:
            raise ValueError(f"{name}: chat templates {sorted(templates)} include none named 'default'")
        self.chat_template: str | None = templates.get("default", chat_template if not templates else None)
        self._tool_use_template: str | None = templates.get("tool_use")
        self._chat_template_origin = chat_template_origin or f"chat template of {name}"
        self.special_tokens: dict[str, str] = {
            k: v for k, v in (special_tokens or {}).items() if v is not None
        }
        eos = set()
        for tid in eos_token_ids:
            eos.add(self._check_id(tid, where=f"eos_token_ids of {name}"))
        eos_token = self.special_tokens.get("eos_token")
        if eos_token is not None:
            tid = backend.token_to_id(eos_token)
            if tid is None:
                raise ValueError(f"{name}: eos_token {eos_token!r} is not in the vocabulary")
            eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._special_ids = frozenset(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._byte_level = _is_byte_level_decoder(backend.decoder)
        self._has_byte_fallback = _decoder_has(backend.decoder, "ByteFallback")
        self._token_bytes: dict[int, bytes] = {}  # byte-level path: id -> bytes, filled lazily

    # ------------------------------------------------------------------------------------------
    # Loading

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json."""
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"tokenizer folder {root} does not exist")
        if not root.is_dir():
            raise NotADirectoryError(f"tokenizer folder {root} is not a directory")
        tok_file = root / TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found: a lily_py checkpoint needs a {TOKENIZER_FILE}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ValueError(f"{tok_file}: cannot be loaded by the tokenizers library: {exc}") from exc

        config: Mapping[str, Any] = {}
        config_file = root / TOKENIZER_CONFIG_FILE
        if config_file.is_file():
            config = _read_json(config_file)
            if not isinstance(config, Mapping):
                raise ValueError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
        special_tokens = {}
        for key in SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(key), where=f"{config_file} [{key!r}]")
            if content is not None:
                special_tokens[key] = content
        if "eos_token" in special_tokens and backend.token_to_id(special_tokens["eos_token"]) is None:
            raise ValueError(f"{config_file}: eos_token {special_tokens['eos_token']!r} is not in the "
                             f"vocabulary of {tok_file}")

        chat_template, origin = None, None
        template_file = root / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            try:
                chat_template = template_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{template_file}: not UTF-8 text: {exc}") from exc
            origin = str(template_file)
        elif config.get("chat_template") is not None:
            chat_template = _named_templates(config["chat_template"], where=f"{config_file} ['chat_template']")
            origin = f"{config_file} ['chat_template']"

        eos_ids: list[int] = []
        gen_file = root / GENERATION_CONFIG_FILE
        if gen_file.is_file():
            gen = _read_json(gen_file)
            if not isinstance(gen, Mapping):
                raise ValueError(f"{gen_file}: expected a JSON object, got {type(gen).__name__}")
            value = gen.get("eos_token_id")
            values = value if isinstance(value, list) else [] if value is None else [value]
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"{gen_file}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
                if backend.id_to_token(v) is None:
                    raise ValueError(f"{gen_file}: eos_token_id {v} is not in the vocabulary of {tok_file} "
                                     f"({backend.get_vocab_size(with_added_tokens=True)} tokens)")
                eos_ids.append(v)

        return cls(backend, chat_template=chat_template, special_tokens=special_tokens,
                   eos_token_ids=eos_ids, name=str(root), chat_template_origin=origin)

    # ------------------------------------------------------------------------------------------
    # Text <-> ids

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        check_text(text, "the text to encode")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD). Unknown ids raise ValueError."""
        checked = [self._check_id(t, where="decode()", position=i) for i, t in enumerate(ids)]
        return self._backend.decode(checked, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, tok: str) -> int | None:
        return self._backend.token_to_id(tok)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (dropped by ``skip_special_tokens``)."""
        return self._special_ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def _check_id(self, token_id: Any, *, where: str, position: int | None = None) -> int:
        at = "" if position is None else f" at position {position}"
        try:
            tid = operator.index(token_id)
        except TypeError:
            raise TypeError(f"{where}: token id{at} must be an int, got {type(token_id).__name__}") from None
        if tid < 0 or self._backend.id_to_token(tid) is None:
            raise ValueError(f"{where}: token id {tid}{at} is not in the vocabulary of {self.name} "
                             f"({self.vocab_size} tokens)")
        return tid

    # ------------------------------------------------------------------------------------------
    # Chat

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (render only; ``encode`` it to get ids).

        ``enable_thinking=None`` leaves the variable undefined (the template's default); other
        keywords (``preserve_thinking``, ``documents``, ...) are passed to the template.
        """
        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no chat template: expected {CHAT_TEMPLATE_FILE} or a 'chat_template' "
                f"entry in {TOKENIZER_CONFIG_FILE}"
            )
        if enable_thinking is not None:
            kwargs["enable_thinking"] = bool(enable_thinking)
        documents = kwargs.pop("documents", None)
        source = self.chat_template
        if tools is not None and self._tool_use_template is not None:
            source = self._tool_use_template
        return render_chat_template(
            source, messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens,
            template_name=self._chat_template_origin, **kwargs,
        )

    # ------------------------------------------------------------------------------------------
    # Streaming

    def detokenizer(self, *, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for this tokenizer."""
        if self._byte_level:
            return _ByteLevelDetokenizer(self, skip_special_tokens)
        return _WindowDetokenizer(self, skip_special_tokens)

    def _bytes_of(self, token_id: int, skip_special_tokens: bool) -> bytes:
        """Bytes the byte-level decoder writes for one token (tokenizers' ByteLevel rule)."""
        if skip_special_tokens and token_id in self._special_ids:
            return b""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            token = self._backend.id_to_token(token_id)
            table = _byte_level_char_to_byte()
            try:
                cached = bytes(table[c] for c in token)
            except KeyError:  # a char outside the byte alphabet: the token is written as its own UTF-8
                cached = token.encode("utf-8")
            self._token_bytes[token_id] = cached
        return cached

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)})"


def _named_templates(value: Any, *, where: str) -> str | dict[str, str]:
    """tokenizer_config.json 'chat_template': a string, or a list of {"name", "template"}."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{where}: each entry must be {{'name': str, 'template': str}}, got {entry!r}")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            raise ValueError(f"{where}: templates {sorted(named)} include none named 'default'")
        return named
    raise ValueError(f"{where}: expected a string or a list of named templates, got {type(value).__name__}")


def _decoder_has(decoder: Any, kind: str) -> bool:
    """True when the decoder (or a step of a Sequence decoder) has type ``kind``."""
    if decoder is None:
        return False
    spec = json.loads(decoder.__getstate__())
    steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    return any(step.get("type") == kind for step in steps)


def _is_byte_level_decoder(decoder: Any) -> bool:
    """True when decoding is exactly tokenizers' ByteLevel decoder (alone or as a one-step Sequence)."""
    if decoder is None:
        return False
    spec = json.loads(decoder.__getstate__())
    while spec.get("type") == "Sequence" and len(spec.get("decoders", [])) == 1:
        spec = spec["decoders"][0]
    return spec.get("type") == "ByteLevel"


class StreamingDetokenizer:
    """Turns token ids, one at a time, into text pieces that never change afterwards.

    ``add(token_id)`` returns the newly final text ("" while a character is still incomplete);
    ``finalize()`` flushes the rest. ``"".join(pieces) + finalize()`` equals
    ``tokenizer.decode(all ids)``; ``text`` is everything returned so far.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self._pieces: list[str] = []
        self._text_cache = ""
        self._cached_pieces = 0
        self._finalized = False

    @property
    def text(self) -> str:
        if self._cached_pieces != len(self._pieces):
            self._text_cache = "".join(self._pieces)
            self._cached_pieces = len(self._pieces)
        return self._text_cache

    def add(self, token_id: int) -> str:
        if self._finalized:
            raise RuntimeError("StreamingDetokenizer.add() after finalize(); call reset() first")
        tid = self._tokenizer._check_id(token_id, where="StreamingDetokenizer.add()", position=len(self.token_ids))
        self.token_ids.append(tid)
        piece = self._add(tid)
        if piece:
            self._pieces.append(piece)
        return piece

    def finalize(self) -> str:
        if self._finalized:
            return ""
        self._finalized = True
        piece = self._finalize()
        if piece:
            self._pieces.append(piece)
        return piece

    def reset(self) -> None:
        """Forget all tokens and text, keeping the tokenizer."""
        self.__init__(self._tokenizer, self._skip_special)

    def _add(self, token_id: int) -> str:
        raise NotImplementedError

    def _finalize(self) -> str:
        raise NotImplementedError


class _ByteLevelDetokenizer(StreamingDetokenizer):
    """Byte-level BPE: token -> bytes -> incremental UTF-8 decoder (errors='replace').

    tokenizers decodes a byte-level sequence as ``String::from_utf8_lossy(all bytes)``; Python's
    incremental UTF-8 decoder with errors='replace' emits the same replacement characters, and only
    holds back an incomplete trailing sequence, so pieces never need revising.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        super().__init__(tokenizer, skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _add(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer._bytes_of(token_id, self._skip_special))

    def _finalize(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowDetokenizer(StreamingDetokenizer):
    """Any other decoder: decode a window from the last safe offset (as TGI and mlx-lm do).

    ``prefix`` .. ``read`` are tokens already emitted that give the window its left context;
    a new piece is emitted once the window decodes to more text that does not end in U+FFFD
    (and, for ByteFallback decoders, does not end in a <0xNN> byte token). The window is
    re-decoded at each step, so a step costs O(window), and the window stays a few tokens long
    for ordinary text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        super().__init__(tokenizer, skip_special_tokens)
        self._prefix = 0
        self._read = 0
        # ByteFallback decodes a run of <0xNN> tokens together and turns *all* of it into U+FFFD
        # when the run is not valid UTF-8, so a later byte token can change earlier text: hold the
        # window while it ends in a byte token.
        self._hold_byte_runs = tokenizer._has_byte_fallback

    def _is_byte_token(self, token_id: int) -> bool:
        token = self._tokenizer.backend.id_to_token(token_id)
        return len(token) == 6 and token.startswith("<0x") and token.endswith(">")

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.backend.decode(ids, skip_special_tokens=self._skip_special)

    def _add(self, token_id: int) -> str:
        ids = self.token_ids
        if self._hold_byte_runs and (
            self._is_byte_token(token_id)
            # a skipped special token is invisible to the decoder: it does not end a byte run
            or (self._skip_special and token_id in self._tokenizer.special_token_ids)
        ):
            return ""
        before = self._decode(ids[self._prefix:self._read])
        after = self._decode(ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            self._prefix, self._read = self._read, len(ids)
            return after[len(before):]
        return ""

    def _finalize(self) -> str:
        ids = self.token_ids
        before = self._decode(ids[self._prefix:self._read])
        after = self._decode(ids[self._prefix:])
        return after[len(before):] if after.startswith(before) else after

