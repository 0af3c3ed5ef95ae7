"""Anthropic's Messages API without HTTP: requests converted to the chat path's messages, tools and
switches; bad fields named by their path; chunks mapped to content blocks and stream events;
stop reasons, usage and error objects."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from lily_py import GenerationStats
from lily_py.serve import anthropic
from lily_py.serve.anthropic import Blocks, parse_count_tokens, parse_messages
from lily_py.serve.protocol import APIError

U = [{"role": "user", "content": "Hi"}]
TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}


def req(**body):
    return parse_messages({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": U, **body})


def test_plain_request_and_sampling_defaults():
    r = req(system="Be brief.", stop_sequences=["END", ""], stream=True)
    assert r.kind == "chat" and r.model == "claude-sonnet-4-5" and r.max_tokens == 5
    assert r.stream and r.prompt == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi"}]
    assert r.sampling == dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                              stop=["END"])
    assert r.chat_template_kwargs == {"enable_thinking": False} and not r.thinking
    assert r.tools is None and r.tool_choice == "auto"
    # the checkpoint's defaults fill what the request leaves out; the request wins
    body = {"model": "m", "max_tokens": 5, "messages": U, "top_p": 0.5}
    r = parse_messages(body, defaults={"temperature": 0.7, "top_k": 20, "top_p": 0.95})
    assert (r.sampling["temperature"], r.sampling["top_k"], r.sampling["top_p"]) == (0.7, 20, 0.5)


def test_generation_defaults_of_the_demo(tmp_path):
    from lily_py.resources import demo_path
    assert anthropic.generation_defaults(demo_path()) == {
        "temperature": 0.7, "top_p": 0.95, "top_k": 20}
    assert anthropic.generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot", "top_k": 5}')
    assert anthropic.generation_defaults(tmp_path) == {"top_k": 5}


def test_blocks_become_template_messages():
    r = req(system=[{"type": "text", "text": "A."}, {"type": "text", "text": "B.",
                                                     "cache_control": {"type": "ephemeral"}}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {"type": "tool_result", "tool_use_id": "toolu_2",
                     "content": [{"type": "text", "text": "21 C"}], "is_error": False},
                    {"type": "text", "text": "And tomorrow?"}]}])
    assert r.prompt == [
        {"role": "system", "content": "A.\n\nB."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "21 C"},
        {"role": "user", "content": "And tomorrow?"}]


def test_tools_tool_choice_and_thinking():
    r = req(tools=[TOOL])
    assert r.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOL["input_schema"],
        "description": "Weather in a city"}}]
    assert (r.tool_choice, r.parallel_tool_calls) == ("auto", True)
    r = req(tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert (r.tool_choice, r.parallel_tool_calls) == ("required", False)
    r = req(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"})
    assert r.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    r = req(tools=[TOOL], tool_choice={"type": "none"})
    assert r.tool_choice == "none" and r.tools is None       # not shown to the template
    for th, on in (({"type": "enabled", "budget_tokens": 2048}, True),
                   ({"type": "adaptive"}, True), ({"type": "disabled"}, False)):
        r = req(thinking=th)
        assert r.thinking is on and r.chat_template_kwargs == {"enable_thinking": on}
    c = parse_count_tokens({"model": "m", "messages": U, "tools": [TOOL],
                            "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert c.tools and c.thinking and c.prompt == U


M = {"model": "m", "max_tokens": 5, "messages": U}
BAD = [
    ({"model": "m", "messages": U}, "max_tokens: field required"),
    ({**M, "max_tokens": 0}, "max_tokens: must be an integer >= 1, got 0"),
    ({**M, "model": None}, "model: field required"),
    ({**M, "messages": []}, "messages: must be a non-empty array"),
    ({**M, "temperature": 1.5}, "temperature: must be in [0, 1], got 1.5"),
    ({**M, "top_k": "5"}, "top_k: must be an integer, got string"),
    ({**M, "max_token": 5}, "max_token: unknown field"),
    ({**M, "stop_sequences": "END"}, "stop_sequences: must be an array of strings"),
    ({**M, "messages": [{"role": "robot", "content": "x"}]},
     "messages.0.role: must be 'user' or 'assistant'"),
    ({**M, "messages": [{"role": "user"}]}, "messages.0.content: field required"),
    ({**M, "messages": [{"role": "user", "content": []}]}, "messages.0.content: must not be empty"),
    ({**M, "messages": [U[0], {"role": "assistant", "content": [{"type": "foo"}]}, U[0]]},
     "messages.1.content.0.type: unknown content block type 'foo'"),
    ({**M, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type: 'image' blocks are not supported"),
    ({**M, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages.0.content.0.text: must be a string, got integer"),
    ({**M, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     "messages.0.content.0.x: unknown field"),
    ({**M, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                      "input": {}}]}]},
     "messages.0.content.0.type: tool_use blocks belong in an assistant message"),
    ({**M, "messages": [U[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}, U[0]]},
     "messages.1.content.0.input: must be an object, got string"),
    ({**M, "messages": [U[0], {"role": "assistant", "content": "The"}]},
     "messages.1: the last message is an assistant message (a prefill)"),
    ({**M, "system": [{"type": "image"}]}, "system.0.type: only text blocks are supported"),
    ({**M, "tools": [{"name": "f"}]}, "tools.0.input_schema: field required"),
    ({**M, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0.type: 'web_search_20250305': Anthropic's server and client tools are not"),
    ({**M, "tool_choice": {"type": "any"}}, "tool_choice: type 'any' needs 'tools'"),
    ({**M, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name: 'nope' is not one of the tools"),
    ({**M, "tools": [TOOL], "tool_choice": {"type": "maybe"}},
     "tool_choice.type: must be 'auto', 'any', 'tool' or 'none'"),
    ({**M, "thinking": {"type": "enabled"}}, "thinking.budget_tokens: field required"),
    ({**M, "thinking": {"type": "on"}}, "thinking.type: must be 'enabled', 'adaptive' or"),
]


@pytest.mark.parametrize("body,message", BAD, ids=[m.split(":")[0] + f"-{i}"
                                                   for i, (_, m) in enumerate(BAD)])
def test_bad_fields_are_400s_naming_the_field(body, message):
    with pytest.raises(APIError) as e:
        parse_messages(body)
    assert e.value.status == 400 and e.value.message.startswith(message), e.value.message
    status, err = anthropic.error_body(e.value)
    assert status == 400 and err == {"type": "error", "error": {
        "type": "invalid_request_error", "message": e.value.message}}


def test_error_types_by_status():
    kinds = {s: anthropic.error_body(APIError(s, "x"))[:1] + (anthropic.error_body(
        APIError(s, "x"))[1]["error"]["type"],) for s in (401, 404, 413, 500, 503)}
    assert kinds == {401: (401, "authentication_error"), 404: (404, "not_found_error"),
                     413: (413, "request_too_large"), 500: (500, "api_error"),
                     503: (529, "overloaded_error")}
    _, err = anthropic.error_body(APIError(400, "the prompt has 9 tokens; the context length "
                                           "is 4", code="context_length_exceeded"))
    assert err["error"]["message"].startswith("prompt is too long: ")


@dataclass
class Call:
    name: str
    arguments: str


@dataclass
class Bad:
    raw: str


@dataclass
class Chunk:
    text: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)
    tool_call_errors: list = field(default_factory=list)


def run(blocks: Blocks, chunks) -> list[dict]:
    events = [e for c in chunks for e in blocks.feed(c)]
    return events + blocks.finish()


def test_blocks_thinking_text_and_tool_use():
    b = Blocks(thinking=True)
    events = run(b, [Chunk(reasoning="Let me"), Chunk(reasoning=" see."), Chunk(text="Sure."),
                     Chunk(tool_calls=[Call("get_weather", '{"city": "Paris"}')]),
                     Chunk(tool_call_errors=[Bad("<tool_call>oops")])])
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_stop", 2), ("content_block_start", 3), ("content_block_delta", 3),
        ("content_block_stop", 3)]
    assert events[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[1]["delta"] == {"type": "thinking_delta", "thinking": "Let me"}
    assert events[5]["delta"] == {"type": "text_delta", "text": "Sure."}
    start = events[7]["content_block"]
    assert start["type"] == "tool_use" and start["input"] == {} and start["id"].startswith("toolu_")
    assert json.loads(events[8]["delta"]["partial_json"]) == {"city": "Paris"}
    tool_id = start["id"]
    assert b.content == [
        {"type": "thinking", "thinking": "Let me see.", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": tool_id, "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "text", "text": "<tool_call>oops"}]
    assert b.saw_tool_use


def test_blocks_empty_reasoning_still_gives_a_thinking_block():
    b = Blocks(thinking=True)
    run(b, [Chunk(), Chunk(text="Hi")])
    assert b.content == [{"type": "thinking", "thinking": "", "signature": ""},
                         {"type": "text", "text": "Hi"}]
    b = Blocks(thinking=True)
    assert [e["type"] for e in run(b, [])] == ["content_block_start", "content_block_stop"]
    b = Blocks(thinking=False)
    run(b, [Chunk(text="Hi")])
    assert b.content == [{"type": "text", "text": "Hi"}]


def test_stop_reasons_and_usage():
    sr = anthropic.stop_reason
    assert sr("stop", False) == ("end_turn", None)
    assert sr("stop", False, "END") == ("stop_sequence", "END")
    assert sr("tool_calls", True) == sr("stop", True) == ("tool_use", None)
    assert sr("length", False) == ("max_tokens", None)
    assert sr("context_length", False) == ("model_context_window_exceeded", None)
    stats = GenerationStats(40, 32, 8, 5, 0.1, 0.1, "reference")
    assert anthropic.usage(stats) == {"input_tokens": 8, "output_tokens": 5,
                                      "cache_creation_input_tokens": 0,
                                      "cache_read_input_tokens": 32}
    assert anthropic.usage(None, 40)["input_tokens"] == 40
