#!/usr/bin/env bash
# The emulator's race detector over the kernel tests (issue 9; docs/testing.md, "GPU failure
# classes"). LILY_EMU_RACES=1 turns RunOptions::races on for every launch: each GPU thread's
# writes to threadgroup memory between two of its sync points, and each threadgroup's writes to
# device memory, are recorded per 2-byte unit; two writers that no barrier or atomic orders fail
# the launch with an EmulatorError naming the kernel, the threads (or threadgroups) and the array
# or buffer. About 2.5x the kernel tests' CPU time, hence a job of its own; the default test run
# keeps the cheap checks (hazards between dispatches, bounds at the binding, red zones, the
# 'ahead' thread order).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pip install --quiet ".[test]"
LILY_EMU_RACES=1 python -m pytest -q -n auto -p no:cacheprovider tests/kernels
