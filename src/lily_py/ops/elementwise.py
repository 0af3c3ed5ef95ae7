"""Elementwise kernels: SwiGLU and the sigmoid gate (``shaders/elementwise.metal``)."""
from __future__ import annotations

import numpy as np

from ._common import _check_device, _core, _float_array, _from_core

__all__ = ['swiglu', 'sigmoid_mul']


def swiglu(gate: np.ndarray, up: np.ndarray, *, device: str = "emu") -> np.ndarray:
    """``silu(gate) * up`` elementwise (float32 or bfloat16, same shape and dtype; math in float32)."""
    return _elementwise("swiglu", gate, up, device=device)[0]


def sigmoid_mul(x: np.ndarray, gate: np.ndarray, *, device: str = "emu") -> np.ndarray:
    """``x * sigmoid(gate)``: ``gate`` has x's shape, or ``[..., 1]`` for one gate per row."""
    return _elementwise("sigmoid_mul", x, gate, device=device)[0]


def _elementwise(op, a, b, *, device="emu", order="shuffle", seed=0, fp_traps=True):
    names = {"swiglu": ("gate", "up"), "sigmoid_mul": ("x", "gate")}[op]
    ac, a_dtype = _float_array(a, names[0], op)
    bc, b_dtype = _float_array(b, names[1], op)
    if a_dtype != b_dtype:
        raise ValueError(f"{op}: {names[0]} ({a.dtype}) and {names[1]} ({b.dtype}) must have the same dtype")
    if ac.ndim < 1 or ac.shape[-1] == 0:
        raise ValueError(f"{op}: {names[0]} must have shape [..., n] with n > 0, got {a.shape}")
    per_row = op == "sigmoid_mul" and b.shape == (*a.shape[:-1], 1) and a.shape[-1] != 1
    if b.shape != a.shape and not per_row:
        allowed = f"{list(a.shape)}" + (f" or {list((*a.shape[:-1], 1))}" if op == "sigmoid_mul" else "")
        raise ValueError(f"{op}: {names[1]} must have shape {allowed}, got {list(b.shape)}")
    _check_device(device, op)
    n = a.shape[-1]
    m = int(np.prod(a.shape[:-1], dtype=np.int64)) if a.ndim > 1 else 1
    if m == 0:
        return np.zeros(a.shape, a.dtype), {"kernels": [], "dispatches": 0}
    y, stats = _core().ops.elementwise(op, ac.reshape(m, n), bc.reshape(m, 1 if per_row else n),
                                       b_per_row=per_row, dtype=a_dtype, device=device, order=order,
                                       seed=seed, fp_traps=fp_traps)
    return _from_core(y, a_dtype).reshape(a.shape), stats
