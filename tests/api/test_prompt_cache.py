"""The prompt cache: a radix tree of whole-state snapshots with LRU eviction by bytes; hits across
conversations; the state after a hit is bit-identical to prefilling the same tokens (reference
and emulator backends)."""
import numpy as np
import pytest

import lily_py
import lily_py.prompts
from lily_py import PromptCache
from lily_py.prompts import system_end

SYSTEM = ("You are a careful assistant for the King James Bible. Answer in one short verse, "
          "quote the book and the chapter, and never invent a verse that is not there. ") * 3


def arr(n):
    return np.zeros(n, np.float32)        # stands in for logits (n * 4 bytes)


def test_radix_tree_longest_prefix_and_pruning():
    c = PromptCache(10_000)
    c.insert([1, 2, 3, 4], "a", None, 10)
    c.insert([1, 2], "b", None, 10)                 # splits the edge
    c.insert([1, 2, 3, 9, 9], "c", None, 10)        # splits again, below
    c.insert([5], "d", None, 10)
    assert c.lookup([1, 2, 3, 4, 5, 6]).state == "a"
    assert c.lookup([1, 2, 3, 9, 9]).state == "c"
    assert c.lookup([1, 2, 3, 9]).state == "b"
    assert c.lookup([1, 2]).state == "b"
    assert c.lookup([1]) is None and c.lookup([7, 1, 2]) is None and c.lookup([]) is None
    assert (c.hits, c.misses) == (4, 3)
    assert len(c) == 4 and c.nbytes == 40 and [1, 2] in c
    assert c.remove([1, 2]) and not c.remove([1, 2])
    assert c.lookup([1, 2, 3]) is None and c.lookup([1, 2, 3, 4]).state == "a"
    c.remove([1, 2, 3, 4])
    assert c.lookup([1, 2, 3, 9, 9, 1]).state == "c"
    # after the removals the tree holds one merged edge per remaining entry
    assert sorted(len(e) for e, _ in c._root.children.values()) == [1, 5]
    c.insert([1, 2, 3, 9, 9], "c2", arr(5), 10)         # replace: bytes include the logits
    assert c.lookup([1, 2, 3, 9, 9]).state == "c2" and c.nbytes == 10 + 30
    c.clear()
    assert len(c) == 0 and c.nbytes == 0 and c.lookup([5]) is None


def test_lru_eviction_by_bytes():
    c = PromptCache(100)
    c.insert([1], "a", None, 40)
    c.insert([2], "b", None, 40)
    c.lookup([1, 0])                                   # a is now the most recently used
    c.insert([3], "c", None, 40)                       # evicts b
    assert [e.state for e in c.entries()] == ["a", "c"] and c.nbytes == 80 and c.evictions == 1
    assert c.insert([4], "huge", None, 101) is None    # over the budget alone: not kept
    assert len(c) == 2
    c.max_bytes = 50                                   # shrinking evicts LRU first
    assert [e.state for e in c.entries()] == ["c"]
    with pytest.raises(ValueError, match="non-negative integer"):
        c.max_bytes = -1
    with pytest.raises(ValueError, match="non-negative integer"):
        lily_py.load(prompt_cache_bytes=1.5)


def conv(user, reply=None, more=None, system=SYSTEM):
    m = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if reply is not None:
        m += [{"role": "assistant", "content": reply}, {"role": "user", "content": more}]
    return m


def head_len(model, msgs):
    t = model.tokenizer
    return len(t.encode(t.apply_chat_template(msgs, add_generation_prompt=False,
                                              enable_thinking=False)))


def test_switching_conversations_and_shared_system_prompt():
    m = lily_py.load(backend="reference")
    kw = dict(max_tokens=4, enable_thinking=False)
    sys_end = system_end(m.tokenizer, conv("x"), m.prompt_ids(conv("x")), None)
    assert sys_end >= lily_py.prompts.SYSTEM_SNAPSHOT_MIN_TOKENS
    a1 = m.generate_text(conv("In the beginning"), **kw)
    assert a1.stats.reused_tokens == 0 and len(m.prompt_cache) == 2   # system end + prompt end
    # another conversation with the same system prompt: only its own part is prefilled
    b1 = m.generate_text(conv("And God said"), **kw)
    assert b1.stats.cached_tokens == b1.stats.reused_tokens == sys_end
    assert b1.stats.prefilled_tokens == b1.stats.prompt_tokens - sys_end
    # back to the first conversation: restored at the end of its first prompt
    a2 = m.generate_text(conv("In the beginning", a1.text, "Go on"), **kw)
    assert a2.stats.cached_tokens == head_len(m, conv("In the beginning"))
    assert "from the prompt cache" in str(a2.stats)
    # and to the second
    b2 = m.generate_text(conv("And God said", b1.text, "Then?"), **kw)
    assert b2.stats.cached_tokens == head_len(m, conv("And God said"))
    assert m.prompt_cache.hits == 3 and m.prompt_cache.misses == 1
    # the same request again: the whole conversation before the generation prompt is cached
    again = m.generate_text(conv("And God said", b1.text, "Then?"), **kw)
    assert again.stats.cached_tokens == head_len(m, conv("And God said", b1.text, "Then?"))
    assert again.tokens == b2.tokens
    # results equal a model without a cache
    fresh = lily_py.load(backend="reference", prompt_cache_bytes=0)
    assert fresh.generate_text(conv("And God said", b1.text, "Then?"), **kw).tokens == b2.tokens
    assert len(fresh.prompt_cache) == 0


def test_eviction_under_the_budget_turns_hits_into_misses():
    m = lily_py.load(backend="reference")
    ids = [m.tokenizer.encode(f"Verse {i}: in the beginning") for i in range(3)]
    m.generate_text(ids[0], max_tokens=2)
    one = m.prompt_cache.nbytes
    m.prompt_cache.max_bytes = int(one * 2.5)          # room for two snapshots
    for p in ids[1:]:
        m.generate_text(p, max_tokens=2)
    assert len(m.prompt_cache) == 2 and m.prompt_cache.nbytes <= m.prompt_cache.max_bytes
    assert ids[0] not in m.prompt_cache and ids[2] in m.prompt_cache
    r = m.generate_text(ids[0] + [5], max_tokens=2)      # evicted: prefilled again
    assert r.stats.cached_tokens == 0 and r.stats.prefilled_tokens == len(ids[0]) + 1
    r = m.generate_text(ids[2] + [5], max_tokens=2)      # ids[1] was evicted by that, not ids[2]
    assert r.stats.cached_tokens == len(ids[2])


def state_bytes(model):
    b = model._backend
    return b.snapshot_bytes(b.snapshot())


@pytest.mark.parametrize("backend", ["reference", "emu"])
def test_state_after_a_hit_is_bit_identical(backend, monkeypatch):
    # a short system prompt (the emulator is slow) that still gets its own snapshot
    monkeypatch.setattr(lily_py.prompts, "SYSTEM_SNAPSHOT_MIN_TOKENS", 8)
    kw = dict(max_tokens=3, enable_thinking=False)
    m = lily_py.load(backend=backend, context_length=256)
    a1 = conv("In the beginning", system="Answer in one verse of the Bible.")
    m.generate_text(a1, **kw)
    m.generate_text(conv("And God said", system=a1[0]["content"]), **kw)   # live state elsewhere
    a2 = conv("In the beginning", "God created", "Go on", system=a1[0]["content"])
    ids = m.prompt_ids(a2, enable_thinking=False)
    sys_end, b1, b2 = system_end(m.tokenizer, a2, ids, None), head_len(m, a1), head_len(m, a2)
    assert 8 <= sys_end < b1 < b2 < len(ids) and ids[:sys_end] in m.prompt_cache
    entry = m.prompt_cache.lookup(ids, count=False)
    assert len(entry.tokens) == b1
    # a fresh model without a cache, fed the same tokens in the same pieces
    f = lily_py.load(backend=backend, context_length=256, prompt_cache_bytes=0)
    f.prefill(ids[:sys_end])
    f.prefill(ids[sys_end:b1])
    assert m._backend.snapshot_bytes(entry.state) == state_bytes(f)
    r = m.generate_text(a2, **kw)
    assert r.stats.cached_tokens == b1
    f.prefill(ids[b1:b2])
    assert m._backend.snapshot_bytes(m.prompt_cache.lookup(ids[:b2], count=False).state) == \
        state_bytes(f)
    f.prefill(ids[b2:])
    g = f.generate_text(ids, **dict(kw, enable_thinking=None))   # everything is in the state
    assert g.stats.reused_tokens == len(ids) and g.tokens == r.tokens
    assert list(f.tokens) == list(m.tokens) and state_bytes(f) == state_bytes(m)


def test_restoring_a_short_snapshot_never_touches_a_longer_one():
    """The reference backend's KV buffers grow in place; a snapshot must not share them."""
    m = lily_py.load(backend="reference")
    x = m.tokenizer.encode("In the beginning God")
    m.generate_text(x, max_tokens=1)
    xy = list(m.tokens) + m.tokenizer.encode(" and the earth")
    m.generate_text(xy, max_tokens=1)                      # live reuse, snapshot at xy
    before = m._backend.snapshot_bytes(m.prompt_cache.lookup(xy, count=False).state)
    r = m.generate_text(x + m.tokenizer.encode(" said, Let there be"), max_tokens=3)
    assert r.stats.cached_tokens == len(x)
    after = m.prompt_cache.lookup(xy, count=False)
    assert m._backend.snapshot_bytes(after.state) == before
    r2 = m.generate_text(xy + [7], max_tokens=3)
    fresh = lily_py.load(backend="reference", prompt_cache_bytes=0)
    assert list(m.tokens[:len(x)]) == x
    fresh.prefill(x)
    fresh.prefill(xy[len(x):])
    assert fresh.generate_text(xy + [7], max_tokens=3).tokens == r2.tokens


@pytest.mark.parametrize("backend", ["reference", "emu"])
def test_snapshot_sizes_are_what_sizes_says(backend):
    """lily_py.sizes.snapshot_bytes (the README's snapshot figures for the real model) is what a
    snapshot measures: on the engine the KV cache in whole blocks, on the reference exact rows."""
    from lily_py import sizes
    block = 32
    m = lily_py.load(backend=backend, context_length=256,
                     kv_block_tokens=block if backend == "emu" else None)
    b = m._backend
    for n in (5, block, block + 1):
        m.reset()
        m.prefill(list(range(1, n + 1)))
        want = sizes.snapshot_bytes(m.config, n, engine=backend != "reference", block_tokens=block)
        assert b.snapshot_nbytes(b.snapshot()) == want["total"], n
    if backend == "emu":   # 33 tokens take two blocks, 32 one
        assert sizes.snapshot_bytes(m.config, block + 1, block_tokens=block)["kv"] == \
            2 * sizes.snapshot_bytes(m.config, block, block_tokens=block)["kv"]
