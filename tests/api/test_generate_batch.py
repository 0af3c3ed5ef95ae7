"""Model.generate_batch (issue 42): several conversations decoding at once on the engine, on the
bundled demo checkpoint.

Each request's tokens equal what generate() samples for it alone (greedy and seeded sampling,
per-request parameters), with more requests than places (a queue); no token is lost or crossed
between streams; the model's own conversation is left as it was; cancel(index) ends one stream
and leaves the others; closing early frees every sequence; bad arguments raise before anything
runs, naming the request.
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
from lily_py.errors import BusyError
from engine_backend import ENGINE, require_engine

require_engine()

PROMPTS = ["In the beginning God created", "And the earth was without form", "Let there be light",
           {"prompt": "And God said", "temperature": 0.8, "seed": 3, "max_tokens": 4},
           {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "temperature": 1.1, "top_k": 20, "seed": 9}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return lily_py.load(backend=ENGINE, context_length=256)


def alone(m, p):
    kw = dict(max_tokens=MAX_TOKENS)
    if isinstance(p, dict):
        kw.update({k: v for k, v in p.items() if k != "prompt"})
        p = p["prompt"]
    m.reset()
    r = m.generate_text(p, **kw)
    m.reset()
    m.prompt_cache.clear()   # the batch prefills (test_prompt_cache_in_a_batch restores)
    return r


def run(g):
    """Every chunk of a batch: tokens, text and the last chunk per request, in arrival order."""
    toks, text, last, order = {}, {}, {}, []
    for i, c in g:
        assert i not in last, f"request {i} got a chunk after its last one"
        order.append(i)
        if c.token is not None:
            toks.setdefault(i, []).append(c.token)
        text[i] = text.get(i, "") + c.text
        if c.finish_reason is not None:
            last[i] = c
    return toks, text, last, order


@pytest.fixture(scope="module")
def single(model):
    return [alone(model, p) for p in PROMPTS]


def test_each_request_gets_its_own_tokens(model, single):
    model.reset()
    model.prefill([5, 6, 7])
    want_next = model.decode(8)  # the conversation's next step, before the batch
    model.reset()
    model.prefill([5, 6, 7])
    e = model._backend.engine
    with model.generate_batch(PROMPTS, max_tokens=MAX_TOKENS, max_batch=3) as g:
        assert g.prompt_tokens == [len(model.prompt_ids(p["prompt"] if isinstance(p, dict) else p)) for p in PROMPTS]
        toks, text, last, order = run(g)
    for i, r in enumerate(single):
        assert toks[i] == r.tokens, f"request {i}: {toks[i]} != alone {r.tokens}"
        assert text[i] == r.text, i
        assert last[i].finish_reason == r.finish_reason, i
        assert last[i].stats.generated_tokens == len(r.tokens)
    assert len(set(order[:6])) > 1  # interleaved: the streams decode together
    # the conversation is untouched and the batch's sequences are gone
    assert model.tokens == (5, 6, 7) and e.sequences == [e.active_sequence]
    np.testing.assert_array_equal(model.decode(8), want_next)


def test_eight_at_once_and_a_ninth_queued(model):
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(9)]
    want = [alone(model, p) for p in prompts]
    toks, _, last, _ = run(model.generate_batch(prompts, max_tokens=MAX_TOKENS))
    assert [toks[i] for i in range(9)] == [r.tokens for r in want]
    assert [last[i].finish_reason for i in range(9)] == [r.finish_reason for r in want]


def test_cancel_one_leaves_the_others(model, single):
    g = model.generate_batch(PROMPTS[:3], max_tokens=MAX_TOKENS)
    toks, last = {}, {}
    for i, c in g:
        if c.token is not None:
            toks.setdefault(i, []).append(c.token)
        if i == 1 and len(toks.get(1, [])) == 2:
            g.cancel(1)
        if c.finish_reason:
            last[i] = c.finish_reason
    assert last == {0: single[0].finish_reason, 1: "cancelled", 2: single[2].finish_reason}
    assert toks[1] == single[1].tokens[:len(toks[1])] and len(toks[1]) == 3  # the next token, then stop
    assert toks[0] == single[0].tokens and toks[2] == single[2].tokens


def test_decode_steps_run_two_in_flight_without_copying_logits(model):
    """The batch's decode steps are sampled on the device and overlap: the device is idle at the
    first one only (and after a request ends early, when the rows change), each costs one host
    wait, and no logits row leaves the device (each prefill copies its last row, for the first
    token); the tokens are those generate() samples for each request alone."""
    e = model._backend.engine
    n = 9
    reqs = [dict(prompt=[40 + i, 50 + i, 60 + i], max_tokens=n, temperature=0.9, seed=i) for i in range(3)]
    want = [alone(model, r) for r in reqs]
    counters, copied = dict(e.counters), e.logit_bytes_copied
    g = model.generate_batch(reqs)
    toks, _, last, _ = run(g)
    assert [toks[i] for i in range(3)] == [r.tokens for r in want]
    assert [last[i].finish_reason for i in range(3)] == [r.finish_reason for r in want]
    grew = {k: e.counters[k] - counters[k] for k in counters}
    steps, prefills = g._batcher.steps, len(reqs)   # a prefill: one chunk, one commit, one wait
    early = sum(r.finish_reason != "length" for r in want)
    if not early:
        assert steps == n - 1
    assert grew["commits"] == grew["host_waits"] == prefills + steps, (grew, steps)
    assert prefills + 1 <= grew["idle_commits"] <= prefills + 1 + early, grew
    assert e.logit_bytes_copied - copied == prefills * model.config.vocab_size * 4


def test_a_stop_string_ends_one_stream_with_its_next_row_in_flight(model, single):
    """A stop string cannot be foreseen: request 0 ends at a step whose successor is already in
    flight. That row is dropped, the device waits once more for the host (the rows change), and
    every request's tokens are those generate() gives it alone with the same arguments."""
    e = model._backend.engine
    piece = model.tokenizer.decode(single[0].tokens[2:3])
    reqs = [dict(prompt=PROMPTS[0], stop=[piece])] + PROMPTS[1:3]
    want = [alone(model, r) for r in reqs]
    assert want[0].finish_reason == "stop" and len(want[0].tokens) < MAX_TOKENS, want[0]
    assert all(r.finish_reason == "length" for r in want[1:]), want
    counters = dict(e.counters)
    toks, text, last, _ = run(model.generate_batch(reqs, max_tokens=MAX_TOKENS))
    for i, r in enumerate(want):
        assert (toks[i], text[i], last[i].finish_reason) == (r.tokens, r.text, r.finish_reason), i
    prefills = len(reqs)
    assert e.counters["idle_commits"] - counters["idle_commits"] == prefills + 2
    assert e.sequences == [e.active_sequence]


def test_close_early_frees_every_sequence(model):
    e = model._backend.engine
    g = model.generate_batch(PROMPTS[:4], max_tokens=MAX_TOKENS)
    for n, _ in enumerate(g):
        if n == 5:
            break
    assert len(e.sequences) > 1
    with pytest.raises(BusyError):
        model.generate_text("x", max_tokens=1)
    g.close()
    assert e.sequences == [e.active_sequence]
    assert model.generate_text("In the beginning", max_tokens=2).tokens  # usable again


def test_prompt_cache_in_a_batch(model):
    """A batch snapshots its prompts' points into the prompt cache and restores them on the next
    batch (the tokens unchanged); generate() picks up a batch's snapshot too."""
    chats = [[{"role": "user", "content": f"Tell me of the {w}."}] for w in ("sea", "stars", "ark")]
    want = [alone(model, c) for c in chats]
    cache = model.prompt_cache
    hits, misses = cache.hits, cache.misses
    toks, _, last, _ = run(model.generate_batch(chats, max_tokens=MAX_TOKENS))
    assert [toks[i] for i in range(3)] == [r.tokens for r in want]
    assert all(last[i].stats.cached_tokens == 0 for i in range(3))
    assert len(cache) == 3 and (cache.hits, cache.misses) == (hits, misses + 3)
    heads = sorted(len(e.tokens) for e in cache.entries())   # the conversations before the generation prompt
    toks, _, last, _ = run(model.generate_batch(chats, max_tokens=MAX_TOKENS))
    assert [toks[i] for i in range(3)] == [r.tokens for r in want]
    got = sorted(last[i].stats.cached_tokens for i in range(3))
    assert got == heads and all(0 < h < last[0].stats.prompt_tokens for h in heads)
    assert all(last[i].stats.prefilled_tokens == last[i].stats.prompt_tokens - last[i].stats.cached_tokens
               for i in range(3))
    assert (cache.hits, cache.misses) == (hits + 3, misses + 3)
    model.reset()
    r = model.generate_text(chats[1], max_tokens=MAX_TOKENS)
    assert r.stats.cached_tokens > 0 and r.tokens == want[1].tokens
    cache.clear()
    # the same conversation twice in one batch: the second finds what the first snapshotted
    toks, _, last, _ = run(model.generate_batch([chats[2], chats[2]], max_tokens=MAX_TOKENS))
    assert toks[0] == toks[1] == want[2].tokens
    assert len(cache) == 1 and last[0].stats.cached_tokens == 0
    assert last[1].stats.cached_tokens == len(cache.entries()[0].tokens) > 0
    cache.clear()


def test_bad_arguments_name_the_request(model):
    with pytest.raises(TypeError, match="request 1: unknown keys \\['temp'\\]"):
        model.generate_batch(["a", {"prompt": "b", "temp": 1}])
    with pytest.raises(ValueError, match="request 0: temperature must be >= 0"):
        model.generate_batch([{"prompt": "a", "temperature": -1}])
    with pytest.raises(TypeError, match="non-empty list"):
        model.generate_batch("just a string")
    with pytest.raises(ValueError, match="max_batch must be in \\[1, 8\\]"):
        model.generate_batch(["a"], max_batch=9)
    with pytest.raises(lily_py.ContextLengthError, match="request 0"):
        model.generate_batch([list(range(1, 300))])
    assert model._backend.engine.sequences == [model._backend.engine.active_sequence]


def test_the_reference_backend_says_what_to_use():
    ref = lily_py.load(backend="reference", context_length=64)
    with pytest.raises(NotImplementedError, match="backend='emu'"):
        ref.generate_batch(["a"])
