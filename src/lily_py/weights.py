"""Lazily dequantized weight matrices, backed by memory-mapped checkpoint tensors.

A ``Linear`` is a logical float32 matrix ``[out, in]`` (or a stack ``[E, out, in]`` of expert
matrices). Nothing is read from disk or dequantized until a caller asks for rows, and then only
those rows, a bounded block at a time: this is how the NumPy reference runs the full 35B model in
a few GiB.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .reference.quant import dequantize

# Dequantize at most this many float32 elements at once in ``matmul`` (64 MiB).
BLOCK_ELEMENTS = 1 << 24


class Linear:
    """Base class: logical shape ``(..., out, in)``."""
    shape: tuple[int, ...]
    bits: int | None = None
    group_size: int | None = None

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    def rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """float32 rows ``[start:stop]`` of a 2-D matrix."""
        raise NotImplementedError

    def take(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 rows at ``ids`` (embedding lookup)."""
        raise NotImplementedError

    def expert(self, e: int) -> "Linear":
        """The ``e``-th matrix of a stacked ``[E, out, in]`` weight."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes stored in the checkpoint for this weight."""
        raise NotImplementedError

    def dense(self) -> np.ndarray:
        return self.rows(0, self.out_features)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T`` in float32, dequantizing ``W`` one bounded block of rows at a time."""
        if len(self.shape) != 2:
            raise ValueError(f"matmul needs a 2-D weight, this one is {self.shape}")
        x = np.asarray(x, dtype=np.float32)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, weight expects {self.in_features}")
        n = self.out_features
        block = max(1, BLOCK_ELEMENTS // max(1, self.in_features))
        if block >= n:
            return x @ self.rows(0, n).T
        out = np.empty(x.shape[:-1] + (n,), dtype=np.float32)
        for s in range(0, n, block):
            e = min(n, s + block)
            out[..., s:e] = x @ self.rows(s, e).T
        return out


class DenseLinear(Linear):
    """An unquantized weight (bf16/fp16/fp32 array, possibly a memory-mapped view)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.shape = tuple(array.shape)

    def rows(self, start=0, stop=None):
        return np.asarray(self.array[start:stop], dtype=np.float32)

    def take(self, ids):
        return np.asarray(self.array[np.asarray(ids, dtype=np.int64)], dtype=np.float32)

    def expert(self, e):
        return DenseLinear(self.array[e])

    @property
    def nbytes(self):
        return int(self.array.nbytes)


class QuantLinear(Linear):
    """An MLX affine-quantized weight: packed uint32 codes + per-group scales and biases."""

    def __init__(self, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                 group_size: int):
        self.w, self.scales, self.biases = w, scales, biases
        self.bits, self.group_size = bits, group_size
        self.shape = tuple(w.shape[:-1]) + (w.shape[-1] * 32 // bits,)

    def _deq(self, w, s, b):
        return dequantize(np.asarray(w), np.asarray(s), np.asarray(b), bits=self.bits,
                          group_size=self.group_size)

    def rows(self, start=0, stop=None):
        return self._deq(self.w[start:stop], self.scales[start:stop], self.biases[start:stop])

    def take(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        return self._deq(self.w[ids], self.scales[ids], self.biases[ids])

    def expert(self, e):
        return QuantLinear(self.w[e], self.scales[e], self.biases[e], self.bits, self.group_size)

    @property
    def nbytes(self):
        return int(self.w.nbytes + self.scales.nbytes + self.biases.nbytes)


class StackedLinear(Linear):
    """Experts stored as separate matrices (Hugging Face per-expert naming), seen as one stack."""

    def __init__(self, experts: list[Linear]):
        if not experts:
            raise ValueError("StackedLinear needs at least one expert")
        self.experts = experts
        self.shape = (len(experts),) + tuple(experts[0].shape)

    def expert(self, e):
        return self.experts[e]

    def rows(self, start=0, stop=None):
        raise ValueError("rows() needs a 2-D weight; select an expert first")

    def take(self, ids):
        raise ValueError("take() needs a 2-D weight; select an expert first")

    @property
    def nbytes(self):
        return sum(x.nbytes for x in self.experts)
