"""generate(logprobs=True, top_logprobs=k) on the demo checkpoint: each chunk's TokenLogprob is
log_softmax of that step's raw logits (before temperature and filters), on the reference (host,
NumPy) and on the engine (backend=ENGINE: the device's logprob pass, docs/structured.md)."""
import math

import numpy as np
import pytest

import lily_py
from engine_backend import ENGINE, require_engine

require_engine()

PROMPT = "The capital of France is"


_MODELS = {}


def _load(backend):
    if backend not in _MODELS:
        _MODELS[backend] = lily_py.load(backend=backend)
    return _MODELS[backend]


@pytest.fixture(scope="module", params=["reference", "emu"])
def demo(request):
    return _load(request.param)


SAMPLINGS = {"greedy": dict(temperature=0.0), "small-k": dict(temperature=0.9, top_k=10, seed=11),
             "top-p": dict(temperature=1.2, top_p=0.9, seed=5)}
# The emulator runs about a second per demo step: it checks one sampled route end to end (every
# route's logprob pass is checked on the emulator in tests/kernels/test_sampling_kernels.py).
CASES = [("reference", k) for k in SAMPLINGS] + [("emu", "small-k")]


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("backend,route", CASES, ids=[f"{b}-{r}" for b, r in CASES])
def test_logprobs_are_log_softmax_of_each_steps_logits(backend, route):
    demo, sampling = _load(backend), SAMPLINGS[route]
    chunks = list(demo.generate(PROMPT, max_tokens=4, logprobs=True, top_logprobs=5, **sampling))
    assert chunks[-1].finish_reason is not None
    # Replay the same tokens one step at a time and read each step's logits.
    demo.reset()
    logits = demo.prefill(demo.prompt_ids(PROMPT))
    valid = min(demo.tokenizer.vocab_size, demo.config.vocab_size)
    for c in chunks:
        lp = c.logprobs
        assert lp is not None and lp.token == c.token
        ref = log_softmax(logits[:valid])
        assert math.isclose(lp.logprob, ref[c.token], abs_tol=1e-4)
        ids = [t for t, _ in lp.top]
        vals = np.array([v for _, v in lp.top])
        assert len(ids) == 5 and np.all(np.diff(vals) <= 0)
        np.testing.assert_allclose(vals, ref[ids], atol=1e-4)
        np.testing.assert_allclose(vals, np.sort(ref)[::-1][:5], atol=1e-4)
        assert np.exp(vals).sum() <= 1 + 1e-5
        if sampling["temperature"] == 0:     # greedy: the token is the most likely one
            assert ids[0] == c.token and lp.logprob == lp.top[0][1]
        logits = demo.decode(c.token)


def test_logprobs_off_and_zero_top(demo):
    out = list(demo.generate(PROMPT, max_tokens=2))
    assert all(c.logprobs is None for c in out)
    out = list(demo.generate(PROMPT, max_tokens=2, logprobs=True))
    assert all(c.logprobs is not None and c.logprobs.top == [] and c.logprobs.logprob <= 0 for c in out)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(logprobs=True, top_logprobs=21), ValueError, "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), ValueError, "top_logprobs"),
    (dict(top_logprobs=3), ValueError, "needs logprobs=True"),
    (dict(logprobs=1), TypeError, "logprobs"),
])
def test_bad_logprob_arguments(demo, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        demo.generate(PROMPT, max_tokens=2, **kw)


@pytest.mark.parametrize("backend", ["reference", "emu"])
def test_generate_text_carries_the_logprobs(backend):
    """generate_text(logprobs=True) keeps what the chunks carry: one TokenLogprob per token, in
    order, equal to the streamed ones; without logprobs the field is None."""
    m = _load(backend)
    kw = dict(max_tokens=4, temperature=0.9, top_k=10, seed=11)
    streamed = [c.logprobs for c in m.generate(PROMPT, logprobs=True, top_logprobs=3, **kw)
                if c.token is not None]
    r = m.generate_text(PROMPT, logprobs=True, top_logprobs=3, **kw)
    assert r.logprobs is not None and len(r.logprobs) == len(r.tokens) == len(streamed)
    assert [lp.token for lp in r.logprobs] == r.tokens
    assert [(lp.logprob, lp.top) for lp in r.logprobs] == [(lp.logprob, lp.top) for lp in streamed]
    assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in r.logprobs)
    assert m.generate_text(PROMPT, **kw).logprobs is None
