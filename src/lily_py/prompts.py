"""Prompts into token ids: a chat's messages checked and rendered with the checkpoint's chat
template, and the positions where ``generate`` snapshots the state into the prompt cache.

Snapshot points (README, "Conversations: what is prefilled"): the end of the system message /
tool list when it is at least ``SYSTEM_SNAPSHOT_MIN_TOKENS`` long, and the end of the
conversation before the generation prompt (every later turn starts with it).
"""
from __future__ import annotations

import json

from .tokenizer import check_text

# A system prompt / tool list at least this long gets its own prompt-cache snapshot.
SYSTEM_SNAPSHOT_MIN_TOKENS = 128
ROLES = ("system", "user", "assistant", "tool")


def chat_prompt(tok, messages, *, enable_thinking, tools, chat_template_kwargs=None
                ) -> tuple[list[int], list[int], str]:
    """(token ids, snapshot points, text) of ``messages`` rendered by tokenizer ``tok``'s chat
    template with a generation prompt. The points are empty when the conversation without the
    generation prompt does not tokenize as a prefix of the whole (the caller snapshots the end)."""
    check_messages(messages)
    messages = json_tool_arguments(messages)
    kw = dict(chat_template_kwargs or {})
    clash = {"tools", "messages", "documents", "add_generation_prompt"} & set(kw)
    if clash:
        raise TypeError(f"chat_template_kwargs cannot set {sorted(clash)}: pass tools= "
                        "to generate(); generate() sets the others")
    if enable_thinking is not None:
        kw["enable_thinking"] = enable_thinking
    text = tok.apply_chat_template(list(messages), add_generation_prompt=True, tools=tools, **kw)
    ids = tok.encode(text)
    head = tok.encode(tok.apply_chat_template(list(messages), add_generation_prompt=False,
                                              tools=tools, **kw))
    points: list[int] = []
    if head == ids[:len(head)]:
        sys_end = system_end(tok, messages, ids, tools)
        if SYSTEM_SNAPSHOT_MIN_TOKENS <= sys_end < len(head):
            points.append(sys_end)
        points.append(len(head))
    return ids, points, text


def system_end(tok, messages, ids: list[int], tools) -> int:
    """Where the system turn (the system message and/or the tool list) ends in ``ids``:
    after its end-of-turn token and the newline that follows; 0 when there is none."""
    first = messages[0]
    role = first.get("role") if isinstance(first, dict) else getattr(first, "role", None)
    if role != "system" and not tools:
        return 0
    end = tok.token_to_id("<|im_end|>")
    if end is None or end not in ids:
        return 0
    i = ids.index(end) + 1
    if i < len(ids) and tok.decode([ids[i]]) == "\n":
        i += 1
    return i


def check_messages(messages) -> None:
    """Clear errors for what the chat template would reject confusingly (or not at all)."""
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            role, content = m.get("role"), m.get("content")
            tool_calls = m.get("tool_calls")
        else:
            role = getattr(m, "role", None)
            content, tool_calls = getattr(m, "content", None), getattr(m, "tool_calls", None)
        if role is None and not isinstance(m, dict) and not hasattr(m, "role"):
            continue            # not a message-like object: the template layer explains
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}] needs a string 'role' (one of {', '.join(ROLES)}), "
                             f"got {role!r}")
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; the chat template takes "
                             f"{', '.join(repr(r) for r in ROLES)}")
        if content is None and not (role == "assistant" and tool_calls):
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'"
                             + ("" if role != "assistant" else " and no 'tool_calls'"))
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise TypeError(f"messages[{i}]['content'] must be a string or a list of content "
                            f"parts, got {type(content).__name__}")
        if isinstance(content, str):
            check_text(content, f"messages[{i}]['content']")
        elif content is not None:
            for j, part in enumerate(content):
                t = part.get("text") if isinstance(part, dict) else None
                if isinstance(t, str):
                    check_text(t, f"messages[{i}]['content'][{j}]['text']")


def json_tool_arguments(messages):
    """OpenAI messages carry tool-call arguments as JSON text; the chat template iterates them as
    a mapping. Parse such text into a dict (in a copy; other messages are passed as they are)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls and isinstance(calls, (list, tuple)):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ValueError(f"tool call {fn.get('name')!r}: arguments are not valid "
                                         f"JSON: {args[:80]!r}") from None
                    c = {**c, "function": {**fn, "arguments": parsed}}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
