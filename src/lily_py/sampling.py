"""Token sampling: greedy, temperature, top-k, top-p, min-p — reproducible by construction.

Sampling is Gumbel-max with a counter-based generator: the noise for vocabulary entry ``i`` at
generation step ``n`` is a pure function ``uniform(seed, n, i)`` (an integer hash, no hidden
generator state). A device kernel computes the same function per entry, so the reference can
reproduce a device's choice exactly for the same seed, and a run is reproducible regardless of
how it was interrupted or resumed.

    choice = argmax_i over kept entries of  fma(logits[i] - max, 1/temperature, gumbel(uniform(seed, n, i)))

which draws from softmax(logits / temperature) restricted to the kept entries. Everything that
decides the choice is exactly specified float32 or integer arithmetic (``log32``, ``exp32``,
fixed-point masses for top-p), so the device kernels (shaders/sampling.metal) choose the same
token bit for bit; see docs/sampling.md. Filters
apply one after the other, each to the distribution renormalised over what the previous ones
kept (the order and semantics of transformers' warpers): top-k (the k most likely), top-p (the
smallest most-likely set whose probability reaches p), min-p (entries with probability >=
min_p * max probability). Each keeps at least the most likely entry. Ties (greedy and filters)
go to the lowest token id.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

_M1 = np.uint32(0x7FEB352D)
_M2 = np.uint32(0x846CA68B)
_GOLDEN = np.uint32(0x9E3779B9)


def hash32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer mixer (xor-shift-multiply, "lowbias32"); uint32 in, uint32 out.
    Must match ``lily_hash32`` in shaders/common/sampling.h."""
    x = np.asarray(x, dtype=np.uint32).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= _M1
        x ^= x >> np.uint32(15)
        x *= _M2
        x ^= x >> np.uint32(16)
    return x


def uniform(seed: int, step: int, n: int) -> np.ndarray:
    """Uniform floats in (0, 1) for entries 0..n-1 at ``step`` under ``seed``: the top 23 bits of
    the hash, centred in their bucket, ``(j + 0.5) * 2^-23``. Exact in float32 (24 significant
    bits), so 0 and 1 never occur (24 bits would round ``2^24 - 0.5`` up to exactly 1.0, whose
    Gumbel noise is +inf). Must match ``lily_uniform`` in shaders/common/sampling.h."""
    h = hash32(np.arange(n, dtype=np.uint32) * _GOLDEN ^ sample_key(seed, step))
    return ((h >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)


def sample_key(seed: int, step: int) -> np.uint32:
    """The per-(seed, step) key mixed into every entry's hash. Must match ``lily_sample_key``."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    with np.errstate(over="ignore"):
        key = hash32(np.uint32(seed & 0xFFFFFFFF) ^ hash32(np.uint32(seed >> 32) + _GOLDEN))
        return np.uint32(hash32(key ^ hash32(np.uint32(step & 0xFFFFFFFF))))


# ---- float32 math that every device computes bit-identically ----------------------------------
# Gumbel noise needs log, and the top-p mass needs exp. Library log/exp differ between glibc,
# NumPy's SIMD loops and Metal (a few ulp), which would change choices at near-ties. So both are
# defined here by exactly rounded float32 operations only: +, -, *, exact bit manipulation and
# fused multiply-add (one rounding; `fma` in Metal and C++). Every multiply feeding an add is an
# explicit fma, so a compiler that contracts a*b+c into an fma cannot change the result.
# Must match lily_log / lily_exp in shaders/common/sampling.h, operation for operation.

_F32 = np.float32


def fma32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 ``a * b + c`` (one rounding), as Metal's and C's ``fma``.

    The float64 product of two float32 is exact; the float64 sum is rounded to odd (TwoSum gives
    the exact error, an even inexact result moves one ulp towards it), and rounding to odd at 53
    bits followed by rounding to nearest at 24 bits is a correct rounding (Boldo & Melquiond)."""
    a = np.asarray(a, np.float32).astype(np.float64)
    b = np.asarray(b, np.float32).astype(np.float64)
    c = np.asarray(c, np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = a * b
        s = p + c
        # Rounding s to 24 bits can only differ from rounding the exact sum where s sits exactly
        # halfway between two float32 (its low 29 mantissa bits 1 followed by zeros); elsewhere
        # s.astype(float32) is already correct. Only those entries need the round-to-odd fix
        # (and results in float32's subnormal range, whose rounding bit is elsewhere).
        half = ((np.asarray(s).view(np.uint64) & np.uint64(0x1FFFFFFF)) == np.uint64(0x10000000)) \
            | (np.abs(s) < 2.0 ** -125)    # float32's subnormals round at another bit
        if half.any():
            bp = s - c
            err = (p - bp) + (c - (s - bp))
            bits = np.asarray(s).view(np.uint64)
            fix = half & np.isfinite(s) & (err != 0) & ((bits & np.uint64(1)) == 0)
            s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


# Cephes logf: log(1 + f) = f - f^2/2 + f^3 P(f) for f in [sqrt(1/2) - 1, sqrt(2) - 1].
_LOG_P = [7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
          -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1]
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4


def log32(x) -> np.ndarray:
    """float32 natural log (about 1 ulp) for positive normal x (the only inputs Gumbel noise
    produces: u in [2^-24, 1 - 2^-24], -log(u) in [5.9e-8, 16.7]). Must match lily_log."""
    x = np.asarray(x, np.float32)
    b = x.view(np.uint32)
    e = (b >> np.uint32(23)).astype(np.int32) - 126             # x = m 2^e, m in [0.5, 1)
    m = ((b & np.uint32(0x007FFFFF)) | np.uint32(0x3F000000)).view(np.float32)
    small = m < _F32(0.707106781186547524)
    e = np.where(small, e - 1, e)
    f = np.where(small, (m + m) - _F32(1.0), m - _F32(1.0))   # exact (Sterbenz)
    z = f * f
    y = np.full_like(f, _F32(_LOG_P[0]))
    for c in _LOG_P[1:]:
        y = fma32(y, f, _F32(c))
    y = (y * f) * z
    ef = e.astype(np.float32)
    y = fma32(ef, _F32(_LN2_LO), y)
    y = fma32(z, _F32(-0.5), y)
    r = f + y
    return fma32(ef, _F32(_LN2_HI), r)


# exp(s) = 2^k exp(r), k = rint(s log2(e)), r = s - k ln2 (two fma steps), exp(r) by a degree-6
# Taylor-like minimax polynomial (Cephes expf).
_EXP_P = [1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
          5.0000001201e-1]
_EXP_C1, _EXP_C2 = 0.693359375, -2.12194440e-4
EXP_MIN = -32.0   # exp32(s) = 0 below this (and for -inf); mass_fixed is 0 there anyway
                  # (exp(-27.8) < 2^-40), and 2^k stays a normal float (no denormal flushing)


def exp32(s) -> np.ndarray:
    """float32 exp for EXP_MIN <= s <= 0 (about 1 ulp); 0 below. Must match lily_exp."""
    s = np.asarray(s, np.float32)
    low = ~(s >= _F32(EXP_MIN))
    x = np.where(low, _F32(0.0), s)
    k = np.rint(x * _F32(1.44269504088896341))
    r = fma32(k, _F32(-_EXP_C1), x)
    r = fma32(k, _F32(-_EXP_C2), r)
    z = r * r
    y = np.full_like(r, _F32(_EXP_P[0]))
    for c in _EXP_P[1:]:
        y = fma32(y, r, _F32(c))
    y = fma32(y, z, r)
    y = y + _F32(1.0)
    scale = ((k.astype(np.int32) + 127).astype(np.uint32) << np.uint32(23)).view(np.float32)
    return np.where(low, _F32(0.0), y * scale).astype(np.float32)


MASS_BITS = 40   # fixed-point mass: floor(exp32(s) * 2^40), s <= 0, so <= 2^40 per entry


def mass_fixed(s) -> np.ndarray:
    """Each entry's probability mass relative to the most likely one, as an exact integer:
    floor(exp32(s) * 2^MASS_BITS) (uint64). Integer sums do not depend on the order of the
    additions, so a parallel reduction on a device gives exactly these sums. Entries below
    2^-40 of the maximum count as 0 (at most 248320 * 2^-40 = 2.3e-7 of the mass)."""
    e = exp32(s).astype(np.float64)
    return np.floor(e * 2.0 ** MASS_BITS).astype(np.uint64)


def top_p_fixed(top_p: float) -> int:
    """top_p as a 32-bit fraction t = floor(top_p * 2^32) (top_p < 1); must match the host op."""
    return min(int(np.floor(float(top_p) * 2.0 ** 32)), 0xFFFFFFFF)


def top_p_limit(total_mass: int, top_p: float) -> int:
    """The integer mass limit P = max(1, ceil(Z * t / 2^32)): an entry is kept by top-p iff the
    mass strictly before it (in the sorted order) is < P."""
    t = top_p_fixed(top_p)
    return max(1, -((-int(total_mass) * t) >> 32))


def min_p_threshold(min_p: float) -> np.float32:
    """min-p keeps p_i >= min_p * p_max, i.e. s_i >= log(min_p) on the scaled logits (max 0):
    float32(log(min_p)) computed in float64 once by the host."""
    return np.float32(np.log(np.float64(min_p))) if min_p > 0 else np.float32(-np.inf)


def inverse_temperature(temperature: float) -> np.float32:
    """float32(1 / temperature); the scaled logits are (l - max l) * this (one rounded multiply,
    the same on every device, unlike division). inf (temperature < ~2.9e-39) means greedy."""
    with np.errstate(over="ignore", divide="ignore"):
        return np.float32(1.0 / float(temperature))


def real_param(name: str, value) -> float:
    """``value`` as a float: TypeError unless a real number (a string or a bool is not one),
    ValueError unless finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def int_param(name: str, value) -> int:
    """``value`` as an int: TypeError unless an integer (a bool, a float or a string is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    min_p: float = 0.0           # 0 = off
    seed: int | None = None      # None = a random seed drawn once per generation

    def __post_init__(self):
        # A wrong type raises TypeError naming the parameter; a value out of range, ValueError.
        temperature = real_param("temperature", self.temperature)
        top_k = int_param("top_k", self.top_k)
        top_p = real_param("top_p", self.top_p)
        min_p = real_param("min_p", self.min_p)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and int_param("seed", self.seed) < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def keep_mask(scaled_logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Boolean mask of the entries the filters keep (at least the most likely one).

    ``scaled_logits`` are float32, normally with maximum 0 (``(l - max l) * inverse_temperature``;
    other inputs are shifted so). In the
    sorted order (most likely first, ties by lowest id) entry j is kept iff
      * top-k: j < top_k;
      * top-p: the mass strictly before j, sum_{i<j} q_i, is < top_p_limit(Z, top_p), with
        q = mass_fixed(s) and Z the sum of q over the top-k set (the distribution renormalised
        over what top-k kept);
      * min-p: s_j >= min_p_threshold(min_p)  (p_j >= min_p * p_max).
    Exact integer / float32 comparisons, so a device reproduces the kept set bit for bit.
    """
    s = np.asarray(scaled_logits, dtype=np.float32)
    n = s.shape[-1]
    order = np.argsort(-s, kind="stable")                       # most likely first, ties by id
    with np.errstate(invalid="ignore"):
        s = (s - s[order[0]]).astype(np.float32)                # no-op (exact) when the max is 0
    keep_sorted = np.ones(n, dtype=bool)
    if top_k and top_k < n:
        keep_sorted[top_k:] = False
    if top_p < 1.0:
        q = mass_fixed(s[order])
        q_kept = np.where(keep_sorted, q, np.uint64(0))
        before = np.cumsum(q_kept) - q_kept                     # exact (< 2^58)
        keep_sorted &= before < np.uint64(top_p_limit(int(q_kept.sum()), top_p))
    if min_p > 0.0:
        keep_sorted &= s[order] >= min_p_threshold(min_p)
    keep_sorted[0] = True
    mask = np.zeros(n, dtype=bool)
    mask[order[keep_sorted]] = True
    return mask


def gumbel(seed: int, step: int, n: int) -> np.ndarray:
    """Gumbel noise -log(-log(u)) in float32 with log32 (bit-identical on every device)."""
    return -log32(-log32(uniform(seed, step, n)))


def pack_mask(allowed) -> np.ndarray:
    """An allowed-token set (bool [V]) as the device's packed bitset: uint32 [ceil(V / 32)],
    token i is bit i % 32 of word i // 32 (llguidance's and xgrammar's layout)."""
    a = np.asarray(allowed, dtype=bool).reshape(-1)
    bits = np.zeros(-(-a.shape[0] // 32) * 32, dtype=np.uint8)
    bits[:a.shape[0]] = a
    return np.packbits(bits.reshape(-1, 4, 8), axis=-1, bitorder="little").reshape(-1).view(np.uint32).copy()


def unpack_mask(words, n: int) -> np.ndarray:
    """The bool [n] allowed set of a packed bitset (inverse of ``pack_mask``)."""
    w = np.ascontiguousarray(words, dtype=np.uint32).reshape(-1)
    return np.unpackbits(w.view(np.uint8), bitorder="little")[:n].astype(bool)


def _checked(logits, allowed) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float32)
    if allowed is not None:
        a = np.asarray(allowed)
        a = unpack_mask(a, logits.shape[0]) if a.dtype == np.uint32 else a.astype(bool)
        if a.shape != logits.shape:
            raise ValueError(f"allowed has shape {a.shape}, logits {logits.shape}")
        logits = np.where(a, logits, np.float32(-np.inf)).astype(np.float32)
    if np.isnan(logits).any() or np.isposinf(logits).any() or np.isneginf(logits).all():
        bad = int(np.flatnonzero(~np.isfinite(logits) & ~np.isneginf(logits))[0]) \
            if not np.isneginf(logits).all() else 0
        raise FloatingPointError(f"logits contain a non-finite value at token id {bad}: "
                                 f"{logits[bad]} (numerical failure in the model)")
    return logits


def _top_k_set(s: np.ndarray, top_k: int) -> np.ndarray:
    """Ids (ascending) of the first ``top_k`` entries of the stable order (most likely first,
    ties by lowest id)."""
    n = s.shape[0]
    v = np.partition(s, n - top_k)[n - top_k]                   # the k-th largest value
    above = np.flatnonzero(s > v)
    at = np.flatnonzero(s == v)[:top_k - above.shape[0]]
    return np.sort(np.concatenate([above, at]))


def _top_p_prefix(s: np.ndarray, ids: np.ndarray, top_p: float) -> np.ndarray:
    """Of ``ids`` (the top-k set, or every entry of nonzero mass), those top-p keeps: the
    entries whose mass strictly before them in the stable order is < the limit (a prefix)."""
    if ids.shape[0] > 1024:
        kept = _top_p_screened(s, ids, top_p)
        if kept is not None:
            return kept
    order = ids[np.argsort(-s[ids], kind="stable")]
    q = mass_fixed(s[order])
    before = np.cumsum(q) - q
    limit = top_p_limit(int(q.sum()), top_p)
    return order[before < np.uint64(limit)]


def _top_p_screened(s: np.ndarray, ids: np.ndarray, top_p: float) -> np.ndarray | None:
    """``_top_p_prefix`` without the exact masses of every entry, or None where the screen
    cannot decide. The masses in float64 with the library exp are each within
    ``1 + q 2^-20`` of the exact ones (exp32 is within 1.4 x 2^-24 of exp, measured over 4e7
    draws in [-32, 0]), so the exact total lies in ``Z64 +- err`` and the limit in [lo, hi].
    The entries above a value where the float64 mass surely reaches ``hi`` hold the whole
    prefix (the rest come later in the order); they are sorted and summed exactly, and every
    one of them must be surely in (exact mass before it < lo) or surely out (>= hi)."""
    sv = s[ids]
    finite = np.isfinite(sv)
    if not finite.all():       # -inf entries have mass 0 and come last: never kept
        ids, sv = ids[finite], sv[finite]
    if ids.shape[0] == 0:
        return None
    q64 = np.floor(np.exp(sv.astype(np.float64)) * 2.0 ** MASS_BITS)
    z = float(q64.sum())
    err = ids.shape[0] + z * 2.0 ** -20 + 2.0 * ids.shape[0] * z * 2.0 ** -52
    lo = top_p_limit(max(int(z - err), 0), top_p)
    hi = top_p_limit(int(z + err) + 1, top_p)
    # a value tau with float64 mass(s >= tau) - err >= hi: the top of a 256-bin histogram
    low = float(sv.min())
    width = max(-low, 1e-30) / 256
    bins = np.minimum(((sv.astype(np.float64) - low) / width).astype(np.int64), 255)
    mass = np.bincount(bins, weights=q64, minlength=256)
    above = np.cumsum(mass[::-1])                               # mass of the top j + 1 bins
    j = int(np.searchsorted(above, hi + 2.0 * err))
    if j >= above.shape[0]:
        return None
    # every entry of those bins is >= tau (bins were cut in float64; tau is rounded down)
    tau = np.nextafter(np.float32(low + (255 - j) * width), np.float32(-np.inf))
    cand = ids[sv >= tau]
    order = cand[np.argsort(-s[cand], kind="stable")]
    q = mass_fixed(s[order])
    if int(q.sum()) < hi:      # the exact mass of the candidates must reach every possible limit
        return None
    before = np.cumsum(q) - q
    sure_in, sure_out = before < np.uint64(lo), before >= np.uint64(hi)
    if not (sure_in | sure_out).all():
        return None
    return order[sure_in]


def sample(logits: np.ndarray, params: SamplingParams, step: int, seed: int,
           allowed: np.ndarray | None = None) -> int:
    """Choose the next token from ``logits [V]`` (float32). ``allowed`` (bool [V] or a packed
    bitset, ``pack_mask``): a constraint's allowed tokens; every other logit becomes -inf first
    (probability zero, as the device's masked max pass does), then the rule is unchanged.

    The rule is ``sample_full``'s (bit for bit: tests/api/test_sampling.py), computed from the
    entries that can win: z = s + Gumbel noise, the noise is at most ``GUMBEL_MAX``, and the most
    likely entry is always kept, so an entry with s + GUMBEL_MAX below its z never wins. The
    top-k set comes from a partition, the top-p prefix from a sort of the top-k set (or of the
    entries of nonzero mass), the noise only for the candidates: a few ms for a 248,320-entry
    row instead of a quarter of a second."""
    logits = _checked(logits, allowed)
    inv_t = inverse_temperature(params.temperature) if not params.greedy else np.float32(np.inf)
    if np.isinf(inv_t):
        return int(np.argmax(logits))                             # greedy: ties to the lowest id
    n = logits.shape[0]
    top = logits.max()
    with np.errstate(over="ignore", invalid="ignore"):
        s = (logits - top) * inv_t
    s = np.where(np.isneginf(logits), np.float32(-np.inf), s).astype(np.float32)
    s = (s - s.max()).astype(np.float32)                          # as keep_mask: exact no-op
    a = int(np.argmax(s))                                         # always kept
    ids_a = np.array([a])
    z_a = float(_z(logits, top, inv_t, seed, step, ids_a)[0])
    # s + noise (one fma rounding) < z_a for every entry below this, with a wide margin
    bound = z_a - float(GUMBEL_MAX) - 2.0 ** -10 * (abs(z_a) + float(GUMBEL_MAX) + 1.0)
    cand = np.flatnonzero(s >= np.float32(bound))
    keep = np.ones(cand.shape[0], dtype=bool)
    top_k = params.top_k if params.top_k and params.top_k < n else 0
    if top_k:
        t_set = _top_k_set(s, top_k)
        keep &= np.isin(cand, t_set, assume_unique=True)
    if params.top_p < 1.0:
        if top_k:
            kept = _top_p_prefix(s, t_set, params.top_p)
            keep &= np.isin(cand, kept, assume_unique=True)
        else:
            live = np.flatnonzero(s >= np.float32(EXP_MIN))       # mass 0 below (exp32)
            kept = _top_p_prefix(s, live, params.top_p)
            if kept.shape[0] < live.shape[0]:
                keep &= np.isin(cand, kept, assume_unique=True)
            else:   # everything of nonzero mass is kept: the zero-mass entries decide alone
                q_total = int(mass_fixed(s[live]).sum())
                zero_kept = q_total < top_p_limit(q_total, params.top_p)
                keep &= np.isin(cand, kept, assume_unique=True) | (zero_kept & (s[cand] < EXP_MIN))
    if params.min_p > 0.0:
        keep &= s[cand] >= min_p_threshold(params.min_p)
    keep |= cand == a
    ids = cand[keep]
    if ids.shape[0] > 64:
        # z in float64 first (within 1e-6 of the exact float32 z), then exactly where it is
        # within a wide margin of the best: the exact winner is among those.
        z64 = (logits[ids] - top).astype(np.float64) * float(inv_t) + _gumbel64(seed, step, ids)
        best = float(z64.max())
        ids = ids[z64 >= best - 2.0 ** -10 * (1.0 + abs(best))]
    z = _z(logits, top, inv_t, seed, step, ids)
    return int(ids[np.argmax(z)])                                 # ties to the lowest id


def _uniform_at(seed: int, step: int, ids: np.ndarray) -> np.ndarray:
    """``uniform(seed, step, n)[ids]``."""
    u = hash32(ids.astype(np.uint32) * _GOLDEN ^ sample_key(seed, step))
    return ((u >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)


def _gumbel64(seed: int, step: int, ids: np.ndarray) -> np.ndarray:
    """The Gumbel noise at ``ids`` in float64 with the library log (not bit-exact)."""
    return -np.log(-np.log(_uniform_at(seed, step, ids).astype(np.float64)))


def _z(logits, top, inv_t, seed: int, step: int, ids: np.ndarray) -> np.ndarray:
    """z = fma(l - max, inv_t, gumbel) at ``ids`` (-inf where l is), as ``sample_full``."""
    g = -log32(-log32(_uniform_at(seed, step, ids)))
    lo = logits[ids]
    with np.errstate(over="ignore", invalid="ignore"):
        z = fma32(lo - top, inv_t, g)
    return np.where(np.isneginf(lo), np.float32(-np.inf), z)


def sample_full(logits: np.ndarray, params: SamplingParams, step: int, seed: int,
           allowed: np.ndarray | None = None) -> int:
    """The sampling rule written out over the whole vocabulary (the definition ``sample`` and the
    device follow; ``sample`` computes the same choice from the few entries that can win)."""
    logits = _checked(logits, allowed)
    inv_t = inverse_temperature(params.temperature) if not params.greedy else np.float32(np.inf)
    if np.isinf(inv_t):
        return int(np.argmax(logits))                             # greedy: ties to the lowest id
    # Shift by the max first: a tiny temperature then sends every other entry to -inf instead of
    # overflowing; the most likely entry has s = 0 exactly.
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (logits - logits.max()) * inv_t
    scaled = np.where(np.isneginf(logits), np.float32(-np.inf), scaled).astype(np.float32)
    mask = keep_mask(scaled, params.top_k, params.top_p, params.min_p)
    # z = (l - max) * inv_t + gumbel in one rounding (fma), as the device computes it: an explicit
    # fma, so no compiler contraction of a product feeding an add can change the choice.
    with np.errstate(over="ignore", invalid="ignore"):
        z = fma32(logits - logits.max(), inv_t, gumbel(seed, step, logits.shape[0]))
    z = np.where(np.isneginf(logits), np.float32(-np.inf), z)
    return int(np.argmax(np.where(mask, z, -np.inf)))


MAX_LOGPROBS = 20   # top_logprobs <= this (OpenAI's limit; the device record's size)


def logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, np.ndarray, np.ndarray]:
    """The model's distribution at a step: ``log_softmax(logits)`` of the raw float32 logits (no
    temperature, no filters; OpenAI's ``logprobs``). Returns (logprob of ``token``, the ``top``
    most likely ids int64, their logprobs float32). Order: ``float32(l - max l)`` descending,
    ties to the lowest id (the device's order); values in float64, rounded to float32 (the
    device sums float32 exponentials: it agrees within about 1e-6 absolute)."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max()
    with np.errstate(invalid="ignore"):
        s = (x - m).astype(np.float32)
    lz = np.log(np.sum(np.exp(s.astype(np.float64))))
    k = min(int(top), x.shape[0])
    order = np.lexsort((np.arange(x.shape[0]), -s.astype(np.float64)))[:k]
    return (float(np.float32(s[token] - lz)), order.astype(np.int64),
            (s[order].astype(np.float64) - lz).astype(np.float32))


# The largest Gumbel noise: u at its largest, (2^23 - 0.5) 2^-23 (``uniform``): about 16.6.
GUMBEL_MAX = np.float32(-log32(-log32(np.float32((2.0 ** 23 - 0.5) * 2.0 ** -23))))
