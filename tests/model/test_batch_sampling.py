"""Batched decode sampled on the device, two steps in flight (Engine.submit_batch /
complete_batch; issue 42's "the host's part of a batched step").

What must hold:
  * the device samples row t with sequence t's own parameters, seed and step, bit for bit as
    the host sampler (lily_py.sampling.sample) does on decode_batch's logits, on every sampler
    route (greedy, temperature only, small top_k, the bucket route of top_p / min_p), while a
    parked sequence's KV pool grows with a step in flight;
  * the pipeline's counters: one commit and one host wait per step, the device idle only at
    the first one, no logits copied to the host;
  * the step is decode_batch's plus each row's sampler passes, in the levels of the deepest
    route, and every barrier of it orders something (the emulator's plan check);
  * one sequence is the single-stream submit();
  * misuse raises ValueError saying what is wrong, before anything runs.
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
import lily_py._core as core
from lily_py.sampling import SamplingParams, sample
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint
from engine_backend import ENGINE, require_engine

require_engine()

HAZARD = "hazard between dispatches with no barrier between them"
KV_BLOCK = 32
CHUNK = 16
# One row per sampler route: greedy, temperature only, small top_k, the bucket route.
ROUTES = [dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
          dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
          dict(temperature=0.7, top_k=20, top_p=1.0, min_p=0.0),
          dict(temperature=1.1, top_k=0, top_p=0.9, min_p=0.05)]
LEVELS = {0: 2, 1: 4, 2: 4, 3: 6}   # sampler levels (= dispatches) of each route (ops::SamplePlan)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bsample"), dict(TINY_TEXT_CONFIG), fmt="mlx", seed=5, std=0.08)


@pytest.fixture()
def engine(ckpt):
    m = lily_py.load(ckpt, backend=ENGINE, context_length=200, prefill_chunk=CHUNK, kv_block_tokens=KV_BLOCK,
                     activations="float32")
    return m._backend.engine, m.config.vocab_size


def prefill(e, ids):
    for s in range(0, len(ids), CHUNK):
        logits, _ = e.forward(np.asarray(ids[s:s + CHUNK], np.uint32), False)
    return logits[-1]


def sequences(e, prompts):
    """Each prompt on a sequence of its own (the first on the active one): ids, first rows."""
    seqs = [e.active_sequence] + [e.add_sequence() for _ in prompts[1:]]
    first = []
    for s, p in zip(seqs, prompts):
        e.select_sequence(s)
        first.append(prefill(e, p))
    return seqs, first


def sampling_dicts(routes, seeds, V):
    return [dict(r, seed=int(s), step=0, valid_vocab=V) for r, s in zip(routes, seeds)]


def host_params(d):
    return SamplingParams(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"], min_p=d["min_p"],
                          seed=d["seed"])


def u32(*v):
    return np.array(v, np.uint32)


def test_device_rows_equal_the_host_sampler(engine):
    e, V = engine
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    # 30 and 62 cross a 32-token KV block within the steps: those pools grow with a step in flight
    lengths = (30, 5, 62, 17)
    prompts = [rng.integers(0, V, n).tolist() for n in lengths]
    seqs, first = sequences(e, prompts)
    snaps = {}
    for s in seqs:
        e.select_sequence(s)
        snaps[s] = e.snapshot()
    dicts = sampling_dicts(ROUTES, rng.integers(0, 2**63, 4), V)
    hp = [host_params(d) for d in dicts]
    steps = 7
    tok0 = [sample(first[i], hp[i], 0, dicts[i]["seed"]) for i in range(4)]
    host = [[t] for t in tok0]
    for n in range(1, steps + 1):
        lg, _ = e.decode_batch(u32(*seqs), u32(*[h[-1] for h in host]))
        for i in range(4):
            host[i].append(sample(lg[i], hp[i], n, dicts[i]["seed"]))
    for s in seqs:
        e.select_sequence(s)
        e.restore(snaps[s])

    samplings = [core.Sampling(d) for d in dicts]
    before, copied = dict(e.counters), e.logit_bytes_copied
    dev = [[t] for t in tok0]
    e.submit_batch(u32(*seqs), u32(*tok0), samplings, u32(1, 1, 1, 1))
    pools = e.memory["state_bytes"]   # (the restores took the pools back to the prompts' blocks)
    for n in range(2, steps + 2):
        if n <= steps:
            st = e.submit_batch(u32(*seqs), None, samplings, u32(n, n, n, n))
            assert st["in_flight"] == 1
        for i, t in enumerate(e.complete_batch()):
            dev[i].append(t)
    for i in range(4):
        assert dev[i] == host[i], f"seed {seed}, sequence {i} ({ROUTES[i]}): device {dev[i]} != host {host[i]}"
    assert e.memory["state_bytes"] > pools   # KV pools grew while a step was in flight
    grew = {k: e.counters[k] - before[k] for k in before}
    assert grew == dict(commits=steps, idle_commits=1, host_waits=steps, masks_written=0), grew
    assert e.logit_bytes_copied == copied
    assert [e.sequence_position(s) for s in seqs] == [n + steps for n in lengths]
    assert all(e.sequence_valid(s) for s in seqs) and e.in_flight == 0


def test_step_is_decode_batch_plus_the_samplers(engine):
    e, V = engine
    seqs, _ = sequences(e, [[3, 4, 5], [6, 7], [8, 9, 10, 11]])
    _, plain = e.decode_batch(u32(*seqs), u32(1, 2, 3))
    for rows in ([0, 0, 0], [1, 2, 0], [3, 0, 1]):
        samplings = [core.Sampling(d) for d in sampling_dicts([ROUTES[r] for r in rows], [4, 5, 6], V)]
        st = e.submit_batch(u32(*seqs), u32(1, 2, 3), samplings, u32(0, 0, 0))
        e.complete_batch()
        assert st["dispatches"] == plain["dispatches"] + sum(LEVELS[r] for r in rows), rows
        # one barrier before the samplers, then one between two levels of the deepest route
        assert st["barriers"] == plain["barriers"] + max(LEVELS[r] for r in rows), rows


def test_every_barrier_of_a_sampling_batch_is_needed(engine):
    if ENGINE != "emu":
        pytest.skip("the plan check is the emulator's")
    e, V = engine
    samplings = [core.Sampling(d) for d in sampling_dicts(ROUTES[::-1], [1, 2, 3, 4], V)]
    st = e.check_batch(4, 40, samplings=samplings)
    sampler = range(st["barriers"] - max(LEVELS.values()), st["barriers"])  # the samplers' barriers
    for k in sampler:
        with pytest.raises(core.EmulatorError, match=HAZARD):
            e.check_batch(4, 40, skip_barrier=k, samplings=samplings)


def test_one_sequence_is_the_single_stream_submit(engine):
    e, V = engine
    prompt = list(range(3, 40))
    d = sampling_dicts([ROUTES[1]], [9], V)[0]
    first = prefill(e, prompt)
    t0 = sample(first, host_params(d), 0, 9)
    want = []
    e.submit(np.array([t0], np.uint32), dict(d, step=1))
    for n in (2, 3):
        e.submit_slot(core.Sampling(d), n)
        want.append(e.complete_token())
    want.append(e.complete_token())
    alone = e.last_stats()
    e.reset()
    s = e.add_sequence()
    e.select_sequence(s)
    prefill(e, prompt)
    e.select_sequence(0)
    got = []
    e.submit_batch(u32(s), u32(t0), [core.Sampling(d)], u32(1))
    for n in (2, 3):
        e.submit_batch(u32(s), None, [core.Sampling(d)], u32(n))
        got += e.complete_batch()
    got += e.complete_batch()
    assert got == want
    st = e.last_stats()
    for k in ("dispatches", "barriers", "bytes_touched", "ids_from_slot"):
        assert st[k] == alone[k], k


def test_misuse_raises(engine):
    e, V = engine
    seqs, _ = sequences(e, [[3, 4], [5, 6, 7]])
    d = sampling_dicts(ROUTES[:2], [1, 2], V)
    two = [core.Sampling(x) for x in d]
    with pytest.raises(ValueError, match="feeding the device slot needs"):
        e.submit_batch(u32(*seqs), None, two, u32(0, 0))
    with pytest.raises(ValueError, match="logprobs"):
        e.submit_batch(u32(*seqs), u32(1, 2), [core.Sampling(dict(x, logprobs=2)) for x in d], u32(0, 0))
    with pytest.raises(ValueError, match="2 sequences for 1 samplings"):
        e.submit_batch(u32(*seqs), u32(1, 2), two[:1], u32(0, 0))
    with pytest.raises(ValueError, match="valid_vocab must be the same"):
        e.submit_batch(u32(*seqs), u32(1, 2), [two[0], core.Sampling(dict(d[1], valid_vocab=V - 1))], u32(0, 0))
    with pytest.raises(ValueError, match="sampling 1: sample: top_p must be in"):
        e.submit_batch(u32(*seqs), u32(1, 2), [two[0], core.Sampling(dict(d[1], top_p=0.0))], u32(0, 0))
    assert [e.sequence_position(s) for s in seqs] == [2, 3]  # nothing ran
    assert all(e.sequence_valid(s) for s in seqs)
    e.submit_batch(u32(*seqs), u32(1, 2), two, u32(0, 0))
    with pytest.raises(ValueError, match="sampling 0: sample: min_p must be in"):
        e.submit_batch(u32(*seqs), None, [core.Sampling(dict(d[0], min_p=2.0)), two[1]], u32(1, 1))
    assert e.in_flight == 1   # the step in flight is untouched
    with pytest.raises(ValueError, match="only a step fed from the device slot"):
        e.submit_batch(u32(*seqs), u32(1, 2), two, u32(1, 1))
    with pytest.raises(ValueError, match="same sequences in the same order"):
        e.submit_batch(u32(*seqs[::-1]), None, two, u32(1, 1))
    with pytest.raises(ValueError, match="complete_batch"):
        e.complete()
    with pytest.raises(ValueError, match="steps are in flight"):
        e.select_sequence(seqs[0])
    assert len(e.complete_batch()) == 2
    with pytest.raises(ValueError, match="no step in flight"):
        e.complete_batch()
    lg, _ = e.decode_batch(u32(*seqs), u32(1, 2))   # moves on without sampling into the slot
    with pytest.raises(ValueError, match="feeding the device slot needs"):
        e.submit_batch(u32(*seqs), None, two, u32(1, 1))
