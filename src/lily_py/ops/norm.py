"""RMSNorm, plain and with a fused residual add (``shaders/norm.metal``)."""
from __future__ import annotations

import numpy as np

from ._common import _check_device, _core, _float_array, _from_core

__all__ = ['rms_norm']


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
