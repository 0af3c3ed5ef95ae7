"""Progress: load progress (bytes, shards) on a terminal only, and the prefill progress callback."""
from __future__ import annotations

import io
import sys

import pytest

import lily_py
from lily_py.testing import make_checkpoint


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sharded"), fmt="mlx", seed=4, shards=3)


@pytest.mark.parametrize("verbose,tty,shows", [(None, True, True), (None, False, False),
                                               (False, True, False), (True, False, True)])
def test_load_progress_only_on_a_terminal_or_when_asked(sharded, monkeypatch, verbose, tty, shows):
    err = FakeTTY() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    # weights="copy": every byte goes through the progress (the zero-copy plan maps most of them)
    m = lily_py.load(sharded, backend="emu", context_length=32, verbose=verbose, weights="copy")
    text = err.getvalue()
    if not shows:
        assert text == ""
        return
    total = sum(p.nbytes for p in _parts(m))
    # first the engine's memory plan (one line), then the progress line rewritten in place
    plan, sep, text = text.partition("\rloading weights: ")
    assert sep and plan.startswith("lily_py: engine plan on 'emu': ") and plan.endswith("\n"), plan
    assert plan.count("\n") == 1, plan
    text = sep + text
    assert text.startswith("\rloading weights: ") and text.endswith(" s\n")
    last = text.rstrip("\n").split("\r")[-1]
    assert f"/ {total / 1e6:.1f} MB (100.0%), 3/3 shards" in last, last
    shards = [int(s.split(", ")[-1].split("/")[0]) for s in text.split(" shards")[:-1]]
    assert shards == sorted(shards) and shards[-1] == 3      # shards counted up as they are read


def _parts(m):
    from lily_py.backends.engine import _tensors
    return [p for *_, parts in _tensors(m.config, m.weights) for p in parts]


def test_reference_backend_reads_lazily_and_prints_nothing(sharded, monkeypatch):
    err = FakeTTY()
    monkeypatch.setattr(sys, "stderr", err)
    lily_py.load(sharded, backend="reference", verbose=True)
    assert err.getvalue() == ""


@pytest.mark.parametrize("backend", ["emu", "reference"])
def test_prefill_progress_counts_chunks_up_to_the_total(tiny_mlx, backend):
    m = lily_py.load(tiny_mlx, backend=backend, context_length=64, prefill_chunk=7)
    calls = []
    m.prefill(list(range(1, 24)), progress=lambda done, total: calls.append((done, total)))
    assert calls == [(7, 23), (14, 23), (21, 23), (23, 23)]
    calls.clear()
    m.prefill([5, 6], progress=lambda d, t: calls.append((d, t)))     # after existing state
    assert calls == [(2, 2)]


def test_generate_prefill_progress_counts_only_new_tokens(tiny_mlx):
    m = lily_py.load(tiny_mlx, backend="emu", context_length=64, prefill_chunk=4)
    calls = []
    cb = lambda d, t: calls.append((d, t))  # noqa: E731
    r = m.generate_text(list(range(1, 11)), max_tokens=2, prefill_progress=cb)
    assert calls == [(4, 10), (8, 10), (10, 10)]
    calls.clear()
    prompt = list(m.tokens) + [3, 4, 5]          # extends the state: only 3 tokens prefilled
    m.generate_text(prompt, max_tokens=1, prefill_progress=cb)
    assert calls == [(3, 3)] and r.stats.prefilled_tokens == 10
    done = [d for d, _ in calls]
    assert done == sorted(done)


def test_a_callback_that_raises_stops_after_that_chunk(tiny_mlx):
    m = lily_py.load(tiny_mlx, backend="emu", context_length=64, prefill_chunk=5)

    def cancel(done, total):
        if done >= 10:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        m.prefill(list(range(1, 21)), progress=cancel)
    assert m.position == 10 and m.tokens == tuple(range(1, 11))    # the fed chunks stay
    ref = lily_py.load(tiny_mlx, backend="emu", context_length=64, prefill_chunk=5)
    ref.prefill(list(range(1, 11)))
    import numpy as np
    np.testing.assert_array_equal(m.decode(11), ref.decode(11))


def test_prefill_bar_draws_on_its_stream(tiny_mlx):
    from lily_py.progress import prefill_bar
    out = io.StringIO()
    m = lily_py.load(tiny_mlx, backend="reference", prefill_chunk=8)
    m.prefill(list(range(1, 12)), progress=prefill_bar(out))
    assert out.getvalue() == "\rprefill: 8 / 11 tokens\rprefill: 11 / 11 tokens\n"
