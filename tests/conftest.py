"""Shared fixtures: small checkpoints and seeded generators (assert_close lives in tolerances.py)."""
from __future__ import annotations

import os
import types
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


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true", default=False,
        help="run the full tier (tests/tiers.py: real shapes, long prompts, whole-model greedy on "
             "every path) with the emulator's race detector on for tests/kernels; what .ci/run runs")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: full tier only (tests/tiers.py; selected by --full)")


def pytest_collection_modifyitems(config, items):
    """Mark the tests that tests/tiers.py names `full`, and deselect them without --full."""
    from fnmatch import fnmatchcase

    from tiers import FULL_TIER
    root = str(config.rootpath)
    hits = {p: 0 for p in FULL_TIER}
    files = set()
    for item in items:
        nodeid = item.nodeid
        files.add(nodeid.split("::", 1)[0])
        for pattern in FULL_TIER:
            if fnmatchcase(nodeid, pattern):
                hits[pattern] += 1
                item.add_marker(pytest.mark.full)
    stale = [p for p, n in hits.items() if n == 0 and p.split("::", 1)[0] in files]
    # LILY_TEST_DEVICES / LILY_TEST_ENGINE (another device than emu) change the parametrized ids:
    # a pattern naming an emu case then matches nothing without being stale.
    if stale and not (os.environ.get("LILY_TEST_DEVICES") or os.environ.get("LILY_TEST_ENGINE")):
        raise pytest.UsageError(f"tests/tiers.py: these patterns match no collected test of their "
                                f"file (renamed or removed?): {stale} (rootdir {root})")
    if config.getoption("--full"):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("full") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if hasattr(config, "workeroutput"):   # a pytest-xdist worker: tell the controller (below)
        config.workeroutput["lily_deselected"] = len(drop)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Under pytest-xdist the workers collect and deselect, so the controller's summary line would
    not say "N deselected": count one worker's there (each collects the same tests)."""
    n = getattr(node, "workeroutput", {}).get("lily_deselected", 0)
    config = node.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if n and reporter is not None and not getattr(config, "_lily_deselected_counted", False):
        config._lily_deselected_counted = True
        # stand-ins with a __dict__: other plugins' summaries (hypothesis) read every report's
        reporter.stats.setdefault("deselected", []).extend(types.SimpleNamespace() for _ in range(n))


def _races_for_kernel_tests(config) -> bool:
    return config.getoption("--full") or os.environ.get("LILY_CI_KERNEL_RACES") == "1"


@pytest.fixture(autouse=True)
def _kernel_tests_under_race_detection(request):
    """The full tier (--full; or LILY_CI_KERNEL_RACES=1): the emulator's race detector on for the
    tests in tests/kernels, and only there (about 2.5x their CPU time; the other tests keep the
    cheap checks). One run of the kernel tests then does what a separate race-detector job did."""
    if not _races_for_kernel_tests(request.config) or "kernels" not in request.node.path.parts:
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
