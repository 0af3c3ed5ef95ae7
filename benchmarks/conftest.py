"""Benchmarks: ``python -m pytest benchmarks --benchmark-only`` (pytest-benchmark).

Each benchmark prints what it measured (tokens/s, bytes) besides pytest-benchmark's table.
Runs refuse to report when another pytest-benchmark run or a heavy process is competing: the
machine must be idle for numbers to mean anything (see ``idle_machine``)."""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def idle_machine():
    load1 = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load1 > 0.75 * cores and not os.environ.get("LILY_BENCH_ALLOW_BUSY"):
        pytest.exit(f"load average {load1:.2f} on {cores} cores: the machine is busy, numbers "
                    "would be noise (set LILY_BENCH_ALLOW_BUSY=1 to run anyway)", returncode=3)
