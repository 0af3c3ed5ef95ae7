"""Streaming parser of a chat model's output: reasoning, answer text and tool calls.

Qwen3.6 (qwen3_5_moe) writes, after the chat template's generation prompt:

* reasoning, when the prompt ends inside ``<think>\\n`` (thinking on, the template's default):
  ``REASONING\\n</think>\\n\\nANSWER``. With ``enable_thinking=False`` the template itself writes the
  empty block ``<think>\\n\\n</think>\\n\\n`` and the model starts with the answer;
* tool calls in the XML-like format its chat template teaches (the Qwen3-Coder format)::

      <tool_call>
      <function=NAME>
      <parameter=ARG>
      VALUE
      </parameter>
      </function>
      </tool_call>

  after optional answer text; several calls follow one another, separated by a newline.

``OutputParser.push(text)`` takes the streamed text in pieces of any size (a tag may be split
across tokens: text that could still become a tag is held back, never shown half) and returns a
``ParsedDelta`` with the new answer text, the new reasoning, and the tool calls (or malformed
calls, ``ToolCallError``) completed by this piece. ``finish()`` flushes what is held back at the
end of the generation. The whitespace the template puts around the tags (newlines after
``<think>`` / before and after ``</think>``, before ``<tool_call>`` and between calls) is dropped,
as the template drops it when it renders a past assistant turn.

Parameter values are converted to JSON with the JSON-schema type of the tool's parameter when the
tools are known (integer, number, boolean, null, object, array); strings stay strings, and a value
without a schema, or one that does not convert, stays a string.
"""
from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

__all__ = ["ToolCall", "ToolCallError", "ParsedDelta", "OutputParser", "parse_tool_call",
           "prompt_opens_reasoning"]


@dataclass
class ToolCall:
    """One parsed tool call: ``arguments`` is a JSON object (text), as in the OpenAI API."""
    id: str
    name: str
    arguments: str
    index: int = 0

    @property
    def arguments_dict(self) -> dict:
        return json.loads(self.arguments)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallError:
    """A ``<tool_call>`` block that could not be parsed: its raw text and what is wrong."""
    raw: str
    message: str
    index: int = 0


@dataclass
class ParsedDelta:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)

    def __iadd__(self, other: "ParsedDelta") -> "ParsedDelta":
        self.text += other.text
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        self.errors += other.errors
        return self


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the model's output starts inside a reasoning block: the rendered prompt ends with
    an unclosed ``<think>`` (Qwen3.6's generation prompt with thinking on)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---- tool-call blocks --------------------------------------------------------------------------

_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)


def _tool_schemas(tools: Sequence[Mapping] | None) -> dict[str, dict]:
    """function name -> its parameters' ``properties`` (JSON schemas)."""
    out: dict[str, dict] = {}
    for t in tools or ():
        if not isinstance(t, Mapping):
            continue
        fn = t.get("function", t) if t.get("type", "function") == "function" else t
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    t = schema.get("type")
    types = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] \
        if isinstance(t, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types += [x for x in _schema_types(sub) if x not in types]
    return types


_MISSING = object()


def _as_type(value: str, t: str):
    v = value.strip()
    if t == "string":
        return value
    if t == "null":
        return None if v == "null" else _MISSING
    if t == "boolean":
        return {"true": True, "false": False}.get(v.lower(), _MISSING)
    if t in ("integer", "number"):
        if re.fullmatch(r"[-+]?\d+", v):
            return int(v)
        try:
            f = float(v)
        except ValueError:
            return _MISSING
        if not math.isfinite(f):
            return _MISSING
        if t == "integer":
            return int(f) if f.is_integer() else _MISSING
        return f
    if t in ("object", "array"):
        try:
            parsed = json.loads(v)
        except ValueError:
            return _MISSING
        return parsed if isinstance(parsed, dict if t == "object" else list) else _MISSING
    return _MISSING


def convert_value(value: str, schema: Any):
    """A parameter's text converted by its JSON schema; unchanged (a string) when there is no
    schema type or the text does not convert."""
    types = _schema_types(schema)
    # Other types first: with ["string", "null"], "null" means None.
    for t in sorted(types, key=lambda t: t == "string"):
        got = _as_type(value, t)
        if got is not _MISSING:
            return got
    return value


def parse_tool_call(raw: str, schemas: Mapping[str, Mapping] | None = None, *, index: int = 0,
                    complete: bool = True) -> ToolCall | ToolCallError:
    """Parse one block ``<tool_call>...</tool_call>`` (``complete=False``: the generation ended
    before ``</tool_call>``; accepted when the ``</function>`` is there)."""
    body = raw[len(TOOL_OPEN):] if raw.startswith(TOOL_OPEN) else raw
    if complete:
        if not body.endswith(TOOL_CLOSE):
            return ToolCallError(raw, "missing </tool_call>", index)
        body = body[:-len(TOOL_CLOSE)]
    stripped = body.strip()
    if stripped.startswith("{"):
        # The JSON form ({"name": ..., "arguments": {...}}) some Qwen models fall back on.
        try:
            obj = json.loads(stripped)
        except ValueError as e:
            return ToolCallError(raw, f"tool call is neither <function=...> nor valid JSON: {e}",
                                 index)
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                not isinstance(args, dict):
            return ToolCallError(raw, "JSON tool call needs a string 'name' and an object "
                                 "'arguments'", index)
        return ToolCall(_new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False), index)
    m = _FUNCTION.fullmatch(body)
    if m is None:
        if "<function=" not in body:
            why = "no <function=NAME> inside <tool_call>"
        elif "</function>" not in body:
            why = "missing </function>" if complete else \
                "the generation ended inside the tool call (no </function>)"
        else:
            why = "unexpected text around <function=...>...</function>"
        return ToolCallError(raw, why, index)
    name, inner = m.group(1).strip(), m.group(2)
    if not name:
        return ToolCallError(raw, "empty function name", index)
    props = (schemas or {}).get(name, {})
    args: dict[str, Any] = {}
    for p in _PARAM.finditer(inner):
        key = p.group(1).strip()
        if not key:
            return ToolCallError(raw, "empty parameter name", index)
        value = p.group(2)
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        args[key] = convert_value(value, props.get(key))
    leftover = _PARAM.sub("", inner)
    if leftover.strip():
        return ToolCallError(raw, f"unexpected text in <function={name}>: "
                             f"{leftover.strip()[:80]!r}", index)
    return ToolCall(_new_call_id(), name, json.dumps(args, ensure_ascii=False), index)


# ---- the streaming parser ---------------------------------------------------------------------

class OutputParser:
    """Split streamed model text into answer text, reasoning and tool calls (see module doc).

    ``reasoning``: the output starts inside a ``<think>`` block. ``tools``: the tool list given to
    the chat template (for parameter types). ``parse_tools=False`` leaves ``<tool_call>`` in the
    text."""

    def __init__(self, *, reasoning: bool = False, tools: Sequence[Mapping] | None = None,
                 parse_tools: bool = True):
        self.mode = "reasoning" if reasoning else "content"
        self.schemas = _tool_schemas(tools)
        self.parse_tools = parse_tools
        self.buf = ""
        self.at_start = True        # at the start of a section: leading newlines are dropped
        self.calls = 0              # tool calls seen (parsed or not), for indices
        self.n_tool_calls = 0       # parsed ones
        self.section = ""           # where the last pushed piece belongs (see push)

    def push(self, piece: str) -> ParsedDelta:
        """Parse the next piece of output. Afterwards ``section`` says where the piece belongs:
        "reasoning" (inside ``<think>``, its closing tag included), "tool_call" (a
        ``<tool_call>`` block, its opening tag included), "whitespace" (newlines dropped at the
        start of the answer) or "content" (the answer; also text held back that may still be
        dropped, such as the newlines before a ``<tool_call>``)."""
        before = self.mode
        self.buf += piece
        out = ParsedDelta()
        while self.buf:
            if self.mode == "reasoning":
                if not self._reasoning(out):
                    break
            elif self.mode == "tool":
                if not self._tool(out):
                    break
            elif not self._content(out):
                break
        if before == "reasoning" or (before == "content" and self.mode == "reasoning"):
            self.section = "reasoning"
        elif before == "tool" or self.mode == "tool":
            self.section = "tool_call"
        elif not out.text and self.at_start and not self.buf:
            self.section = "whitespace"
        else:
            self.section = "content"
        return out

    def finish(self) -> ParsedDelta:
        """End of the generation: release what was held back."""
        out = ParsedDelta()
        buf, self.buf = self.buf, ""
        if self.mode == "reasoning":
            out.reasoning += buf.lstrip("\n") if self.at_start else buf
        elif self.mode == "tool":
            r = parse_tool_call(buf, self.schemas, index=self.calls, complete=False)
            self._add(r, out)
        elif buf:
            out.text += buf.lstrip() if self.at_start else buf
        return out

    # Each step consumes what it can; returns False when it must wait for more text.
    def _reasoning(self, out: ParsedDelta) -> bool:
        if self.at_start:
            self.buf = self.buf.lstrip("\n")
            if not self.buf:
                return False
            if self.buf.startswith(THINK_OPEN):        # an explicit opening tag: skip it
                self.buf = self.buf[len(THINK_OPEN):]
                return True
            if THINK_OPEN.startswith(self.buf):
                return False
        i = self.buf.find(THINK_CLOSE)
        if i >= 0:
            part = self.buf[:i].rstrip("\n")
            out.reasoning += part.lstrip("\n") if self.at_start else part
            self.buf = self.buf[i + len(THINK_CLOSE):]
            self.mode, self.at_start = "content", True
            return True
        hold = _partial_suffix(self.buf, THINK_CLOSE)
        keep = len(self.buf) - hold
        keep = len(self.buf[:keep].rstrip("\n"))      # trailing newlines may precede </think>
        if keep:
            out.reasoning += self.buf[:keep]
            self.buf = self.buf[keep:]
            self.at_start = False
        return False

    def _content(self, out: ParsedDelta) -> bool:
        if self.at_start:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            if self.buf.startswith(THINK_OPEN):        # the model opened a reasoning block
                self.buf = self.buf[len(THINK_OPEN):]
                self.mode = "reasoning"
                return True
            if THINK_OPEN.startswith(self.buf):
                return False
        i = self.buf.find(TOOL_OPEN) if self.parse_tools else -1
        if i >= 0:
            out.text += self.buf[:i].rstrip()
            self.buf = self.buf[i:]
            self.mode = "tool"
            return True
        hold = _partial_suffix(self.buf, TOOL_OPEN) if self.parse_tools else 0
        keep = len(self.buf) - hold
        if self.parse_tools:
            keep = len(self.buf[:keep].rstrip())          # whitespace before a <tool_call> goes
        if keep:
            out.text += self.buf[:keep]
            self.buf = self.buf[keep:]
            self.at_start = False
        return False

    def _tool(self, out: ParsedDelta) -> bool:
        i = self.buf.find(TOOL_CLOSE)
        if i < 0:
            return False
        raw, self.buf = self.buf[:i + len(TOOL_CLOSE)], self.buf[i + len(TOOL_CLOSE):]
        self._add(parse_tool_call(raw, self.schemas, index=self.calls), out)
        self.mode, self.at_start = "content", True
        return True

    def _add(self, r: ToolCall | ToolCallError, out: ParsedDelta) -> None:
        self.calls += 1
        if isinstance(r, ToolCall):
            self.n_tool_calls += 1
            out.tool_calls.append(r)
        else:
            out.errors.append(r)
