"""Render Hugging Face chat templates with Jinja2, the way transformers does.

The rendering environment mirrors ``transformers/utils/chat_template_utils.py`` (transformers 5.24):

* ``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension and a ``{% generation %}...{% endgeneration %}`` tag (transformers
  uses it to track assistant spans; here it just renders its body);
* a ``tojson`` filter that does *not* HTML-escape and accepts ``ensure_ascii``, ``indent``,
  ``separators`` and ``sort_keys`` (plain ``json.dumps``);
* globals ``raise_exception(msg)``, ``strftime_now(fmt)``, ``dict`` (a call-only wrapper) and a
  ``namespace`` that refuses underscore-prefixed attributes;
* the template sees ``messages``, ``tools`` (None when absent), ``documents`` (None when absent),
  ``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``, ``eos_token``,
  ... from ``tokenizer_config.json``) and every extra keyword (``enable_thinking``,
  ``preserve_thinking``, ...); extra keywords override special tokens of the same name;
* inputs are rebuilt from plain JSON types first: message keys whose value is None are dropped,
  dataclasses / pydantic objects become dicts, other objects become ``"<TypeName>"`` placeholders,
  and a message's reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` is
  exposed under both ``reasoning_content`` and ``thinking``.

Nothing here imports ``lily_py._core``; Jinja2 is the only dependency.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import LilyError

__all__ = [
    "ChatTemplateError",
    "SPECIAL_TOKEN_NAMES",
    "compile_chat_template",
    "render_chat_template",
]

# The named special tokens transformers passes to every chat template
# (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES in transformers 5.24).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Names a message's reasoning may be given under; the first is the one chat templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Variables the renderer sets itself; passing them as extra keywords is an error.
_RESERVED_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(LilyError, ValueError):
    """A chat template could not be compiled, or refused the conversation it was given."""


# ----------------------------------------------------------------------------------------------
# Environment


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    transformers registers this tag to record which characters the assistant wrote
    (``return_assistant_tokens_mask``); a template that uses it must still render here.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Unlike Jinja's built-in filter: no HTML escaping, and json.dumps options are exposed.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` inside templates, nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` once (cached by its text). Raises ChatTemplateError on a syntax error."""
    if not isinstance(source, str):
        raise TypeError(f"chat template must be a str, got {type(source).__name__}")
    try:
        return _make_environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc


# ----------------------------------------------------------------------------------------------
# Inputs


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types (what the sandboxed template may touch)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # str subclasses (enums, ...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):  # np.bool_(False) must stay falsy
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message_to_dict(message: Any, index: int) -> dict:
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    elif not isinstance(message, Mapping) and callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise TypeError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
    # Drop None values: APIs send content=None / tool_calls=None, templates expect a missing key.
    plain = {k: _plain(v) for k, v in message.items() if v is not None}
    role = plain.get("role")
    if not isinstance(role, str):
        raise ValueError(f"messages[{index}] needs a string 'role', got {role!r}")
    reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _prepare_messages(messages: Any) -> list[dict]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty: a chat template needs at least one message")
    return [_message_to_dict(m, i) for i, m in enumerate(messages)]


def _prepare_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of JSON-schema dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TypeError(
                f"tools[{i}] must be a JSON-schema dict like "
                "{'type': 'function', 'function': {'name': ..., 'parameters': ...}}, "
                f"got {type(tool).__name__}"
            )
    return _plain(list(tools))


def _prepare_documents(documents: Any) -> list | None:
    if documents is None:
        return None
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
        raise TypeError(f"documents must be a list of dicts, got {type(documents).__name__}")
    for i, doc in enumerate(documents):
        if not isinstance(doc, Mapping):
            raise TypeError(f"documents[{i}] must be a dict with 'title' and 'text', got {type(doc).__name__}")
    return _plain(list(documents))


# ----------------------------------------------------------------------------------------------
# Rendering


def render_chat_template(
    source: str,
    messages: Sequence[Any],
    *,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    template_name: str = "chat template",
    **kwargs: Any,
) -> str:
    """Render the Jinja chat template ``source`` for ``messages``; returns the prompt text.

    ``special_tokens`` maps names like ``eos_token`` to token strings (the tokenizer's named special
    tokens); ``kwargs`` are passed to the template as variables and override ``special_tokens``.
    ``template_name`` names the template in error messages (e.g. the file it came from).
    Errors raised by the template itself (``raise_exception``) become ChatTemplateError.
    """
    reserved = _RESERVED_NAMES.intersection(kwargs)
    if reserved:
        raise TypeError(f"render_chat_template() sets {sorted(reserved)} itself; pass them as named arguments")
    if "continue_final_message" in kwargs:
        raise TypeError("continue_final_message is not supported by lily_py's chat template renderer")
    template = compile_chat_template(source)
    chat = _prepare_messages(messages)
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(kwargs)
    variables = _plain(variables)
    try:
        return template.render(
            messages=chat,
            tools=_prepare_tools(tools),
            documents=_prepare_documents(documents),
            add_generation_prompt=bool(add_generation_prompt),
            **variables,
        )
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"{template_name}: refused by the sandbox: {exc}") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"{template_name} rejected the conversation: {exc.message}") from exc
