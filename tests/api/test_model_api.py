"""The Python API contract: prefill / decode / reset / generate, on a random-weight model with a
Qwen-style tokenizer and chat template (tests/fixtures/chat/tokenizer, 575 ids; the model's
vocabulary is padded to 640 rows like the real model's)."""
import numpy as np
import pytest

import lily_py
from lily_py import BackendError, BusyError, ContextLengthError
from lily_py.sampling import SamplingParams, sample


@pytest.fixture(scope="module")
def ckpt(chat_ckpt):
    return chat_ckpt


@pytest.fixture
def model(ckpt):
    return lily_py.load(ckpt, backend="reference")


def manual_loop(model, ids, n, params=SamplingParams(), seed=0):
    """Reference loop over the explicit API: what generate() must reproduce."""
    model.reset()
    logits = model.prefill(ids)
    out = []
    for step in range(n):
        masked = logits.copy()
        masked[model.tokenizer.vocab_size:] = -np.inf
        t = sample(masked, params, step, seed)
        out.append(t)
        logits = model.decode(t)
    return out


def test_prefill_decode_shapes(model):
    ids = model.tokenizer.encode("hello world")
    a = model.prefill(ids, all_logits=True)
    assert a.shape == (len(ids), 640) and a.dtype == np.float32
    assert model.position == len(ids) and model.tokens == tuple(ids)
    d = model.decode(5)
    assert d.shape == (640,) and model.position == len(ids) + 1
    model.reset()
    assert model.position == 0
    # same math, different BLAS blocking (1 row vs T rows): fp32 rounding only
    np.testing.assert_allclose(model.prefill(ids), a[-1], rtol=1e-5, atol=1e-5)


def test_generate_greedy_equals_explicit_loop(model):
    ids = model.tokenizer.encode("The quick brown fox")
    chunks = list(model.generate(ids, max_tokens=12))
    tokens = [c.token for c in chunks]
    assert tokens == manual_loop(model, ids, 12)
    assert [c.finish_reason for c in chunks] == [None] * 11 + ["length"]
    assert "".join(c.text for c in chunks) == model.tokenizer.decode(tokens)
    st = chunks[-1].stats
    assert (st.prompt_tokens, st.prefilled_tokens, st.generated_tokens) == (len(ids), len(ids), 12)
    assert st.backend == "reference" and "tok/s" in str(st)


def test_string_prompt_is_raw_text_and_messages_use_the_template(model):
    text = "In the beginning"
    r1 = model.generate_text(text, max_tokens=3)
    assert r1.tokens == manual_loop(model, model.tokenizer.encode(text), 3)
    msgs = [{"role": "user", "content": text}]
    rendered = model.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                   enable_thinking=False)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    r2 = model.generate_text(msgs, max_tokens=3, enable_thinking=False)
    assert r2.tokens == manual_loop(model, model.tokenizer.encode(rendered), 3)
    assert r2.stats.prompt_tokens == len(model.tokenizer.encode(rendered))


def test_seeded_sampling_is_reproducible_and_follows_the_sampler(model):
    ids = model.tokenizer.encode("seeded")
    kw = dict(max_tokens=10, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=1234)
    a = model.generate_text(ids, **kw).tokens
    model.reset()
    b = model.generate_text(ids, **kw).tokens
    assert a == b
    params = SamplingParams(0.9, 50, 0.95, 0.01, 1234)
    assert a == manual_loop(model, ids, 10, params, seed=1234)
    model.reset()
    c = model.generate_text(ids, **dict(kw, seed=4321)).tokens
    assert c != a


def test_stop_string_ends_generation_and_is_not_included(model):
    ids = model.tokenizer.encode("stop test")
    full = model.generate_text(ids, max_tokens=24)
    text = full.text
    assert len(text) > 8, text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    model.reset()
    r = model.generate_text(ids, max_tokens=24, stop=[stop, "\x00never"])
    assert r.text == text[:text.find(stop)] and r.finish_reason == "stop"


def test_eos_token_stops_and_is_not_in_the_text(model):
    ids = model.tokenizer.encode("eos test")
    tokens = model.generate_text(ids, max_tokens=6).tokens
    model.reset()
    model.tokenizer.eos_token_ids = frozenset({tokens[3]})
    r = model.generate_text(ids, max_tokens=6)
    assert r.tokens == tokens[:4] and r.finish_reason == "stop"
    assert r.text == model.tokenizer.decode(tokens[:3])


def test_closing_early_leaves_the_model_usable(model):
    ids = model.tokenizer.encode("close me")
    expected = manual_loop(model, ids, 5)
    model.reset()
    g = model.generate(ids, max_tokens=50)
    first = [next(g).token for _ in range(2)]
    g.close()
    assert first == expected[:2]
    assert model.position == len(ids) + 1          # the second token was not fed yet
    model.reset()
    assert model.generate_text(ids, max_tokens=5).tokens == expected


def test_second_generation_is_refused_while_one_runs(model):
    g = model.generate([1, 2, 3], max_tokens=5)
    next(g)
    with pytest.raises(BusyError, match="already generating"):
        model.generate([4], max_tokens=2)
    with pytest.raises(BusyError):
        model.decode(1)
    with pytest.raises(BusyError):
        model.prefill([1])
    list(g)                                     # exhausting it releases the model
    model.generate_text([4], max_tokens=2)


def test_abandoned_generator_releases_the_model(model):
    g = model.generate([1, 2, 3], max_tokens=5)
    next(g)
    del g
    model.generate_text([4], max_tokens=2)


def test_next_turn_reuses_the_state(model):
    ids1 = model.tokenizer.encode("first turn")
    r1 = model.generate_text(ids1, max_tokens=4)
    assert r1.stats.reused_tokens == 0
    # continuing exactly where generation stopped: only the new tokens are prefilled
    ids2 = list(model.tokens) + model.tokenizer.encode(" and more")
    before = model.prefilled_tokens_total
    r2 = model.generate_text(ids2, max_tokens=4)
    assert r2.stats.reused_tokens == len(ids1) + 3          # prompt + 3 fed generated tokens
    assert model.prefilled_tokens_total - before == r2.stats.prefilled_tokens == len(ids2) - len(ids1) - 3
    # same result as a fresh model on the whole prompt
    fresh = lily_py.load(model.path, backend="reference")
    assert fresh.generate_text(ids2, max_tokens=4).tokens == r2.tokens


def test_chat_turn_rolls_back_to_the_previous_prompt_when_the_reply_retokenizes(model):
    msgs = [{"role": "user", "content": "Hi"}]
    r1 = model.generate_text(msgs, max_tokens=6, enable_thinking=False)
    # the conversation without the generation prompt: every later turn starts with it
    p1 = model.tokenizer.encode(model.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=False, enable_thinking=False))
    msgs2 = msgs + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "More"}]
    r2 = model.generate_text(msgs2, max_tokens=6, enable_thinking=False)
    assert r2.stats.reused_tokens >= len(p1) > 0
    assert r2.stats.prefilled_tokens == r2.stats.prompt_tokens - r2.stats.reused_tokens
    fresh = lily_py.load(model.path, backend="reference")
    assert fresh.generate_text(msgs2, max_tokens=6, enable_thinking=False).tokens == r2.tokens


def test_a_diverging_prompt_resets(model):
    model.generate_text([1, 2, 3, 4], max_tokens=2)
    r = model.generate_text([9, 8, 7], max_tokens=2)
    assert r.stats.reused_tokens == 0 and r.stats.prefilled_tokens == 3


def test_context_length(ckpt):
    m = lily_py.load(ckpt, backend="reference", context_length=10)
    with pytest.raises(ContextLengthError, match="11 tokens; the context length is 10"):
        m.generate(list(range(1, 12)), max_tokens=1)
    with pytest.raises(ContextLengthError, match="exceed the context length 10"):
        m.prefill(list(range(1, 12)))
    assert m.position == 0
    r = m.generate_text(list(range(1, 8)), max_tokens=50)
    assert r.finish_reason == "context_length" and m.position == 10 and len(r.tokens) == 4


@pytest.mark.parametrize("call, exc, msg", [
    (lambda m: m.prefill([]), ValueError, "at least one token"),
    (lambda m: m.prefill([[1, 2]]), ValueError, "1-D"),
    (lambda m: m.prefill([1, 640]), ValueError, "token id 640 at index 1 is outside"),
    (lambda m: m.prefill([-1]), ValueError, "outside the vocabulary"),
    (lambda m: m.prefill([1.5]), TypeError, "integers"),
    (lambda m: m.decode(1.5), TypeError, "one token id"),
    (lambda m: m.generate("", max_tokens=1), ValueError, "empty"),
    (lambda m: m.generate(3.0), TypeError, "prompt must be"),
    (lambda m: m.generate([1], max_tokens=0), ValueError, "max_tokens"),
    (lambda m: m.generate([1], stop=[1]), TypeError, "stop must be"),
    (lambda m: m.generate([1], temperature=-1), ValueError, "temperature"),
    (lambda m: m.generate([{"role": "user", "content": "x"}], tools="nope"), TypeError, "tools must be"),
    (lambda m: m.generate([{"content": "x"}]), ValueError, "role"),
    (lambda m: m.generate([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]),
     lily_py.ChatTemplateError, "System message must be at the beginning"),
])
def test_bad_inputs(model, call, exc, msg):
    with pytest.raises(exc, match=msg):
        call(model)
    model.generate_text([1, 2], max_tokens=1)       # still usable


def test_backends(ckpt):
    with pytest.raises(BackendError, match="not available in this build"):
        lily_py.load(ckpt, backend="metal")     # Linux builds have no Metal device
    with pytest.raises(ValueError, match="backend must be one of"):
        lily_py.load(ckpt, backend="vulkan")
    assert lily_py.load(ckpt, backend="auto").backend == "reference"


def test_auto_picks_metal_only_where_a_capable_gpu_exists(monkeypatch):
    import types
    import lily_py._core as core
    import lily_py.backends
    import lily_py.model
    # one function, one answer: (the pick, why Metal is not usable or None), wherever it is imported
    assert lily_py.auto_backend is lily_py.backends.auto_backend is lily_py.model.auto_backend
    usable = core.registry.check_usable("metal") == ""
    assert lily_py.auto_backend() == (("metal", None) if usable else ("reference", core.registry.check_usable("metal")))
    # The device registry decides (device, library and every pipeline usable: "" = no reason).
    monkeypatch.setattr(core, "registry", types.SimpleNamespace(check_usable=lambda name: ""))
    assert lily_py.auto_backend() == ("metal", None)
    monkeypatch.setattr(core, "registry", types.SimpleNamespace(
        check_usable=lambda name: "Metal library: cannot load lily.metallib"))
    assert lily_py.auto_backend() == ("reference", "Metal library: cannot load lily.metallib")
