"""Structured outputs and logprobs through a real ``lily-py serve`` on the demo, with the official
``openai`` client: a schema-constrained answer validates (jsonschema), a forced tool call parses,
an invalid schema is a 400 with the compiler's message, logprobs have OpenAI's shapes and
sensible values, streamed and not."""
from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest

pytest.importorskip("llguidance", reason="the structured extra (llguidance) is not installed")

DEMO = "lily-py-demo"
U = [{"role": "user", "content": "Describe:"}]
SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["calm", "busy"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["mood", "n"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
PICK = {"type": "object", "properties": {"c": {"enum": ["x", "y"]}, "k": {"type": "boolean"}},
        "required": ["c", "k"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "go", "parameters": PICK}}]


@pytest.fixture(scope="module")
def server(serve_factory):
    return serve_factory("--context", "1024")


def off_think(**kw):
    return dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)


def test_json_schema_answer_validates_streamed_and_not(server):
    c = server.client()
    for seed in (0, 1):
        r = c.chat.completions.create(model=DEMO, messages=U, response_format=RF, seed=seed,
                                      temperature=1.0, max_tokens=60, **off_think())
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=DEMO, messages=U, response_format=RF, seed=seed, temperature=1.0, max_tokens=60,
            stream=True, **off_think()) if ch.choices]
        assert "".join(parts) == r.choices[0].message.content
    r = c.chat.completions.create(model=DEMO, messages=U, response_format={"type": "json_object"},
                                  temperature=0, max_tokens=40, **off_think())
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_invalid_schema_is_a_400_with_the_compilers_message(server):
    bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=DEMO, messages=U, response_format=bad)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "response_format"
    assert "nope" in err["message"], err


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_tool_call_parses(server, stream):
    c = server.client()
    for tool_choice, seed in (("required", 0), ({"type": "function", "function": {"name": "go"}}, 1)):
        kw = off_think(model=DEMO, messages=[{"role": "user", "content": "Go"}], tools=TOOLS,
                       tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0,
                       seed=seed, max_tokens=120)
        if stream:
            calls, fr = [], None
            for ch in c.chat.completions.create(stream=True, **kw):
                if ch.choices:
                    calls += ch.choices[0].delta.tool_calls or []
                    fr = ch.choices[0].finish_reason or fr
        else:
            r = c.chat.completions.create(**kw)
            calls, fr = r.choices[0].message.tool_calls, r.choices[0].finish_reason
            assert not r.choices[0].message.content
        assert fr == "tool_calls" and len(calls) == 1
        assert calls[0].function.name == "go" and calls[0].id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].function.arguments), PICK)


def _check_chat_entries(entries, k):
    for e in entries:
        assert e.logprob <= 0 and math.isfinite(e.logprob)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == k and tops == sorted(tops, reverse=True)
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-5
        assert e.logprob <= tops[0] + 1e-6


def test_chat_logprobs_shape_and_values(server):
    c = server.client()
    r = c.chat.completions.create(model=DEMO, messages=U, logprobs=True, top_logprobs=4,
                                  temperature=0, max_tokens=12, **off_think())
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    _check_chat_entries(content, 4)
    for e in content:      # greedy: the sampled token is the most likely one
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob
    streamed = []
    for ch in c.chat.completions.create(model=DEMO, messages=U, logprobs=True, top_logprobs=4,
                                        temperature=0, max_tokens=12, stream=True, **off_think()):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # sampled, with a constraint: logprobs of the masked distribution, still sensible
    r = c.chat.completions.create(model=DEMO, messages=U, logprobs=True, top_logprobs=2,
                                  response_format=RF, temperature=1.0, seed=3, max_tokens=60,
                                  **off_think())
    _check_chat_entries(r.choices[0].logprobs.content, 2)
    r = c.chat.completions.create(model=DEMO, messages=U, temperature=0, max_tokens=3)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_shape_and_values(server):
    c = server.client()
    r = c.completions.create(model=DEMO, prompt="The king", logprobs=3, temperature=0,
                             max_tokens=8)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == v and top[tok] == v   # greedy
        assert sum(math.exp(x) for x in top.values()) <= 1 + 1e-5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    toks, vals = [], []
    for ch in c.completions.create(model=DEMO, prompt="The king", logprobs=3, temperature=0,
                                   max_tokens=8, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            toks += ch.choices[0].logprobs.tokens
            vals += ch.choices[0].logprobs.token_logprobs
    assert toks == lp.tokens and vals == lp.token_logprobs
