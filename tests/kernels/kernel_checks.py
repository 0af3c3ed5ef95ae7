"""Shared pieces of the kernel tests: fixtures, devices, tolerance checks.

Kernel tests need the compiled extension ``lily_py._core`` (built by ``pip install .``); they do
not need torch, transformers or mlx. Random inputs are drawn fresh on every run; the seed is
printed in failure messages so a failing case can be replayed (``LILY_TEST_SEED=<seed>``).

Test modules import the fixtures from here (``from kernel_checks import device, rng``): a
conftest.py in this folder would shadow ``tests/conftest.py`` for ``from conftest import ...``.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import lily_py._core as core  # a missing extension must fail loudly, not skip

# Devices every kernel test runs on: the emulator always, the GPU where the device registry says
# Metal is usable (device apple7+, library loaded, every kernel's pipeline created).
# LILY_TEST_DEVICES=cuda (or emu,cuda, ...) replaces that list: a device the registry says is not
# usable here (no NVIDIA GPU, a build without LILY_CUDA) is skipped with the registry's reason.
DEVICES = ["emu"] + (["metal"] if core.registry.check_usable("metal") == "" else [])
if os.environ.get("LILY_TEST_DEVICES"):
    DEVICES = []
    for _name in os.environ["LILY_TEST_DEVICES"].split(","):
        _why = core.registry.check_usable(_name.strip())
        DEVICES.append(pytest.param(_name.strip(), marks=pytest.mark.skip(reason=f"{_name}: {_why}"))
                       if _why else _name.strip())

F32_EPS = 2.0 ** -24   # unit roundoff of float32 (round to nearest)
BF16_EPS = 2.0 ** -9   # half of bfloat16's unit roundoff (2^-8: 8 significant bits); tolerances use multiples >= 2 of it


def assert_close(actual, ref, *, atol, rtol, what: str, seed=None) -> None:
    """Assert ``|actual - ref| <= atol + rtol * |ref|`` elementwise (atol may be an array).

    NaN anywhere in ``actual`` fails. The message names the first bad index, both values, the
    bound, the worst ratio error/bound and the random seed.
    """
    a = np.asarray(actual, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert a.shape == r.shape, f"{what}: shape {a.shape} != reference {r.shape}"
    bound = np.asarray(atol, dtype=np.float64) + rtol * np.abs(r)
    err = np.abs(a - r)
    bad = ~(err <= bound)  # NaN counts as bad
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        ratio = np.nanmax(np.where(bound > 0, err / np.where(bound > 0, bound, 1), np.inf))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements out of tolerance; first at index "
            f"{idx}: got {a[idx]!r}, reference {r[idx]!r}, |diff| {err[idx]:.3g} > bound "
            f"{np.broadcast_to(bound, a.shape)[idx]:.3g}; worst error/bound {ratio:.3g}"
            + (f" (seed {seed}, replay with LILY_TEST_SEED={seed})" if seed is not None else ""))


class SeededRng:
    """np.random.Generator with its seed kept for failure messages."""

    def __init__(self, seed: int):
        self.seed = seed
        self.gen = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self.gen, name)


@pytest.fixture
def rng() -> SeededRng:
    env = os.environ.get("LILY_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().entropy % (1 << 63))
    return SeededRng(seed)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
