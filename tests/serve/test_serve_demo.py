"""A real ``lily-py serve`` process on the bundled demo checkpoint, driven by the official
``openai`` client over loopback HTTP. Answers are compared with the Python API run in-process
(greedy, so they must be identical)."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

import lily_py

DEMO = "lily-py-demo"
CONTEXT = 256       # small, so that a prompt past the context is cheap to send


@pytest.fixture(scope="module")
def server(serve_factory):
    return serve_factory("--context", str(CONTEXT), "--max-queue", "8")


@pytest.fixture(scope="module")
def local():
    """The same checkpoint in-process: what the server must answer."""
    return lily_py.load(context_length=CONTEXT)


def expected(local, prompt, max_tokens, **kw):
    local.reset()
    return local.generate_text(prompt, max_tokens=max_tokens, temperature=0.0, **kw)


def chat_ids_head(local, messages) -> int:
    """Tokens of the conversation before the generation prompt (where the state is kept)."""
    tok = local.tokenizer
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False)))


def post(server, path, body: bytes, headers=None):
    req = urllib.request.Request(server.base + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [DEMO]
    assert server.client().models.retrieve(DEMO).id == DEMO
    h = server.health()
    assert h["status"] == "ok" and h["model"] == DEMO and h["backend"] == "reference"
    assert h["context_length"] == CONTEXT and h["max_queue"] == 8


def test_chat_non_streaming(server, local):
    messages = [{"role": "user", "content": "Recite Genesis 1:3."}]
    r = server.client().chat.completions.create(model=DEMO, messages=messages, max_tokens=6,
                                                temperature=0)
    want = expected(local, messages, 6)
    assert r.object == "chat.completion" and r.model == DEMO
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == want.stats.prompt_tokens
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == want.stats.prompt_tokens + 6


def test_chat_streaming_matches_non_streaming(server, local):
    messages = [{"role": "system", "content": "Answer in the words of the King James Bible."},
                {"role": "user", "content": "Who made the light?"}]
    stream = server.client().chat.completions.create(
        model=DEMO, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    want = expected(local, messages, 5)
    assert text == want.text
    assert chunks[-1].usage.prompt_tokens == want.stats.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_stream_and_not(server, local):
    prompt = "And God said, Let there be"
    want = expected(local, prompt, 4)
    c = server.client()
    r = c.completions.create(model=DEMO, prompt=prompt, max_tokens=4, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == want.stats.prompt_tokens and r.usage.completion_tokens == 4
    parts = list(c.completions.create(model=DEMO, prompt=prompt, max_tokens=4, temperature=0,
                                      stream=True))
    assert "".join(p.choices[0].text for p in parts) == want.text
    assert parts[-1].choices[0].finish_reason == "length"
    # token ids as the prompt, and a stop string that ends the text early
    ids = local.tokenizer.encode(prompt)
    stop = want.text[2:4]
    r = c.completions.create(model=DEMO, prompt=ids, max_tokens=4, temperature=0, stop=[stop])
    assert r.choices[0].text == want.text[:want.text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_sampling_parameters_and_seed(server):
    c = server.client()
    kw = dict(model=DEMO, prompt="The LORD is my", max_tokens=5, temperature=1.2, top_p=0.95,
              seed=1234, extra_body={"top_k": 40, "min_p": 0.02})
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    texts = {c.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(4)}
    assert len(texts) > 1, "different seeds all gave the same sample"


def test_cached_tokens_on_a_repeated_prefix(server, local):
    messages = [{"role": "system", "content": "Thou art a scribe."},
                {"role": "user", "content": "Recite Psalm 23:1."}]
    c = server.client()
    first = c.chat.completions.create(model=DEMO, messages=messages, max_tokens=3, temperature=0)
    again = c.chat.completions.create(model=DEMO, messages=messages, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Everything before the generation prompt comes from the kept state.
    assert again.usage.prompt_tokens_details.cached_tokens == chat_ids_head(local, messages)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    # The next turn of the same conversation reuses it too.
    turn2 = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And the next verse?"}]
    r = c.chat.completions.create(model=DEMO, messages=turn2, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= chat_ids_head(local, messages)
    # A raw prompt that extends an earlier one.
    p = "Blessed are the meek"
    c.completions.create(model=DEMO, prompt=p, max_tokens=2, temperature=0)
    r = c.completions.create(model=DEMO, prompt=p + " and the poor", max_tokens=2, temperature=0)
    # (more when the first answer began with the words added)
    assert len(local.tokenizer.encode(p)) <= r.usage.prompt_tokens_details.cached_tokens \
        < r.usage.prompt_tokens


def test_tools_reach_the_chat_template(server, local):
    # Qwen3.6's tool preamble is long: with the tools the demo's prompt no longer fits in 256
    # tokens, and the error names the exact count the template gives with these tools.
    tools = [{"type": "function", "function": {
        "name": "find_verse", "description": "Look up a verse",
        "parameters": {"type": "object", "properties": {"ref": {"type": "string"}},
                       "required": ["ref"]}}}]
    messages = [{"role": "user", "content": "Find John 3:16."}]
    tok = local.tokenizer
    n = len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tools=tools)))
    assert n > CONTEXT
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=DEMO, messages=messages, tools=tools,
                                                max_tokens=2, temperature=0)
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"the prompt has {n} tokens" in str(e.value)
    # tool_choice="none" leaves them out of the prompt
    r = server.client().chat.completions.create(model=DEMO, messages=messages, tools=tools,
                                                tool_choice="none", max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == expected(local, messages, 1).stats.prompt_tokens


def test_errors_are_openai_error_objects(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Hi"}]

    status, body = post(server, "/v1/chat/completions", b'{"model": "lily-py-demo", "messa')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    assert "not valid JSON" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=DEMO, messages=msgs, extra_body={"max_tokenz": 3})
    assert e.value.status_code == 400 and "unknown field 'max_tokenz'" in str(e.value)
    assert e.value.body["param"] == "max_tokenz"

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=DEMO, messages=msgs, temperature="0.7")
    assert "'temperature' must be a number, got string" in str(e.value)

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=DEMO, messages=msgs, max_tokens=0)
    assert "'max_tokens' must be an integer >= 1" in str(e.value)

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=DEMO, messages=[{"role": "robot", "content": "x"}])
    assert "'messages[0].role' must be one of" in str(e.value)

    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=DEMO, prompt="x", stop=123)
    assert "'stop' must be a string or an array of strings" in str(e.value)

    with pytest.raises(openai.BadRequestError) as e:       # a prompt past the context
        c.completions.create(model=DEMO, prompt="and " * (CONTEXT + 10), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"the context length is {CONTEXT}" in str(e.value)

    # any model name is served by default (an agent sends the name it was configured with)
    r = c.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=1, temperature=0)
    assert r.model == "gpt-4o" and r.usage.completion_tokens == 1

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=DEMO, messages=msgs, n=2)
    assert "'n' must be an integer in [1, 1]" in str(e.value)

    h = server.wait_idle()
    assert h["running"] == 0 and h["queued"] == 0
    # and the server still answers
    r = c.completions.create(model=DEMO, prompt="Amen", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1


def test_eight_concurrent_clients(server, local):
    prompts = [f"And the {w} of the LORD" for w in
               ("word", "hand", "angel", "glory", "spirit", "house", "name", "voice")]
    want = [expected(local, p, 3).text for p in prompts]
    before = server.wait_idle()
    results: dict[int, str] = {}
    errors = []

    def run(i: int) -> None:
        try:
            c = server.client()
            if i % 2:
                parts = c.completions.create(model=DEMO, prompt=prompts[i], max_tokens=3,
                                             temperature=0, stream=True)
                results[i] = "".join(p.choices[0].text for p in parts)
            else:
                results[i] = c.completions.create(model=DEMO, prompt=prompts[i], max_tokens=3,
                                                  temperature=0).choices[0].text
        except Exception as e:     # reported below
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert [results.get(i) for i in range(8)] == want
    after = server.wait_idle()
    assert after["completed"] == before["completed"] + 8
    assert after["rejected"] == before["rejected"] and after["failed"] == before["failed"]


def test_client_that_disconnects_mid_stream(server, local):
    before = server.wait_idle()
    c = server.client()
    stream = c.chat.completions.create(model=DEMO, max_tokens=CONTEXT, temperature=0,
                                       stream=True,
                                       messages=[{"role": "user", "content": "Recite Job 1."}])
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 2:
            break
    stream.close()          # the connection goes away mid-generation
    after = server.wait_idle(timeout=30)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]
    # the model is free and answers the next request correctly
    r = c.completions.create(model=DEMO, prompt="In the beginning", max_tokens=3, temperature=0)
    assert r.choices[0].text == expected(local, "In the beginning", 3).text


def test_api_key_and_graceful_shutdown(serve_factory):
    srv = serve_factory("--api-key", "s3cret", "--context", str(CONTEXT), "--model-name", DEMO,
                        "--served-model-name", "qwen3.6")
    with pytest.raises(openai.AuthenticationError) as e:
        srv.client(api_key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    one = b'{"model": "qwen3.6", "prompt": "x", "max_tokens": 1}'
    status, body = post(srv, "/v1/completions", one)
    assert status == 401
    status, body = post(srv, "/v1/completions", one, headers={"x-api-key": "s3cret"})
    assert status == 200 and body["model"] == "qwen3.6"       # Anthropic's header works too
    assert srv.health()["status"] == "ok"           # /health needs no key
    c = srv.client(api_key="s3cret")
    # --served-model-name: only these names (and --model-name, listed first)
    assert [m.id for m in c.models.list().data] == [DEMO, "qwen3.6"]
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and "'qwen3.6'" in str(e.value)
    # SIGTERM while a stream runs: the stream still ends properly, then the process exits 0.
    want = c.completions.create(model=DEMO, prompt="In the beginning", max_tokens=6,
                                temperature=0).choices[0].text
    stream = c.completions.create(model=DEMO, prompt="In the beginning", max_tokens=6,
                                  temperature=0, stream=True)
    it = iter(stream)
    parts = [next(it)]
    srv.proc.terminate()
    parts += list(it)
    assert "".join(p.choices[0].text for p in parts) == want
    assert parts[-1].choices[0].finish_reason == "length"
    assert srv.proc.wait(60) == 0
    assert "lily-py serve: stopped" in srv.log()


def test_shutdown_timeout_stops_a_long_stream_cleanly(serve_factory):
    srv = serve_factory("--context", str(CONTEXT), "--shutdown-timeout", "0.5")
    stream = srv.client().completions.create(model=DEMO, prompt="In the beginning",
                                             max_tokens=CONTEXT, temperature=0, stream=True)
    it = iter(stream)
    next(it)
    srv.proc.terminate()
    with pytest.raises(openai.APIError, match="the server is shutting down"):
        for _ in it:
            pass
    assert srv.proc.wait(60) == 0
    log = srv.log()
    assert "lily-py serve: stopped" in log and "Traceback" not in log
