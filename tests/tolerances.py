"""assert_close for the model / reference / api tests: |actual - ref| <= atol + rtol |ref|, naming
the first bad index. A module of its own (not conftest.py): two conftest modules (tests/ and
tests/serve/) both import as "conftest", so `from conftest import ...` picked whichever pytest
loaded first and failed to collect `pytest tests/serve tests/model`."""
from __future__ import annotations

import numpy as np


def assert_close(actual, ref, *, atol: float, rtol: float, what: str = "") -> None:
    """|actual - ref| <= atol + rtol * |ref| elementwise; on failure report the first bad index,
    the worst absolute and relative errors."""
    actual = np.asarray(actual, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert actual.shape == ref.shape, f"{what}: shape {actual.shape} != reference {ref.shape}"
    err = np.abs(actual - ref)
    bad = err > atol + rtol * np.abs(ref)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        rel = err / np.maximum(np.abs(ref), 1e-30)
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.size} elements out of tolerance (atol={atol}, "
            f"rtol={rtol}); first bad index {first}: got {actual[first]!r}, reference "
            f"{ref[first]!r}; max abs err {err.max():.3e}, max rel err {rel.max():.3e}")
