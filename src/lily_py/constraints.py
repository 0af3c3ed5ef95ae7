"""Constrained decoding: OpenAI ``response_format`` (and regex, Lark, choices) compiled by
llguidance into a token matcher; the sampler takes its allowed set (docs/structured.md).

llguidance is an optional dependency (the ``structured`` extra): ``pip install 'lily-py[structured]'``.
"""
from __future__ import annotations

import json
import re

import numpy as np


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("response_format needs llguidance: pip install 'lily-py[structured]'") from None
    return llguidance


_TOKENIZERS: dict[int, object] = {}
# Compact JSON (no whitespace between tokens): a model that does not know JSON
# cannot fill max_tokens with newlines; a schema's own "x-guidance" options override this.
_JSON_DEFAULTS = {"whitespace_flexible": False}


def _ll_tokenizer(tokenizer, eos: int):
    """The llguidance tokenizer of our ``tokenizers`` tokenizer (its tokenizer.json), cached."""
    key = id(tokenizer)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _llguidance().LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                                     eos_token=eos)
    return _TOKENIZERS[key]


def grammar(response_format) -> str:
    """The llguidance grammar of a response format:
    ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` (OpenAI's; a bare schema under
    "json_schema" also works), ``{"type": "json_object"}``, ``{"type": "regex", "regex": ...}``,
    ``{"type": "grammar", "grammar": <Lark>}`` or ``{"type": "choice", "choices": [str, ...]}``.
    Raises ValueError for anything else."""
    ll = _llguidance().LLMatcher
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError(f"response_format must be a dict with a 'type', got {response_format!r}")
    kind = response_format["type"]
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError("response_format json_schema needs a 'json_schema' object")
        schema = js.get("schema", js) if "schema" in js else js
        return ll.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_DEFAULTS)
    if kind == "json_object":
        return ll.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=_JSON_DEFAULTS)
    if kind == "regex":
        return ll.grammar_from_regex(str(response_format["regex"]))
    if kind == "grammar":
        return ll.grammar_from_lark(str(response_format["grammar"]))
    if kind == "choice":
        choices = response_format.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("response_format choice needs a non-empty list of strings 'choices'")
        return ll.grammar_from_regex("|".join(re.escape(c) for c in choices))
    raise ValueError(f"response_format type must be json_schema, json_object, regex, grammar or choice, "
                     f"got {kind!r}")


class Constraint:
    """A matcher over the generated tokens: ``allowed()`` the packed bitset of the next token's
    allowed set (uint32 [ceil(valid / 32)]), ``consume(token)`` advances it."""

    def __init__(self, response_format, tokenizer, eos: int, valid_vocab: int):
        ll = _llguidance()
        try:
            self.matcher = ll.LLMatcher(_ll_tokenizer(tokenizer, eos), grammar(response_format))
        except (ValueError, TypeError) as e:
            raise ValueError(f"response_format: {e}") from None
        if self.matcher.is_error():
            raise ValueError(f"response_format: {self.matcher.get_error()}")
        self.words = -(-int(valid_vocab) // 32)
        self.valid_vocab = int(valid_vocab)

    def allowed(self) -> np.ndarray:
        w = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)[:self.words].copy()
        if self.valid_vocab % 32:
            w[-1] &= np.uint32((1 << (self.valid_vocab % 32)) - 1)
        return w

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"constraint: token {token} is not allowed ({self.matcher.get_error()})")

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""
