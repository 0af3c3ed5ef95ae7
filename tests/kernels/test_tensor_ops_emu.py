"""The emulator's Metal 4 tensor ops (csrc/emu/tensor_ops_emu.h): matmul2d's documented semantics
and the bugs the emulator must catch. Runs csrc/emu/selftest_m5.metal through
lily_py._core.emu.dispatch.

Tolerance: the operands are half, so every product is exact in fp32 and in float64; the kernel
sums 24 products (plus the initial destination) in fp32: |error| <= 25 u sum(|a||b|) + |c|)
with u = 2^-24. The relaxed-precision kernel rounds each run's fp32 sum to half before adding it
(the emulator's stated model); against the exact sum rounded to half that may differ by one half
ulp, 2^-10 |a b| (2^-24 among half's subnormals), when the two sums straddle a rounding boundary; the
test also checks that it differs from the unrounded result, i.e. that the rounding happens.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

import lily_py._core as core
from kernel_checks import F32_EPS, assert_close, rng  # noqa: F401  (fixture)

ORDERS = ("forward", "reverse", "shuffle")
HALF_EPS = 2.0 ** -11


def args(param: int = 0) -> bytes:
    return struct.pack("<II", 0, param)


def operands(rng, tl, tr):
    a = rng.standard_normal((16, 24)).astype(np.float16)  # op(a): 16 x 24
    b = rng.standard_normal((24, 8)).astype(np.float16)   # op(b): 24 x 8
    c0 = rng.standard_normal((16, 8)).astype(np.float32)
    a_stored = np.ascontiguousarray(a.T if tl else a)
    b_stored = np.ascontiguousarray(b.T if tr else b)
    return a, b, c0, a_stored, b_stored


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kernel, tl, tr, acc, relaxed", [
    ("nn_acc_coop", False, False, True, False),
    ("tn_mul_coop", True, False, False, False),
    ("nt_acc_tg", False, True, True, False),
    ("tt_acc_relaxed_coop", True, True, True, True),
])
def test_matmul2d_semantics(rng, order, kernel, tl, tr, acc, relaxed):
    a, b, c0, a_st, b_st = operands(rng, tl, tr)
    c = c0.copy()
    core.emu.dispatch(f"selftest_tensor_mm_{kernel}", args(), [a_st, b_st, c], (1, 1, 1), (64, 1, 1),
                      order=order, seed=rng.seed)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    prod = a64 @ b64
    if relaxed:
        prod_r = prod.astype(np.float16).astype(np.float64)  # the stated relaxed rounding
        assert not np.array_equal(c, (prod + c0).astype(np.float32)), "relaxed_precision did not round"
        prod = prod_r
    ref = prod + c0 if acc else prod
    scale = np.abs(a64) @ np.abs(b64) + (np.abs(c0) if acc else 0)
    # Relaxed: the fp32 sum rounded to half may land one half unit away from the exact sum rounded.
    # (one ulp of half: 2 HALF_EPS relative; 2^-24 absolute among subnormals).
    atol = 25 * F32_EPS * scale + (2 * HALF_EPS * np.abs(prod) + 2.0 ** -24 if relaxed else 0)
    assert_close(c, ref, atol=atol, rtol=0, what=f"matmul2d {kernel}", seed=rng.seed)


def test_missing_barrier_before_run_is_caught(rng):
    a, b, _, a_st, b_st = operands(rng, False, False)
    c = np.zeros(16 * 8, np.float32)
    with pytest.raises(core.EmulatorError, match=r"matmul2d::run: an operand changed.*without a threadgroup_barrier"):
        core.emu.dispatch("selftest_broken_tensor_mm", args(0), [a_st, b_st, c], (1, 1, 1), (64, 1, 1),
                          order="forward", fp_traps=False)


def test_run_by_part_of_the_scope_is_caught(rng):
    a, b, _, a_st, b_st = operands(rng, False, False)
    c = np.zeros(16 * 8, np.float32)
    with pytest.raises(core.EmulatorError, match=r"matmul2d::run"):
        core.emu.dispatch("selftest_broken_tensor_mm", args(1), [a_st, b_st, c], (1, 1, 1), (64, 1, 1))


def test_scope_larger_than_the_threadgroup_is_caught(rng):
    a, b, _, a_st, b_st = operands(rng, False, False)
    c = np.zeros(16 * 8, np.float32)
    with pytest.raises(core.EmulatorError, match=r"execution_simdgroups<2> needs exactly 64 threads.*has 32"):
        core.emu.dispatch("selftest_broken_tensor_mm", args(2), [a_st, b_st, c], (1, 1, 1), (32, 1, 1))


def test_correct_broken_kernel_variant_runs(rng):
    """The same kernel with its barrier (param 1 would diverge; param 0 misses the barrier): with
    the barrier and all simdgroups, param 3, it computes a @ b."""
    a, b, _, a_st, b_st = operands(rng, False, False)
    c = np.zeros(16 * 8, np.float32)
    core.emu.dispatch("selftest_broken_tensor_mm", args(3), [a_st, b_st, c], (1, 1, 1), (64, 1, 1))
    # Thread t stored its element i at c[t * 2 + i]; element e = i * 64 + t is (row e / 8, col e % 8).
    ref = (a.astype(np.float64) @ b.astype(np.float64)).reshape(-1)
    got = np.empty(128)
    for t in range(64):
        for i in range(2):
            got[i * 64 + t] = c[t * 2 + i]
    assert_close(got, ref, atol=25 * F32_EPS * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))).reshape(-1),
                 rtol=0, what="matmul2d cooperative layout", seed=rng.seed)
