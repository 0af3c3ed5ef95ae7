"""Reasoning and tool calls end to end: the real demo model and lily_py's real parser, through
the real server (Starlette app, scheduler, uvicorn, loopback HTTP, openai client). The demo model
cannot write Qwen3.6's tool calls, so its sampler is replaced by a scripted token sequence (the
issue allows a scripted token sequence through the real server path); everything else is real:
prefill and decode of every token, detokenization, the parser, the server's mapping."""
from __future__ import annotations

import json

import pytest

import lily_py
import lily_py.generation_loop

REASONING = "A verse."
ANSWER = "Look."
SCRIPT_TEXT = (f"{REASONING}\n</think>\n\n{ANSWER}\n\n<tool_call>\n<function=find_verse>\n"
               "<parameter=ref>\nJohn 3:16\n</parameter>\n</function>\n</tool_call><|im_end|>")
MSGS = [{"role": "user", "content": "Find John 3:16."}]


@pytest.fixture(scope="module")
def demo():
    return lily_py.load(context_length=512)


@pytest.fixture
def scripted(demo, monkeypatch):
    script = demo.tokenizer.encode(SCRIPT_TEXT)
    assert demo.tokenizer.decode(script) == SCRIPT_TEXT
    steps = []

    def sample(logits, params, n, seed, allowed=None):   # the real sampler's signature
        steps.append(n)
        return script[n]

    monkeypatch.setattr(lily_py.generation_loop, "sample", sample)
    return script, steps


def test_tool_call_and_reasoning_not_streamed(demo, scripted, inproc):
    script, steps = scripted
    s = inproc(demo, model_id="lily-py-demo")
    r = s.client().chat.completions.create(model="lily-py-demo", messages=MSGS, max_tokens=100,
                                           temperature=0)
    assert steps == list(range(len(script)))           # every scripted token was sampled
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.model_extra["reasoning_content"].strip() == REASONING
    assert msg.content.strip() == ANSWER
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "find_verse"
    assert json.loads(call.function.arguments) == {"ref": "John 3:16"}
    assert call.id.startswith("call_")
    assert r.usage.completion_tokens == len(script)


def test_tool_call_and_reasoning_streamed(demo, scripted, inproc):
    script, _ = scripted
    s = inproc(demo, model_id="lily-py-demo")
    chunks = list(s.client().chat.completions.create(
        model="lily-py-demo", messages=MSGS, max_tokens=100, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning.strip() == REASONING and content.strip() == ANSWER
    assert sum(bool(d.model_extra.get("reasoning_content")) for d in deltas) > 1   # streamed
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    assert calls[0].function.name == "find_verse"
    assert json.loads(calls[0].function.arguments) == {"ref": "John 3:16"}
    for d in deltas:                   # no tag text leaks into either stream
        for text in (d.content or "", d.model_extra.get("reasoning_content") or ""):
            assert "<" not in text and ">" not in text, text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(script)


def test_logprobs_cover_the_content_only(demo, scripted, inproc):
    """``logprobs.content`` holds the tokens of ``content``: not the reasoning (nor its
    ``</think>``), not the tool call, not the newlines the parser drops after ``</think>``. (The
    newlines before ``<tool_call>`` stay: while they are written they may still be content.)"""
    script, _ = scripted
    s = inproc(demo, model_id="lily-py-demo")
    kw = dict(model="lily-py-demo", messages=MSGS, max_tokens=100, temperature=0, logprobs=True,
              top_logprobs=2)
    r = s.client().chat.completions.create(**kw)
    entries = r.choices[0].logprobs.content
    assert r.choices[0].message.content == ANSWER
    assert "".join(e.token for e in entries) == ANSWER + "\n\n"
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert r.usage.completion_tokens == len(script) > len(entries)
    streamed = [e for c in s.client().chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs is not None
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
