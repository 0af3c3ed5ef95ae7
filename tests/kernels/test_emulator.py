"""The emulator itself: MSL semantics it implements, and the GPU bugs it must catch.

Runs the self-test kernels of csrc/emu/selftest.metal through lily_py._core.emu.dispatch.
Feature kernels are compared with NumPy models of the Metal functions; "broken" kernels contain
one bug each (missing barrier, divergent simd_sum, early return before a barrier, out-of-bounds
access, ...) and must raise lily_py._core.EmulatorError naming it.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

import lily_py._core as core
from kernel_checks import F32_EPS, assert_close, rng  # noqa: F401  (fixture)

FEATURES = core.emu.features()
ORDERS = ("forward", "reverse", "shuffle", "ahead")
POISON = np.uint32(0xFFA0FFA0)


def args(n: int, param: int = 0) -> bytes:
    return struct.pack("<II", n, param)  # SelftestArgs {uint32 n; uint32 param;}


def dispatch(kernel, n, param, buffers, groups, threads, **kw):
    core.emu.dispatch(f"selftest_{kernel}", args(n, param), buffers, groups, threads, **kw)


def run_good_kernel():
    """A correct kernel after a failure: the emulator must be left in a usable state."""
    x = np.arange(40, dtype=np.float32)
    out = np.zeros(40, np.float32)
    dispatch("tg_rotate", 40, 1, [x, out], (1, 1, 1), (40, 1, 1))
    np.testing.assert_array_equal(out, 2 * np.roll(x, -1))


# ------------------------------------------------------------------------------ simd collectives
SIMD_OPS = ["sum", "max", "min", "prefix_inclusive", "prefix_exclusive", "shuffle_lane_xor1",
            "shuffle_down3", "shuffle_up5", "shuffle_xor6", "broadcast7", "broadcast_first", "all",
            "any_gt2", "sum_int", "sum_float4"]


def simd_model(x: np.ndarray) -> np.ndarray:
    """NumPy model of csrc/emu/selftest.metal:simd_ops for one threadgroup (32-lane simdgroups)."""
    n = x.size
    out = np.zeros((len(SIMD_OPS), n), np.float64)
    for start in range(0, n, 32):
        v = x[start:start + 32].astype(np.float64)
        w = v.size
        lanes = np.arange(w)
        sl = slice(start, start + w)
        out[0, sl] = v.sum()
        out[1, sl] = v.max()
        out[2, sl] = v.min()
        out[3, sl] = np.cumsum(v)
        out[4, sl] = np.cumsum(v) - v
        out[5, sl] = v[lanes ^ 1]
        out[6, sl] = np.where(lanes + 3 < w, v[np.minimum(lanes + 3, w - 1)], v)
        out[7, sl] = np.where(lanes >= 5, v[np.maximum(lanes - 5, 0)], v)
        out[8, sl] = v[lanes ^ 6]
        out[9, sl] = v[7]
        out[10, sl] = v[0]
        out[11, sl] = float((v > -100).all())
        out[12, sl] = float((v > 2).any())
        out[13, sl] = np.trunc(v * 4).sum()
        out[14, sl] = v.sum() + 10 * w
    return out


@pytest.mark.parametrize("threads", [64, 48, 96], ids=["2full", "partial16", "3full"])
@pytest.mark.parametrize("order", ORDERS)
def test_simd_collectives_match_numpy(rng, threads, order):
    # Multiples of 1/4 in [-8, 8): every sum below is exact in float32, so the comparison is exact.
    x = (rng.integers(-32, 32, size=threads) / 4).astype(np.float32)
    out = np.zeros(len(SIMD_OPS) * threads, np.float32)
    dispatch("simd_ops", threads, 0, [x, out], (1, 1, 1), (threads, 1, 1), order=order, seed=rng.seed)
    got = out.reshape(len(SIMD_OPS), threads)
    want = simd_model(x)
    for i, name in enumerate(SIMD_OPS):
        assert_close(got[i], want[i], atol=0, rtol=0, what=f"simd op {name}", seed=rng.seed)


def pairwise_lane_sum(v: np.ndarray) -> np.float32:
    """simd_sum's order in float32: a pairwise tree in lane order (stride 1 first)."""
    v = v.astype(np.float32).copy()
    s = 1
    while s < v.size:
        v[0::2 * s] = v[0::2 * s] + v[s::2 * s]
        s *= 2
    return v[0]


@pytest.mark.parametrize("order", ORDERS)
def test_simd_sum_scatter_is_simd_sum_bit_for_bit(rng, order):
    # common/reduce.h's simd_sum_scatter<N>: each lane holds one value's total, which must equal
    # simd_sum of that value bit for bit, at the lane simd_scatter_index<N> names. Magnitudes
    # spread over 2^-12 .. 2^12 so that a different order of the adds changes the rounding.
    x = (rng.standard_normal((32, 32)) * 2.0 ** rng.integers(-12, 13, size=(32, 32))).astype(np.float32)
    out = np.full(32 + 6 * 2 * 32, np.nan, np.float32)
    dispatch("sum_scatter", 32, 0, [x.ravel(), out], (1, 1, 1), (32, 1, 1), order=order, seed=rng.seed)
    sums = out[:32]
    want = np.array([pairwise_lane_sum(x[:, j]) for j in range(32)], np.float32)
    assert_close(sums, want, atol=0, rtol=0, what="simd_sum against the pairwise lane-order tree", seed=rng.seed)
    lanes = np.arange(32)
    for i in range(6):
        n = 1 << i
        got = out[32 + 2 * i * 32:32 + (2 * i + 1) * 32]
        index = out[32 + (2 * i + 1) * 32:32 + (2 * i + 2) * 32].astype(np.int64)
        # the index: lane bit b (b < log2 N) is worth N / 2^(b + 1): bit-reversed low bits
        want_index = sum(((lanes >> b) & 1) * (n >> (b + 1)) for b in range(i))
        np.testing.assert_array_equal(index, want_index, err_msg=f"N = {n}: simd_scatter_index")
        assert set(index[:n]) == set(range(n)), f"N = {n}: lanes 0 .. N - 1 hold every value once"
        assert_close(got, sums[index], atol=0, rtol=0, what=f"N = {n}: scattered totals", seed=rng.seed)


def test_thread_positions_3d_grid():
    groups, threads = (3, 2, 2), (5, 3, 2)  # 30 threads per threadgroup: one partial simdgroup
    per_group = int(np.prod(threads))
    total = int(np.prod(groups)) * per_group
    out = np.zeros(8 * total, np.uint32)
    dispatch("thread_ids", groups[0], groups[1], [out], groups, threads)
    got = out.reshape(total, 8)
    want = []
    for gz in range(groups[2]):
        for gy in range(groups[1]):
            for gx in range(groups[0]):
                for tz in range(threads[2]):
                    for ty in range(threads[1]):
                        for tx in range(threads[0]):
                            local = tx + threads[0] * (ty + threads[1] * tz)
                            want.append([gx * threads[0] + tx, gy * threads[1] + ty, gz * threads[2] + tz,
                                         tx, ty, tz, local % 32, local // 32])
    np.testing.assert_array_equal(got, np.array(want, np.uint32))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("param", [1, 37, 99])
def test_threadgroup_memory_with_barrier(rng, order, param):
    n, groups = 100, 3  # 100 threads: four simdgroups, the last one partial
    x = rng.standard_normal(n * groups).astype(np.float32)
    out = np.zeros_like(x)
    dispatch("tg_rotate", n, param, [x, out], (groups, 1, 1), (n, 1, 1), order=order, seed=rng.seed)
    want = 2 * np.concatenate([np.roll(x[g * n:(g + 1) * n], -param) for g in range(groups)])
    np.testing.assert_array_equal(out, want)


def test_device_atomics(rng):
    n = 1000
    x = (rng.integers(-32, 33, size=n) / 8).astype(np.float32)  # sums exact in float32
    counter = np.zeros(1, np.uint32)
    fsum = np.zeros(1, np.float32)
    imax = np.full(1, -(2 ** 31), np.int32)
    dispatch("atomics", n, 0, [x, counter, fsum, imax], (4, 1, 1), (256, 1, 1), seed=rng.seed)
    assert counter[0] == n
    assert fsum[0] == x.astype(np.float64).sum()
    assert imax[0] == int(np.trunc(x.astype(np.float64) * 100).max())


@pytest.mark.parametrize("order", ORDERS)
def test_simdgroup_matrix_multiply_accumulate(rng, order):
    a = rng.standard_normal((8, 16)).astype(np.float32)
    b = rng.standard_normal((16, 8)).astype(np.float32)
    c0 = rng.standard_normal((8, 8)).astype(np.float32)
    b_top = np.ascontiguousarray(b[:8])
    bt_bot = np.ascontiguousarray(b[8:].T)  # loaded with transpose_matrix = true
    c = np.zeros((8, 8), np.float32)
    dispatch("mma", 0, 0, [a, b_top, bt_bot, c0, c], (1, 1, 1), (32, 1, 1), order=order, seed=rng.seed)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64 + c0
    # 16 fp32 multiply-adds per element: |error| <= 17 u sum(|a||b|) + |c|) (two accumulations).
    scale = np.abs(a64) @ np.abs(b64) + np.abs(c0)
    assert_close(c, ref, atol=2 * 17 * F32_EPS * scale, rtol=0, what="simdgroup mma", seed=rng.seed)


def test_registry_lists_selftests_and_read_only_flags():
    entries = {k["name"]: k for k in core.emu.kernels()}
    assert entries["selftest_tg_rotate"]["read_only"] == [True, False]  # const device float* x; float* out
    assert entries["selftest_atomics"]["read_only"] == [True, False, False, False]
    assert entries["selftest_thread_ids"]["num_buffers"] == 1
    assert entries["selftest_simd_ops"]["args_size"] == 8


# ------------------------------------------------------------------------------ broken kernels
def broken(kernel, n=64, param=0, threads=64, out_size=None, **kw):
    x = np.arange(n, dtype=np.float32) + 1
    out = np.zeros(out_size if out_size is not None else n, np.float32)
    dispatch(kernel, n, param, [x, out], (1, 1, 1), (threads, 1, 1), **kw)
    return out


@pytest.mark.parametrize("order", ORDERS)
def test_missing_barrier_is_caught(order):
    if not FEATURES["fp_traps"]:
        pytest.skip("fp traps need glibc on x86-64; test_missing_barrier_without_traps_gives_nan covers this build")
    with pytest.raises(core.EmulatorError, match=r"broken_missing_barrier.*floating-point invalid operation.*missing barrier"):
        broken("broken_missing_barrier", order=order)
    run_good_kernel()


def test_missing_barrier_without_traps_gives_nan():
    out = broken("broken_missing_barrier", fp_traps=False, order="forward")
    # Forward order: thread i reads slot i + 1 before thread i + 1 wrote it -> poison (NaN).
    assert np.isnan(out[:-1]).all(), out[:8]


def test_unwritten_threadgroup_memory_shows_as_poison():
    out = broken("broken_unwritten_copy")
    bits = out.view(np.uint32)
    assert (bits[1::2] == POISON).all(), bits[1::2][:4]  # never written: the poison pattern
    np.testing.assert_array_equal(out[0::2], np.arange(0, 64, 2, dtype=np.float32) + 1)


@pytest.mark.parametrize("active", [16, 1, 31])
def test_divergent_simd_sum_is_caught(active):
    with pytest.raises(core.EmulatorError, match=r"divergent simdgroup.*simd_sum at csrc/emu/selftest\.metal:\d+"):
        broken("broken_divergent_simd_sum", param=active)
    run_good_kernel()


def test_early_return_before_barrier_is_caught():
    with pytest.raises(core.EmulatorError, match=r"thread \(3,0,0\).*returned while .* wait at threadgroup_barrier"):
        broken("broken_early_return", param=3)
    run_good_kernel()


def test_threads_at_different_barriers_are_caught():
    with pytest.raises(core.EmulatorError, match="threads wait at different barriers"):
        broken("broken_different_barriers")
    run_good_kernel()


def test_out_of_bounds_write_is_caught():
    # With guard pages the faulting write is reported at once; without them the canary bytes
    # after the buffer are checked after the dispatch. Both name the buffer.
    with pytest.raises(core.EmulatorError, match=r"out-of-bounds write.*buffer\(2\)"):
        broken("broken_oob_write", param=1)
    run_good_kernel()


def test_out_of_bounds_write_far_past_end_is_caught():
    with pytest.raises(core.EmulatorError, match=r"out-of-bounds write.*buffer\(2\)"):
        broken("broken_oob_write", param=5000)
    run_good_kernel()


def test_out_of_bounds_read_is_caught():
    if FEATURES["guard_pages"]:
        with pytest.raises(core.EmulatorError, match=r"out-of-bounds read past the end of buffer\(1\)"):
            broken("broken_oob_read", param=1)
    else:  # the read lands in poisoned slack: the value copied out is NaN
        out = broken("broken_oob_read", param=1)
        assert np.isnan(out[-1]) and not np.isnan(out[:-1]).any()
    run_good_kernel()


def test_write_to_const_buffer_is_caught():
    if not FEATURES["guard_pages"]:
        pytest.skip("read-only buffers need page protection + the fault handler (Linux x86-64 builds)")
    with pytest.raises(core.EmulatorError, match=r"write to buffer\(1\).*const device"):
        broken("broken_write_const")
    run_good_kernel()


def test_nonuniform_shuffle_delta_is_caught():
    with pytest.raises(core.EmulatorError, match="simd_shuffle_down: argument differs between lanes"):
        broken("broken_nonuniform_shuffle")


def test_threadgroup_memory_limit_is_enforced():
    with pytest.raises(core.EmulatorError, match="32768-byte limit"):
        broken("broken_tg_overflow")
    run_good_kernel()


def test_gpu_thread_stack_overflow_is_caught():
    if not FEATURES["guard_pages"]:
        pytest.skip("needs the fault handler (Linux x86-64 builds)")
    with pytest.raises(core.EmulatorError, match="GPU thread stack overflow"):
        broken("broken_stack_overflow")
    run_good_kernel()


def test_platform_features_reported():
    f = FEATURES
    assert f["simd_width"] == 32 and f["threadgroup_memory"] == 32768
    import platform
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        assert f["guard_pages"] and f["fp_traps"] and "assembly" in f["fibers"]


def test_dispatch_rejects_bad_launches():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="no kernel named"):
        core.emu.dispatch("no_such_kernel", args(4), [x, x], (1, 1, 1), (4, 1, 1))
    with pytest.raises(core.EmulatorError, match="1 buffers bound, kernel takes 2"):
        core.emu.dispatch("selftest_tg_rotate", args(4), [x], (1, 1, 1), (4, 1, 1))
    with pytest.raises(core.EmulatorError, match="args struct of 4 bytes"):
        core.emu.dispatch("selftest_tg_rotate", b"\0" * 4, [x, x.copy()], (1, 1, 1), (4, 1, 1))
    with pytest.raises(core.EmulatorError, match="at most 1024 per threadgroup"):
        core.emu.dispatch("selftest_tg_rotate", args(4), [x, x.copy()], (1, 1, 1), (2048, 1, 1))
    with pytest.raises(ValueError, match="order must be"):
        core.emu.dispatch("selftest_tg_rotate", args(4), [x, x.copy()], (1, 1, 1), (4, 1, 1), order="random")


# ------------------------------------------------------------------------------ issue 9: races, bounds
def test_write_after_read_in_a_loop_is_exposed_by_order_ahead(rng):
    """The K-loop barrier of a tiled matmul deleted: lockstep orders hide it, 'ahead' does not."""
    n, iters = 64, 3
    x = rng.standard_normal(n * iters).astype(np.float32)
    # out[i] = sum over iterations of the simd_sum of the other simdgroup's slots
    other = x.reshape(iters, 2, 32)[:, ::-1].sum(axis=2)  # [iters, simdgroup]
    want = np.repeat(other.sum(axis=0), 32).astype(np.float32)
    for order in ORDERS:
        for param in (0, 1) if order != "ahead" else (1,):
            out = np.zeros(n, np.float32)
            dispatch("broken_war_loop", iters, param, [x, out], (1, 1, 1), (n, 1, 1), order=order, seed=rng.seed)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"{order} param={param}")
    for seed in range(4):  # the broken kernel under 'ahead': the slower simdgroup reads the next tile
        out = np.zeros(n, np.float32)
        dispatch("broken_war_loop", iters, 0, [x, out], (1, 1, 1), (n, 1, 1), order="ahead", seed=seed)
        assert not np.allclose(out, want, rtol=1e-5, atol=1e-5), seed


@pytest.mark.parametrize("order", ORDERS)
def test_lost_update_is_caught(order):
    x = np.arange(1, 5, dtype=np.float32)
    out = np.zeros(128, np.float32)
    with pytest.raises(core.EmulatorError, match=r"threadgroup memory race: thread .* and thread .* both wrote "
                                                 r"threadgroup array #0 \(csrc/emu/selftest\.metal:\d+, 16 bytes\) at "
                                                 r"byte [0-3] with no threadgroup_barrier between them.*non-atomic"):
        dispatch("broken_lost_update", 4, 0, [x, out], (1, 1, 1), (128, 1, 1), order=order)
    run_good_kernel()


def test_lost_update_without_the_detector_is_silent():
    # What the emulator did before issue 9: the += never interleaves with another fiber.
    x = np.arange(1, 5, dtype=np.float32)
    out = np.zeros(128, np.float32)
    dispatch("broken_lost_update", 4, 0, [x, out], (1, 1, 1), (128, 1, 1), races=False)
    assert (out == 10).all()


def test_tokens_sharing_one_scratch_slot_are_caught(rng):
    n, groups = 64, 3
    x = rng.standard_normal(n * groups).astype(np.float32)
    scratch = np.zeros(n * groups, np.float32)
    out = np.zeros(n * groups, np.float32)
    want = 2 * np.concatenate([np.roll(x[g * n:(g + 1) * n], -1) for g in range(groups)])
    dispatch("broken_shared_scratch", n, 1, [x, scratch, out], (groups, 1, 1),
             (n, 1, 1), seed=rng.seed)  # the fixed kernel: one slot range per token
    np.testing.assert_array_equal(out, want)
    with pytest.raises(core.EmulatorError, match=r"device memory race: threadgroups \(\d,0,0\) and \(\d,0,0\) both "
                                                 r"wrote byte offset \d+ of buffer\(2\)"):
        dispatch("broken_shared_scratch", n, 0, [x, scratch, out], (groups, 1, 1), (n, 1, 1), seed=rng.seed)
    # Without the detector the emulator (threadgroups one after another) computes the right answer.
    out[:] = 0
    dispatch("broken_shared_scratch", n, 0, [x, scratch, out], (groups, 1, 1), (n, 1, 1), races=False)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("races", [True, False], ids=["detector", "red_zones_only"])
def test_threadgroup_array_overflow_is_caught(rng, races):
    x = rng.standard_normal(64).astype(np.float32)
    # The red-zone check finds the first byte that no longer holds poison (bytes FF A0 by address
    # parity), so a stray byte equal to its poison byte is invisible to it. The value written out of
    # bounds, x[63], gets no byte FF or A0, else the offset reported below is off by the bytes that
    # matched: 0xA0 as its low byte gave "1 bytes past", 1 run in 256.
    while {0xFF, 0xA0} & set(x[-1:].tobytes()):
        x[-1] = rng.standard_normal()
    out = np.zeros(64, np.float32)
    dispatch("broken_tg_array_overflow", 64, 0, [x, out], (1, 1, 1), (64, 1, 1), races=races)
    np.testing.assert_array_equal(out, 3 * x)
    with pytest.raises(core.EmulatorError, match=r"threadgroup memory overflow: .*the red zone before threadgroup "
                                                 r"array #1 .*past the end of the array before it"):
        dispatch("broken_tg_array_overflow", 64, 1, [x, out], (1, 1, 1), (64, 1, 1), races=races)
    with pytest.raises(core.EmulatorError, match=r"threadgroup memory overflow: .*unallocated threadgroup memory "
                                                 r"0 bytes past the end of the last threadgroup array #1"):
        dispatch("broken_tg_array_overflow", 64, 2, [x, out], (1, 1, 1), (64, 1, 1), races=races)
    run_good_kernel()


def test_access_outside_the_bound_range_is_caught():
    # x is a 128-float array; only floats [16, 80) are bound. Reading one past the bound range is
    # inside the allocation, and still an error.
    n = 64
    x = np.arange(128, dtype=np.float32)
    out = np.zeros(n, np.float32)
    dispatch("broken_oob_read", n, 0, [x, out], (1, 1, 1), (n, 1, 1), ranges=[(64, n * 4), (0, 0)])
    np.testing.assert_array_equal(out, x[16:80])
    if FEATURES["guard_pages"]:
        with pytest.raises(core.EmulatorError, match=r"out-of-bounds read past the end of buffer\(1\) \(bound to bytes "
                                                     r"\[64, 320\) of a 512-byte buffer\) at byte offset 256 of the bound range"):
            dispatch("broken_oob_read", n, 1, [x, out], (1, 1, 1), (n, 1, 1), ranges=[(64, n * 4), (0, 0)])
    big = np.zeros(2 * n, np.float32)
    with pytest.raises(core.EmulatorError, match=r"out-of-bounds write.*buffer\(2\) \(bound to bytes \[0, 256\) of a "
                                                 r"512-byte buffer\)"):
        dispatch("broken_oob_write", n, 1, [x[:n].copy(), big], (1, 1, 1), (n, 1, 1), ranges=[(0, 0), (0, n * 4)])
    assert (big[n:] == 0).all()  # the bytes past the bound range were never touched
    run_good_kernel()


def test_never_written_integer_index_is_caught():
    n = 64
    x = np.arange(n, dtype=np.float32)
    out = np.zeros(n, np.float32)
    dispatch("broken_unwritten_index", n, 1, [x, out], (1, 1, 1), (n, 1, 1))
    np.testing.assert_array_equal(out, np.roll(x, -1))
    if not FEATURES["guard_pages"]:
        pytest.skip("needs the fault handler (Linux x86-64 builds)")
    with pytest.raises(core.EmulatorError, match=r"out-of-bounds read .*never-written memory\? poison reads as 0xFFA0FFA0"):
        dispatch("broken_unwritten_index", n, 0, [x, out], (1, 1, 1), (n, 1, 1))
    run_good_kernel()


def test_set_races_default_round_trip():
    """lily_py._core.emu.set_races_default: True / False override the environment for runs made
    afterwards, None returns to it (LILY_EMU_RACES=1 on)."""
    import os
    emu = core.emu
    before = emu.races_default()
    try:
        emu.set_races_default(False)
        assert emu.races_default() is False
        emu.set_races_default(True)
        assert emu.races_default() is True
        emu.set_races_default(None)
        assert emu.races_default() is (os.environ.get("LILY_EMU_RACES") == "1")
    finally:
        emu.set_races_default(before)


def test_kernel_tests_run_under_the_race_detector_in_the_full_tier(pytestconfig):
    """In the full tier (--full, what .ci/run runs; or LILY_CI_KERNEL_RACES=1) every kernel test
    runs with the race detector on (tests/conftest.py); elsewhere only where LILY_EMU_RACES=1 asks
    for it."""
    import os
    want = (pytestconfig.getoption("--full") or os.environ.get("LILY_CI_KERNEL_RACES") == "1"
            or os.environ.get("LILY_EMU_RACES") == "1")
    assert core.emu.races_default() is want



# ------------------------------------------------------------------------------ issue 23: memory ordering
ORDERING = pytest.mark.skipif(not FEATURES["guard_pages"],
                              reason="the memory-ordering model watches pages (LILY_EMU_SIGNALS: Linux x86-64)")


def ticket_sum(rng, param, groups=5, n=96, **kw):
    x = rng.standard_normal(groups * n).astype(np.float32)
    partial = np.zeros(groups * n, np.float32)
    counter = np.zeros(1, np.uint32)
    out = np.zeros(n, np.float32)
    dispatch("ticket_sum", groups, param, [x, partial, counter, out], (groups, 1, 1), (n, 1, 1), seed=rng.seed, **kw)
    # the fp32 sum over the threadgroups in index order, as the kernel adds
    want = np.zeros(n, np.float32)
    for g in range(groups):
        want += 2 * x[g * n:(g + 1) * n]
    return out, want, counter


@ORDERING
@pytest.mark.parametrize("order", ORDERS)
def test_published_stores_pass_the_ordering_model(rng, order):
    """A ticket (relaxed atomic) after a device-scope fence (MSL 3.2's atomic_thread_fence with
    thread_scope_device) publishes the rows; the thread with the last ticket reads them after its own
    fence: allowed, and the sums are right."""
    out, want, counter = ticket_sum(rng, 3, order=order)
    np.testing.assert_array_equal(out, want)
    assert counter[0] == 0


@ORDERING
@pytest.mark.parametrize("param, why", [
    (0, r"no device-scope fence of the writer .* a threadgroup_barrier / simdgroup_barrier with mem_device "
        r"orders its own threadgroup only"),
    (1, r"no device-scope fence of the writer"),
    (2, r"no device-scope fence of the writer"),
    (4, r"the writer's device-scope fence after the store comes after its atomic"),
    (5, r"no device-scope fence of the writer .* follows the store before an atomic"),
], ids=["msl31_barrier_idiom", "writer_without_fence", "reader_without_fence", "fence_after_the_ticket",
        "no_fence_at_all"])
@pytest.mark.parametrize("order", ORDERS)
def test_unpublished_stores_read_by_another_threadgroup_are_caught(rng, param, why, order):
    """The writer's stores are not ordered before its ticket (or the reader's reads after its
    ticket): on a GPU the last threadgroup may sum stale rows. The emulator names the reader (its
    threadgroup and thread), the writer and the address. Param 0 is the idiom gated_delta_decode
    used until issue 39 (o_raw stores, threadgroup_barrier(mem_device), a relaxed ticket, the last
    threadgroup reading every other's columns): MSL 3.1 promises no visibility there (section 4.8:
    device memory is coherent within a threadgroup only), so the emulator rejects it."""
    with pytest.raises(core.EmulatorError, match=(
            r"selftest_ticket_sum \(threadgroup \(\d,0,0\)\): device memory ordering: threadgroup \(\d,0,0\) "
            r"thread \(\d+,0,0\) \[simdgroup \d lane \d+\] \(after .*\) read byte offset \d+ of buffer\(2\) of 1920 "
            r"bytes, stored in this dispatch by threadgroup \(\d,0,0\) thread \(\d+,0,0\) .*not visible to it: ") + why):
        ticket_sum(rng, param, order=order)
    run_good_kernel()


@ORDERING
def test_ordering_error_names_the_right_writer(rng):
    """The reported byte is the writer's row: offset / 4 = writer group * n + writer thread."""
    import re
    n = 96
    with pytest.raises(core.EmulatorError) as e:
        ticket_sum(rng, 1, n=n, order="forward")
    m = re.search(r"read byte offset (\d+) of buffer\(2\).*stored in this dispatch by threadgroup \((\d),0,0\) "
                  r"thread \((\d+),0,0\)", str(e.value))
    assert m, str(e.value)
    off, g, t = (int(v) for v in m.groups())
    assert off // 4 == g * n + t


def test_unpublished_stores_are_invisible_without_the_detector(rng):
    """Why the model exists: threadgroups run one after another, so without it the broken
    kernels compute the right sums."""
    for param in (0, 1, 2, 4, 5):
        out, want, _ = ticket_sum(rng, param, races=False)
        np.testing.assert_array_equal(out, want)
