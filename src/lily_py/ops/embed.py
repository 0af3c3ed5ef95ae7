"""Embedding lookup from a quantized table (``shaders/embedding.metal``)."""
from __future__ import annotations

import numpy as np

from ._common import _FLOAT_DTYPES, _BITS, _GROUP_SIZES, _check_device, _core, _float_array, _from_core

__all__ = ['embedding']

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
