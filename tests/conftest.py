"""Shared test helpers: tolerance checks that name the first bad index, and small checkpoints."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest


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


@pytest.fixture(scope="session")
def tiny_mlx(tmp_path_factory):
    """A random-weight MLX 4-bit checkpoint with every feature of the real model (tiny sizes)."""
    from lily_py.testing import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("tiny_mlx"), fmt="mlx", seed=1)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    from lily_py.testing import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("tiny_hf"), fmt="hf", dtype="f32", seed=2)


TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "fixtures", "chat", "tokenizer")


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory):
    """Random-weight MLX checkpoint with a Qwen-style tokenizer and chat template (575 ids; the
    model's vocabulary is padded to 640 rows like the real model's)."""
    from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint
    p = make_checkpoint(tmp_path_factory.mktemp("chat"), dict(TINY_TEXT_CONFIG, vocab_size=640),
                        fmt="mlx", seed=11, std=0.08)
    for f in os.listdir(TOKENIZER_DIR):
        shutil.copy(os.path.join(TOKENIZER_DIR, f), p)
    return p


@pytest.fixture
def rng(request):
    """A fresh random generator per test; its seed is reported if the test fails."""
    import secrets
    seed = secrets.randbits(32)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("random seed", f"np.random.default_rng({value})"))
