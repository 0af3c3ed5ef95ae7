// Emulator self-test kernels for the Metal 4 tensor ops (csrc/emu/tensor_ops_emu.h): compiled into
// the emulator only (and by the strict pass, as C++20 like shaders/m5/). tests/kernels/
// test_tensor_ops_emu.py runs them through lily_py._core.emu.dispatch and checks matmul2d's
// documented semantics (transposes, modes, cooperative and tensor destinations, the stated
// relaxed-precision rounding) against NumPy, and that the scope and barrier bugs are caught.
#include "common/lily_metal.h"
#include "common/tensor_ops.h"

namespace lily_selftest_m5 {

struct TensorSelftestArgs {
  uint32_t n;      // unused
  uint32_t param;  // kernel-specific knob
};

// dst[16 x 8] (=|+=) op(a) * op(b) on execution_simdgroups<2> (64 threads), K = 24.
//   a: half, stored [16][24] (TL = false) or [24][16] (TL = true)
//   b: half, stored [24][8] (TR = false) or [8][24] (TR = true)
//   c: float [16][8]: the initial destination, then the result.
// COOP: the destination is a cooperative tensor initialised from c and stored back through
// get_multidimensional_index; otherwise a tensor over threadgroup float memory.
template <bool TL, bool TR, bool ACC, bool RELAXED, bool COOP>
[[kernel]] void tensor_mm(constant TensorSelftestArgs& args [[buffer(0)]],
                          const device half* a [[buffer(1)]],
                          const device half* b [[buffer(2)]],
                          device float* c [[buffer(3)]],
                          LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(half, as, [16 * 24]);
  LILY_TG_ARRAY(half, bs, [24 * 8]);
  LILY_TG_ARRAY(float, cs, [16 * 8]);
  const uint32_t t = thread_pos.x;
  for (uint32_t i = t; i < 16 * 24; i += 64) as[i] = a[i];
  for (uint32_t i = t; i < 24 * 8; i += 64) bs[i] = b[i];
  for (uint32_t i = t; i < 16 * 8; i += 64) cs[i] = c[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);

  constexpr auto desc = matmul2d_descriptor(16, 8, 24, TL, TR, RELAXED,
                                            ACC ? matmul2d_descriptor::mode::multiply_accumulate
                                                : matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroups<2>> op;
  auto ta = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(as, dextents<int32_t, 2>(TL ? 16 : 24, TL ? 24 : 16));
  auto tb = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(bs, dextents<int32_t, 2>(TR ? 24 : 8, TR ? 8 : 24));
  if (COOP) {
    auto d = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
    for (uint16_t i = 0; i < d.get_capacity(); ++i) {
      if (!d.is_valid_element(i)) continue;
      const auto idx = d.get_multidimensional_index(i);
      d[i] = cs[idx[1] * 8 + idx[0]];
    }
    op.run(ta, tb, d);
    for (uint16_t i = 0; i < d.get_capacity(); ++i) {
      if (!d.is_valid_element(i)) continue;
      const auto idx = d.get_multidimensional_index(i);
      c[idx[1] * 8 + idx[0]] = d[i];
    }
  } else {
    auto tc = tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline>(cs, dextents<int32_t, 2>(8, 16));
    op.run(ta, tb, tc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t i = t; i < 16 * 8; i += 64) c[i] = cs[i];
  }
}

// Broken: param 0: no barrier between staging a and the run; 1: only simdgroup 0 calls run;
// 2: dispatched with 32 threads (execution_simdgroups<2> needs 64).
template <typename Dummy>
[[kernel]] void broken_tensor_mm(constant TensorSelftestArgs& args [[buffer(0)]],
                                 const device half* a [[buffer(1)]],
                                 const device half* b [[buffer(2)]],
                                 device float* c [[buffer(3)]],
                                 LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(half, as, [16 * 24]);
  LILY_TG_ARRAY(half, bs, [24 * 8]);
  const uint32_t t = thread_pos.x;
  for (uint32_t i = t; i < 24 * 8; i += group_size.x) bs[i] = b[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t i = t; i < 16 * 24; i += group_size.x) as[i] = a[i];
  if (args.param != 0) threadgroup_barrier(mem_flags::mem_threadgroup);
  constexpr auto desc = matmul2d_descriptor(16, 8, 24, false, false, false, matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroups<2>> op;
  auto ta = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(as, dextents<int32_t, 2>(24, 16));
  auto tb = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(bs, dextents<int32_t, 2>(8, 24));
  auto d = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  if (args.param != 1 || simd_id == 0) op.run(ta, tb, d);
  for (uint16_t i = 0; i < d.get_capacity(); ++i)
    if (d.is_valid_element(i)) c[t * d.get_capacity() + i] = d[i];
}

LILY_INSTANTIATE("selftest_tensor_mm_nn_acc_coop", tensor_mm<false, false, true, false, true>)
LILY_INSTANTIATE("selftest_tensor_mm_tn_mul_coop", tensor_mm<true, false, false, false, true>)
LILY_INSTANTIATE("selftest_tensor_mm_nt_acc_tg", tensor_mm<false, true, true, false, false>)
LILY_INSTANTIATE("selftest_tensor_mm_tt_acc_relaxed_coop", tensor_mm<true, true, true, true, true>)
LILY_INSTANTIATE("selftest_broken_tensor_mm", broken_tensor_mm<void>)

}  // namespace lily_selftest_m5
