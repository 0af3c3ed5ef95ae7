"""Quantized matmul (qmv / qmm routes; ``shaders/qmm.metal``)."""
from __future__ import annotations

import numpy as np

from ._common import _BITS, _GROUP_SIZES, BFLOAT16, _check_device, _core, _float_array

__all__ = ['quantized_matmul', 'quantized_matmul_norm', 'quantized_matmul_route']

def quantized_matmul_route(m: int, *, bits: int = 4, tensor_ops: bool = False, bf16_tiles: bool = True) -> str:
    """The route :func:`quantized_matmul` takes for ``m`` rows of ``x``: ``"qmv1"`` (one row), ``"qmv"`` (2..8 rows),
    ``"qmm"``, ``"qmm_bf16"`` (``m >= 33`` where the operands may be rounded to bf16,
    ``bf16_tiles``: bfloat16 ``x``, or float32 ``x`` with ``f32_x_bf16_tiles=True``), or
    ``"qmm_m5"`` (4- or 8-bit weights on a device with Metal 4 tensor ops, ``tensor_ops=True``: an M5,
    or the emulator under ``lily_py.testing.simulated_device(tensor_ops=True)``)."""
    return str(_core().ops.qmm_route(int(m), int(bits), bool(tensor_ops), bool(bf16_tiles)))


def quantized_matmul(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, *,
                     bits: int, group_size: int, device: str = "emu") -> np.ndarray:
    """``y = x @ dequant(w).T`` with the dequantization fused into the kernel.

    ``x``: ``[..., K]`` float32 or bfloat16. ``w``: uint32 ``[N, K * bits / 32]`` (MLX affine
    layout, ``32 // bits`` codes per word, least significant first). ``scales``, ``biases``:
    ``[N, K / group_size]``, float32 or bfloat16 (the same dtype). ``bits`` is 2, 3, 4, 5, 6 or 8
    (2, 3, 5, 6: bfloat16 scales and the ``qmv1`` / ``qmv`` / ``qmm`` routes only; 3-, 5- and 6-bit
    codes straddle words as in MLX), ``group_size`` 32, 64 or 128. Returns ``[..., N]`` in the dtype of ``x``; accumulation is fp32.
    Rows ``M <= 8`` take the matrix-vector route (``qmv``), larger ``M`` the tiled one (``qmm``;
    ``qmm_bf16`` for ``M >= 33`` with bfloat16 ``x``: the dequantized weights rounded to bf16,
    fp32 accumulation; ``qmm_m5`` (4- or 8-bit weights) where the device reports Metal 4 tensor ops:
    x and the dequantized weights rounded to half, fp32 accumulation).
    """
    y, _ = _quantized_matmul(x, w, scales, biases, bits=bits, group_size=group_size, device=device)
    return y


def _quantized_matmul(x, w, scales, biases, *, bits, group_size, device="emu", order="shuffle",
                      seed=0, fp_traps=True, f32_x_bf16_tiles=False, y_f32=False):
    """:func:`quantized_matmul` plus the run's stats (kernels, dispatches, bytes bound, threads)
    and the emulator's scheduling knobs (``order``: forward/reverse/shuffle/ahead, ``seed``,
    ``fp_traps``). ``f32_x_bf16_tiles``: float32 ``x`` may take ``qmm_bf16`` (rounded to bf16 at
    the tile load; bfloat16 ``x`` always may); ``y_f32``: y in float32 whatever x's dtype (the
    engine's lm_head)."""
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
        scale_dtype=s_dtype, y_f32=bool(y_f32), device=device, order=order, seed=seed, fp_traps=fp_traps,
        f32_x_bf16_tiles=bool(f32_x_bf16_tiles))
    if x_dtype == "bfloat16" and not y_f32:
        y = y.view(BFLOAT16)
    return y.reshape(*lead, n), stats


def quantized_matmul_norm(x, w, scales, biases, norm_weight, *, bits: int, group_size: int, eps: float = 1e-6,
                          residual=None, side: bool = False, device: str = "emu"):
    """One token through the single-token route with an RMSNorm fused in front (the decode step's
    input, post and final norms): ``h = x (+ residual)``, ``xn = rmsnorm(h) * norm_weight``,
    ``y = xn @ dequant(w).T``. Returns ``(y, h, xn)`` (``h``, ``xn`` are ``None`` unless
    ``side``: then the kernel's first threadgroup also writes them). ``x``, ``residual``: ``[K]``
    float32 or bfloat16; ``norm_weight``: float32 ``[K]``."""
    y, h, xn, _ = _quantized_matmul_norm(x, w, scales, biases, norm_weight, bits=bits, group_size=group_size,
                                         eps=eps, residual=residual, side=side, device=device)
    return y, h, xn


def _quantized_matmul_norm(x, w, scales, biases, norm_weight, *, bits, group_size, eps=1e-6, residual=None,
                           side=False, device="emu", order="shuffle", seed=0, fp_traps=True, y_f32=False):
    fn = "quantized_matmul_norm"
    if bits not in _BITS:
        raise ValueError(f"{fn}: bits must be one of {_BITS}, got {bits!r}")
    if group_size not in _GROUP_SIZES:
        raise ValueError(f"{fn}: group_size must be one of {_GROUP_SIZES}, got {group_size!r}")
    xc, x_dtype = _float_array(x, "x", fn)
    if xc.ndim != 1 or xc.shape[0] == 0 or xc.shape[0] % group_size:
        raise ValueError(f"{fn}: x must be [K] with K a multiple of group_size={group_size}, got {list(x.shape)}")
    k = xc.shape[0]
    if not isinstance(w, np.ndarray) or w.dtype != np.uint32 or w.ndim != 2 or w.shape[1] * 32 != k * bits:
        raise ValueError(f"{fn}: w must be uint32 [N, {k * bits // 32}], got {getattr(w, 'dtype', '?')} "
                         f"{list(getattr(w, 'shape', []))}")
    sc, s_dtype = _float_array(scales, "scales", fn)
    bc, b_dtype = _float_array(biases, "biases", fn)
    if s_dtype != b_dtype or sc.shape != (w.shape[0], k // group_size) or bc.shape != sc.shape:
        raise ValueError(f"{fn}: scales and biases must be [N, K/group_size] of one dtype")
    nw = np.asarray(norm_weight)
    if nw.dtype != np.float32 or nw.shape != (k,):
        raise ValueError(f"{fn}: norm_weight must be float32 [{k}], got {nw.dtype} {list(nw.shape)}")
    res = None
    if residual is not None:
        res, r_dtype = _float_array(residual, "residual", fn)
        if r_dtype != x_dtype or res.shape != (k,):
            raise ValueError(f"{fn}: residual must be [{k}] of x's dtype")
    if not float(eps) > 0:
        raise ValueError(f"{fn}: eps must be > 0, got {eps!r}")
    _check_device(device, fn)
    y, h, xn, stats = _core().ops.quantized_matmul_norm(
        xc, np.ascontiguousarray(w), sc, bc, np.ascontiguousarray(nw), res, side=bool(side), bits=bits,
        group_size=group_size, eps=float(eps), x_dtype=x_dtype, scale_dtype=s_dtype, y_f32=bool(y_f32), device=device,
        order=order, seed=seed, fp_traps=fp_traps)
    if x_dtype == "bfloat16":
        y = y if y_f32 else y.view(BFLOAT16)
        h = None if h is None else h.view(BFLOAT16)
        xn = None if xn is None else xn.view(BFLOAT16)
    return y, h, xn, stats


def _quantize_i8(x, *, device="emu", order="shuffle", seed=0, fp_traps=True):
    """The int8 activation scratch ``quantize_i8`` writes for ``x [rows, K]`` (bfloat16, or float32 as
    the MoE's h; K a multiple of 64; a device with tensor ops): ``(codes int8 [rows, K] in the order
    0 2 4 6 1 3 5 7 of each 8 columns, scales float32 [rows, K / 32], sums float32 [rows, K / 32],
    stats)``; ``lily_py.reference.kernels.quantize_i8`` is its reference."""
    xc, x_dtype = _float_array(x, "x", "quantize_i8")
    if xc.ndim != 2:
        raise ValueError(f"quantize_i8: x must be a 2-D array [rows, K], got shape {np.shape(x)}")
    _check_device(device, "quantize_i8")
    codes, scales, sums, stats = _core().ops.quantize_i8(xc, x_dtype=x_dtype, device=device, order=order, seed=seed,
                                                         fp_traps=fp_traps)
    return np.asarray(codes), np.asarray(scales), np.asarray(sums), stats
