"""lily_py.ops.argmax / sample on the emulator vs lily_py.sampling (the reference).

No tolerance: the device must choose exactly the token the reference chooses for the same seed and
step. That is by construction (docs/kernels-sampling.md, "Sampling"): the noise uses only correctly rounded
float32 operations with explicit fma (checked bit for bit below over the full vocabulary), the
scaled logits are one subtract and one multiply, and the filters compare exact integers (masses
in fixed point) or float32 values, so any reduction order gives the same kept set. Inputs are
fresh random logits (seed in failure messages, replay with LILY_TEST_SEED), with planted ties
where they matter (greedy, the top-k / top-p cutoff) and -inf entries.
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py._core as core
from kernel_checks import device, rng  # noqa: F401  (fixtures)
from lily_py import ops
from lily_py import sampling as S

FULL_V = 248_320
ODD_V = [1, 31, 33, 1000, 2049]           # 2048 entries per partial threadgroup: 2049 spans two
NO_ID = 0xFFFFFFFF

SMALL_K = 64                              # must match kSampleSmallK
CANDIDATES = 4096                         # must match kSampleCandidates

# (params, dispatches = dependent levels): greedy 2 (max partial + final); temperature only 4
# (+ Gumbel partial + final); 0 < top_k <= SMALL_K: 4 (+ per-group candidates + one merge); any
# other filter: the bucket route, 6 (+ histogram, select, collect, resolve).
CONFIGS = [
    (dict(temperature=1.0), 4),
    (dict(temperature=0.7, top_k=1), 4),
    (dict(temperature=1.3, top_k=7), 4),
    (dict(temperature=1.0, top_p=0.9), 6),
    (dict(temperature=1.0, top_p=0.3), 6),
    (dict(temperature=1.0, min_p=0.05), 6),
    (dict(temperature=0.9, top_k=20, top_p=0.8), 4),
    (dict(temperature=0.6, top_p=0.95, min_p=0.02), 6),
    (dict(temperature=0.8, top_k=50, top_p=0.7, min_p=0.01), 4),
    (dict(temperature=0.8, top_k=64, top_p=0.9, min_p=0.2), 4),              # the largest small k
    (dict(temperature=0.8, top_k=65, top_p=0.7, min_p=0.01), 6),             # one past it
    (dict(temperature=1.1, top_k=300), 6),
    (dict(temperature=0.9, top_k=200, top_p=0.99), 6),                      # Z split inside a bucket
    (dict(temperature=1.0, top_p=1e-9), 6),                                 # top-p near 0: one entry
    (dict(temperature=1.0, top_p=0.999999), 6),                             # top-p near 1
    (dict(temperature=1.0, min_p=1.0), 6),                                  # only the max (and ties)
]
IDS = ["plain", "k1", "k7", "p0.9", "p0.3", "minp", "k+p", "p+minp", "k+p+minp", "k64+p+minp",
       "k65+p+minp", "k300", "k200+p0.99", "p1e-9", "p0.999999", "minp1"]


def expected_dispatches(params, v):
    """The documented route (docs/kernels-sampling.md): 2 for greedy, 4 for temperature only or
    0 < top_k <= SMALL_K (top_k < V), 6 for every other filter (the bucket route)."""
    if params.get("temperature", 1.0) == 0:
        return 2
    top_k = 0 < params.get("top_k", 0) < v
    if top_k and params["top_k"] <= SMALL_K:
        return 4
    if top_k or params.get("top_p", 1.0) < 1 or params.get("min_p", 0.0) > 0:
        return 6
    return 4


def ref_sample(logits, params, step, seed, valid=None):
    row = logits if valid is None else logits[:valid]
    return S.sample(row, S.SamplingParams(**params), step, seed)


def random_logits(rng, v, *, ties=False, neg_inf=False, scale=3.0):
    x = (rng.standard_normal(v) * scale).astype(np.float32)
    if ties:  # coarse values: many entries tie, also at the top-k / top-p cutoffs
        x = (np.round(x * 2) / 2).astype(np.float32)
    if neg_inf and v > 3:
        x[rng.choice(v, size=v // 4, replace=False)] = -np.inf
        x[rng.integers(v)] = 1.0
    return x


def test_constants_match_extension():
    assert core.ops.SAMPLE_NO_ID == NO_ID
    assert core.ops.SAMPLE_CHUNK == 2048


def test_noise_is_bit_identical_over_the_full_vocabulary(rng):
    seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**32))
    dev = core.ops.sample_noise(FULL_V, seed, step)
    ref = S.gumbel(seed, step, FULL_V)
    bad = np.flatnonzero(dev.view(np.uint32) != ref.view(np.uint32))
    assert bad.size == 0, f"noise differs at id {bad[:5]} (seed {seed}, step {step}): {dev[bad[:5]]} vs {ref[bad[:5]]}"
    assert np.isfinite(dev).all()


def test_reference_log_exp_are_accurate(rng):
    x = rng.uniform(1e-7, 17.0, 20000).astype(np.float32)
    ulp = np.spacing(np.abs(np.log(x.astype(np.float64))).astype(np.float32))
    assert np.all(np.abs(S.log32(x) - np.log(x.astype(np.float64))) <= 2 * ulp)
    s = -rng.uniform(0, 31.9, 20000).astype(np.float32)
    e = np.exp(s.astype(np.float64))
    assert np.all(np.abs(S.exp32(s) - e) <= 2 * np.spacing(e.astype(np.float32)))
    assert S.exp32(np.float32(-np.inf)) == 0 and S.exp32(np.float32(0)) == 1


@pytest.mark.parametrize("v", ODD_V)
def test_argmax_matches_numpy(rng, device, v):
    x = random_logits(rng, v, neg_inf=True)
    got, logit = ops.argmax(x, return_logit=True, device=device)
    assert got == int(np.argmax(x)), f"seed {rng.seed}"
    assert logit == x[got]


def test_argmax_planted_ties_go_to_lowest_id(rng, device):
    v = 5000
    x = random_logits(rng, v)
    ids = np.sort(rng.choice(v, size=4, replace=False))  # across threads and threadgroups
    x[ids] = x.max() + 1
    assert ops.argmax(x, device=device) == ids[0], f"seed {rng.seed}"
    assert ops.argmax(np.zeros(3000, np.float32), device=device) == 0
    assert ops.argmax(np.where(np.arange(40) >= 30, 0.0, -np.inf).astype(np.float32), device=device) == 30


def test_argmax_valid_vocab_and_batch(rng, device):
    x = np.stack([random_logits(rng, 3001) for _ in range(3)])
    x[:, 2990:] = 100.0  # padding rows: never chosen
    got = ops.argmax(x, valid_vocab=2990, device=device)
    np.testing.assert_array_equal(got, np.argmax(x[:, :2990], axis=1))


@pytest.mark.parametrize("params,dispatches", CONFIGS, ids=IDS)
@pytest.mark.parametrize("v", ODD_V)
def test_sample_matches_reference(rng, device, params, dispatches, v):
    for trial in range(3):
        x = random_logits(rng, v, ties=trial == 1, neg_inf=trial == 2)
        seed, step = int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(0, 1000))
        ids, chosen, status, _, stats = ops._sample(x, seed=seed, step=step, device=device, **params)
        want = ref_sample(x, params, step, seed)
        assert status[0] == 0 and ids[0] == want, \
            f"v={v} {params} seed={seed} step={step} trial={trial}: device {ids[0]}, reference {want} (rng {rng.seed})"
        assert chosen[0] == x[want]
        # Each filter configuration encodes a fixed pass sequence (top-k >= V is off).
        expect = expected_dispatches(params, v)
        assert v < 1000 or expect == dispatches
        assert stats["dispatches"] == expect == stats["planned_dispatches"] == len(stats["kernels"])
        assert stats["barriers"] == expect - 1


def test_many_seed_step_pairs(rng, device):
    x = random_logits(rng, 777, ties=True)
    params = dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01)
    seed = int(rng.integers(0, 2**63))
    for step in range(40):
        assert ops.sample(x, seed=seed, step=step, device=device, **params) == ref_sample(x, params, step, seed), \
            f"seed {seed} step {step} (rng {rng.seed})"


def test_small_k_route_planted_ties_across_groups(rng, device):
    """The small-k route with ties spread over several 2048-entry groups (and inside the
    candidates of one group): the lowest ids are kept, the choice equals the reference's."""
    v = 3 * 2048 + 77
    x = np.full(v, -20.0, np.float32)
    tied = rng.choice(v, size=40, replace=False)
    x[tied] = 2.0
    x[rng.choice(v, size=3, replace=False)] = 3.0
    for params in (dict(temperature=1.0, top_k=10), dict(temperature=0.5, top_k=37, top_p=0.6),
                   dict(temperature=2.0, top_k=64, min_p=0.5)):
        for step in range(6):
            got = ops.sample(x, seed=11, step=step, device=device, **params)
            assert got == ref_sample(x, params, step, 11), (params, step, rng.seed)


def test_top_k_tie_at_the_cutoff_keeps_lowest_ids(device):
    # Five entries tie for the last two top-k places: ids 3 and 10 are kept, 12, 20, 40 are not.
    x = np.full(50, -30.0, np.float32)
    x[[0, 1]] = 5.0
    x[[3, 10, 12, 20, 40]] = 4.0
    kept = set()
    for step in range(200):
        kept.add(ops.sample(x, temperature=1.0, top_k=4, seed=1, step=step, device=device))
        assert kept <= {0, 1, 3, 10}
    assert kept == {0, 1, 3, 10}


def test_top_p_tie_at_the_cutoff_keeps_lowest_ids(device):
    # p = 0.5 at id 5 and five ties of 0.1: top-p 0.65 keeps the ties whose mass before them is
    # < 0.65 (0.5, 0.6), i.e. the two lowest ids 2 and 9; 17, 30, 33 are cut.
    x = np.full(40, -30.0, np.float32)
    x[5] = np.log(0.5)
    x[[2, 9, 17, 30, 33]] = np.log(0.1)
    scaled = (x - x.max()).astype(np.float32)
    assert set(np.flatnonzero(S.keep_mask(scaled, 0, 0.65, 0.0))) == {2, 5, 9}
    kept = {ops.sample(x, temperature=1.0, top_p=0.65, seed=4, step=s, device=device) for s in range(300)}
    assert kept == {2, 5, 9}


@pytest.mark.parametrize("params,dispatches", [CONFIGS[0], CONFIGS[4], CONFIGS[8], CONFIGS[10]],
                         ids=["plain", "p0.3", "k+p+minp", "k65+p+minp"])
def test_full_vocabulary(rng, params, dispatches):
    x = random_logits(rng, FULL_V, scale=2.0)
    x[FULL_V - 100:] = -np.inf  # like the model's padding rows
    seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 10**6))
    ids, _, _, _, stats = ops._sample(x, seed=seed, step=step, **params)
    assert ids[0] == ref_sample(x, params, step, seed), f"seed {seed} step {step} (rng {rng.seed})"
    assert stats["dispatches"] == dispatches
    assert ops.argmax(x) == int(np.argmax(x))


def test_valid_vocab_is_never_sampled(rng, device):
    x = random_logits(rng, 2500)
    x[2100:] = np.nan  # garbage past valid_vocab is not even read
    for step in range(5):
        got = ops.sample(x, temperature=5.0, seed=3, step=step, valid_vocab=2100, device=device)
        assert got == ref_sample(x, dict(temperature=5.0), step, 3, valid=2100)


def test_slot_write_and_batch(rng, device):
    x = np.stack([random_logits(rng, 1500) for _ in range(3)])
    params = dict(temperature=1.0, top_k=30)
    ids, chosen, status, _, stats = ops._sample(x, seed=11, step=2, slot=5, device=device, **params)
    assert ids.shape == (8,) and ids.dtype == np.uint32
    assert np.all(ids[:5] == 0xABABABAB)  # other slots untouched
    for r in range(3):
        assert ids[5 + r] == ref_sample(x[r], params, 2, 11)
        assert chosen[5 + r] == x[r, ids[5 + r]]
    np.testing.assert_array_equal(ops.sample(x, seed=11, step=2, device=device, **params), ids[5:])
    assert stats["dispatches"] == expected_dispatches(params, x.shape[1])  # one sequence for the batch
    ids, _, _, _, stats = ops._argmax(x, slot=2, device=device)
    np.testing.assert_array_equal(ids[2:], np.argmax(x, axis=1))
    assert stats["dispatches"] == 2 and stats["barriers"] == 1


def test_tiny_temperature_is_greedy(device):
    x = np.array([0.1, 2.0, -1.0, 2.0, 1.9], np.float32)
    ids, _, _, _, stats = ops._sample(x, temperature=1e-40, seed=0, step=0, device=device)
    assert ids[0] == 1 and stats["dispatches"] == 2
    assert ops.sample(x, temperature=0, seed=0, step=0, device=device) == 1


@pytest.mark.parametrize("bad,where", [(np.nan, 7), (np.inf, 2000)])
def test_nonfinite_logits_raise_like_the_reference(rng, device, bad, where):
    x = random_logits(rng, 2100)
    x[where] = bad
    for call in (lambda: ops.argmax(x, device=device),
                 lambda: ops.sample(x, temperature=1.0, top_p=0.5, seed=1, step=0, device=device)):
        with pytest.raises(FloatingPointError, match=f"token id {where}"):
            call()
    with pytest.raises(FloatingPointError):
        ref_sample(x, dict(temperature=1.0), 0, 1)
    ids, chosen, status, bad_id, _ = ops._sample(x, temperature=1.0, top_k=3, seed=1, step=0, slot=1, device=device)
    assert ids[1] == NO_ID and np.isnan(chosen[1]) and status[0] != 0 and bad_id[0] == where


def test_all_neg_inf_raises(device):
    x = np.full(100, -np.inf, np.float32)
    with pytest.raises(FloatingPointError):
        ops.argmax(x, device=device)
    with pytest.raises(FloatingPointError):
        ops.sample(x, temperature=1.0, seed=0, step=0, device=device)


@pytest.mark.parametrize("top_k,cap", [(100, None), (0, None), (100, 0), (30, None)],
                         ids=["buckets", "buckets-top-p", "buckets-fallback", "small-k"])
def test_result_independent_of_thread_order(rng, top_k, cap):
    x = random_logits(rng, 3000, ties=True)
    p = dict(temperature=1.0, top_k=top_k, top_p=0.8, min_p=0.01, seed=5, step=9)
    got = {int(ops._sample(x, order=o, emu_seed=rng.seed, candidate_cap=cap, **p)[0][0])
           for o in ("forward", "reverse", "shuffle", "ahead")}
    params = {k: v for k, v in p.items() if k not in ("seed", "step")}
    assert len(got) == 1 and got == {ref_sample(x, params, 9, 5)}


@pytest.mark.parametrize("kw,msg", [
    (dict(logits=np.zeros(5, np.float64)), "float32"), (dict(logits=np.zeros((2, 0), np.float32)), "shape"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(seed=-1), "seed"), (dict(step=True), "step"),
    (dict(valid_vocab=0), "valid_vocab"), (dict(valid_vocab=6), "valid_vocab"), (dict(device="vulkan"), "device"),
])
def test_bad_input_raises_value_error(kw, msg):
    args = dict(logits=np.zeros(5, np.float32), temperature=1.0, seed=0, step=0)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        ops.sample(args.pop("logits"), **args)


BUCKET_CONFIGS = [(p, d) for p, d in CONFIGS if d == 6]
BUCKET_IDS = [i for i, (p, d) in zip(IDS, CONFIGS) if d == 6]


@pytest.mark.parametrize("params,dispatches", BUCKET_CONFIGS, ids=BUCKET_IDS)
@pytest.mark.parametrize("v", [33, 2049, 5000])
def test_bucket_route_fallback_matches_reference(rng, params, dispatches, v):
    """candidate_cap=0: resolve scans the whole row in one threadgroup (the path pathological
    inputs take) and must choose exactly what the candidate path and the reference choose."""
    for trial in range(3):
        x = random_logits(rng, v, ties=trial == 1, neg_inf=trial == 2)
        seed, step = int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(0, 1000))
        want = ref_sample(x, params, step, seed)
        ids, _, _, _, st = ops._sample(x, seed=seed, step=step, candidate_cap=0, **params)
        assert ids[0] == want, f"fallback v={v} {params} seed={seed} step={step} (rng {rng.seed})"
        assert st["dispatches"] == expected_dispatches(params, v)
        if st["dispatches"] == 6:  # top_k >= v is off: k300 at v = 33 is the plain route
            assert st["fallback"] == [st["collected"][0] > 0]
        ids, _, _, _, st = ops._sample(x, seed=seed, step=step, **params)
        assert ids[0] == want and st["fallback"] == ([False] if st["dispatches"] == 6 else [])


def test_bucket_route_many_random_rows(rng):
    """Seeded equality on many random rows: odd sizes, random temperatures, filters on both sides
    of the small-k switch, top_k up to the vocabulary, ties and -inf, a batch of rows at once."""
    for trial in range(24):
        v = int(rng.integers(2, 7000))
        r = int(rng.integers(1, 4))
        x = np.stack([random_logits(rng, v, ties=trial % 3 == 1, neg_inf=trial % 3 == 2,
                                    scale=float(rng.uniform(0.2, 8))) for _ in range(r)])
        params = dict(temperature=float(rng.uniform(0.1, 3.0)))
        if rng.random() < 0.6:
            params["top_k"] = int(rng.choice([int(rng.integers(1, v + 1)), v, v - 1, 65]))
        if rng.random() < 0.6:
            params["top_p"] = float(rng.choice([rng.uniform(0.01, 1.0), 1e-6, 0.999]))
        if rng.random() < 0.5:
            params["min_p"] = float(rng.uniform(0, 0.5))
        seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 10**6))
        ids, _, status, _, st = ops._sample(x, seed=seed, step=step, **params)
        assert st["dispatches"] == expected_dispatches(params, v) <= 6
        for row in range(r):
            assert ids[row] == ref_sample(x[row], params, step, seed), \
                f"trial {trial} row {row} v={v} {params} seed={seed} step={step} (rng {rng.seed})"


@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=5000), dict(temperature=0.7, top_p=0.5),
                                    dict(temperature=1.0, top_k=3000, top_p=0.4, min_p=0.5)],
                         ids=["k5000", "p0.5", "k+p+minp"])
def test_bucket_route_many_ties_in_one_bucket_fall_back(rng, params):
    """More than kSampleCandidates entries tie in the cutoff bucket: the row falls back to the
    one-threadgroup scan and still keeps exactly the reference's set (ties to the lowest ids)."""
    v = 9001
    x = np.full(v, 1.5, np.float32)
    x[rng.choice(v, size=7, replace=False)] = 4.0
    x[rng.choice(v, size=100, replace=False)] = -np.inf
    for step in range(3):
        ids, _, _, _, st = ops._sample(x, seed=7, step=step, **params)
        assert st["fallback"] == [True] and st["collected"][0] > CANDIDATES
        assert ids[0] == ref_sample(x, params, step, 7), (params, step, rng.seed)


def test_bucket_route_splits_the_top_k_bucket(rng):
    """top-k and top-p with the top_k-th entry inside a bucket: Z is searched among the candidates
    (both sides: split and whole-bucket Z), equal to the reference."""
    seen = set()
    for trial in range(8):
        x = random_logits(rng, 4000, scale=1.0)
        params = dict(temperature=1.0, top_k=int(rng.integers(100, 2000)), top_p=float(rng.uniform(0.5, 0.999)))
        seed, step = int(rng.integers(0, 2**63)), trial
        ids, _, _, _, st = ops._sample(x, seed=seed, step=step, **params)
        seen.add(st["split_k"][0])
        assert ids[0] == ref_sample(x, params, step, seed), (params, seed, rng.seed)
    x = np.zeros(300, np.float32)  # every entry in bucket 0: top_k = 150 splits it, Z = 150 entries
    ids, _, _, _, st = ops._sample(x, seed=1, step=2, temperature=1.0, top_k=150, top_p=0.5)
    assert st["split_k"] == [True] and ids[0] == ref_sample(x, dict(temperature=1.0, top_k=150, top_p=0.5), 2, 1)
    x = np.arange(300, dtype=np.float32)  # one entry per bucket: Z is known from whole buckets
    ids, _, _, _, st = ops._sample(x, seed=1, step=2, temperature=1.0, top_k=150, top_p=0.5)
    assert st["split_k"] == [False] and ids[0] == ref_sample(x, dict(temperature=1.0, top_k=150, top_p=0.5), 2, 1)
    assert True in seen


# ---- logprobs: log_softmax of the raw logits, after the sampler, on the device --------------

LOGPROB_ROUTES = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=7),
                  dict(temperature=0.9, top_p=0.9, min_p=0.01)]


def test_logprob_constant_matches_extension():
    assert core.ops.SAMPLE_MAX_LOGPROBS == S.MAX_LOGPROBS == 20


@pytest.mark.parametrize("params", LOGPROB_ROUTES, ids=["greedy", "plain", "small-k", "buckets"])
@pytest.mark.parametrize("v", [1, 33, 2049, 5001])
def test_logprobs_match_numpy(rng, device, params, v):
    """Every route, odd vocabularies (one group, a partial second group): the sampled token is the
    reference's, its logprob and the top-k ids / logprobs match log_softmax in float64 (ids exactly,
    values within 2e-6: float32 exponentials summed on the device, lily_log)."""
    for trial, k in enumerate((0, 1, 20)):
        x = random_logits(rng, v, ties=trial == 1, neg_inf=trial == 2)
        seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 1000))
        ids, chosen, top_ids, top_lps = ops.sample_logprobs(x, top_logprobs=k, seed=seed, step=step,
                                                            device=device, **params)
        tok = ref_sample(x, params, step, seed)
        assert ids[0] == tok, f"v={v} {params} rng {rng.seed}"
        want_c, want_ids, want_lps = S.logprobs(x, tok, k)
        np.testing.assert_allclose(chosen[0], want_c, rtol=1e-6, atol=2e-6)
        np.testing.assert_array_equal(top_ids[0], want_ids)
        np.testing.assert_allclose(top_lps[0], want_lps, rtol=1e-6, atol=2e-6)
        assert top_ids.shape == (1, min(k, v))
        # Against an independent log_softmax in float64:
        x64 = x.astype(np.float64)
        lsm = x64 - x64.max() - np.log(np.exp(x64 - x64.max()).sum())
        np.testing.assert_allclose(chosen[0], lsm[tok], rtol=1e-6, atol=2e-6)
        np.testing.assert_allclose(top_lps[0], np.sort(lsm)[::-1][:min(k, v)], rtol=1e-6, atol=2e-6)


def test_logprobs_full_vocabulary_batch_and_valid_vocab(rng):
    v, valid = FULL_V, FULL_V - 77
    x = np.stack([random_logits(rng, v) for _ in range(2)])
    x[:, valid:] = 50.0                      # padding ids: never in the distribution
    ids, chosen, top_ids, top_lps = ops.sample_logprobs(x, top_logprobs=5, temperature=1.0, seed=3, step=4,
                                                        valid_vocab=valid)
    for r in range(2):
        want_c, want_ids, want_lps = S.logprobs(x[r, :valid], int(ids[r]), 5)
        np.testing.assert_allclose(chosen[r], want_c, rtol=1e-6, atol=1e-5)
        np.testing.assert_array_equal(top_ids[r], want_ids)
        np.testing.assert_allclose(top_lps[r], want_lps, rtol=1e-6, atol=1e-5)
    # the logprobs passes: + candidates and sums (one level), + the record (one level)
    *_, stats = ops._sample(x[:1], temperature=1.0, seed=3, step=4, logprobs=5)
    assert stats["dispatches"] == stats["planned_dispatches"] == 4 + 3 and stats["barriers"] == 4 + 1
    *_, stats = ops._sample(x[:1], temperature=0.0, seed=3, step=4, logprobs=0)
    assert stats["kernels"][-2:] == ["sample_lse_partial_f32", "sample_logprobs"] and stats["dispatches"] == 4


@pytest.mark.parametrize("k", [-2, 21, 1.5])
def test_logprobs_bad_count_raises(k):
    with pytest.raises(ValueError, match="top_logprobs"):
        ops.sample_logprobs(np.zeros(5, np.float32), top_logprobs=k)


# ---- constraint masks: the allowed-token bitset, applied before every route ----------------

MASK_CONFIGS = [(dict(temperature=0.0), 2)] + CONFIGS
MASK_IDS = ["greedy"] + IDS


def random_mask(rng, v, trial):
    """Dense (90%), sparse (2%) or a single allowed token, as bool [v]."""
    if trial == 2:
        m = np.zeros(v, bool)
        m[rng.integers(v)] = True
        return m
    m = rng.random(v) < (0.9 if trial == 0 else 0.02)
    m[rng.integers(v)] = True
    return m


def test_pack_mask_layout(rng):
    m = rng.random(77) < 0.5
    w = S.pack_mask(m)
    assert w.dtype == np.uint32 and w.shape == (3,)
    assert all(bool((w[i // 32] >> (i % 32)) & 1) == m[i] for i in range(77))
    np.testing.assert_array_equal(S.unpack_mask(w, 77), m)


@pytest.mark.parametrize("params,dispatches", MASK_CONFIGS, ids=MASK_IDS)
@pytest.mark.parametrize("v", [33, 2049])
def test_masked_sample_is_bit_exact_against_the_reference(rng, device, params, dispatches, v):
    """Every route with a dense, a sparse and a one-token mask: the device's choice is the
    reference's with the same mask, always an allowed token, with no extra dispatch."""
    for trial in range(3):
        x = random_logits(rng, v, ties=trial == 1)
        m = random_mask(rng, v, trial)
        seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 1000))
        ids, chosen, status, _, stats = ops._sample(x, seed=seed, step=step, device=device,
                                                    mask=S.pack_mask(m), **params)
        want = S.sample(x, S.SamplingParams(**params), step, seed, allowed=m)
        assert status[0] == 0 and ids[0] == want and m[want], \
            f"v={v} {params} trial={trial}: device {ids[0]}, reference {want} (rng {rng.seed})"
        assert chosen[0] == x[want]
        assert stats["dispatches"] == expected_dispatches(params, v)
        if trial == 2:
            assert want == int(np.flatnonzero(m)[0])


def test_mask_hides_bad_logits_and_a_dead_end_raises(rng, device):
    x = random_logits(rng, 3000)
    m = np.ones(3000, bool)
    x[17], m[17] = np.nan, False              # a disallowed NaN is never looked at
    got = ops.sample(x, temperature=1.0, seed=1, step=2, mask=m, device=device)
    assert got == S.sample(x, S.SamplingParams(temperature=1.0), 2, 1, allowed=m) and got != 17
    with pytest.raises(FloatingPointError):   # nothing allowed: no finite logit
        ops.sample(x, temperature=1.0, seed=1, step=2, mask=np.zeros(3000, bool), device=device)
    with pytest.raises(FloatingPointError):
        S.sample(x, S.SamplingParams(temperature=1.0), 2, 1, allowed=np.zeros(3000, bool))


def test_masked_batch_full_vocabulary_and_logprobs(rng):
    """Two rows with their own masks over the full vocabulary; with a mask the logprobs are the
    masked distribution's (renormalised over the allowed tokens)."""
    x = np.stack([random_logits(rng, FULL_V) for _ in range(2)])
    m = np.stack([random_mask(rng, FULL_V, t) for t in (0, 1)])
    ids, chosen, top_ids, top_lps = ops.sample_logprobs(x, top_logprobs=4, temperature=0.7, top_k=40,
                                                        seed=9, step=3, mask=m)
    for r in range(2):
        p = S.SamplingParams(temperature=0.7, top_k=40)
        assert ids[r] == S.sample(x[r], p, 3, 9, allowed=m[r])
        xm = np.where(m[r], x[r], -np.inf).astype(np.float32)
        c, want_ids, want_lps = S.logprobs(xm, int(ids[r]), 4)
        np.testing.assert_array_equal(top_ids[r], want_ids)
        np.testing.assert_allclose(top_lps[r], want_lps, atol=1e-5)
        np.testing.assert_allclose(chosen[r], c, atol=1e-5)


def test_bad_mask_raises():
    with pytest.raises(ValueError, match="mask"):
        ops.sample(np.zeros(40, np.float32), temperature=1.0, seed=0, step=0, mask=np.zeros(3, np.uint32))
    with pytest.raises(ValueError, match="mask"):
        ops.sample(np.zeros(40, np.float32), temperature=1.0, seed=0, step=0, mask=np.zeros(40, np.int64))


@pytest.mark.parametrize("v", [1, 31, 1000, 2049])
@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=5),
                                    dict(temperature=1.0, top_p=0.8)], ids=["greedy", "plain", "k5", "p0.8"])
def test_mask_odd_sizes_ignore_the_last_words_padding_bits(rng, device, params, v):
    """A vocabulary that is not a multiple of 32: the last word's bits past valid_vocab are set
    (garbage a matcher may leave) and never read; all masked but one picks that one; a dense
    mask picks what the reference picks, always an allowed token."""
    for trial in (0, 2):
        x = random_logits(rng, v)
        m = random_mask(rng, v, trial)
        words = S.pack_mask(m)
        if v % 32:
            words[-1] |= np.uint32(0xFFFFFFFF) << np.uint32(v % 32)
        seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 1000))
        got = ops.sample(x, seed=seed, step=step, device=device, mask=words, **params)
        want = S.sample(x, S.SamplingParams(**params), step, seed, allowed=m)
        assert got == want and m[got], f"v={v} {params} trial={trial}: {got} vs {want} (rng {rng.seed})"
        if trial == 2:
            assert got == int(np.flatnonzero(m)[0])


def test_masked_sampling_distribution_is_softmax_over_the_allowed_tokens(rng, device):
    """Over many steps the masked sampler's choices follow softmax(l / T) renormalised over the
    allowed tokens (disallowed: never), on the reference (4000 draws, each token's count within
    5 sigma of its expectation) and on the device (its first 150 draws equal the reference's)."""
    v, t = 37, 0.8
    x = (rng.standard_normal(v) * 1.5).astype(np.float32)
    m = rng.random(v) < 0.4
    m[[3, 20]] = True
    seed = int(rng.integers(0, 2**63))
    p = S.SamplingParams(temperature=t)
    draws = np.array([S.sample(x, p, step, seed, allowed=m) for step in range(4000)])
    assert m[draws].all()
    z = np.where(m, x.astype(np.float64) / t, -np.inf)
    want = np.exp(z - z.max())
    want /= want.sum()
    counts = np.bincount(draws, minlength=v)
    sigma = np.sqrt(len(draws) * want * (1 - want))
    bad = np.flatnonzero(np.abs(counts - len(draws) * want) > 5 * sigma + 1e-9)
    assert bad.size == 0, f"tokens {bad}: counts {counts[bad]}, expected {len(draws) * want[bad]} (rng {rng.seed})"
    words = S.pack_mask(m)
    dev = [ops.sample(x, temperature=t, seed=seed, step=step, device=device, mask=words) for step in range(150)]
    np.testing.assert_array_equal(dev, draws[:150])
