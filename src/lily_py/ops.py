"""Metal kernels as functions over NumPy arrays.

Each function runs one kernel family on a device and returns NumPy arrays:

* ``device="emu"`` - the CPU emulator: the very ``shaders/*.metal`` sources compiled as C++, with
  GPU-faithful threadgroups, barriers and simd collectives, and checks a GPU would not do (see
  ``docs/kernels.md``). Slow; always available.
* ``device="metal"`` - the GPU, in macOS builds (the Metal device is written but has not run in CI
  yet; see ``docs/kernels.md``).

Arrays are float32 or bfloat16 (``ml_dtypes.bfloat16``); quantized weights use MLX's affine
layout (``lily_py.reference.quant``). The NumPy oracle of every function is in
``lily_py.reference.kernels``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ._ops_sampling import _argmax, _sample, argmax, sample  # noqa: E402,F401  (sampling kernels)

__all__ = ["quantized_matmul", "quantized_matmul_route", "rms_norm", "embedding", "swiglu",
           "sigmoid_mul", "devices"]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_FLOAT_DTYPES = {np.dtype(np.float32): "float32", BFLOAT16: "bfloat16"}
_BITS = (4, 8)
_GROUP_SIZES = (32, 64, 128)


def _core():
    from . import _core  # the compiled extension; imported lazily so `import lily_py` stays light
    return _core


def devices() -> list[str]:
    """Devices compiled into this build (always includes ``"emu"``)."""
    return list(_core().devices())


def _check_device(device, fn: str) -> None:
    if device not in ("emu", "metal"):
        raise ValueError(f"{fn}: device must be 'emu' or 'metal', got {device!r}")


def _from_core(y: np.ndarray, dtype_name: str) -> np.ndarray:
    return y.view(BFLOAT16) if dtype_name == "bfloat16" else y


def _float_array(a, what: str, fn: str) -> tuple[np.ndarray, str]:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{fn}: {what} must be a numpy.ndarray, got {type(a).__name__}")
    name = _FLOAT_DTYPES.get(a.dtype)
    if name is None:
        raise ValueError(f"{fn}: {what} must be float32 or bfloat16, got {a.dtype}")
    a = np.ascontiguousarray(a)
    return (a.view(np.uint16) if name == "bfloat16" else a), name


def quantized_matmul_route(m: int) -> str:
    """The route :func:`quantized_matmul` takes for ``m`` rows of ``x``: ``"qmv"`` or ``"qmm"``."""
    return str(_core().ops.qmm_route(int(m)))


def quantized_matmul(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, *,
                     bits: int, group_size: int, device: str = "emu") -> np.ndarray:
    """``y = x @ dequant(w).T`` with the dequantization fused into the kernel.

    ``x``: ``[..., K]`` float32 or bfloat16. ``w``: uint32 ``[N, K * bits / 32]`` (MLX affine
    layout, ``32 // bits`` codes per word, least significant first). ``scales``, ``biases``:
    ``[N, K / group_size]``, float32 or bfloat16 (the same dtype). ``bits`` is 4 or 8,
    ``group_size`` 32, 64 or 128. Returns ``[..., N]`` in the dtype of ``x``; accumulation is fp32.
    Rows ``M <= 8`` take the matrix-vector route (``qmv``), larger ``M`` the tiled one (``qmm``).
    """
    y, _ = _quantized_matmul(x, w, scales, biases, bits=bits, group_size=group_size, device=device)
    return y


def _quantized_matmul(x, w, scales, biases, *, bits, group_size, device="emu", order="shuffle",
                      seed=0, fp_traps=True):
    """:func:`quantized_matmul` plus the run's stats (kernels, dispatches, bytes bound, threads)
    and the emulator's scheduling knobs (``order``: forward/reverse/shuffle/ahead, ``seed``,
    ``fp_traps``)."""
    fn = "quantized_matmul"
    if bits not in _BITS:
        raise ValueError(f"{fn}: bits must be one of {_BITS}, got {bits!r}")
    if group_size not in _GROUP_SIZES:
        raise ValueError(f"{fn}: group_size must be one of {_GROUP_SIZES}, got {group_size!r}")
    xc, x_dtype = _float_array(x, "x", fn)
    if xc.ndim < 1 or xc.shape[-1] == 0:
        raise ValueError(f"{fn}: x must have shape [..., K] with K > 0, got {x.shape}")
    if not isinstance(w, np.ndarray) or w.dtype != np.uint32 or w.ndim != 2:
        raise ValueError(f"{fn}: w must be a 2-D uint32 array [N, K*bits/32], got "
                         f"{getattr(w, 'dtype', type(w).__name__)} {getattr(w, 'shape', '')}")
    k = x.shape[-1]
    n = w.shape[0]
    if n == 0:
        raise ValueError(f"{fn}: w has no rows (N = 0)")
    if k % group_size:
        raise ValueError(f"{fn}: K={k} (last dim of x) is not a multiple of group_size={group_size}")
    if w.shape[1] * 32 != k * bits:
        raise ValueError(f"{fn}: w is {w.shape} but x has K={k}: at {bits} bits w must be "
                         f"[N, {k * bits // 32}]")
    sc, s_dtype = _float_array(scales, "scales", fn)
    bc, b_dtype = _float_array(biases, "biases", fn)
    if s_dtype != b_dtype:
        raise ValueError(f"{fn}: scales ({scales.dtype}) and biases ({biases.dtype}) must have the same dtype")
    want = (n, k // group_size)
    for what, a in (("scales", scales), ("biases", biases)):
        if a.shape != want:
            raise ValueError(f"{fn}: {what} must be [N, K/group_size] = {list(want)}, got {list(a.shape)}")
    _check_device(device, fn)
    lead = x.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64)) if lead else 1
    if m == 0:
        return np.zeros((*lead, n), dtype=x.dtype), {"kernels": [], "dispatches": 0}
    x2 = xc.reshape(m, k)
    y, stats = _core().ops.quantized_matmul(
        x2, np.ascontiguousarray(w), sc, bc, bits=bits, group_size=group_size, x_dtype=x_dtype,
        scale_dtype=s_dtype, device=device, order=order, seed=seed, fp_traps=fp_traps)
    if x_dtype == "bfloat16":
        y = y.view(BFLOAT16)
    return y.reshape(*lead, n), stats


def rms_norm(x: np.ndarray, weight: np.ndarray, *, eps: float = 1e-6, weight_offset: float = 0.0,
             residual: np.ndarray | None = None, device: str = "emu"):
    """RMSNorm over the last axis: ``h * rsqrt(mean(h^2) + eps) * (weight + weight_offset)``.

    ``x``: ``[..., D]`` float32 or bfloat16; ``weight``: ``[D]`` float32 or bfloat16. Use
    ``weight_offset=1`` for Hugging Face's zero-centred norm weights (``(1 + w)``); MLX-format
    files store the multiplier (offset 0). Without ``residual``, ``h = x`` and the result is ``y``.
    With ``residual`` (same shape and dtype as ``x``) the add is fused: ``h = x + residual``
    (in float32, stored in x's dtype) and the result is ``(y, h)``. Math in float32.
    """
    y, h, _ = _rms_norm(x, weight, eps=eps, weight_offset=weight_offset, residual=residual, device=device)
    return y if residual is None else (y, h)


def _rms_norm(x, weight, *, eps=1e-6, weight_offset=0.0, residual=None, device="emu", order="shuffle",
              seed=0, fp_traps=True):
    fn = "rms_norm"
    xc, x_dtype = _float_array(x, "x", fn)
    wc, w_dtype = _float_array(weight, "weight", fn)
    if xc.ndim < 1 or xc.shape[-1] == 0:
        raise ValueError(f"{fn}: x must have shape [..., D] with D > 0, got {x.shape}")
    d = x.shape[-1]
    if wc.shape != (d,):
        raise ValueError(f"{fn}: weight must have shape [{d}] (the last dim of x), got {list(weight.shape)}")
    if not float(eps) > 0:
        raise ValueError(f"{fn}: eps must be > 0, got {eps!r}")
    rc = None
    if residual is not None:
        rc, r_dtype = _float_array(residual, "residual", fn)
        if residual.shape != x.shape or r_dtype != x_dtype:
            raise ValueError(f"{fn}: residual must match x ({x.dtype} {list(x.shape)}), got "
                             f"{residual.dtype} {list(residual.shape)}")
    _check_device(device, fn)
    lead = x.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64)) if lead else 1
    if m == 0:
        empty = np.zeros(x.shape, x.dtype)
        return empty, (empty.copy() if residual is not None else None), {"kernels": [], "dispatches": 0}
    y, h, stats = _core().ops.rms_norm(
        xc.reshape(m, d), wc, None if rc is None else rc.reshape(m, d), eps=float(eps),
        weight_offset=float(weight_offset), x_dtype=x_dtype, w_dtype=w_dtype, device=device,
        order=order, seed=seed, fp_traps=fp_traps)
    y = _from_core(y, x_dtype).reshape(x.shape)
    if h is not None:
        h = _from_core(h, x_dtype).reshape(x.shape)
    return y, h, stats


def embedding(ids, table: np.ndarray, scales: np.ndarray, biases: np.ndarray, *, bits: int,
              group_size: int, dtype=np.float32, device: str = "emu") -> np.ndarray:
    """Rows ``ids`` of a quantized embedding table, dequantized in the kernel.

    ``ids``: integer array of any shape with values in ``[0, vocab)``. ``table``: uint32
    ``[vocab, D * bits / 32]`` (MLX affine layout), ``scales``/``biases``: ``[vocab, D / group_size]``
    float32 or bfloat16. Returns ``[*ids.shape, D]`` in ``dtype`` (float32 or bfloat16).
    """
    out, _ = _embedding(ids, table, scales, biases, bits=bits, group_size=group_size, dtype=dtype, device=device)
    return out


def _embedding(ids, table, scales, biases, *, bits, group_size, dtype=np.float32, device="emu",
               order="shuffle", seed=0, fp_traps=True):
    fn = "embedding"
    if bits not in _BITS:
        raise ValueError(f"{fn}: bits must be one of {_BITS}, got {bits!r}")
    if group_size not in _GROUP_SIZES:
        raise ValueError(f"{fn}: group_size must be one of {_GROUP_SIZES}, got {group_size!r}")
    out_name = _FLOAT_DTYPES.get(np.dtype(dtype))
    if out_name is None:
        raise ValueError(f"{fn}: dtype must be float32 or bfloat16, got {np.dtype(dtype)}")
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{fn}: ids must be integers, got {ids.dtype}")
    if not isinstance(table, np.ndarray) or table.dtype != np.uint32 or table.ndim != 2:
        raise ValueError(f"{fn}: table must be a 2-D uint32 array [vocab, D*bits/32], got "
                         f"{getattr(table, 'dtype', type(table).__name__)} {getattr(table, 'shape', '')}")
    vocab, d = table.shape[0], table.shape[1] * 32 // bits
    if d == 0 or d % group_size:
        raise ValueError(f"{fn}: D={d} (from the table width) is not a positive multiple of group_size={group_size}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids.reshape(-1)[np.flatnonzero((ids.reshape(-1) < 0) | (ids.reshape(-1) >= vocab))[0]])
        raise ValueError(f"{fn}: token id {bad} outside the table's vocabulary [0, {vocab})")
    sc, s_dtype = _float_array(scales, "scales", fn)
    bc, b_dtype = _float_array(biases, "biases", fn)
    if s_dtype != b_dtype:
        raise ValueError(f"{fn}: scales ({scales.dtype}) and biases ({biases.dtype}) must have the same dtype")
    for what, a in (("scales", scales), ("biases", biases)):
        if a.shape != (vocab, d // group_size):
            raise ValueError(f"{fn}: {what} must be [vocab, D/group_size] = {[vocab, d // group_size]}, got {list(a.shape)}")
    _check_device(device, fn)
    if ids.size == 0:
        return np.zeros((*ids.shape, d), np.dtype(dtype)), {"kernels": [], "dispatches": 0}
    out, stats = _core().ops.embedding(
        np.ascontiguousarray(ids.reshape(-1), dtype=np.uint32), np.ascontiguousarray(table), sc, bc,
        bits=bits, group_size=group_size, out_dtype=out_name, scale_dtype=s_dtype, device=device,
        order=order, seed=seed, fp_traps=fp_traps)
    return _from_core(out, out_name).reshape(*ids.shape, d), stats


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
from ._ops_gated_delta import causal_conv1d, gated_delta_mixer, gated_delta_scan, gated_delta_step  # noqa: E402,F401


from ._ops_moe import _moe, moe, moe_route, moe_weights  # noqa: E402,F401  (the MoE block)

from ._ops_attention import *  # noqa: E402,F401,F403  rope, qk_norm_rope_append, attention_* (attention family)

# Every family's public functions (each _ops_<family> module lists its own).
from . import _ops_attention, _ops_gated_delta, _ops_moe, _ops_sampling  # noqa: E402

__all__ += [*_ops_sampling.__all__, *_ops_gated_delta.__all__, *_ops_moe.__all__,
            *_ops_attention.__all__]
