"""The OpenAI wire format: request validation and response objects (no HTTP here).

Requests are checked field by field against what lily-py serve implements. An unknown field, a
wrong type or a value lily_py cannot honour (``n=2``, ``logprobs=true``, a JSON response format)
is a 400 with a message naming the field, never silently ignored. ``response_format``
(json_schema, json_object), a forcing ``tool_choice`` ("required", a named function) and
``logprobs`` / ``top_logprobs`` go to ``Model.generate`` (docs/structured.md). Fields OpenAI clients send
that do not change the output (``user``, ``metadata``, ``store``, ``parallel_tool_calls``, a
``frequency_penalty`` of 0, ...) are accepted.

``chunk_delta`` is the one place that maps a ``lily_py.GenerationChunk`` to an OpenAI delta.
"""
from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any


class APIError(Exception):
    """An error answered as an OpenAI error object: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "invalid_request_error",
                             404: "invalid_request_error", 413: "invalid_request_error",
                             503: "server_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- field checks -------------------------------------------------------------------------------
def _type_name(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False,
            default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{name}' must be a number, got {_type_name(v)} {json.dumps(v)}", name,
                  "invalid_type")
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(f"'{name}' must be in {rng}, got {v!r}", name, "invalid_value")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int | None = None, *, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {_type_name(v)} {json.dumps(v)}", name,
                  "invalid_type")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"'{name}' must be an integer {rng}, got {v}", name, "invalid_value")
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {_type_name(v)} {json.dumps(v)}", name,
                  "invalid_type")
    return v


def _only(body: dict, name: str, neutral, why: str) -> None:
    """A field lily_py accepts only with a value that changes nothing."""
    v = body.get(name)
    if v is not None and v not in neutral:
        raise bad(f"'{name}'={json.dumps(v)} is not supported by lily-py serve ({why})", name,
                  "unsupported_value")


def _check_fields(body: dict, known: set[str], where: str = "") -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(f"unknown field{'s' if len(unknown) > 1 else ''} "
                  f"{', '.join(repr(where + u) for u in unknown)} (lily-py serve accepts: "
                  f"{', '.join(sorted(known))})", where + unknown[0], "unknown_field")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'stop' must be a string or an array of strings, got {json.dumps(v)}", "stop",
                  "invalid_type")
    if len(v) > 16:
        raise bad(f"'stop' takes at most 16 strings, got {len(v)}", "stop", "invalid_value")
    return [s for s in v if s]


def _stream_options(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    _check_fields(so, {"include_usage", "include_obfuscation"}, "stream_options.")
    return _bool(so, "include_usage")


# Fields of both endpoints.
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
           "min_p", "seed", "stop", "n", "user", "frequency_penalty", "presence_penalty",
           "logit_bias", "logprobs"}
_NEUTRAL = {"user": None}     # accepted and ignored whatever their value (checked for type)


@dataclass
class GenRequest:
    """A validated request: what to pass to ``Model.generate`` and how to answer."""
    kind: str                       # "chat" | "completion"
    model: str
    prompt: Any                     # list of template messages, a string, or token ids
    stream: bool
    include_usage: bool
    max_tokens: int | None          # None: the server's default
    sampling: dict                  # temperature, top_p, top_k, min_p, seed, stop
    tools: list | None = None
    tool_choice: Any = "auto"       # "auto" | "none" | "required" | {"type": "function", ...}
    chat_template_kwargs: dict = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict | None = None     # None: free text
    parallel_tool_calls: bool = True


def _common(body: dict, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type_name(body)}")
    _check_fields(body, known)
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise bad("'model' is required (a string: the id listed by /v1/models)", "model",
                  "missing_field" if m is None else "invalid_type")
    _integer(body, "n", 1, 1)       # only one choice
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, -2.0, 2.0) not in (None, 0.0):
            raise bad(f"'{name}' is not supported by lily-py serve (only 0)", name,
                      "unsupported_value")
    lb = body.get("logit_bias")
    if lb is not None and (not isinstance(lb, dict) or lb):
        raise bad("'logit_bias' is not supported by lily-py serve (only an empty object)",
                  "logit_bias", "unsupported_value")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user", "invalid_type")
    return dict(temperature=_number(body, "temperature", 0.0, 2.0, default=1.0),
                top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True, default=1.0),
                top_k=_integer(body, "top_k", 0, default=0),
                min_p=_number(body, "min_p", 0.0, 1.0, default=0.0),
                seed=_integer(body, "seed", 0, 2 ** 63 - 1),
                stop=_stop(body))


# ---- chat ---------------------------------------------------------------------------------------
_CHAT = _COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice",
                   "parallel_tool_calls", "top_logprobs", "response_format", "metadata", "store",
                   "chat_template_kwargs", "reasoning_effort"}
_MESSAGE_FIELDS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "reasoning_content", "refusal",
                  "audio", "annotations", "function_call"},
    "tool": {"role", "content", "tool_call_id"},
}
_TEMPLATE_KWARGS = {"enable_thinking", "preserve_thinking"}


def _text_content(content, where: str, *, required: bool) -> str:
    if content is None:
        if required:
            raise bad(f"'{where}.content' is required for this role", f"{where}.content",
                      "missing_field")
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"),
                                                                                  str)):
                kind = p.get("type") if isinstance(p, dict) else _type_name(p)
                raise bad(f"'{where}.content[{j}]': only text parts "
                          f"({{\"type\": \"text\", \"text\": ...}}) are supported, got {kind!r}",
                          f"{where}.content", "unsupported_content")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"'{where}.content' must be a string or an array of text parts, got "
              f"{_type_name(content)}", f"{where}.content", "invalid_type")


def _tool_calls_in(calls, where: str) -> list[dict]:
    """OpenAI assistant tool calls -> the template's {"name", "arguments": dict}."""
    if not isinstance(calls, list):
        raise bad(f"'{where}.tool_calls' must be an array", f"{where}.tool_calls", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"'{w}' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                      f"\"arguments\"}}}}", w, "invalid_type")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise bad(f"'{w}.function.arguments' is not valid JSON: {e}",
                          f"{w}.function.arguments", "invalid_value") from None
        if not isinstance(args, dict):
            raise bad(f"'{w}.function.arguments' must be a JSON object", f"{w}.function.arguments",
                      "invalid_value")
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(msgs) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of message objects", "messages",
                  "missing_field" if msgs is None else "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{w}' must be an object, got {_type_name(m)}", w, "invalid_type")
        role = m.get("role")
        if role not in _MESSAGE_FIELDS:
            raise bad(f"'{w}.role' must be one of {', '.join(_MESSAGE_FIELDS)}, got "
                      f"{json.dumps(role)}", f"{w}.role", "invalid_value")
        _check_fields(m, _MESSAGE_FIELDS[role], f"{w}.")
        msg = {"role": "system" if role == "developer" else role}
        has_calls = role == "assistant" and m.get("tool_calls")
        msg["content"] = _text_content(m.get("content"), w, required=not has_calls
                                       and role != "assistant")
        if role == "assistant":
            if has_calls:
                msg["tool_calls"] = _tool_calls_in(m["tool_calls"], w)
            rc = m.get("reasoning_content")
            if rc is not None:
                if not isinstance(rc, str):
                    raise bad(f"'{w}.reasoning_content' must be a string",
                              f"{w}.reasoning_content", "invalid_type")
                msg["reasoning_content"] = rc
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of {\"type\": \"function\", \"function\": {...}}",
                  "tools", "invalid_type")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": "
                      f"..., \"description\": ..., \"parameters\": {{...}}}}}}", f"tools[{i}]",
                      "invalid_type")
        _check_fields(fn, {"name", "description", "parameters", "strict"}, f"tools[{i}].function.")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"'tools[{i}].function.parameters' must be a JSON schema object",
                      f"tools[{i}].function.parameters", "invalid_type")
    return tools or None


_CHOICES = ("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
            "\"function\": {\"name\": ...}}")


def _tool_choice(body: dict, tools: list | None):
    tc = body.get("tool_choice")
    if tc is None or tc == "auto":
        return "auto"
    if tc == "none":
        return "none"
    if tc == "required" or isinstance(tc, dict):
        if isinstance(tc, dict):
            fn = tc.get("function")
            if tc.get("type") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str):
                raise bad(f"{_CHOICES}, got {json.dumps(tc)}", "tool_choice", "invalid_value")
            if fn["name"] not in [t["function"]["name"] for t in tools or ()]:
                raise bad(f"'tool_choice' names the function {fn['name']!r}, which is not in "
                          f"'tools'", "tool_choice", "invalid_value")
        if not tools:
            raise bad(f"'tool_choice'={json.dumps(tc)} needs 'tools'", "tool_choice",
                      "invalid_value")
        return tc
    raise bad(f"{_CHOICES}, got {json.dumps(tc)}", "tool_choice", "invalid_value")


def _response_format(body: dict) -> dict | None:
    """OpenAI's response formats: text (None), json_object, json_schema (its schema is compiled
    by generate(): a schema that does not compile is a 400 with the compiler's message)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad(f"'response_format' must be an object, got {_type_name(rf)}", "response_format",
                  "invalid_type")
    kind = rf.get("type")
    if kind == "text":
        _check_fields(rf, {"type"}, "response_format.")
        return None
    if kind == "json_object":
        _check_fields(rf, {"type"}, "response_format.")
        return {"type": "json_object"}
    if kind == "json_schema":
        _check_fields(rf, {"type", "json_schema"}, "response_format.")
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad("'response_format.json_schema' must be {\"name\": ..., \"schema\": {...}}",
                      "response_format.json_schema", "invalid_type")
        _check_fields(js, {"name", "description", "schema", "strict"}, "response_format.json_schema.")
        return {"type": "json_schema", "json_schema": {"schema": js.get("schema", {})}}
    raise bad(f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", "
              f"got {json.dumps(kind)}", "response_format.type", "invalid_value")


def parse_chat(body) -> GenRequest:
    sampling = _common(body, _CHAT)
    messages = _messages(body.get("messages"))
    mt = _integer(body, "max_tokens", 1)
    mct = _integer(body, "max_completion_tokens", 1)
    if mt is not None and mct is not None and mt != mct:
        raise bad("give 'max_completion_tokens' or 'max_tokens', not two different values",
                  "max_completion_tokens", "invalid_value")
    logprobs = _bool(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, 20, default=0)
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    rf = _response_format(body)
    _bool(body, "store")
    parallel = _bool(body, "parallel_tool_calls", True)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad("'metadata' must be an object", "metadata", "invalid_type")
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    if rf is not None and tool_choice not in ("auto", "none"):
        raise bad("give 'response_format' or a forcing 'tool_choice', not both", "tool_choice",
                  "invalid_value")
    ctk = body.get("chat_template_kwargs") or {}
    if not isinstance(ctk, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs",
                  "invalid_type")
    _check_fields(ctk, _TEMPLATE_KWARGS, "chat_template_kwargs.")
    for k, v in ctk.items():
        if not isinstance(v, bool):
            raise bad(f"'chat_template_kwargs.{k}' must be a boolean", f"chat_template_kwargs.{k}",
                      "invalid_type")
    re = body.get("reasoning_effort")
    if re is not None:
        if re not in ("none", "minimal", "low", "medium", "high"):
            raise bad(f"'reasoning_effort' must be one of none, minimal, low, medium, high; got "
                      f"{json.dumps(re)}", "reasoning_effort", "invalid_value")
        # Qwen3.6 thinks or does not: "none" turns thinking off, any other level on.
        ctk.setdefault("enable_thinking", re != "none")
    return GenRequest("chat", body["model"], messages, _bool(body, "stream"),
                      _stream_options(body), mct if mct is not None else mt, sampling,
                      tools=tools if tool_choice != "none" else None, tool_choice=tool_choice,
                      chat_template_kwargs=ctk, logprobs=logprobs, top_logprobs=top,
                      response_format=rf, parallel_tool_calls=parallel)


# ---- completions --------------------------------------------------------------------------------
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}


def parse_completion(body) -> GenRequest:
    sampling = _common(body, _COMPLETION)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]        # a batch of one
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        prompt = p
    elif isinstance(p, str) and p:
        prompt = p
    elif isinstance(p, list) and len(p) > 1 and all(
            isinstance(x, str) or (isinstance(x, list) and all(isinstance(t, int) for t in x))
            for x in p):
        raise bad("'prompt' holds several prompts; lily-py serve answers one prompt per request",
                  "prompt", "unsupported_value")
    else:
        raise bad("'prompt' must be a non-empty string or an array of token ids", "prompt",
                  "missing_field" if p is None else "invalid_type")
    _only(body, "echo", (False,), "the prompt is not echoed")
    _only(body, "best_of", (1,), "one candidate per request")
    _only(body, "suffix", ("",), "no insertion")
    # the legacy field: an integer, the number of top tokens (0: the sampled token's only)
    top = _integer(body, "logprobs", 0, 20)
    return GenRequest("completion", body["model"], prompt, _bool(body, "stream"),
                      _stream_options(body), _integer(body, "max_tokens", 1, default=16),
                      sampling, logprobs=top is not None, top_logprobs=top or 0)


# ---- responses ----------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def finish_reason(reason: str | None, saw_tool_calls: bool) -> str | None:
    """lily_py's finish reasons -> OpenAI's (stop, length, tool_calls)."""
    if reason is None:
        return None
    if reason == "context_length":
        return "length"
    if reason == "stop" and saw_tool_calls:
        return "tool_calls"
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


def usage(stats) -> dict:
    """OpenAI usage from ``GenerationStats``: cached_tokens are the prompt tokens that were not
    prefilled (kept in the model's state or restored from the prompt cache)."""
    if stats is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                "prompt_tokens_details": {"cached_tokens": 0}}
    p, c = int(stats.prompt_tokens), int(stats.generated_tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": int(stats.reused_tokens)}}


def chunk_delta(chunk) -> dict:
    """The OpenAI chat delta of one ``GenerationChunk``: ``reasoning_content`` (chunk.reasoning),
    ``content`` (chunk.text, plus the raw text of a malformed tool call so it is never lost),
    ``tool_calls`` (each completed call once, whole). Empty dict when the chunk adds nothing."""
    d: dict = {}
    reasoning = getattr(chunk, "reasoning", "") or ""
    if reasoning:
        d["reasoning_content"] = reasoning
    text = chunk.text or ""
    for err in getattr(chunk, "tool_call_errors", None) or ():
        text += err.raw
    if text:
        d["content"] = text
    calls = getattr(chunk, "tool_calls", None) or ()
    if calls:
        d["tool_calls"] = [dict(index=c.index, **c.to_openai()) for c in calls]
    return d


def answer_logprob(chunk, kind: str):
    """The chunk's ``TokenLogprob`` where the answer's logprobs include it: every token of a
    completion; of a chat, the tokens of ``content`` only (not the reasoning, the tool-call
    blocks or the newlines the parser drops around them)."""
    lp = getattr(chunk, "logprobs", None)
    if kind == "chat" and getattr(chunk, "section", "") not in ("", "content"):
        return None
    return lp


def merge_delta(message: dict, d: dict) -> None:
    """Accumulate deltas into a non-streamed ``message``."""
    for k in ("content", "reasoning_content"):
        if k in d:
            message[k] = (message.get(k) or "") + d[k]
    if "tool_calls" in d:
        message.setdefault("tool_calls", []).extend(
            {k: v for k, v in c.items() if k != "index"} for c in d["tool_calls"])


# ---- logprobs -------------------------------------------------------------------------------------
def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (a byte-level BPE token may be part of a UTF-8 character)."""
    if getattr(tokenizer, "_byte_level", False):
        return tokenizer._bytes_of(int(token_id), False)
    return tokenizer.decode([int(token_id)]).encode("utf-8")


# JSON has no -inf: a token of probability zero (outside a constraint's mask) is written as OpenAI
# writes very unlikely tokens.
MIN_LOGPROB = -9999.0


def _lp(v: float) -> float:
    return max(float(v), MIN_LOGPROB)


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    b = token_bytes(tokenizer, token_id)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": _lp(logprob),
            "bytes": list(b)}


def chat_logprobs(tokenizer, lp) -> dict:
    """One token's entry of a chat choice's ``logprobs.content`` (``lp``: a ``TokenLogprob``)."""
    return {**_entry(tokenizer, lp.token, lp.logprob),
            "top_logprobs": [_entry(tokenizer, t, v) for t, v in lp.top]}


def completion_logprobs(tokenizer, lps, offset: int = 0) -> dict:
    """A completion choice's ``logprobs`` of ``TokenLogprob``s (legacy shape): tokens,
    token_logprobs, top_logprobs (token -> logprob), text_offset (from ``offset``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        e = _entry(tokenizer, lp.token, lp.logprob)
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({_entry(tokenizer, t, 0.0)["token"]: _lp(v) for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


def created() -> int:
    return int(time.time())
