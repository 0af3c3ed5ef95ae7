"""Token sampling: greedy, temperature, top-k, top-p, min-p — reproducible by construction.

Sampling is Gumbel-max with a counter-based generator: the noise for vocabulary entry ``i`` at
generation step ``n`` is a pure function ``uniform(seed, n, i)`` (an integer hash, no hidden
generator state). A device kernel computes the same function per entry, so the reference can
reproduce a device's choice exactly for the same seed, and a run is reproducible regardless of
how it was interrupted or resumed.

    choice = argmax_i over kept entries of  logits[i] / temperature + gumbel(uniform(seed, n, i))

which draws from softmax(logits / temperature) restricted to the kept entries. Filters
apply one after the other, each to the distribution renormalised over what the previous ones
kept (the order and semantics of transformers' warpers): top-k (the k most likely), top-p (the
smallest most-likely set whose probability reaches p), min-p (entries with probability >=
min_p * max probability). Each keeps at least the most likely entry. Ties (greedy and filters)
go to the lowest token id.
"""
from __future__ import annotations

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
    """Uniform floats in (0, 1) for entries 0..n-1 at ``step`` under ``seed`` (float32 exact:
    24-bit mantissa, centred in its bucket so 0 and 1 never occur)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    with np.errstate(over="ignore"):
        key = hash32(np.uint32(seed & 0xFFFFFFFF) ^ hash32(np.uint32(seed >> 32) + _GOLDEN))
        key = hash32(key ^ hash32(np.uint32(step & 0xFFFFFFFF)))
        h = hash32(np.arange(n, dtype=np.uint32) * _GOLDEN ^ key)
    return ((h >> np.uint32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    min_p: float = 0.0           # 0 = off
    seed: int | None = None      # None = a random seed drawn once per generation

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, (int, np.integer)) and not isinstance(self.top_k, bool)
                and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, (int, np.integer))
                                          and not isinstance(self.seed, bool) and self.seed >= 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def keep_mask(scaled_logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Boolean mask of the entries the filters keep (at least the most likely one)."""
    n = scaled_logits.shape[-1]
    order = np.argsort(-scaled_logits, kind="stable")           # most likely first, ties by id
    keep_sorted = np.ones(n, dtype=bool)
    if top_k and top_k < n:
        keep_sorted[top_k:] = False
    if top_p < 1.0 or min_p > 0.0:
        s = scaled_logits[order].astype(np.float64)
        p = np.where(keep_sorted, np.exp(s - s[0]), 0.0)       # renormalised over the kept set
        p /= p.sum()
        if top_p < 1.0:
            before = np.cumsum(p) - p                            # mass strictly before entry
            keep_sorted &= before < top_p
        if min_p > 0.0:
            keep_sorted &= p >= min_p * p[0]
    keep_sorted[0] = True
    mask = np.zeros(n, dtype=bool)
    mask[order[keep_sorted]] = True
    return mask


def sample(logits: np.ndarray, params: SamplingParams, step: int, seed: int) -> int:
    """Choose the next token from ``logits [V]`` (float32)."""
    logits = np.asarray(logits, dtype=np.float32)
    if np.isnan(logits).any() or np.isposinf(logits).any() or np.isneginf(logits).all():
        bad = int(np.flatnonzero(~np.isfinite(logits) & ~np.isneginf(logits))[0]) \
            if not np.isneginf(logits).all() else 0
        raise FloatingPointError(f"logits contain a non-finite value at token id {bad}: "
                                 f"{logits[bad]} (numerical failure in the model)")
    if params.greedy:
        return int(np.argmax(logits))
    # Shift by the max first: a tiny temperature then sends every other entry to -inf instead
    # of overflowing.
    with np.errstate(over="ignore"):
        scaled = (logits - logits.max()) / np.float32(params.temperature)
    mask = keep_mask(scaled, params.top_k, params.top_p, params.min_p)
    u = uniform(seed, step, logits.shape[0])
    gumbel = -np.log(-np.log(u))
    return int(np.argmax(np.where(mask, scaled + gumbel, -np.inf)))
