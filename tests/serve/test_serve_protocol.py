"""Request validation and the chunk -> OpenAI mapping, without HTTP."""
from __future__ import annotations

import json

import pytest

from lily_py import GenerationChunk, GenerationStats
from lily_py.serve import protocol
from lily_py.serve.protocol import APIError, parse_chat, parse_completion

U = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return parse_chat({"model": "m", "messages": U, **kw})


@pytest.mark.parametrize("body, param, fragment", [
    ({"model": "m", "messages": U, "temprature": 1}, "temprature", "unknown field 'temprature'"),
    ({"messages": U}, "model", "'model' is required"),
    ({"model": "m"}, "messages", "'messages' must be a non-empty array"),
    ({"model": "m", "messages": []}, "messages", "'messages' must be a non-empty array"),
    ({"model": "m", "messages": ["hi"]}, "messages[0]", "must be an object, got string"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
     "must be one of system, developer, user, assistant, tool"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "must be a string or an array of text parts"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "only text parts"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "nmae": "a"}]},
     "messages[0].nmae", "unknown field 'messages[0].nmae'"),
    ({"model": "m", "messages": U, "temperature": "0.7"}, "temperature",
     "'temperature' must be a number, got string \"0.7\""),
    ({"model": "m", "messages": U, "temperature": float("inf")}, "temperature",
     "'temperature' must be in [0, 2]"),
    ({"model": "m", "messages": U, "temperature": float("nan")}, "temperature", "must be in"),
    ({"model": "m", "messages": U, "temperature": True}, "temperature", "got boolean"),
    ({"model": "m", "messages": U, "top_p": 0}, "top_p", "'top_p' must be in (0, 1]"),
    ({"model": "m", "messages": U, "top_k": 2.5}, "top_k", "'top_k' must be an integer"),
    ({"model": "m", "messages": U, "min_p": 1.5}, "min_p", "'min_p' must be in [0, 1]"),
    ({"model": "m", "messages": U, "seed": -1}, "seed", "'seed' must be an integer in [0, "),
    ({"model": "m", "messages": U, "max_tokens": 0}, "max_tokens", "must be an integer >= 1"),
    ({"model": "m", "messages": U, "max_tokens": 5, "max_completion_tokens": 6},
     "max_completion_tokens", "not two different values"),
    ({"model": "m", "messages": U, "stop": 123}, "stop", "must be a string or an array"),
    ({"model": "m", "messages": U, "stop": ["a", 1]}, "stop", "must be a string or an array"),
    ({"model": "m", "messages": U, "stream": "yes"}, "stream", "'stream' must be a boolean"),
    ({"model": "m", "messages": U, "stream_options": {"usage": True}}, "stream_options.usage",
     "unknown field"),
    ({"model": "m", "messages": U, "n": 2}, "n", "'n' must be an integer in [1, 1]"),
    ({"model": "m", "messages": U, "logprobs": 1}, "logprobs", "'logprobs' must be a boolean"),
    ({"model": "m", "messages": U, "top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ({"model": "m", "messages": U, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "in [0, 20]"),
    ({"model": "m", "messages": U, "presence_penalty": 0.5}, "presence_penalty",
     "not supported"),
    ({"model": "m", "messages": U, "response_format": {"type": "xml"}},
     "response_format.type", "must be \"text\", \"json_object\" or \"json_schema\""),
    ({"model": "m", "messages": U, "response_format": {"type": "json_schema", "json_schema": 3}},
     "response_format.json_schema", "must be {\"name\""),
    ({"model": "m", "messages": U, "response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tool_choice", "not both"),
    ({"model": "m", "messages": U, "tools": {"type": "function"}}, "tools", "must be an array"),
    ({"model": "m", "messages": U, "tools": [{"type": "function", "function": {}}]}, "tools[0]",
     "must be {\"type\": \"function\""),
    ({"model": "m", "messages": U, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"model": "m", "messages": U, "tool_choice": "sometimes"}, "tool_choice",
     "must be \"auto\", \"none\", \"required\""),
    ({"model": "m", "messages": U, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "'g', which is not in 'tools'"),
    ({"model": "m", "messages": U, "chat_template_kwargs": {"enable_thinking": "no"}},
     "chat_template_kwargs.enable_thinking", "must be a boolean"),
    ({"model": "m", "messages": U, "chat_template_kwargs": {"add_vision_id": True}},
     "chat_template_kwargs.add_vision_id", "unknown field"),
    ({"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "is not valid JSON"),
])
def test_bad_chat_requests_name_the_field(body, param, fragment):
    with pytest.raises(APIError) as e:
        parse_chat(body)
    assert e.value.status == 400
    assert e.value.param == param
    assert fragment in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_an_object():
    with pytest.raises(APIError, match="must be a JSON object, got array"):
        parse_chat([1, 2])


def test_chat_request_is_converted_for_the_template():
    r = parse_chat({
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": 7, "stop": "END", "seed": 3, "temperature": 0,
        "user": "u1", "metadata": {"a": "b"}, "store": False, "parallel_tool_calls": True,
        "frequency_penalty": 0, "n": 1, "reasoning_effort": "none",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok", "reasoning_content": "hm", "refusal": None},
        ]})
    assert r.kind == "chat" and r.stream and r.include_usage and r.max_tokens == 7
    assert r.sampling == dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=3,
                              stop=["END"])
    assert r.prompt == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "ab"},
                        {"role": "assistant", "content": "ok", "reasoning_content": "hm"}]
    assert r.chat_template_kwargs == {"enable_thinking": False}
    assert chat(reasoning_effort="high").chat_template_kwargs == {"enable_thinking": True}
    assert chat().sampling["temperature"] == 1.0        # OpenAI's default
    assert chat(max_tokens=9).max_tokens == 9 and chat().max_tokens is None


def test_tool_choice_none_drops_the_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat(tools=tools).tools == tools
    assert chat(tools=tools, tool_choice="none").tools is None


def test_forcing_tool_choice_response_format_and_logprobs_are_passed_on():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "f"}}
    r = chat(tools=tools, tool_choice=named, parallel_tool_calls=False)
    assert r.tools == tools and r.tool_choice == named and r.parallel_tool_calls is False
    assert chat(tools=tools, tool_choice="required").tool_choice == "required"
    r = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object"}, "strict": True}}, logprobs=True, top_logprobs=5)
    assert r.response_format == {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    assert r.logprobs and r.top_logprobs == 5
    assert chat(response_format={"type": "text"}).response_format is None
    assert chat(response_format={"type": "json_object"}).response_format == {"type": "json_object"}
    c = parse_completion({"model": "m", "prompt": "a", "logprobs": 3})
    assert c.logprobs and c.top_logprobs == 3
    c = parse_completion({"model": "m", "prompt": "a", "logprobs": 0})
    assert c.logprobs and c.top_logprobs == 0
    assert not parse_completion({"model": "m", "prompt": "a"}).logprobs


def test_completion_requests():
    r = parse_completion({"model": "m", "prompt": "abc"})
    assert r.prompt == "abc" and r.max_tokens == 16 and not r.stream      # OpenAI's default 16
    assert parse_completion({"model": "m", "prompt": ["abc"]}).prompt == "abc"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion({"model": "m", "prompt": [[4, 5]]}).prompt == [4, 5]
    for body, fragment in (({"model": "m", "prompt": ["a", "b"]}, "several prompts"),
                           ({"model": "m", "prompt": ""}, "non-empty string"),
                           ({"model": "m", "prompt": [1, "a"]}, "non-empty string"),
                           ({"model": "m", "prompt": "a", "echo": True}, "not echoed"),
                           ({"model": "m", "prompt": "a", "messages": U}, "unknown field")):
        with pytest.raises(APIError) as e:
            parse_completion(body)
        assert fragment in e.value.message, body


def test_chunk_delta_today_and_with_parsed_fields():
    assert protocol.chunk_delta(GenerationChunk("Hello", 5)) == {"content": "Hello"}
    assert protocol.chunk_delta(GenerationChunk("", 5)) == {}

    class Call:
        index, id, name, arguments = 1, "call_x", "f", '{"a": 1}'

        def to_openai(self):
            return {"id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}

    class Err:
        raw = "<tool_call>\n<function=f"

    class Chunk:
        text, reasoning, tool_calls, tool_call_errors = "x", "why", [Call()], [Err()]

    d = protocol.chunk_delta(Chunk())
    assert d == {"reasoning_content": "why", "content": "x<tool_call>\n<function=f",
                 "tool_calls": [{"index": 1, "id": "call_x", "type": "function",
                                 "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    msg = {"role": "assistant", "content": None}
    protocol.merge_delta(msg, d)
    protocol.merge_delta(msg, {"content": "y"})
    assert msg == {"role": "assistant", "content": "x<tool_call>\n<function=fy",
                   "reasoning_content": "why",
                   "tool_calls": [{"id": "call_x", "type": "function",
                                   "function": {"name": "f", "arguments": '{"a": 1}'}}]}


def test_usage_and_finish_reason():
    s = GenerationStats(30, 12, 18, 5, 0.1, 0.1, "reference")
    assert protocol.usage(s) == {"prompt_tokens": 30, "completion_tokens": 5,
                                 "total_tokens": 35, "prompt_tokens_details": {"cached_tokens": 12}}
    assert protocol.finish_reason("context_length", False) == "length"
    assert protocol.finish_reason("stop", True) == "tool_calls"
    assert protocol.finish_reason("stop", False) == "stop"
    assert protocol.finish_reason(None, False) is None
    json.dumps(protocol.usage(None))
