"""The server's real path (Starlette app, scheduler, uvicorn, loopback HTTP, openai client) around
a scripted model: reasoning and tool calls the demo model cannot produce, queue limits and
cancellation at exact points. The scripted chunks have the fields of lily_py's GenerationChunk
(text, token, finish_reason, stats, reasoning, tool_calls, tool_call_errors)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import openai
import pytest

from lily_py import ContextLengthError, GenerationStats


@dataclass
class Call:
    id: str
    name: str
    arguments: str
    index: int

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class BadCall:
    raw: str
    message: str
    index: int


@dataclass
class Chunk:
    text: str = ""
    token: int | None = 1
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)
    tool_call_errors: list = field(default_factory=list)
    error: str = ""


def stats(n: int, prompt: int = 11, reused: int = 4) -> GenerationStats:
    return GenerationStats(prompt, reused, prompt - reused, n, 0.01, 0.01, "scripted")


class ScriptedModel:
    """Yields ``script`` (a list of Chunk); records every call; ``gate`` (an Event) holds each
    chunk until set; ``delay`` sleeps between chunks."""

    backend = "scripted"
    context_length = 64

    def __init__(self, script=(), *, gate=None, delay=0.0, error=None):
        self.script, self.gate, self.delay, self.error = list(script), gate, delay, error
        self.tokenizer = SimpleNamespace(chat_template="(scripted)")
        self.calls: list[tuple] = []
        self.closed = threading.Event()
        self.cancels = 0

    def generate(self, prompt, *, max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                 seed=None, stop=None, enable_thinking=None, tools=None,
                 chat_template_kwargs=None):
        self.calls.append((prompt, dict(max_tokens=max_tokens, temperature=temperature,
                                        top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                        stop=stop, enable_thinking=enable_thinking, tools=tools,
                                        chat_template_kwargs=chat_template_kwargs)))
        if self.error is not None:
            raise self.error
        return self._run()

    def _run(self):
        try:
            for c in self.script:
                if self.gate is not None:
                    assert self.gate.wait(30), "gate never opened"
                time.sleep(self.delay)
                yield c
        finally:
            self.closed.set()

    def cancel(self):
        self.cancels += 1


MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}]
CALL = Call("call_0123456789abcdef01234567", "get_weather", '{"city": "Paris", "days": 2}', 0)
TOOL_SCRIPT = [Chunk(reasoning="The user wants "), Chunk(reasoning="the weather."),
               Chunk(text="Let me check."), Chunk(tool_calls=[CALL]),
               Chunk(finish_reason="tool_calls", stats=stats(9))]


def test_reasoning_and_tool_call_not_streamed(inproc):
    model = ScriptedModel(TOOL_SCRIPT)
    s = inproc(model)
    r = s.client().chat.completions.create(
        model="scripted", messages=MSGS, tools=TOOLS, max_completion_tokens=20, seed=5,
        temperature=0.6, top_p=0.9, extra_body={"top_k": 20, "min_p": 0.05,
                                                "chat_template_kwargs": {"enable_thinking": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me check."
    assert msg.model_extra["reasoning_content"] == "The user wants the weather."
    assert len(msg.tool_calls) == 1
    tc = msg.tool_calls[0]
    assert (tc.id, tc.type, tc.function.name) == (CALL.id, "function", "get_weather")
    assert json.loads(tc.function.arguments) == {"city": "Paris", "days": 2}
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens_details.cached_tokens == 4
    # what reached the model: the messages, tools unchanged, every sampling parameter
    prompt, kw = model.calls[0]
    assert prompt == MSGS and kw["tools"] == TOOLS
    assert kw == dict(max_tokens=20, temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, seed=5,
                      stop=[], enable_thinking=True, tools=TOOLS, chat_template_kwargs=None)


def test_reasoning_and_tool_call_streamed(inproc):
    s = inproc(ScriptedModel(TOOL_SCRIPT))
    chunks = list(s.client().chat.completions.create(
        model="scripted", messages=MSGS, tools=TOOLS, stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas]
    assert [x for x in reasoning if x] == ["The user wants ", "the weather."]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id == CALL.id
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4


def test_tool_results_and_reasoning_go_back_to_the_template(inproc):
    model = ScriptedModel([Chunk(text="It is sunny.", finish_reason="stop", stats=stats(4))])
    s = inproc(model)
    history = MSGS + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [CALL.to_openai()]},
        {"role": "tool", "tool_call_id": CALL.id, "content": '{"sky": "clear"}'}]
    r = s.client().chat.completions.create(model="scripted", messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny."
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    prompt, _ = model.calls[0]
    assert prompt[1] == {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
                         "tool_calls": [{"id": CALL.id, "type": "function", "function": {
                             "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
    assert prompt[2] == {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": CALL.id}


def test_malformed_tool_call_is_reported_as_text(inproc):
    raw = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"
    s = inproc(ScriptedModel([Chunk(text="Checking. "),
                             Chunk(tool_call_errors=[BadCall(raw, "unterminated", 0)]),
                             Chunk(finish_reason="stop", stats=stats(7))]))
    r = s.client().chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS)
    assert r.choices[0].message.content == "Checking. " + raw
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_finish_reasons_map_to_openai(inproc):
    for given, want in (("context_length", "length"), ("length", "length"), ("stop", "stop")):
        s = inproc(ScriptedModel([Chunk(text="x", finish_reason=given, stats=stats(1))]))
        r = s.client().completions.create(model="scripted", prompt="p")
        assert r.choices[0].finish_reason == want
    # an EOS after a tool call (a lily_py that reports plain "stop") is still "tool_calls"
    s = inproc(ScriptedModel([Chunk(tool_calls=[CALL]), Chunk(finish_reason="stop",
                                                            stats=stats(2))]))
    r = s.client().chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"


def test_chat_without_max_tokens_gets_the_default_cap(inproc):
    """A chat request without max_tokens stops at the server's cap (--max-tokens), not at the
    end of the context; a completion keeps OpenAI's 16."""
    from lily_py.serve.app import DEFAULT_MAX_TOKENS
    from lily_py.serve.cli import DEFAULT_MAX_TOKENS as CLI_DEFAULT
    assert DEFAULT_MAX_TOKENS == CLI_DEFAULT == 32768
    done = [Chunk(text="x", finish_reason="stop", stats=stats(1))]
    model = ScriptedModel(done)
    s = inproc(model)
    s.client().chat.completions.create(model="scripted", messages=MSGS)
    s.client().completions.create(model="scripted", prompt="p")
    assert [kw["max_tokens"] for _, kw in model.calls] == [DEFAULT_MAX_TOKENS, 16]
    model = ScriptedModel(done)
    s = inproc(model, default_max_tokens=100)
    s.client().chat.completions.create(model="scripted", messages=MSGS)
    assert model.calls[0][1]["max_tokens"] == 100


def test_messages_reasoning_and_tool_use(inproc, tmp_path):
    """/v1/messages around the same script: thinking, text and tool_use blocks, whole and
    streamed; sampling fields left out come from the checkpoint's generation_config.json."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    model = ScriptedModel(TOOL_SCRIPT)
    model.path = str(tmp_path)
    c = inproc(model).anthropic()
    tools = [{"name": "get_weather", "description": "Current weather",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    r = c.messages.create(model="claude-sonnet-4-5", max_tokens=20, messages=MSGS, tools=tools,
                          thinking={"type": "enabled", "budget_tokens": 1024},
                          extra_body={"top_p": 0.5})
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"]
    assert r.content[0].thinking == "The user wants the weather."
    assert r.content[1].text == "Let me check."
    assert r.content[2].input == {"city": "Paris", "days": 2} and r.content[2].id.startswith(
        "toolu_")
    assert r.stop_reason == "tool_use"
    assert (r.usage.input_tokens, r.usage.cache_read_input_tokens, r.usage.output_tokens) == \
        (7, 4, 9)
    prompt, kw = model.calls[0]
    assert prompt == MSGS and kw["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"],
        "description": "Current weather"}}]
    assert (kw["max_tokens"], kw["enable_thinking"]) == (20, True)
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.6, 0.5, 20)
    with c.messages.stream(model="m", max_tokens=20, messages=MSGS, tools=tools,
                           thinking={"type": "enabled", "budget_tokens": 1024}) as st:
        kinds = [e.type for e in st if e.type in ("thinking", "text", "input_json")]
        final = st.get_final_message()
    assert kinds == ["thinking", "thinking", "text", "input_json"]
    assert [b.model_dump(exclude={"id"}, exclude_none=True) for b in final.content] == \
        [b.model_dump(exclude={"id"}, exclude_none=True) for b in r.content]


def test_messages_dead_end_is_an_error_event(inproc):
    import anthropic
    why = "the constraint admits no token here (a dead end: ...)"
    script = [Chunk(text='{"a":'), Chunk(token=None, finish_reason="error", stats=stats(3),
                                         error=why)]
    s = inproc(ScriptedModel(script))
    with pytest.raises(anthropic.InternalServerError) as e:
        s.anthropic().messages.create(model="m", max_tokens=5, messages=MSGS)
    assert e.value.body["error"]["type"] == "api_error" and why in str(e.value)
    s = inproc(ScriptedModel(script))
    with pytest.raises(anthropic.APIStatusError) as e:
        with s.anthropic().messages.stream(model="m", max_tokens=5, messages=MSGS) as st:
            for _ in st:
                pass
    assert why in str(e.value)


def test_constraint_dead_end_is_an_error_not_a_stop(inproc):
    """finish_reason "error" (a constraint with no allowed token, not at an accepting state):
    a 500 error object, as vLLM answers a generation that finished with an error; streamed,
    the text so far, then an error event before [DONE] (the client raises), never "stop"."""
    why = "the constraint admits no token here (a dead end: ...)"
    script = [Chunk(text='{"a":'), Chunk(token=None, finish_reason="error", stats=stats(3), error=why)]
    s = inproc(ScriptedModel(script))
    with pytest.raises(openai.InternalServerError) as e:
        s.client().chat.completions.create(model="scripted", messages=MSGS)
    assert e.value.status_code == 500 and e.value.body["code"] == "constraint_dead_end"
    assert why in e.value.body["message"] and e.value.body["type"] == "server_error"
    with pytest.raises(openai.InternalServerError):
        s.client().completions.create(model="scripted", prompt="p")
    s = inproc(ScriptedModel(script))
    got = []
    with pytest.raises(openai.APIError) as e:
        for c in s.client().chat.completions.create(model="scripted", messages=MSGS, stream=True):
            got += [c.choices[0].delta.content or "", c.choices[0].finish_reason] if c.choices else []
    assert "".join(x for x in got if x not in (None, "stop")) == '{"a":' and "stop" not in got
    assert why in str(e.value)


def test_context_length_error_is_400(inproc):
    s = inproc(ScriptedModel(error=ContextLengthError("the prompt has 99 tokens; the context "
                                                     "length is 64")))
    with pytest.raises(openai.BadRequestError) as e:
        s.client().chat.completions.create(model="scripted", messages=MSGS, stream=True)
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["param"] == "messages"
    # the worker records the failure after the 400 is on its way: allow it a moment (bounded)
    deadline = time.monotonic() + 5.0
    while s.status()["running"] != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.status()["failed"] == 1 and s.status()["running"] == 0


def test_queue_full_is_503_and_fifo(inproc):
    gate = threading.Event()
    model = ScriptedModel([Chunk(text="a"), Chunk(text="b", finish_reason="length",
                                                  stats=stats(2))], gate=gate)
    s = inproc(model, max_queue=1)
    out, errors = {}, []

    def run(name):
        try:
            out[name] = s.client().completions.create(model="scripted", prompt=name).choices[0]
        except Exception as e:
            errors.append(e)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    wait_for(lambda: s.status()["running"] == 1)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    wait_for(lambda: s.status()["queued"] == 1)
    with pytest.raises(openai.InternalServerError) as e:       # 5xx
        s.client().completions.create(model="scripted", prompt="third")
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    assert e.value.response.headers["retry-after"] == "1"
    gate.set()
    first.join(30)
    second.join(30)
    assert not errors and out["first"].text == out["second"].text == "ab"
    assert [c[0] for c in model.calls] == ["first", "second"]      # FIFO; "third" never ran
    # the worker releases its slot just after the response's last byte: wait for it
    wait_for(lambda: s.status()["running"] == 0)
    assert s.status() == {"running": 0, "queued": 0, "max_queue": 1, "completed": 2,
                          "cancelled": 0, "failed": 0, "rejected": 1,
                          # a scripted model has no batched step: one request at a time
                          "max_batch": 1, "batched_steps": 0, "peak_batch": 0}


def test_disconnect_while_queued_leaves_the_queue(inproc):
    import httpx
    gate = threading.Event()
    model = ScriptedModel([Chunk(text="a", finish_reason="length", stats=stats(1))], gate=gate)
    s = inproc(model, max_queue=4)
    t = threading.Thread(target=lambda: s.client().completions.create(model="scripted",
                                                                      prompt="first"))
    t.start()
    wait_for(lambda: s.status()["running"] == 1)
    with pytest.raises(httpx.ReadTimeout):       # gives up while waiting in the queue
        httpx.post(s.base + "/v1/completions", json={"model": "scripted", "prompt": "gone"},
                   timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: s.status()["queued"] == 0)
    assert s.status()["cancelled"] == 1
    gate.set()
    t.join(30)
    assert [c[0] for c in model.calls] == ["first"]      # the abandoned request never ran


def test_disconnect_mid_stream_closes_the_generator(inproc):
    endless = [Chunk(text=f"{i} ") for i in range(100000)]
    model = ScriptedModel(endless, delay=0.002)
    s = inproc(model)
    stream = s.client().completions.create(model="scripted", prompt="p", stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert model.closed.wait(10), "the generation was not closed after the client left"
    wait_for(lambda: s.status()["running"] == 0)
    assert s.status()["cancelled"] == 1 and model.cancels == 1
    # the next request runs
    model.script = [Chunk(text="ok", finish_reason="stop", stats=stats(1))]
    model.delay = 0
    assert s.client().completions.create(model="scripted", prompt="q").choices[0].text == "ok"


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_scheduler_stop_answers_what_waits():
    import asyncio

    from lily_py.serve.scheduler import CHUNK, DONE, ERROR, START, Job, Scheduler, ShuttingDown

    async def main():
        gate = threading.Event()
        model = ScriptedModel([Chunk(text=str(i)) for i in range(1000)], gate=gate)
        sched = Scheduler(model, max_queue=2)
        loop = asyncio.get_running_loop()
        running, waiting = Job("a", {}, loop), Job("b", {}, loop)
        sched.submit(running)
        sched.submit(waiting)
        assert (await running.events.get())[0] == START
        await asyncio.to_thread(wait_for, lambda: sched.status()["running"] == 1)
        gate.set()
        await asyncio.to_thread(sched.stop)
        kind, err = await waiting.events.get()
        assert kind == ERROR and isinstance(err, ShuttingDown)
        kinds = []
        while not kinds or kinds[-1] != DONE:
            kinds.append((await running.events.get())[0])
        assert set(kinds[:-1]) <= {CHUNK} and len(kinds) < 1000     # stopped, not finished
        assert model.closed.is_set() and model.cancels == 1
        with pytest.raises(ShuttingDown):
            sched.submit(Job("c", {}, loop))
        assert [c[0] for c in model.calls] == ["a"]

    asyncio.run(main())
