"""Shared fixtures: small checkpoints and seeded generators (assert_close lives in tolerances.py)."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest


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


@pytest.fixture(autouse=True)
def _kernel_tests_under_race_detection(request):
    """LILY_CI_KERNEL_RACES=1 (.ci/run sets it): the emulator's race detector on for the tests in
    tests/kernels, and only there (about 2.5x their CPU time; the other tests keep the cheap
    checks). One run of the kernel tests then does what the separate race-detector job did."""
    if os.environ.get("LILY_CI_KERNEL_RACES") != "1" or "kernels" not in request.node.path.parts:
        yield
        return
    import lily_py._core as core
    core.emu.set_races_default(True)
    try:
        yield
    finally:
        core.emu.set_races_default(None)


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
