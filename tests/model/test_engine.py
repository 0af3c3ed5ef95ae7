"""The whole model on the engine (backend=ENGINE: the C++ engine encoding every step, the Metal
kernels run by the CPU emulator) against the NumPy reference backend.

Tolerance (logits): both sides dequantize the same 4-bit weights exactly and compute in float32;
they differ only in accumulation order (the kernels' simdgroup / threadgroup trees and the
chunked-vs-recurrent delta rule against NumPy's BLAS). Each float32 dot product of length
K <= 2 * hidden carries a relative error ~ sqrt(K) * 2^-24 ~ 1e-6 of its absolute-value sum;
through L layers of norm -> matmul -> residual it compounds to a few 1e-6 of the logit scale.
Measured on the 3-layer DeltaNet checkpoint below: max |emu - ref| / max |ref| = 7e-7 (prefill,
11 tokens) and 4e-7 .. 1.6e-6 (decode steps). We allow atol = 1e-4 * max|ref logit| + rtol 1e-3:
60x above the worst measured, far below any routing change (a flipped expert moves logits by
~1e-1 of their scale).

With gated attention layers the engine keeps the KV cache in bfloat16 (as specified) and the
reference in float32: keys and values are rounded by <= 2^-9 relative, which moves scores and the
convex combination of values by O(2^-9) and the logits by at most O(2^-8) of their scale. There
we allow atol = 2^-7 * max|ref| (measured: 3e-4 .. 1e-3 on the tiny and demo checkpoints).
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint

from tolerances import assert_close
from engine_backend import ENGINE, require_engine
from step_plan import attention_decode_padding_flops, expected_counts, expected_useful_flops

require_engine()

DN_LAYERS = 3  # DeltaNet-only checkpoints: float32 all the way, the tightest comparison
# The checkpoints here have bf16 scales, so the engine's default is bf16 activations (as MLX
# computes them). The comparisons with the fp32 reference at the fp32 tolerances above run the
# float32 path (activations="float32"); the bf16 path is compared with mlx-lm's own bf16 error in
# tests/model/test_bf16_activations.py, and here where a test says so (demo greedy, counters).
FP32 = {"activations": "float32"}


def _dn_config(**kw):
    cfg = dict(TINY_TEXT_CONFIG, num_hidden_layers=DN_LAYERS,
               layer_types=["linear_attention"] * DN_LAYERS, **kw)
    cfg.pop("full_attention_interval", None)
    return cfg


@pytest.fixture(scope="module")
def dn_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("engine_dn"), _dn_config(), fmt="mlx", seed=5,
                           std=0.08)


@pytest.fixture(scope="module")
def attn_ckpt(tmp_path_factory):
    """TINY_TEXT_CONFIG: 4 layers, layer 3 gated full attention."""
    return make_checkpoint(tmp_path_factory.mktemp("engine_attn"), dict(TINY_TEXT_CONFIG), fmt="mlx",
                           seed=6, std=0.08)


def _close(actual, ref, what, *, attention=False):
    scale = float(np.abs(ref).max())
    if attention:
        assert_close(actual, ref, atol=2.0 ** -7 * scale, rtol=0, what=what)
    else:
        assert_close(actual, ref, atol=1e-4 * scale, rtol=1e-3, what=what)


def _pair(path, **kw):
    return (lily_py.load(path, backend=ENGINE, context_length=300, **FP32, **kw),
            lily_py.load(path, backend="reference", context_length=300, **kw))


def _reference_run_without_routing_ties(ref, rng, n_prefill, n_decode, *, min_gap=1e-3, tries=20):
    """Draw prompt and decode ids until no MoE router of the reference run has a near-tie between
    its k-th and (k+1)-th logit (a gap under `min_gap`): there a few-ulp difference between the
    engine and the reference picks another expert and moves that position's logits by O(0.1)
    (seen once: gap 2.2e-4 in the last layer, error 0.32). Returns the ids, the decode ids and the
    reference's prefill logits and decode logits."""
    import lily_py.reference.moe as ref_moe
    route = ref_moe.route
    gaps = []

    def spy(logits, top_k):
        s = -np.sort(-np.asarray(logits, dtype=np.float64), axis=-1)
        gaps.append(float((s[:, top_k - 1] - s[:, top_k]).min()))
        return route(logits, top_k)

    for _ in range(tries):
        ids = rng.integers(0, 320, size=n_prefill).tolist()
        dec = rng.integers(0, 320, size=n_decode).tolist()
        gaps.clear()
        ref.reset()
        ref_moe.route = spy
        try:
            pre = ref.prefill(ids, all_logits=True)
            outs = [ref.decode(t) for t in dec]
        finally:
            ref_moe.route = route
        if min(gaps) >= min_gap:
            return ids, dec, pre, outs
    raise AssertionError(f"no draw without a routing near-tie in {tries} tries")


@pytest.mark.parametrize("which", ["deltanet", "attention"])
def test_prefill_and_decode_match_reference(dn_ckpt, attn_ckpt, rng, which):
    emu, ref = _pair(dn_ckpt if which == "deltanet" else attn_ckpt)
    assert emu.backend == ENGINE
    att = which == "attention"
    ids, dec, ref_pre, ref_dec = _reference_run_without_routing_ties(ref, rng, 11, 3)
    _close(emu.prefill(ids, all_logits=True), ref_pre, "prefill all_logits", attention=att)
    for t, want in zip(dec, ref_dec):
        _close(emu.decode(t), want, f"decode {t}", attention=att)


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunked_prefill_equals_one_shot(attn_ckpt, rng, chunk):
    ids = rng.integers(0, 320, size=23).tolist()
    one = lily_py.load(attn_ckpt, backend=ENGINE, context_length=64, prefill_chunk=23, **FP32)
    whole = one.prefill(ids)
    chunked = lily_py.load(attn_ckpt, backend=ENGINE, context_length=64, prefill_chunk=chunk, **FP32)
    # Different chunk sizes take different routes (qmv / qmm, MoE mv / tiled, attention decode /
    # prefill): float32 accumulation order, except where a K or V value that the two routes compute
    # a few fp32 ulps apart lands on different sides of a bf16 rounding boundary of the KV cache
    # (one bf16 ulp, 2^-8 relative, in that cached element). So the attention tolerance, derived for
    # the bf16 KV cache; the fp32 one failed once in CI on such a flip (chunk 1: 5.5e-4 against
    # 2.7e-4 of a logit scale of 2.67). A chunking bug (a wrong position or window) moves logits by O(1).
    _close(chunked.prefill(ids), whole, f"prefill in chunks of {chunk}", attention=True)
    _close(chunked.decode(ids[0]), one.decode(ids[0]), "decode after chunked prefill", attention=True)


def test_prefill_then_decode_equals_longer_prefill(attn_ckpt, rng):
    ids = rng.integers(0, 320, size=10).tolist()
    a = lily_py.load(attn_ckpt, backend=ENGINE, context_length=64, **FP32)
    a.prefill(ids[:-1])
    b = lily_py.load(attn_ckpt, backend=ENGINE, context_length=64, **FP32)
    _close(a.decode(ids[-1]), b.prefill(ids), "prefill(N) + decode vs prefill(N + 1)")


def test_demo_greedy_32_tokens_and_logits():
    """The bundled demo checkpoint (3 DeltaNet + 1 attention layers), with its default bf16
    activations: greedy tokens identical to the reference for 32 steps; the logits of the prompt
    within the attention tolerance (measured in bf16: max |d| / max |ref| = 1.2e-3 of the 2^-7)."""
    emu = lily_py.load(backend=ENGINE, context_length=128)
    assert emu._backend.activations == "bfloat16"
    ref = lily_py.load(backend="reference", context_length=128)
    prompt = emu.tokenizer.encode("The quick brown fox")
    _close(emu.prefill(prompt), ref.prefill(prompt), "demo prefill", attention=True)
    emu.reset(), ref.reset()
    a = emu.generate_text(prompt, max_tokens=32)
    b = ref.generate_text(prompt, max_tokens=32)
    assert a.tokens == b.tokens and a.text == b.text


def test_greedy_generation_matches_reference(dn_ckpt):
    emu, ref = _pair(dn_ckpt)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a = emu.generate_text(prompt, max_tokens=12)
    b = ref.generate_text(prompt, max_tokens=12)
    assert a.tokens == b.tokens
    assert a.stats.backend == ENGINE


def test_snapshot_restore_reset(dn_ckpt, rng):
    m = lily_py.load(dn_ckpt, backend=ENGINE, context_length=64)
    ids = rng.integers(0, 320, size=6).tolist()
    m.prefill(ids[:3])
    snap = m._backend.snapshot()
    first = m.prefill(ids[3:])
    m._backend.restore(snap)
    np.testing.assert_array_equal(m._backend.forward(np.array(ids[3:]), all_logits=False), first)
    m.reset()
    m.prefill(ids[:3])
    np.testing.assert_array_equal(m.prefill(ids[3:]), first)   # same steps from a reset state


@pytest.mark.parametrize("tokens", [1, 5, 11])  # 5: the MoE mv route with its moe_route level
def test_step_counters(attn_ckpt, rng, tokens):
    m = lily_py.load(attn_ckpt, backend=ENGINE, context_length=64)
    m.prefill(rng.integers(0, 320, size=tokens).tolist())
    st = m.stats()
    d, b = expected_counts(m.config, tokens)
    print(f"{tokens}-token step on the emulator: {st}")
    assert (st["dispatches"], st["barriers"]) == (d, b)
    assert st["waits_in_step"] == 0 and st["commits"] == 1 and st["host_waits"] == 1
    assert st["tokens"] == tokens
    assert st["flops_useful"] == expected_useful_flops(m.config, tokens)
    if tokens == 1:  # qmv, the MoE matvecs and the scan execute exactly the useful work
        assert st["flops_executed"] == st["flops_useful"] + attention_decode_padding_flops(m.config, 0)
    else:            # tiles padded to 32 rows / columns
        assert st["flops_executed"] > st["flops_useful"]
    # The counting device encodes the same plan without weights: identical counters.
    from lily_py.backends.engine import checkpoint_quant, count_step
    counted = count_step(m.config, tokens=tokens, position=m.position - tokens,
                         quant=checkpoint_quant(m.weights), prefill_chunk=m.prefill_chunk,
                         context_length=m.context_length)
    for k in ("dispatches", "barriers", "bytes_bound", "bytes_touched", "threads", "waits_in_step",
              "flops_useful"):
        assert counted[k] == st[k], k
    # flops_executed: the emulator counts the MoE tiles each plan made (after the step); the
    # counting device runs nothing and keeps the bound over every routing.
    assert counted["flops_executed"] >= st["flops_executed"]
    assert (counted["flops_executed"] == st["flops_executed"]) == (tokens <= 8)
    # A prefill chunk that is not the last skips the head (lm_head, with the final norm fused in).
    assert m._backend.forward(np.array([1] * tokens), all_logits=False, logits=False) is None
    st = m.stats()
    assert (st["dispatches"], st["barriers"]) == expected_counts(m.config, tokens, logits=False)
    assert (st["dispatches"], st["barriers"]) == (d - 1, b - 1)


def test_decode_split_route_counters(attn_ckpt, rng):
    """Decode on both sides of 256 keys (the single/split switch of head dims off the vec route;
    the vec route takes two passes at every length): counters as planned, logits equal to the
    reference's."""
    emu, ref = _pair(attn_ckpt)
    ids = rng.integers(0, 320, size=255).tolist()
    emu.prefill(ids), ref.prefill(ids)
    for pos in (255, 256):
        t = int(rng.integers(0, 320))
        _close(emu.decode(t), ref.decode(t), f"decode at position {pos}", attention=True)
        st = emu.stats()
        assert (st["dispatches"], st["barriers"]) == expected_counts(emu.config, 1, pos), pos
        assert st["waits_in_step"] == 0


def test_serialize_switch(attn_ckpt, rng):
    ids = rng.integers(0, 320, size=9).tolist()
    a = lily_py.load(attn_ckpt, backend=ENGINE, context_length=64)
    b = lily_py.load(attn_ckpt, backend=ENGINE, context_length=64)
    b._backend.engine.serialize = True
    np.testing.assert_array_equal(b.prefill(ids), a.prefill(ids))
    st = b.stats()
    assert st["barriers"] == st["dispatches"] - 1 and st["dispatches"] == a.stats()["dispatches"]


def _q4_bytes(rows: int, H: int, gs: int) -> int:
    """One [rows, H] 4-bit matrix: codes, and a bf16 scale and bias per group of gs."""
    return rows * H // 2 + 2 * 2 * rows * (H // gs)


@pytest.mark.parametrize("activations,xe", [("float32", 4), ("bfloat16", 2)])
def test_bytes_touched_counts_routed_experts_and_touched_rows(attn_ckpt, activations, xe):
    """Exact per-kernel bytes on a small config: the embedding reads one row, the expert
    gathers k of E experts, the DeltaNet step its state twice; activations of xe bytes (the MoE
    intermediate h stays fp32)."""
    from lily_py.backends.engine import checkpoint_quant, count_kernels
    m = lily_py.load(attn_ckpt, backend="reference")
    cfg, quant = m.config, checkpoint_quant(m.weights)
    st, ks = count_kernels(cfg, position=5, quant=quant, activations=activations)
    H, E, k, I = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    gs = quant["experts_q"]["group_size"]
    emb = [v for n, v in ks.items() if n.startswith("embedding")][0]
    assert emb["bytes_touched"] == 4 + H // 2 + 2 * 2 * (H // quant["embed"]["group_size"]) + xe * H
    expert = _q4_bytes(I, H, gs)
    shared = cfg.shared_expert_intermediate_size
    gate_up = [v for n, v in ks.items() if n.startswith("moe_gate_up")][0]
    L = cfg.num_hidden_layers
    sh = _q4_bytes(shared, H, gs)
    # x, the router logits (each threadgroup selects the experts itself), h, and the routing it
    # writes for moe_down_mv (ids [k] uint32, weights [k + 1] float)
    x, logits, h, routing = xe * H, xe * (E + 1), 4 * (k + 1) * max(I, shared), 4 * k + 4 * (k + 1)
    assert gate_up["bytes_touched"] == L * (2 * k * expert + 2 * sh + x + logits + h + routing)
    dn = [v for n, v in ks.items() if n.startswith("gated_delta_decode_x")][0]
    Hv, Dv, Dk = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim
    state = Hv * Dv * Dk * 4
    assert dn["bytes_touched"] > 2 * state * dn["dispatches"] > 0
    assert not [n for n in ks if n.startswith(("conv1d", "gated_delta_x"))]   # decode: the conv is fused


@pytest.mark.parametrize("tokens", [2, 3, 5])
def test_moe_mv_bytes_on_both_gate_up_paths(attn_ckpt, tokens):
    """The MoE mv route's bytes at a few tokens (float32 activations): below
    MOE_MV_ROUTE_MIN_TOKENS moe_gate_up_mv reads the router logits and writes the routing (ids
    and weights) itself; from there on a moe_route level reads the logits and writes the
    routing, and gate/up reads the ids only (neither the logits nor the weights count for it)."""
    from lily_py.backends.engine import _core, checkpoint_quant, engine_spec
    m = lily_py.load(attn_ckpt, backend="reference")
    cfg, quant = m.config, checkpoint_quant(m.weights)
    eng = _core().Engine(engine_spec(cfg, quant, context_length=tokens, prefill_chunk=tokens,
                                     activations="float32"), "count")
    eng.count(tokens, 0, False)
    ks = eng.count_kernels()
    T, H, E, k, I = tokens, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    L, shared, gs = cfg.num_hidden_layers, cfg.shared_expert_intermediate_size, quant["experts_q"]["group_size"]
    used = min(E, T * k)
    x, logits, h = 4 * T * H, 4 * T * (E + 1), 4 * T * (k + 1) * max(I, shared)
    ids, weights = 4 * T * k, 4 * T * (k + 1)
    routed = T >= _core().ops.MOE_MV_ROUTE_MIN_TOKENS
    gate_up = [v for n, v in ks.items() if n.startswith("moe_gate_up_mv")]
    route = [v for n, v in ks.items() if n.startswith("moe_route")]
    assert len(gate_up) == 1 and gate_up[0]["dispatches"] == L
    weights_and_x = 2 * used * _q4_bytes(I, H, gs) + 2 * _q4_bytes(shared, H, gs) + x + h
    if routed:
        assert gate_up[0]["bytes_touched"] == L * (weights_and_x + ids)
        assert len(route) == 1 and route[0]["bytes_touched"] == L * (logits + ids + weights)
    else:
        assert gate_up[0]["bytes_touched"] == L * (weights_and_x + logits + ids + weights)
        assert not route


def test_engine_refuses_unsupported_checkpoints(tiny_hf):
    with pytest.raises(lily_py.BackendError, match="not MLX-quantized"):
        lily_py.load(tiny_hf, backend=ENGINE, context_length=16)
    with pytest.raises(lily_py.BackendError, match="not available in this build"):
        lily_py.load(tiny_hf, backend="metal", context_length=16)


SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, seed=7),
            dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11),
            dict(temperature=0.9, top_k=100, top_p=0.9, min_p=0.02, seed=5)]  # the bucket route


@pytest.mark.parametrize("opts", SAMPLING, ids=["greedy", "temperature", "filters", "buckets"])
def test_device_sampling_reproduces_reference(dn_ckpt, opts):
    """Decode steps sample on the device (fused into the step, token written to the device slot
    and read by the next step's embedding): the same tokens as the reference's host sampler."""
    emu, ref = _pair(dn_ckpt)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a = emu.generate_text(prompt, max_tokens=24, **opts)
    b = ref.generate_text(prompt, max_tokens=24, **opts)
    assert a.tokens == b.tokens
    st = emu.stats()
    assert st["ids_from_slot"] and st["token"] == a.tokens[-1] and st["waits_in_step"] == 0


@pytest.mark.parametrize("opts", SAMPLING[1:], ids=["temperature", "filters", "buckets"])
def test_device_sampling_demo(opts):
    emu = lily_py.load(backend=ENGINE, context_length=96)
    ref = lily_py.load(backend="reference", context_length=96)
    prompt = emu.tokenizer.encode("Once upon a time")
    assert emu.generate_text(prompt, max_tokens=24, **opts).tokens == \
        ref.generate_text(prompt, max_tokens=24, **opts).tokens


def test_sampling_step_counters(attn_ckpt):
    """A decode step with the sampler fused in: the model's counts plus exactly the sampler's
    own plan (as the sampling op counts it) and one barrier (logits -> sampler)."""
    from lily_py import ops
    m = lily_py.load(attn_ckpt, backend=ENGINE, context_length=64)
    for opts in SAMPLING:
        m.reset()
        m.generate_text([5, 6, 7], max_tokens=3, **opts)
        st = m.stats()
        d, b = expected_counts(m.config, 1)
        params = dict(temperature=opts["temperature"], top_k=opts.get("top_k", 0),
                      top_p=opts.get("top_p", 1.0), min_p=opts.get("min_p", 0.0))
        logits = np.random.default_rng(0).standard_normal(m.config.vocab_size).astype(np.float32)
        sampler = ops._sample(logits, seed=1, step=1, **params)[4]
        print(opts, st, "sampler:", sampler["dispatches"], sampler["barriers"])
        assert st["dispatches"] == d + sampler["dispatches"]
        assert st["barriers"] == b + 1 + sampler["barriers"]
        assert st["waits_in_step"] == 0 and st["commits"] == 1 and st["ids_from_slot"]


def test_generator_closed_midstream_and_multiturn(dn_ckpt):
    """Closing a generator mid-stream leaves the engine usable; a second turn that extends the
    first reuses the state (only new tokens prefilled) and matches the reference."""
    emu, ref = _pair(dn_ckpt)
    g = emu.generate([7, 8, 9], max_tokens=10, temperature=0.9, seed=3)
    next(g), next(g)
    with pytest.raises(lily_py.BusyError):
        emu.generate([1], max_tokens=1)
    g.close()
    turn1 = emu.generate_text([7, 8, 9], max_tokens=5)
    ref1 = ref.generate_text([7, 8, 9], max_tokens=5)
    assert turn1.tokens == ref1.tokens
    prompt2 = [7, 8, 9] + turn1.tokens + [10, 11]
    turn2 = emu.generate_text(prompt2, max_tokens=5)
    assert turn2.stats.reused_tokens > 0
    assert turn2.tokens == ref.generate_text(prompt2, max_tokens=5).tokens


def test_real_head_dims(tmp_path, rng):
    """Random weights with the real model's head dims (attention head_dim 256, rotary 64;
    DeltaNet Dk = Dv = 128) and fewer heads / a narrow hidden size: engine == reference."""
    cfg = dict(TINY_TEXT_CONFIG, hidden_size=256, vocab_size=512, head_dim=256,
               num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
               shared_expert_intermediate_size=128)
    path = make_checkpoint(tmp_path, cfg, fmt="mlx", seed=9, std=0.06)
    emu, ref = _pair(path)
    ids = rng.integers(0, 512, size=9).tolist()
    _close(emu.prefill(ids), ref.prefill(ids), "prefill", attention=True)
    for t in rng.integers(0, 512, size=2).tolist():
        _close(emu.decode(t), ref.decode(t), f"decode {t}", attention=True)


def test_engine_rejects_bad_input_before_encoding(dn_ckpt):
    """Bad steps raise ValueError before anything is encoded: the state is untouched."""
    m = lily_py.load(dn_ckpt, backend=ENGINE, context_length=8, prefill_chunk=4)
    eng = m._backend.engine
    m.prefill([1, 2, 3])
    snap = m._backend.snapshot()
    for ids, msg in (([320], "outside"), ([1] * 5, "prefill_chunk")):
        with pytest.raises(ValueError, match=msg):
            eng.forward(np.array(ids, dtype=np.uint32))
        assert eng.position == 3 and eng.valid
    with pytest.raises(ValueError, match="device slot"):
        eng.forward(np.array([1], dtype=np.uint32), from_slot=True)
    with pytest.raises(ValueError, match="expected"):
        eng.upload("norm", [np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="no weight named"):
        eng.upload("nope", [np.zeros(3, np.float32)])
    after_errors = m.decode(4)
    m._backend.restore(snap)
    np.testing.assert_array_equal(m._backend.forward(np.array([4]), all_logits=False), after_errors)


def test_two_steps_in_flight(dn_ckpt):
    """Engine level: step N+1 (fed from the device slot) is committed before the host waits on
    step N; tokens and logits equal those of steps run one at a time."""
    sample = dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=5, valid_vocab=320)
    seq = lily_py.load(dn_ckpt, backend=ENGINE, context_length=32)
    seq.prefill([1, 2, 3])
    eng = seq._backend.engine
    toks, logits = [], []
    out, st = eng.forward(np.array([4], np.uint32), sample=dict(sample, step=1))
    toks.append(st["token"]), logits.append(out[0])
    for step in range(2, 6):
        out, st = eng.forward(np.array([0], np.uint32), sample=dict(sample, step=step), from_slot=True)
        toks.append(st["token"]), logits.append(out[0])

    pip = lily_py.load(dn_ckpt, backend=ENGINE, context_length=32)
    pip.prefill([1, 2, 3])
    eng = pip._backend.engine
    assert eng.submit(np.array([4], np.uint32), sample=dict(sample, step=1))["in_flight"] == 0
    got, got_logits = [], []
    for step in range(2, 6):
        st = eng.submit(np.array([0], np.uint32), sample=dict(sample, step=step), from_slot=True)
        assert st["in_flight"] == 1 and eng.in_flight == 2
        with pytest.raises(ValueError, match="in flight"):
            eng.snapshot()
        out, st = eng.complete()
        got.append(st["token"]), got_logits.append(out)
        assert st["waits_in_step"] == 0 and st["host_waits"] == 1
    out, st = eng.complete()
    got.append(st["token"]), got_logits.append(out)
    assert got == toks and eng.in_flight == 0 and eng.position == 8
    np.testing.assert_array_equal(np.array(got_logits), np.array(logits))
    with pytest.raises(ValueError, match="no step in flight"):
        eng.complete()


def test_sampler_in_its_own_command_buffer_with_masks(dn_ckpt, rng):
    """Constrained generation's pipeline at engine level: each step is committed without its
    sampler (fed from the slot), its sampler follows in a command buffer of its own with that
    step's allowed-token bitset. Tokens equal those of steps run one at a time with the mask
    fused into the step, every token is allowed, and no command buffer but the first finds the
    device idle."""
    from lily_py import sampling as S
    import lily_py._core as core
    sample = dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=5, valid_vocab=317)
    masks = []
    for i in range(6):
        m = rng.random(317) < (0.5 if i % 2 else 0.03)
        m[rng.integers(317)] = True
        masks.append(m)
    seq = lily_py.load(dn_ckpt, backend=ENGINE, context_length=32)
    seq.prefill([1, 2, 3])
    eng = seq._backend.engine
    toks = [eng.forward(np.array([4], np.uint32), sample=dict(sample, step=1),
                        mask=S.pack_mask(masks[1]))[1]["token"]]
    for step in range(2, 6):
        toks.append(eng.forward(np.array([0], np.uint32), sample=dict(sample, step=step), from_slot=True,
                                mask=S.pack_mask(masks[step]))[1]["token"])
    assert all(masks[i + 1][t] for i, t in enumerate(toks))

    pip = lily_py.load(dn_ckpt, backend=ENGINE, context_length=32)
    pip.prefill([1, 2, 3])
    eng = pip._backend.engine
    sampling = core.Sampling(dict(sample, step=0))
    c0 = dict(eng.counters)
    eng.submit(np.array([4], np.uint32))                  # no sampler: the row stays on the device
    got = []
    for step in range(1, 6):
        eng.submit_sampler(sampling, step, S.pack_mask(masks[step]))
        with pytest.raises(ValueError, match="already samples"):
            eng.submit_sampler(sampling, step, S.pack_mask(masks[step]))
        if step < 5:
            eng.submit_logits_slot()                      # feeds this step's token from the slot
            assert eng.in_flight == 2
        got.append(eng.complete_token())
    assert eng.in_flight == 0 and got == toks and eng.position == 3 + 6 - 1
    c = {k: v - c0[k] for k, v in eng.counters.items()}
    assert c == dict(commits=10, idle_commits=1, host_waits=5, masks_written=5)
    with pytest.raises(ValueError, match="words"):
        eng.submit_sampler(sampling, 6, np.zeros(3, np.uint32))
    eng.submit(np.array([7], np.uint32))                  # samples nothing
    with pytest.raises(ValueError, match="feeding the device slot"):
        eng.submit_logits_slot()                          # so there is no token to feed
    assert eng.complete_token() is None


def test_generate_pipelined_state(tmp_path):
    """Model.generate on the engine keeps two steps in flight; the token it stopped at has been
    fed (it is in `tokens`), and the next turn reuses the state."""
    emu = lily_py.load(backend=ENGINE, context_length=128)
    ref = lily_py.load(backend="reference", context_length=128)
    prompt = emu.tokenizer.encode("In the beginning")
    a = emu.generate_text(prompt, max_tokens=20, stop=" the")
    b = ref.generate_text(prompt, max_tokens=20, stop=" the")
    assert a.tokens == b.tokens and a.text == b.text and a.finish_reason == "stop"
    # the stop token was fed on both backends (in flight on the engine, after the stop on the
    # reference): the states agree
    assert list(emu.tokens) == prompt + a.tokens == list(ref.tokens)
    assert emu.stats()["in_flight"] == 1                   # the last step overlapped its predecessor
    more = prompt + a.tokens + emu.tokenizer.encode(" and")
    c = emu.generate_text(more, max_tokens=6)
    assert c.stats.reused_tokens == len(prompt) + len(a.tokens)
    assert c.tokens == ref.generate_text(more, max_tokens=6).tokens


def test_reset_discards_steps_in_flight_and_model_recovers_from_interrupts(dn_ckpt):
    """A KeyboardInterrupt can land between a submit() and the host's bookkeeping: reset()
    must wait out and drop steps in flight, and Model.tokens must follow the engine."""
    m = lily_py.load(dn_ckpt, backend=ENGINE, context_length=32, **FP32)
    m.prefill([1, 2, 3])
    eng = m._backend.engine
    sample = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=1, step=1,
                  valid_vocab=m.config.vocab_size)
    eng.submit(np.array([4], np.uint32), sample=sample)
    eng.submit(np.array([0], np.uint32), sample=dict(sample, step=2), from_slot=True)
    assert eng.in_flight == 2
    m.reset()
    assert eng.in_flight == 0 and eng.position == 0 and m.position == 0
    want = lily_py.load(dn_ckpt, backend="reference").prefill([5, 6, 7])
    # fp32 engine vs fp32 reference on a DeltaNet-only model: the module's fp32 tolerance
    np.testing.assert_allclose(m.prefill([5, 6, 7]), want, rtol=1e-3, atol=1e-4 * np.abs(want).max())


def test_huge_seed_and_top_k_are_accepted_like_the_reference(dn_ckpt):
    kw = dict(max_tokens=3, temperature=0.8, top_k=2**40, seed=2**64 + 5)
    emu = lily_py.load(dn_ckpt, backend=ENGINE, context_length=32).generate_text([1, 2], **kw)
    ref = lily_py.load(dn_ckpt, backend="reference").generate_text([1, 2], **kw)
    assert emu.tokens == ref.tokens


_GREEDY_REF: dict = {}


def _real_head_dims_config():
    return dict(TINY_TEXT_CONFIG, hidden_size=256, vocab_size=512, head_dim=256,
                num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                shared_expert_intermediate_size=128)


@pytest.fixture(scope="module")
def real_dims_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("engine_real_dims"), _real_head_dims_config(), fmt="mlx",
                           seed=9, std=0.06)


@pytest.mark.parametrize("chunk", [1, 64, 4096])
@pytest.mark.parametrize("which", ["demo", "real_head_dims"])
def test_greedy_after_chunked_prefill(real_dims_ckpt, which, chunk):
    """Greedy tokens identical to the reference for 32 steps after a prompt prefilled in chunks of
    1 (the scan), 64 and 4096 (the chunked DeltaNet route for every chunk of >= 64 tokens: a
    partial last chunk inside the prompt, and the scan for a short tail); with the default
    activations of these bf16 checkpoints, bfloat16 (issue 11: greedy equality in bf16)."""
    from lily_py.ops import gated_delta_route
    path, n = (None, 100) if which == "demo" else (real_dims_ckpt, 80)
    load = (lambda **kw: lily_py.load(**kw)) if path is None else (lambda **kw: lily_py.load(path, **kw))
    probe = load(backend="reference", context_length=256)
    prompt = (list(range(3, 40)) * 8)[:n] if path else \
        probe.tokenizer.encode("In the beginning God created the heaven and the earth. " * 20)[:n]
    assert len(prompt) == n
    key = (which, n)
    if key not in _GREEDY_REF:
        _GREEDY_REF[key] = probe.generate_text(prompt, max_tokens=32).tokens
    emu = load(backend=ENGINE, context_length=256, prefill_chunk=chunk)
    assert emu._backend.activations == "bfloat16"
    cfg = emu.config
    # bf16 prefill attention on M1-M4 (no tensor ops): the bf16 simdgroup tiles on the default bf16
    # KV cache (chunks of 1 token take the decode kernels)
    if chunk > 1:
        assert f"attn_prefill_tiles_d{cfg.head_dim}_bf16" in {p["kernel"] for p in emu._backend.engine.pipelines}
    got = emu.generate_text(prompt, max_tokens=32)
    assert got.tokens == _GREEDY_REF[key]
    routes = {gated_delta_route(min(chunk, n - s), cfg.linear_key_head_dim, cfg.linear_value_head_dim)
              for s in range(0, n, chunk)}
    assert routes == ({"scan"} if chunk == 1 else {"chunked", "scan"} if chunk == 64 else {"chunked"})


@pytest.mark.parametrize("opts", SAMPLING, ids=["greedy", "temperature", "filters", "buckets"])
def test_first_token_sampled_on_device_in_the_prefill_step(dn_ckpt, opts):
    """The first token is sampled on the device, in the command buffer of the prompt's last
    prefill step (also when the prompt takes several chunks), and equals the reference's choice.
    During generation no logits row is copied to the host except the one the conversation
    snapshot keeps (one row per generate call, however many tokens)."""
    # fp32 path: this random-weight checkpoint's sampled tokens are compared with the fp32
    # reference's (bf16 activations move its logits by ~1e-2 of their scale: other near-ties)
    emu = lily_py.load(dn_ckpt, backend=ENGINE, context_length=64, prefill_chunk=4, **FP32)
    ref = lily_py.load(dn_ckpt, backend="reference", context_length=64, prefill_chunk=4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]          # three chunks of at most 4
    eng = emu._backend.engine
    V = emu.config.vocab_size
    copied = eng.logit_bytes_copied
    opts = dict(opts, seed=opts.get("seed", 5))
    g = emu.generate(prompt, max_tokens=12, **opts)
    first = next(g)
    st = emu.stats()
    assert st["tokens"] == 2 and st["token"] == first.token     # the last chunk (2 tokens) sampled it
    assert st["commits"] == 1 and st["waits_in_step"] == 0
    rest = [c.token for c in g]
    want = ref.generate_text(prompt, max_tokens=12, **opts).tokens
    assert [first.token] + rest == want
    assert eng.logit_bytes_copied - copied == V * 4             # the snapshot's row only
    copied = eng.logit_bytes_copied
    emu.generate_text(prompt + want + [7], max_tokens=20, **opts)
    assert eng.logit_bytes_copied - copied == V * 4


@pytest.mark.parametrize("opts", [dict(temperature=0.9), dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
                                  dict(temperature=0.8, top_p=0.9)], ids=["temperature", "small-k", "bucket"])
def test_prompt_without_new_tokens_samples_the_host_row_on_the_device(dn_ckpt, monkeypatch, opts):
    """The other side of the first-token switch: a prompt that adds no token to the state (the
    state itself, or a prompt-cache hit after reset) has its logits row on the host; the device
    samples that row with the sampler alone (Engine.sample_row), never NumPy; the tokens equal
    the reference's."""
    import lily_py.generation_loop as loop
    emu, ref = _pair(dn_ckpt)
    prompt = [9, 8, 7, 6]
    kw = dict(max_tokens=3, seed=3, **opts)
    a1, b1 = emu.generate_text(prompt, **kw), ref.generate_text(prompt, **kw)
    assert a1.tokens == b1.tokens
    state = prompt + a1.tokens[:2]                 # the last token was sampled, never fed
    assert list(emu.tokens) == list(ref.tokens) == state
    eng = emu._backend.engine
    copied = eng.logit_bytes_copied
    b2 = ref.generate_text(state, max_tokens=6, seed=4, **opts)
    host_calls = []
    real_sample = loop.sample
    monkeypatch.setattr(loop, "sample", lambda *a, **k: host_calls.append(1) or real_sample(*a, **k))
    a2 = emu.generate_text(state, max_tokens=6, seed=4, **opts)
    assert a2.stats.reused_tokens == len(state) and a2.stats.prefilled_tokens == 0
    assert a2.tokens == b2.tokens and host_calls == []
    assert eng.logit_bytes_copied - copied == emu.config.vocab_size * 4   # fetched once, on demand
    # A prompt-cache hit after a reset: the whole prompt's snapshot and logits row come back.
    emu.reset()
    a3 = emu.generate_text(prompt, **kw)
    assert a3.stats.cached_tokens == len(prompt) and a3.stats.prefilled_tokens == 0
    assert a3.tokens == b1.tokens and host_calls == []


def test_sample_row_checks_its_input(dn_ckpt):
    emu = lily_py.load(dn_ckpt, backend=ENGINE, context_length=64, prefill_chunk=4)
    eng = emu._backend.engine
    V = emu.config.vocab_size
    from lily_py.backends.engine import _core
    samp = _core().Sampling(dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=1, step=0, valid_vocab=V))
    with pytest.raises(ValueError, match="the row has 3 logits"):
        eng.sample_row(np.zeros(3, np.float32), samp)
    row = np.random.default_rng(5).standard_normal(V).astype(np.float32)
    row[V // 3] = np.nan
    with pytest.raises(FloatingPointError, match="non-finite logit at token id"):
        eng.sample_row(row, samp)


def test_decode_returns_logits_and_last_logits_on_demand(dn_ckpt, rng):
    """decode()/prefill() hand back the logits (one copy from the device, the caller owns it);
    the engine's last_logits() copies the last step's row again and refuses when there is none."""
    emu, ref = _pair(dn_ckpt)
    eng = emu._backend.engine
    ids = rng.integers(0, emu.config.vocab_size, size=5).tolist()
    a = emu.prefill(ids)
    _close(a, ref.prefill(ids), "prefill")
    copied = eng.logit_bytes_copied
    b = emu.decode(3)
    assert eng.logit_bytes_copied - copied == emu.config.vocab_size * 4
    _close(b, ref.decode(3), "decode")
    b[:] = 0                                                  # the caller's array: edits are free
    np.testing.assert_array_equal(eng.last_logits(), emu._backend.last_logits())
    assert np.abs(eng.last_logits()).max() > 0
    eng.forward(np.array([1, 2], np.uint32), logits=False)   # a chunk without lm_head
    assert not eng.has_last_logits
    with pytest.raises(ValueError, match="computed no logits"):
        eng.last_logits()
    emu.reset()
    with pytest.raises(ValueError, match="computed no logits"):
        eng.last_logits()


def test_count_host_device_generates_without_running_anything(tmp_path):
    """The counting device with host memory backs a Model (benchmarks/host_overhead.py): every
    step is encoded and counted, nothing runs, every sampled token is 0."""
    path = make_checkpoint(tmp_path, _dn_config(), fmt="mlx", seed=1)
    m = lily_py.load(path, backend="count_host", context_length=64, prefill_chunk=8)
    out = m.generate_text([5, 6, 7], max_tokens=10, temperature=0.7, top_p=0.9, seed=1)
    assert out.tokens == [0] * 10 and out.finish_reason == "length"
    st = m.stats()
    assert st["dispatches"] > 0 and st["encode_ns"] > 0 and st["ids_from_slot"]
    assert lily_py.load(path, backend="count_host").backend == "count_host"


def test_streamed_tokens_allocate_no_logits_arrays(tmp_path):
    """With the real vocabulary (a logits row is 1 MB), streaming tokens from the engine builds no
    array per token: the traced peak over 40 tokens stays far below one logits row (before, each
    token allocated two 1 MB rows). On count_host nothing runs, so only the host path is measured."""
    import tracemalloc
    cfg = dict(_dn_config(), vocab_size=248320, num_hidden_layers=1, layer_types=["linear_attention"])
    path = make_checkpoint(tmp_path, cfg, fmt="mlx", seed=2)
    m = lily_py.load(path, backend="count_host", context_length=128, prefill_chunk=8)
    for opts in (dict(temperature=0.0), dict(temperature=0.8, top_k=20, top_p=0.9, seed=1)):
        m.reset()
        g = m.generate([5, 6, 7], max_tokens=60, **opts)
        for _ in range(5):
            next(g)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(40):
                next(g)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        g.close()
        assert peak < 64 * 1024, f"{opts}: {peak} bytes traced while streaming 40 tokens"
