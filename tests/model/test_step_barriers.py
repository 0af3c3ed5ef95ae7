"""Every barrier of an encoded step is needed (issue 9).

The Metal device encodes a step with a concurrent compute encoder: dispatches with no barrier
between them run in any order or at once. The emulator's encoder checks each stretch between
barriers for hazards (csrc/emu/device.cpp: DispatchHazards), and these tests remove the step's
barriers one at a time (Engine.skip_barrier / Engine.check(skip_barrier=k)): each removal must be
reported as a hazard. A barrier whose removal is not reported orders nothing and costs the GPU a
dependency level: delete it from csrc/gpu/step.cpp or csrc/gpu/ops/ (then this test passes again).

The barriers are iterated by the encoder's count, not listed, so the tests follow the plan as it
changes. Two levels:
  * the plan (Engine.check: nothing runs, every `device` binding counts as written): conservative,
    so "no report" would prove a barrier unnecessary for every input; fast, so every route is
    covered (decode single / split-K attention, device sampling, MoE mv / mm32 / mm64, chunks with
    and without logits);
  * a real run (Engine.skip_barrier, writes = the bytes a dispatch changed): each reported hazard
    is real, not an artefact of whole-binding ranges.
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
import lily_py._core as core
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint

HAZARD = "hazard between dispatches with no barrier between them"
SAMPLE = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11, step=0, valid_vocab=0)
GREEDY = dict(SAMPLE, temperature=0.0)


def _dn_config():
    cfg = dict(TINY_TEXT_CONFIG, num_hidden_layers=3, layer_types=["linear_attention"] * 3)
    cfg.pop("full_attention_interval", None)
    return cfg


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("step_barriers")
    return {"deltanet": make_checkpoint(root / "dn", _dn_config(), fmt="mlx", seed=5, std=0.08),
            "attention": make_checkpoint(root / "attn", dict(TINY_TEXT_CONFIG), fmt="mlx", seed=6, std=0.08)}


# (tokens, position, keyword arguments of Engine.check): decode and prefill-chunk routes.
PLAN_CASES = [
    (1, 5, {}),                                        # decode, attention single route, MoE mv
    (1, 300, {}),                                      # decode, attention split-K route
    (1, 5, dict(sample=GREEDY)),                       # decode + greedy sampler
    (1, 5, dict(sample=SAMPLE, from_slot=True)),       # decode fed from the slot + small-k sampler
    (1, 5, dict(sample=dict(SAMPLE, top_k=0))),        # decode + bucket-route sampler (top-p, min-p)
    (1, 5, dict(sample=dict(SAMPLE, top_k=0, top_p=1.0, min_p=0.0))),  # decode + temperature-only sampler
    (4, 0, {}),                                        # chunk, qmv, MoE mv
    (11, 3, {}),                                       # chunk, qmm, MoE mm32
    (11, 3, dict(all_logits=True)),
    (64, 0, dict(logits=False)),                       # a chunk that is not the last
    (1600, 0, {}),                                     # MoE mm64 (tokens * top_k >= 3072)
]


@pytest.mark.parametrize("which", ["deltanet", "attention"])
def test_every_barrier_of_the_plan_is_needed(checkpoints, which):
    m = lily_py.load(checkpoints[which], backend="emu", context_length=2048, prefill_chunk=1600)
    e = m._backend.engine
    removed_without_report = []
    for tokens, position, kw in PLAN_CASES:
        st = e.check(tokens, position, **kw)  # as encoded: no hazard
        assert st["barriers"] > 0
        for k in range(st["barriers"]):
            try:
                e.check(tokens, position, **kw, skip_barrier=k)
            except core.EmulatorError as ex:
                assert HAZARD in str(ex)
            else:
                removed_without_report.append((tokens, position, kw, k))
    assert removed_without_report == [], "barriers that order nothing (delete them): %s" % removed_without_report
    assert e.position == 0  # check() never touches the state


def test_every_barrier_of_the_plan_is_needed_on_the_m5_path(checkpoints):
    """With tensor ops (simulated): the DeltaNet chunk steps take gd_chunk_prep_conv_q16, gd_chunk_wy_m5
    and gd_chunk_state_m5 (and qmm_m5 / moe_*_m5); each of their barriers orders something."""
    from lily_py.testing import simulated_device
    with simulated_device(tensor_ops=True):
        m = lily_py.load(checkpoints["deltanet"], backend="emu", context_length=2048, prefill_chunk=1600)
    e = m._backend.engine
    kernels = {p["kernel"] for p in e.pipelines}
    assert {"gd_chunk_wy_m5_f32", "gd_chunk_state_m5_f32"} <= kernels, sorted(kernels)
    removed_without_report = []
    for tokens, position, kw in [(64, 0, dict(logits=False)), (100, 0, {}), (1600, 0, {})]:
        st = e.check(tokens, position, **kw)
        for k in range(st["barriers"]):
            try:
                e.check(tokens, position, **kw, skip_barrier=k)
            except core.EmulatorError as ex:
                assert HAZARD in str(ex)
            else:
                removed_without_report.append((tokens, position, kw, k))
    assert removed_without_report == [], "barriers that order nothing (delete them): %s" % removed_without_report


@pytest.mark.parametrize("which", ["deltanet", "attention"])
@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "chunk3"])
def test_every_barrier_is_needed_when_run(checkpoints, which, tokens):
    m = lily_py.load(checkpoints[which], backend="emu", context_length=64, prefill_chunk=16)
    e = m._backend.engine
    m.prefill([3, 1, 4, 1, 5])
    snap = e.snapshot()
    e.forward(np.arange(tokens, dtype=np.uint32) + 7)
    barriers = e.last_stats()["barriers"]  # the engine's own step (Model.stats() is the prefill's)
    for k in range(barriers):
        e.skip_barrier = k
        # A run sees as written only the bytes a dispatch changed, so a dispatch that rewrites what
        # its buffer holds (the same expert ids as the last step, say) writes nothing: try fresh
        # token ids until one changes what the barrier orders.
        for attempt in range(6):
            e.restore(snap)
            ids = (np.arange(tokens, dtype=np.uint32) + 11 + 3 * k + 37 * attempt) % m.config.vocab_size
            try:
                e.forward(ids)
            except core.EmulatorError as ex:
                assert HAZARD in str(ex)
                break
        else:
            pytest.fail(f"removing barrier #{k} of {barriers} was not reported in 6 runs")
    e.skip_barrier = -1
    e.restore(snap)
    e.forward(np.arange(tokens, dtype=np.uint32) + 7)  # the engine recovers
    assert e.last_stats()["barriers"] == barriers


def test_check_encodes_what_a_step_encodes(checkpoints):
    m = lily_py.load(checkpoints["attention"], backend="emu", context_length=64)
    m.prefill([1, 2, 3])
    st = m.stats()
    e = m._backend.engine
    for skip in (-1, st["barriers"]):  # a barrier number past the last skips nothing
        c = e.check(3, 0, skip_barrier=skip)
        assert (c["dispatches"], c["barriers"], c["bytes_bound"]) == (st["dispatches"], st["barriers"],
                                                                      st["bytes_bound"])
    assert e.position == 3
