"""Sampling: counter-based noise, filters, reproducibility, and the distribution it draws from."""
import numpy as np
import pytest

from lily_py.sampling import SamplingParams, hash32, keep_mask, sample, uniform


def test_hash32_known_values():
    # lowbias32 of 0 is 0; of 1 computed by hand with the documented constants
    x = np.uint64(1)
    x ^= x >> np.uint64(16); x = (x * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15); x = (x * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    assert hash32(np.array([0, 1], np.uint32)).tolist() == [0, int(x)]


def test_uniform_is_a_pure_function_of_seed_step_index():
    a = uniform(123, 4, 1000)
    np.testing.assert_array_equal(a, uniform(123, 4, 1000))
    np.testing.assert_array_equal(a[:10], uniform(123, 4, 10))      # index-wise, not stream
    assert not np.array_equal(a, uniform(124, 4, 1000))
    assert not np.array_equal(a, uniform(123, 5, 1000))
    assert a.dtype == np.float32 and a.min() > 0 and a.max() < 1


def test_uniform_statistics():
    u = uniform(7, 0, 200_003).astype(np.float64)
    n = u.size
    # mean 1/2 and variance 1/12 within 5 standard errors
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)
    counts = np.bincount((u * 16).astype(int), minlength=16)
    chi2 = ((counts - n / 16) ** 2 / (n / 16)).sum()
    assert chi2 < 45, chi2           # 15 d.o.f.: p < 1e-4 beyond 45


def test_greedy_ties_go_to_lowest_id():
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert sample(logits, SamplingParams(), 0, 0) == 1


def test_nonfinite_logits_raise():
    with pytest.raises(FloatingPointError, match="token id 2"):
        sample(np.array([0.0, 1.0, np.nan], np.float32), SamplingParams(), 0, 0)


def test_keep_mask_filters():
    logits = np.log(np.array([0.05, 0.4, 0.3, 0.2, 0.05], np.float32))
    assert keep_mask(logits, 2, 1.0, 0.0).tolist() == [False, True, True, False, False]
    # top-p 0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.2 is needed too
    assert keep_mask(logits, 0, 0.75, 0.0).tolist() == [False, True, True, True, False]
    assert keep_mask(logits, 0, 0.7, 0.0).tolist() == [False, True, True, False, False]
    # min-p 0.6: keep p >= 0.24
    assert keep_mask(logits, 0, 1.0, 0.6).tolist() == [False, True, True, False, False]
    # always at least the most likely entry
    assert keep_mask(logits, 0, 1e-9, 0.0).tolist() == [False, True, False, False, False]
    # ties in top-k go to the lowest id
    assert keep_mask(np.zeros(4, np.float32), 2, 1.0, 0.0).tolist() == [True, True, False, False]


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), [0.5, 0.3, 0.15, 0.05]),
    (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0, 0]),
    (SamplingParams(temperature=1.0, top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (SamplingParams(temperature=1.0, min_p=0.5), [0.625, 0.375, 0, 0]),
])
def test_sampled_frequencies_match_the_distribution(params, expected):
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    n = 20000
    seed = int(np.random.default_rng().integers(0, 2**31))
    counts = np.bincount([sample(logits, params, s, seed) for s in range(n)], minlength=4)
    exp = np.array(expected)
    assert np.all(counts[exp == 0] == 0), counts
    sd = np.sqrt(n * exp * (1 - exp))
    assert np.all(np.abs(counts - n * exp) <= 5 * sd + 1), (counts, n * exp)


def test_top_k_then_top_p_renormalises_like_transformers():
    # p = [.4, .3, .2, .1]; top-k 2 keeps [.4, .3] -> renormalised [.571, .429]; top-p 0.5 then
    # keeps only the first (transformers' TopK then TopP warpers give the same set).
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    assert keep_mask(logits, 2, 0.5, 0.0).tolist() == [True, False, False, False]


def test_tiny_temperature_is_greedy_not_overflow():
    logits = np.array([0.1, 2.0, -1.0, 1.9], np.float32)
    for t in (1e-40, 1e-30, 1e-8):
        assert sample(logits, SamplingParams(temperature=t), 0, 5) == 1


def test_temperature_sharpens():
    logits = np.log(np.array([0.6, 0.4], np.float32))
    n = 4000
    cold = np.bincount([sample(logits, SamplingParams(temperature=0.25), s, 3) for s in range(n)], minlength=2)
    # p0 at T=0.25: 0.6^4 / (0.6^4 + 0.4^4) = 0.835
    assert abs(cold[0] / n - 0.835) < 0.03, cold


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(temperature=-1), ValueError, "temperature"), (dict(top_p=0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"), (dict(top_k=-2), ValueError, "top_k"),
    (dict(min_p=2), ValueError, "min_p"), (dict(seed=-1), ValueError, "seed"),
    # a wrong type: TypeError naming the parameter
    (dict(seed=True), TypeError, "seed"), (dict(top_k=1.5), TypeError, "top_k"),
])
def test_bad_params(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        SamplingParams(**kw)


def _rows(rng, count):
    """Logit rows that stress the fast sampler: odd sizes, flat and peaked, ties, -inf entries."""
    for t in range(count):
        n = int(rng.choice([7, 33, 1001, 4097, 9001]))
        row = (rng.standard_normal(n) * float(rng.choice([0.1, 1, 3, 10, 30]))).astype(np.float32)
        if t % 3 == 0:
            row = np.round(row).astype(np.float32)          # ties everywhere
        if t % 7 == 0:
            row[rng.integers(0, n, n // 3)] = -np.inf       # masked entries
        if t % 11 == 0:
            row[:] = np.float32(1.5)                        # all equal
        yield row


def test_sample_equals_the_full_vocabulary_rule():
    """``sample`` (candidates only, float64 screens) chooses what ``sample_full`` (every entry,
    the device's rule) chooses: every filter combination, ties, -inf entries (also inside a
    top-k set past the top-p screen's 1,024), sizes past the float64 screens' thresholds, and a
    full 248,320-entry row."""
    from lily_py.sampling import pack_mask, sample_full
    rng = np.random.default_rng()
    checked = 0
    rows = list(_rows(rng, 150)) + [(rng.standard_normal(248_320) * 3).astype(np.float32)]
    for row in rows:
        n = row.shape[0]
        p = SamplingParams(temperature=float(rng.choice([0.05, 0.3, 0.7, 1.0, 2.0])),
                           top_k=int(rng.choice([0, 1, 2, 20, 64, 2000, n, n + 5])),
                           top_p=float(rng.choice([1.0, 0.95, 0.5, 0.01, 0.999999])),
                           min_p=float(rng.choice([0.0, 0.0, 0.05, 0.5])))
        allowed = pack_mask(rng.random(n) < 0.7) if rng.random() < 0.2 else None
        if allowed is not None and np.isneginf(np.where(
                np.unpackbits(allowed.view(np.uint8), bitorder="little")[:n].astype(bool), row, -np.inf)).all():
            allowed = None
        for step in range(2):
            seed = int(rng.integers(0, 2 ** 63))
            fast = sample(row, p, step, seed, allowed)
            full = sample_full(row, p, step, seed, allowed)
            assert fast == full, (n, p, step, seed, fast, full)
            checked += 1
    assert checked == 2 * len(rows)
    # a top-k set larger than the finite entries: -inf entries inside it, past 1,024
    row = (rng.standard_normal(3001) * 3).astype(np.float32)
    row[rng.permutation(3001)[:2000]] = -np.inf
    for top_p in (0.9, 0.3):
        p = SamplingParams(temperature=1.0, top_k=2500, top_p=top_p)
        for step in range(4):
            assert sample(row, p, step, 11) == sample_full(row, p, step, 11), (top_p, step)
