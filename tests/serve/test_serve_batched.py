"""A real ``lily-py serve --backend emu`` process batches concurrent clients (issue 42): eight
streaming clients at once, one of them disconnecting mid-stream, the others' answers equal to
each prompt's single-stream greedy answer on the same backend (no lost or crossed tokens), and
the server free and correct afterwards."""
from __future__ import annotations

import threading

import pytest

import lily_py
from engine_backend import require_engine

require_engine()

NAME = "lily-py-demo"
CONTEXT = 256
MAX_TOKENS = 12
PROMPTS = [f"And the {w} of the LORD" for w in
           ("word", "hand", "angel", "glory", "spirit", "house", "name", "voice")]
LEAVER = 3          # this client closes its stream after two chunks


@pytest.fixture(scope="module")
def server(serve_factory):
    return serve_factory("--backend", "emu", "--context", str(CONTEXT), "--max-queue", "8")


@pytest.fixture(scope="module")
def want():
    m = lily_py.load(backend="emu", context_length=CONTEXT)
    out = []
    for p in PROMPTS:
        m.reset()
        out.append(m.generate_text(p, max_tokens=MAX_TOKENS).text)
    return out


def test_eight_streams_at_once_and_a_disconnect(server, want):
    before = server.wait_idle()
    assert before["max_batch"] == 8
    start = threading.Barrier(len(PROMPTS))
    results: dict[int, str] = {}
    errors = []

    def run(i: int) -> None:
        try:
            c = server.client()
            start.wait(30)
            parts = c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                         temperature=0, stream=True)
            text = []
            for p in parts:
                if p.choices and p.choices[0].text:
                    text.append(p.choices[0].text)
                if i == LEAVER and len(text) == 2:
                    parts.close()           # the connection goes away mid-generation
                    break
            results[i] = "".join(text)
        except Exception as e:     # reported below
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for i, w in enumerate(want):
        if i != LEAVER:
            assert results[i] == w, f"client {i}: {results[i]!r} != alone {w!r}"
    assert want[LEAVER].startswith(results[LEAVER])
    after = server.wait_idle(timeout=60)
    assert after["completed"] == before["completed"] + 7
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["failed"] == before["failed"] and after["rejected"] == before["rejected"]
    # they decoded together (8 requests sent at once, 12 tokens each, steps of milliseconds)
    assert after["peak_batch"] >= 2, after
    # the server is free, and the next answer is right
    r = server.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0)
    assert r.choices[0].text == want[0]
