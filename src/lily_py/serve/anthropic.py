"""Anthropic's Messages API wire format: requests converted to the chat path's ``GenRequest``,
``GenerationChunk``s turned into content blocks and stream events, errors (no HTTP here).

A ``/v1/messages`` request becomes the same ``GenRequest`` an OpenAI chat request becomes, so one
generation path serves both (chat template, reasoning and tool-call parser, forced tool calls,
prompt cache):

* ``system`` (a string or text blocks) -> a ``system`` message;
* user ``text`` blocks -> a ``user`` message; each ``tool_result`` block -> a ``tool`` message
  (Qwen3.6's template renders it as ``<tool_response>``);
* assistant ``text`` -> ``content``, ``thinking`` -> ``reasoning_content``, ``tool_use`` ->
  ``tool_calls`` (arguments: the block's ``input``);
* ``tools`` (``name``, ``description``, ``input_schema``) -> function tools; ``tool_choice``
  auto / any / tool / none -> "auto" / "required" / a named function / "none", and
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls=False``;
* ``thinking`` enabled or adaptive -> ``enable_thinking=True``; disabled or absent -> False.

Every field is checked; a bad one is a 400 whose message starts with its path, as Anthropic
writes it (``messages.1.content.0.type: ...``). ``Blocks`` is the one place that maps a chunk to
content blocks; ``error_body`` the one place that writes Anthropic's error object.
"""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from pathlib import Path

from .protocol import APIError, GenRequest, _type_name

# Anthropic's error types by HTTP status. A full queue or a stopping server (503 on the OpenAI
# routes) is Anthropic's 529 overloaded_error, which its clients retry.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


def error_body(e: APIError) -> tuple[int, dict]:
    """An ``APIError`` as Anthropic answers it: (HTTP status, ``{"type": "error", "error":
    {"type", "message"}}``)."""
    status = 529 if e.status == 503 else e.status
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = e.message
    if e.code == "context_length_exceeded":
        message = f"prompt is too long: {message}"     # the words Anthropic's clients look for
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def bad(path: str, problem: str) -> APIError:
    return APIError(400, f"{path}: {problem}" if path else problem, param=path or None,
                    code="invalid_request")


# ---- field checks -------------------------------------------------------------------------------
def _fields(obj: dict, known: set[str], where: str) -> None:
    """Anthropic rejects fields it does not know; a None value is taken as absent (clients that
    echo response blocks may carry optional fields set to null)."""
    for k in sorted(obj):
        if k not in known and obj[k] is not None:
            raise bad(f"{where}.{k}" if where else k, "unknown field (lily-py serve accepts: "
                      f"{', '.join(sorted(known))})")


def _obj(v, path: str) -> dict:
    if not isinstance(v, dict):
        raise bad(path, f"must be an object, got {_type_name(v)}")
    return v


def _field(obj: dict, name: str, where: str, required: bool):
    """obj[name] (None when absent: "field required" if it must be there) and its path in the
    request, for the messages."""
    path = f"{where}.{name}" if where else name
    v = obj.get(name)
    if v is None and required:
        raise bad(path, "field required")
    return v, path


def _str(obj: dict, name: str, where: str, *, required: bool = True) -> str | None:
    v, path = _field(obj, name, where, required)
    if v is not None and not isinstance(v, str):
        raise bad(path, f"must be a string, got {_type_name(v)}")
    return v


def _bool(obj: dict, name: str, where: str = "", default: bool = False) -> bool:
    v, path = _field(obj, name, where, False)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(path, f"must be a boolean, got {_type_name(v)}")
    return v


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False):
    v, path = _field(body, name, "", False)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(path, f"must be a number, got {_type_name(v)} {json.dumps(v)}")
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise bad(path, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _integer(obj: dict, name: str, lo: int, where: str = "", *, required: bool = False):
    v, path = _field(obj, name, where, required)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(path, f"must be an integer, got {_type_name(v)} {json.dumps(v)}")
    if v < lo:
        raise bad(path, f"must be an integer >= {lo}, got {v}")
    return v


# ---- content blocks -----------------------------------------------------------------------------
_TEXT = {"type", "text", "cache_control", "citations"}
_BLOCK_FIELDS = {
    "text": _TEXT,
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
_NOT_TEXT = {"image", "document", "search_result", "container_upload"}


def _blocks(content, where: str) -> list[dict]:
    """A message's content as a list of checked blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content", "must be a string or an array of content blocks, got "
                  f"{_type_name(content)}" if content is not None else "field required")
    if not content:
        raise bad(f"{where}.content", "must not be empty")
    out = []
    for j, b in enumerate(content):
        w = f"{where}.content.{j}"
        b = _obj(b, w)
        kind = b.get("type")
        if kind in _NOT_TEXT:
            raise bad(f"{w}.type", f"'{kind}' blocks are not supported (lily-py serve runs a "
                      "text-only model)")
        if kind not in _BLOCK_FIELDS:
            raise bad(f"{w}.type", f"unknown content block type {kind!r} (lily-py serve "
                      f"accepts: {', '.join(_BLOCK_FIELDS)})")
        _fields(b, _BLOCK_FIELDS[kind], w)
        if kind == "text":
            _str(b, "text", w)
        elif kind == "thinking":
            _str(b, "thinking", w)
            _str(b, "signature", w, required=False)
        elif kind == "tool_use":
            _str(b, "id", w)
            _str(b, "name", w)
            if not isinstance(b.get("input"), dict):
                raise bad(f"{w}.input", f"must be an object, got {_type_name(b.get('input'))}")
        elif kind == "tool_result":
            _str(b, "tool_use_id", w)
            _bool(b, "is_error", w)
        out.append(b)
    return out


def _tool_result_text(b: dict, where: str) -> str:
    c = b.get("content")
    if c is None or isinstance(c, str):
        return c or ""
    if not isinstance(c, list):
        raise bad(f"{where}.content", f"must be a string or an array of text blocks, got "
                  f"{_type_name(c)}")
    parts = []
    for k, p in enumerate(c):
        w = f"{where}.content.{k}"
        p = _obj(p, w)
        if p.get("type") != "text":
            raise bad(f"{w}.type", f"only text blocks are supported in a tool_result, got "
                      f"{p.get('type')!r}")
        _fields(p, _TEXT, w)
        parts.append(_str(p, "text", w))
    return "\n\n".join(parts)


def _messages(msgs) -> list[dict]:
    """Anthropic messages -> the chat template's messages (system not included)."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "field required" if msgs is None else
                  "must be a non-empty array of messages")
    out: list[dict] = []
    for i, m in enumerate(msgs):
        w = f"messages.{i}"
        m = _obj(m, w)
        _fields(m, {"role", "content"}, w)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{w}.role", f"must be 'user' or 'assistant', got {json.dumps(role)}")
        blocks = _blocks(m.get("content"), w)
        if role == "assistant":
            if i == len(msgs) - 1:
                raise bad(w, "the last message is an assistant message (a prefill); lily-py "
                          "serve does not continue a partial assistant turn: end with a user "
                          "message")
            text = [b["text"] for b in blocks if b["type"] == "text"]
            thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": b["input"]}}
                     for b in blocks if b["type"] == "tool_use"]
            for j, b in enumerate(blocks):
                if b["type"] == "tool_result":
                    raise bad(f"{w}.content.{j}.type", "tool_result blocks belong in a user "
                              "message")
            msg: dict = {"role": "assistant", "content": "\n\n".join(text)}
            if thinking:
                msg["reasoning_content"] = "\n\n".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        text: list[str] = []
        for j, b in enumerate(blocks):
            if b["type"] == "text":
                text.append(b["text"])
            elif b["type"] == "tool_result":
                if text:
                    out.append({"role": "user", "content": "\n\n".join(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": _tool_result_text(b, f"{w}.content.{j}")})
            else:
                raise bad(f"{w}.content.{j}.type", f"{b['type']} blocks belong in an assistant "
                          "message")
        if text:
            out.append({"role": "user", "content": "\n\n".join(text)})
    return out


def _system(body: dict) -> str | None:
    s = body.get("system")
    if s is None or isinstance(s, str):
        return s or None
    if not isinstance(s, list):
        raise bad("system", f"must be a string or an array of text blocks, got {_type_name(s)}")
    parts = []
    for j, b in enumerate(s):
        w = f"system.{j}"
        b = _obj(b, w)
        if b.get("type") != "text":
            raise bad(f"{w}.type", f"only text blocks are supported, got {b.get('type')!r}")
        _fields(b, _TEXT, w)
        parts.append(_str(b, "text", w))
    return "\n\n".join(parts) or None


# ---- tools --------------------------------------------------------------------------------------
_TOOL = {"type", "name", "description", "input_schema", "cache_control", "strict",
         "defer_loading", "input_examples", "eager_input_streaming"}


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", f"must be an array of tools, got {_type_name(tools)}")
    out = []
    for i, t in enumerate(tools):
        w = f"tools.{i}"
        t = _obj(t, w)
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise bad(f"{w}.type", f"{kind!r}: Anthropic's server and client tools are not "
                      "supported; lily-py serve runs custom tools (name, description, "
                      "input_schema)")
        _fields(t, _TOOL, w)
        name = _str(t, "name", w)
        if not name:
            raise bad(f"{w}.name", "must not be empty")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(f"{w}.input_schema", "field required (a JSON schema object)"
                      if schema is None else f"must be a JSON schema object, got "
                      f"{_type_name(schema)}")
        fn = {"name": name, "parameters": schema}
        if _str(t, "description", w, required=False):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: dict, tools: list | None):
    """-> (OpenAI-style tool_choice, parallel_tool_calls)."""
    tc = body.get("tool_choice")
    if tc is None:
        return "auto", True
    tc = _obj(tc, "tool_choice")
    kind = tc.get("type")
    _fields(tc, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    parallel = not _bool(tc, "disable_parallel_tool_use", "tool_choice")
    if kind == "auto":
        return "auto", parallel
    if kind == "none":
        return "none", parallel
    if kind not in ("any", "tool"):
        raise bad("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got "
                  f"{json.dumps(kind)}")
    if not tools:
        raise bad("tool_choice", f"type {kind!r} needs 'tools'")
    if kind == "any":
        return "required", parallel
    name = _str(tc, "name", "tool_choice")
    if name not in [t["function"]["name"] for t in tools]:
        raise bad("tool_choice.name", f"{name!r} is not one of the tools")
    return {"type": "function", "function": {"name": name}}, parallel


def _thinking(body: dict) -> bool:
    th = body.get("thinking")
    if th is None:
        return False
    th = _obj(th, "thinking")
    kind = th.get("type")
    if kind == "enabled":
        _fields(th, {"type", "budget_tokens", "display"}, "thinking")
        _integer(th, "budget_tokens", 1, "thinking", required=True)
        return True
    if kind == "adaptive":
        _fields(th, {"type", "display"}, "thinking")
        return True
    if kind == "disabled":
        _fields(th, {"type"}, "thinking")
        return False
    raise bad("thinking.type", f"must be 'enabled', 'adaptive' or 'disabled', got "
              f"{json.dumps(kind)}")


# ---- requests -----------------------------------------------------------------------------------
# Accepted and ignored: metadata, service_tier, cache_control (the prompt cache is automatic).
_COUNT = {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"}
_CREATE = _COUNT | {"max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k",
                    "metadata", "service_tier", "min_p", "seed"}
# Sampling when neither the request nor generation_config.json says: Anthropic's defaults.
ANTHROPIC_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


@dataclass
class MessagesRequest(GenRequest):
    thinking: bool = False          # the prompt opens reasoning: the answer starts with thinking


def _chat(body, known: set[str]) -> tuple[list[dict], list | None, object, bool, bool]:
    if not isinstance(body, dict):
        raise bad("", f"the request body must be a JSON object, got {_type_name(body)}")
    _fields(body, known, "")
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise bad("model", "field required" if m is None else f"must be a non-empty string, "
                  f"got {_type_name(m)}")
    messages = _messages(body.get("messages"))
    system = _system(body)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    tools = _tools(body)
    tool_choice, parallel = _tool_choice(body, tools)
    thinking = _thinking(body)
    return messages, tools, tool_choice, parallel, thinking


def parse_messages(body, defaults: dict | None = None) -> MessagesRequest:
    """Validate a ``POST /v1/messages`` body. ``defaults``: sampling values for the fields the
    request leaves out (the model's generation_config.json; else Anthropic's defaults)."""
    messages, tools, tool_choice, parallel, thinking = _chat(body, _CREATE)
    max_tokens = _integer(body, "max_tokens", 1, required=True)
    if body.get("metadata") is not None:
        _obj(body["metadata"], "metadata")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise bad("service_tier", f"must be 'auto' or 'standard_only', got "
                  f"{json.dumps(body['service_tier'])}")
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop_sequences", f"must be an array of strings, got {json.dumps(stops)}")
    given = dict(temperature=_number(body, "temperature", 0.0, 1.0),
                 top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
                 top_k=_integer(body, "top_k", 0),
                 min_p=_number(body, "min_p", 0.0, 1.0))
    sampling = {k: v if v is not None else {**ANTHROPIC_SAMPLING, **(defaults or {})}[k]
                for k, v in given.items()}
    sampling.update(seed=_integer(body, "seed", 0), stop=[s for s in stops if s])
    return MessagesRequest(
        "chat", body["model"], messages, _bool(body, "stream"), True, max_tokens, sampling,
        tools=tools if tool_choice != "none" else None, tool_choice=tool_choice,
        chat_template_kwargs={"enable_thinking": thinking}, parallel_tool_calls=parallel,
        thinking=thinking)


def parse_count_tokens(body) -> MessagesRequest:
    """Validate a ``POST /v1/messages/count_tokens`` body (the prompt's fields only)."""
    messages, tools, tool_choice, _, thinking = _chat(body, _COUNT)
    return MessagesRequest("chat", body["model"], messages, False, False, None, {},
                           tools=tools if tool_choice != "none" else None,
                           chat_template_kwargs={"enable_thinking": thinking}, thinking=thinking)


def generation_defaults(model_path) -> dict:
    """The sampling defaults of a checkpoint's generation_config.json (temperature, top_p,
    top_k, min_p; those it sets with a usable value), or {}."""
    try:
        cfg = json.loads((Path(model_path) / "generation_config.json").read_text())
    except (OSError, TypeError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    out = {}
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0)):
        v = cfg.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi:
            out[name] = float(v)
    k = cfg.get("top_k")
    if isinstance(k, int) and not isinstance(k, bool) and k >= 0:
        out["top_k"] = k
    if out.get("top_p") == 0.0:
        del out["top_p"]
    return out


# ---- responses ----------------------------------------------------------------------------------
def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def usage(stats, prompt_tokens: int | None = None) -> dict:
    """Anthropic usage: ``input_tokens`` are the prompt tokens that were prefilled,
    ``cache_read_input_tokens`` those reused from the model's state or the prompt cache (their
    sum is the prompt's length, as Anthropic counts). Without ``stats`` (the stream's start):
    the whole prompt as input, nothing generated yet."""
    if stats is None:
        p, r, c = prompt_tokens or 0, 0, 0
    else:
        p, r, c = int(stats.prompt_tokens), int(stats.reused_tokens), int(stats.generated_tokens)
    return {"input_tokens": p - r, "output_tokens": c, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": r}


def stop_reason(finish: str | None, saw_tool_use: bool, stop_sequence: str = ""
                ) -> tuple[str, str | None]:
    """lily_py's finish reason -> Anthropic's (stop_reason, stop_sequence)."""
    if finish in ("tool_calls",) or (finish == "stop" and saw_tool_use):
        return "tool_use", None
    if finish == "stop" and stop_sequence:
        return "stop_sequence", stop_sequence
    if finish == "length":
        return "max_tokens", None
    if finish == "context_length":
        return "model_context_window_exceeded", None
    return "end_turn", None


class Blocks:
    """Content blocks from ``GenerationChunk``s: ``feed(chunk)`` returns the stream events it
    makes (content_block_start / _delta / _stop) and keeps ``content``, the answer's blocks.

    Reasoning -> a ``thinking`` block (its ``signature`` is empty: nothing signs it here), text
    -> ``text``, each completed tool call -> ``tool_use`` (id ``toolu_...``, ``input`` the parsed
    arguments; streamed as one ``input_json_delta``), a malformed call's raw text -> text, so it
    is never lost. With ``thinking`` (the prompt opened reasoning) the answer starts with a
    thinking block, empty when the model's reasoning was."""

    def __init__(self, thinking: bool = False):
        self.content: list[dict] = []
        self.open: str | None = None        # the type of the block being written
        self.thinking_due = thinking
        self.saw_tool_use = False

    def _start(self, block: dict) -> list[dict]:
        events = self._close()
        self.content.append(block)
        self.open = block["type"]
        self.thinking_due = False
        start = {k: (dict(v) if isinstance(v, dict) else v) for k, v in block.items()}
        return events + [{"type": "content_block_start", "index": len(self.content) - 1,
                          "content_block": start}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _append(self, kind: str, text: str) -> list[dict]:
        events = []
        if kind != "thinking" and self.thinking_due:
            events += self._start({"type": "thinking", "thinking": "", "signature": ""})
        if self.open != kind:
            events += self._start({"type": "thinking", "thinking": "", "signature": ""}
                                  if kind == "thinking" else {"type": "text", "text": ""})
        self.content[-1][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": delta}]

    def feed(self, chunk) -> list[dict]:
        events = []
        reasoning = getattr(chunk, "reasoning", "") or ""
        if reasoning:
            events += self._append("thinking", reasoning)
        text = chunk.text or ""
        for err in getattr(chunk, "tool_call_errors", None) or ():
            text += err.raw
        if text:
            events += self._append("text", text)
        for call in getattr(chunk, "tool_calls", None) or ():
            if self.thinking_due:
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            args = json.loads(call.arguments) if call.arguments else {}
            block = {"type": "tool_use", "id": new_tool_use_id(), "name": call.name,
                     "input": args}
            events += self._start({**block, "input": {}})
            self.content[-1]["input"] = args
            events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                           "delta": {"type": "input_json_delta",
                                     "partial_json": json.dumps(args, ensure_ascii=False)}})
            events += self._close()
            self.saw_tool_use = True
        return events

    def finish(self) -> list[dict]:
        """The end of the answer: the pending empty thinking block, then close the open one."""
        events = []
        if self.thinking_due:
            events += self._start({"type": "thinking", "thinking": "", "signature": ""})
        return events + self._close()


def message(msg_id: str, model: str, content: list, reason: str | None, seq: str | None,
            use: dict) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": use}
