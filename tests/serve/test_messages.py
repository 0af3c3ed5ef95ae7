"""Anthropic's Messages API on a real ``lily-py serve`` process (the bundled demo checkpoint),
driven by the official ``anthropic`` client over loopback HTTP. Greedy answers (temperature 0,
which the anthropic 2.x client sends through ``extra_body``) are compared with the Python API run
in-process on the messages the request converts to."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import httpx
import openai
import pytest

import lily_py

REQUEST_TIMEOUT = 120.0         # as conftest.py's
DEMO = "lily-py-demo"
NAME = "claude-sonnet-4-5"          # what an agent configured for Claude sends
CONTEXT = 1024
GREEDY = {"temperature": 0}
SYSTEM = "Thou art a scribe."
ASK = [{"role": "user", "content": "Recite Psalm 23:1."}]
CHAT = [{"role": "system", "content": SYSTEM}, *ASK]         # the same, as template messages
# An enum keeps the demo's forced call short (a free string never ends on this model).
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]}},
                            "required": ["city"]}}
WEATHER_FN = [{"type": "function", "function": {"name": "get_weather",
                                                "description": "The weather in a city",
                                                "parameters": WEATHER["input_schema"]}}]


@pytest.fixture(scope="module")
def server(serve_factory):
    return serve_factory("--context", str(CONTEXT))


@pytest.fixture(scope="module")
def local():
    """The same checkpoint in-process: what the server must answer."""
    return lily_py.load(context_length=CONTEXT)


def expected(local, messages, max_tokens, **kw):
    local.reset()
    return local.generate_text(messages, max_tokens=max_tokens, temperature=0.0, **kw)


def sse(server, body: dict, headers=None) -> list[tuple[str, dict]]:
    """A streamed /v1/messages answer as (event name, data) pairs, read raw."""
    events = []
    with httpx.stream("POST", server.base + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": "unused", "anthropic-version": "2023-06-01",
                               **(headers or {})}, timeout=REQUEST_TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name         # every event is named by its type
                events.append((name, data))
    return events


def post(server, path: str, body, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.base + path, data=raw, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_plain_message_and_the_prompt_cache(server, local):
    c = server.anthropic()
    r = c.messages.create(model=NAME, max_tokens=8, system=SYSTEM, messages=ASK,
                          extra_body=GREEDY)
    want = expected(local, CHAT, 8, enable_thinking=False)
    n = len(local.prompt_ids(CHAT, enable_thinking=False))
    assert r.id.startswith("msg_") and (r.type, r.role, r.model) == ("message", "assistant", NAME)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want.text
    assert (r.stop_reason, r.stop_sequence) == ("max_tokens", None)
    assert r.usage.output_tokens == 8 and r.usage.cache_creation_input_tokens == 0
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n
    again = c.messages.create(model=NAME, max_tokens=8, system=SYSTEM, messages=ASK,
                              extra_body=GREEDY)
    assert again.content[0].text == want.text
    # the conversation up to the generation prompt comes from the prompt cache
    head = len(local.tokenizer.encode(local.tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=False, enable_thinking=False)))
    assert again.usage.cache_read_input_tokens == head
    assert again.usage.input_tokens == n - head


def test_streamed_message_events_match_the_whole_answer(server, local):
    want = expected(local, CHAT, 8, enable_thinking=False)
    n = len(local.prompt_ids(CHAT, enable_thinking=False))
    events = sse(server, {"model": NAME, "max_tokens": 8, "system": SYSTEM, "messages": ASK,
                          **GREEDY})
    names = [e for e, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta",
                          "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["model"] == NAME
    assert start["stop_reason"] is None and start["usage"]["input_tokens"] == n
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    deltas = [d["delta"] for e, d in events if e == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == want.text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 8
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == n
    # the anthropic client's own stream helper puts the same message together
    with server.anthropic().messages.stream(model=NAME, max_tokens=8, system=SYSTEM,
                                            messages=ASK, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want.text and final.content[0].text == want.text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_stop_sequence(server, local):
    want = expected(local, CHAT, 12, enable_thinking=False).text
    assert "Moses" in want          # the demo's greedy answer, which the stop cuts
    r = server.anthropic().messages.create(model=NAME, max_tokens=12, system=SYSTEM,
                                           messages=ASK, stop_sequences=["Aaron", "Moses"],
                                           extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "Moses")
    assert r.content[0].text == want[:want.index("Moses")]


def test_tool_use_over_two_turns(server, local):
    c = server.anthropic()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=NAME, max_tokens=60, tools=[WEATHER], messages=ask, extra_body=GREEDY,
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    r = c.messages.create(**kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    call = r.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input in ({"city": "Paris"}, {"city": "London"})
    # streamed: the same call, its input as one input_json_delta
    with c.messages.stream(**kw) as s:
        partial = [e.partial_json for e in s if e.type == "input_json"]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == call.input
    assert [json.loads(p) for p in partial] == [call.input]

    # turn 2: the tool's result goes back; the answer is the model's greedy answer to the
    # conversation the template renders with the call and its <tool_response>
    result = "Sunny, 21 degrees."
    turn2 = ask + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": result}]}]
    r2 = c.messages.create(model=NAME, max_tokens=8, tools=[WEATHER], messages=turn2,
                           extra_body=GREEDY)
    chat2 = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}]
    want = expected(local, chat2, 8, tools=WEATHER_FN, enable_thinking=False)
    assert r2.content[0].text == want.text and r2.stop_reason == "max_tokens"
    ids = local.prompt_ids(chat2, tools=WEATHER_FN, enable_thinking=False)
    assert local.tokenizer.decode(ids).count(result) == 1
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == len(ids)
    assert r2.usage.cache_read_input_tokens > 0          # the tools and the question, cached
    n = c.messages.count_tokens(model=NAME, tools=[WEATHER], messages=turn2).input_tokens
    assert n == len(ids)


def test_thinking_returns_a_thinking_block(server, local):
    c = server.anthropic()
    r = c.messages.create(model=NAME, max_tokens=10, messages=ASK, extra_body=GREEDY,
                          thinking={"type": "enabled", "budget_tokens": 1024})
    want = expected(local, ASK, 10, enable_thinking=True)
    # the demo closes its reasoning at once ("\n</think>\n\n"): an empty thinking block
    assert want.reasoning == "" and want.raw_text.startswith("\n</think>")
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == want.reasoning and r.content[0].signature == ""
    assert r.content[1].text == want.text and r.usage.output_tokens == 10
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(
        local.prompt_ids(ASK, enable_thinking=True))
    events = sse(server, {"model": NAME, "max_tokens": 10, "messages": ASK, **GREEDY,
                          "thinking": {"type": "enabled", "budget_tokens": 1024}})
    blocks = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
    assert blocks == ["thinking", "text"]
    off = c.messages.create(model=NAME, max_tokens=4, messages=ASK, extra_body=GREEDY,
                            thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


def test_count_tokens(server, local):
    c = server.anthropic()
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}):
        n = c.messages.count_tokens(model=NAME, system=SYSTEM, messages=ASK, tools=[WEATHER],
                                    thinking=thinking).input_tokens
        assert n == len(local.prompt_ids(CHAT, tools=WEATHER_FN,
                                         enable_thinking=thinking["type"] == "enabled"))
    n = c.messages.count_tokens(model=NAME, system=SYSTEM, messages=ASK).input_tokens
    assert n == len(local.prompt_ids(CHAT, enable_thinking=False))
    # a prompt longer than the context is counted all the same
    long = [{"role": "user", "content": "and " * (CONTEXT + 10)}]
    assert c.messages.count_tokens(model=NAME, messages=long).input_tokens > CONTEXT


def test_errors_have_anthropics_shape(server):
    c = server.anthropic()
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=NAME, max_tokens=5, messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "foo"}]},
            {"role": "user", "content": "Hi"}])
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(
        "messages.1.content.0.type: unknown content block type 'foo'")
    status, body = post(server, "/v1/messages", {"model": NAME, "messages": ASK})
    assert status == 400 and body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: field required"}}
    status, body = post(server, "/v1/messages", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(server, "/v1/messages", {"model": NAME, "max_tokens": 1, "messages": [
        {"role": "user", "content": "and " * (CONTEXT + 10)}]})
    assert status == 400 and body["error"]["message"].startswith("prompt is too long: ")
    status, body = post(server, "/v1/messages/batches", {})
    assert status == 404 and body["error"]["type"] == "not_found_error"
    # the OpenAI routes keep OpenAI's error objects
    status, body = post(server, "/v1/chat/completions", {"model": NAME, "messages": ASK,
                                                         "max_token": 5})
    assert status == 400 and body["error"]["code"] == "unknown_field"


def test_any_model_name_is_served_by_default(server):
    r = server.client().chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1,
                                                temperature=0)
    assert r.model == "gpt-4o" and r.usage.completion_tokens == 1
    assert [m.id for m in server.client().models.list().data] == [DEMO]
    assert server.client().models.retrieve("claude-opus-4-1").id == "claude-opus-4-1"
    models = server.anthropic().models.list()
    assert [m.id for m in models.data] == [DEMO] and models.data[0].type == "model"


def test_strict_names_and_the_api_key(serve_factory):
    s = serve_factory("--context", "256", "--api-key", "sekrit", "--served-model-name", NAME,
                      "--served-model-name", "qwen")
    ok = dict(max_tokens=1, messages=ASK, extra_body=GREEDY)
    with pytest.raises(anthropic.AuthenticationError) as e:
        s.anthropic(api_key="wrong").messages.create(model=NAME, **ok)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    c = s.anthropic(api_key="sekrit")                     # sends x-api-key
    assert c.messages.create(model=NAME, **ok).usage.output_tokens == 1
    assert c.messages.create(model="qwen", **ok).model == "qwen"
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model=DEMO, **ok)
    assert e.value.body["error"]["type"] == "not_found_error" and NAME in str(e.value)
    o = s.client(api_key="sekrit")                        # sends Authorization: Bearer
    assert [m.id for m in o.models.list().data] == [NAME, "qwen"]
    with pytest.raises(openai.NotFoundError) as e:
        o.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    status, body = post(s, "/v1/chat/completions", {"model": "qwen", "messages": ASK,
                                                    "max_tokens": 1},
                        headers={"x-api-key": "sekrit"})
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    status, body = post(s, "/v1/messages/count_tokens", {"model": NAME, "messages": ASK})
    assert status == 401 and body["error"]["type"] == "authentication_error"
