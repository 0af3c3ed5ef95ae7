"""Helpers shared by the kernel-family modules of :mod:`lily_py.ops` (no kernels here)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_FLOAT_DTYPES = {np.dtype(np.float32): "float32", BFLOAT16: "bfloat16"}
_BITS = (2, 3, 4, 5, 6, 8)  # MLX affine widths (the 2, 3, 5, 6-bit kernels take bfloat16 scales)
_GROUP_SIZES = (32, 64, 128)


def _core():
    from .. import _core  # the compiled extension; imported lazily so `import lily_py` stays light
    return _core


def devices() -> list[str]:
    """Devices compiled into this build (always includes ``"emu"``)."""
    return list(_core().devices())


def _check_device(device, fn: str) -> None:
    if device not in ("emu", "metal", "cuda"):
        raise ValueError(f"{fn}: device must be 'emu', 'metal' or 'cuda', got {device!r}")


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

