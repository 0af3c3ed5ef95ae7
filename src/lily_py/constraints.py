"""Constrained decoding: OpenAI ``response_format`` (and regex, Lark, choices) compiled by
llguidance into a token matcher; the sampler takes its allowed set (docs/structured.md).

llguidance is an optional dependency (the ``structured`` extra): ``pip install ".[structured]"``.
"""
from __future__ import annotations

import json
import re

import numpy as np


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError('response_format needs llguidance: pip install ".[structured]" (from a '
                          'clone of lily_py)') from None
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


# ---- forced tool calls ------------------------------------------------------------------------

def _function(tool) -> dict:
    """The function object of an OpenAI tool ({"type": "function", "function": {...}}) or of a
    bare function dict ({"name": ..., "parameters": ...})."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"a tool must be {{'type': 'function', 'function': {{'name': ..., "
                         f"'parameters': {{...}}}}}}, got {tool!r}")
    return fn


def tool_choice_name(tool_choice) -> str | None:
    """The function a named ``tool_choice`` forces ({"type": "function", "function": {"name":
    N}}), or None for the strings "auto", "none", "required". Raises ValueError otherwise."""
    if tool_choice in ("auto", "none", "required"):
        return None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type", "function") == "function" and isinstance(fn, dict) \
                and isinstance(fn.get("name"), str) and fn["name"]:
            return fn["name"]
    raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', "
                     f"'function': {{'name': ...}}}}, got {tool_choice!r}")


def _lark_str(s: str) -> str:
    return json.dumps(s)            # a JSON string literal is a Lark string literal


def _is_text(schema) -> bool:
    """A parameter whose value the tool-call parser keeps as raw text: a string, or an enum /
    const of strings only."""
    if not isinstance(schema, dict):
        return True                 # no schema: the parser keeps the text
    vals = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(vals, list) and vals:
        return all(isinstance(v, str) for v in vals)
    t = schema.get("type")
    return t == "string" or (t is None and not any(k in schema for k in ("anyOf", "oneOf", "allOf",
                                                                          "properties", "items")))


def _text_value(schema) -> str:
    """The Lark expression of a raw-text parameter value: the enum's strings, text without "<" of
    ``minLength``..``maxLength`` characters when bounded, else TEXT (any text up to the first
    closing tag, which TEXT includes)."""
    if isinstance(schema, dict):
        vals = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if isinstance(vals, list) and vals:
            return "(" + " | ".join(_lark_str(v) for v in vals) + ")"
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if isinstance(hi, int) or (isinstance(lo, int) and lo > 0):
            # bounded: no "<" (so no closing tag inside), as a counted repetition
            rep = f"{{{int(lo)},{'' if hi is None else int(hi)}}}"
            return f"/[^<]{rep}/"
    return "text"


def _json_value(schema) -> str:
    s = dict(schema)
    s.setdefault("x-guidance", {"whitespace_flexible": False})
    return "%json " + json.dumps(s)


def tool_call_grammar(tools, tool_choice, tokenizer=None, *, parallel: bool = True) -> str:
    """The Lark grammar (llguidance) of Qwen3.6 tool calls that ``tool_choice`` forces:
    "required" = one or more calls of any of ``tools`` (exactly one with ``parallel=False``), a
    named function = exactly one call of it.
    Each call is the chat template's XML form::

        <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>

    with the parameters in the schema's ``properties`` order, the ``required`` ones always there;
    a string parameter's VALUE is raw text (its enum's strings when it has one, no
    "</parameter>"), any other VALUE is JSON matching its schema (what the parser converts).
    ``<tool_call>``/``</tool_call>`` are the tokenizer's own tokens when it has them."""
    name = tool_choice_name(tool_choice)
    if name is None and tool_choice != "required":
        raise ValueError(f"tool_choice={tool_choice!r} forces no tool call")
    fns = [_function(t) for t in tools or ()]
    if not fns:
        raise ValueError(f"tool_choice={tool_choice!r} needs a non-empty tools list")
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")

    def tag(t: str) -> str:
        tid = tokenizer.token_to_id(t) if tokenizer is not None else None
        return t if tid is not None else _lark_str(t)

    rules, alts = [], []
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValueError(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object")
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        parts = []
        for j, (arg, schema) in enumerate(props.items()):
            value = _text_value(schema) if _is_text(schema) else _json_value(schema)
            close = "" if value == "text" else f" {_lark_str(chr(10) + '</parameter>' + chr(10))}"
            rules.append(f"p{i}_{j}: {_lark_str(f'<parameter={arg}>' + chr(10))} {value}{close}")
            parts.append(f"p{i}_{j}" + ("" if arg in required else "?"))
        head = _lark_str(f"\n<function={fn['name']}>\n")
        rules.append(f"f{i}: {tag('<tool_call>')} {head} {' '.join(parts)} "
                     f"{_lark_str('</function>' + chr(10))} {tag('</tool_call>')}")
        alts.append(f"f{i}")
    nl = _lark_str("\n")
    calls = "call" if name is not None or not parallel else f"call ({nl} call)*"
    # free text: a lazy token that ends at the first closing tag (as the parser reads it)
    text = r"text[lazy]: /(?s:.*)\n<\/parameter>\n/"
    return "\n".join([f"start: {nl}? {nl}? {calls}", "call: " + " | ".join(alts)] + rules + [text])


class Constraint:
    """A matcher over the generated tokens: ``allowed()`` the packed bitset of the next token's
    allowed set (uint32 [ceil(valid / 32)]), ``consume(token)`` advances it. Built from a
    ``response_format`` or, with ``lark=``, from a Lark grammar (a forced tool call)."""

    def __init__(self, response_format, tokenizer, eos: int, valid_vocab: int, *,
                 lark: str | None = None, what: str = "response_format"):
        ll = _llguidance()
        try:
            g = ll.LLMatcher.grammar_from_lark(lark) if lark is not None else grammar(response_format)
            self.matcher = ll.LLMatcher(_ll_tokenizer(tokenizer, eos), g)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{what}: {e}") from None
        if self.matcher.is_error():
            raise ValueError(f"{what}: {self.matcher.get_error()}")
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
    def dead_end(self) -> bool:
        """No continuation is allowed and the text so far is not accepted: llguidance stops with
        an error and offers only EOS (which would end the answer outside the constraint)."""
        m = self.matcher
        return m.is_error() or (m.is_stopped() and not m.is_accepting())

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""
