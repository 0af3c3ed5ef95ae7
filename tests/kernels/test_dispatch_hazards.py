"""Hazards between dispatches: the emulator encoder checks every stretch of dispatches with no
barrier between them (which the GPU runs in any order or at once) for a write that overlaps
another dispatch's binding (csrc/emu/device.cpp: DispatchHazards).

Host side only: real kernels from the kernel table encoded through lily_py._core.emu.encode, with
and without the barrier that orders them. The engine's own steps are checked barrier by barrier
in tests/model/test_step_barriers.py.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

import lily_py._core as core

ROWS, D = 3, 64
ROW = D * 4  # bytes of one float32 row


def norm(x, y, x_off=0, y_off=0, rows=ROWS):
    """rms_norm_xf32_wf32 over `rows` rows: arrays 0.. are (x, w, y) indices into the pool."""
    args = struct.pack("<IIff", rows, D, 1e-6, 0.0)  # RmsNormArgs
    return ("rms_norm_xf32_wf32", args, [(x, x_off, rows * ROW), (1, 0, 0), (y, y_off, rows * ROW)],
            (rows, 1, 1), (32, 1, 1))


def pool(rng):
    x = rng.standard_normal((ROWS, D)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    a = np.zeros((2 * ROWS, D), np.float32)  # two halves: rows [0, 3) and [3, 6)
    b = np.zeros((ROWS, D), np.float32)
    x2 = rng.standard_normal((ROWS, D)).astype(np.float32)
    return [x, w, a, b, x2]


def ref_norm(x, w):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w


@pytest.mark.parametrize("execute", [True, False], ids=["run", "plan"])
def test_dependent_dispatches_without_barrier_are_reported(rng, execute):
    # read after write: norm(x -> a) then norm(a -> b) with nothing between them
    arrays = pool(rng)
    with pytest.raises(core.EmulatorError,
                       match=r"hazard between dispatches.*dispatch #0 'rms_norm_xf32_wf32' \(buffer\(3\) bound to "
                             r"bytes \[0, 768\)\) writes bytes \[0, 768\) of a 1536-byte buffer that dispatch #1 "
                             r"'rms_norm_xf32_wf32' \(buffer\(1\) bound to bytes \[0, 768\)\) reads, with no barrier"):
        core.emu.encode(arrays, [norm(0, 2), norm(2, 3)], execute=execute)


@pytest.mark.parametrize("execute", [True, False], ids=["run", "plan"])
def test_write_after_read_and_write_after_write_are_reported(rng, execute):
    arrays = pool(rng)
    # write after read: norm(a -> b) reads a, then norm(x2 -> a) overwrites it (after barrier #0)
    with pytest.raises(core.EmulatorError, match=r"dispatch #2 .* writes bytes \[0, \d+\) .* dispatch #1 .* reads, "
                                                 r"both after barrier #0"):
        core.emu.encode(arrays, [norm(0, 2), "barrier", norm(2, 3), norm(4, 2)], execute=execute)
    # write after write: both write b
    with pytest.raises(core.EmulatorError, match=r"dispatch #1 .* writes .* dispatch #0 .* also writes"):
        core.emu.encode(pool(rng), [norm(0, 3), norm(4, 3)], execute=execute)


def test_barrier_orders_them_and_results_are_right(rng):
    arrays = pool(rng)
    st = core.emu.encode(arrays, [norm(0, 2), "barrier", norm(2, 3)])
    assert (st["dispatches"], st["barriers"]) == (2, 1)
    x, w, a, b, _ = arrays
    first = ref_norm(x, w)
    np.testing.assert_allclose(a[:ROWS], first, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, ref_norm(first.astype(np.float32), w), rtol=1e-5, atol=1e-6)


def test_skipped_barrier_is_reported_and_names_it(rng):
    cmds = [norm(0, 2), "barrier", norm(2, 3), "barrier", norm(3, 2, y_off=ROWS * ROW)]
    core.emu.encode(pool(rng), cmds)  # fine as encoded
    for k in (0, 1):
        with pytest.raises(core.EmulatorError, match=r"dispatch #%d .* writes .* dispatch #%d .* reads, %s" % (
                    k, k + 1, "with no barrier before" if k == 0 else "both after barrier #0")):
            core.emu.encode(pool(rng), cmds, skip_barrier=k)


@pytest.mark.parametrize("execute", [True, False], ids=["run", "plan"])
def test_no_false_hazards(rng, execute):
    # Two reads of one buffer; two writers of disjoint sub-ranges of one buffer (rows [0, 3) and
    # [3, 6) of a): no order of them can change a result.
    arrays = pool(rng)
    st = core.emu.encode(arrays, [norm(0, 2), norm(0, 2, y_off=ROWS * ROW), norm(0, 3)], execute=execute)
    assert (st["dispatches"], st["barriers"]) == (3, 0)
    if execute:
        x, w, a, b, _ = arrays
        np.testing.assert_allclose(a[:ROWS], a[ROWS:], rtol=0, atol=0)
        np.testing.assert_allclose(b, a[:ROWS], rtol=0, atol=0)
    # Adjacent but not overlapping: rows [0, 3) written, rows [3, 6) read.
    arrays = pool(rng)
    core.emu.encode(arrays, [norm(0, 2), norm(2, 3, x_off=ROWS * ROW)], execute=execute)


def test_unchanged_bytes_are_not_writes_when_run(rng):
    # Run (execute=True): the writes are the bytes a dispatch changed. A second norm(x -> a) over
    # the same values changes nothing, so a third dispatch reading a is not ordered after it...
    arrays = pool(rng)
    core.emu.encode(arrays, [norm(0, 2), "barrier", norm(0, 2), norm(2, 3)])
    # ...while the plan check (bindings only) reports it.
    with pytest.raises(core.EmulatorError, match="hazard between dispatches"):
        core.emu.encode(pool(rng), [norm(0, 2), "barrier", norm(0, 2), norm(2, 3)], execute=False)


def test_encode_rejects_bad_commands(rng):
    with pytest.raises(ValueError, match="no kernel named"):
        core.emu.encode(pool(rng), [("nope", b"", [], (1, 1, 1), (1, 1, 1))])
    with pytest.raises(ValueError, match="must be 'barrier'"):
        core.emu.encode(pool(rng), ["fence"])
