// The only shader header that uses Metal 4 tensors and MetalPerformancePrimitives' tensor ops
// (mpp::tensor_ops::matmul2d; Apple GPU family 10 / M5 neural accelerators, macOS 26).
//   Metal:     Apple's headers; the including shader is compiled with -std=metal4.0 into the
//              second library (lily_m5.metallib), never into lily.metallib (CMakeLists.txt).
//   emulator:  csrc/emu/tensor_ops_emu.h (included by csrc/emu/metal_emu.h): the documented
//              semantics, execution-scope checks and the stated rounding.
//   strict:    csrc/emu/tensor_ops_strict.h: the same declarations with address spaces.
// What of this rests on Apple's documentation rather than on a compiler: docs/metal.md,
// "Metal 4 tensor ops (M5)".
#pragma once
#include "common/lily_metal.h"

#if defined(__METAL_VERSION__)
#if __METAL_VERSION__ >= 400 && defined(__HAVE_TENSOR__)
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#else
#error "common/tensor_ops.h needs the Metal 4 language (-std=metal4.0) and tensor support (macOS 26 SDK)"
#endif
#elif defined(LILY_STRICT)
#include "emu/tensor_ops_strict.h"
#endif
// (LILY_EMU: csrc/emu/metal_emu.h already included csrc/emu/tensor_ops_emu.h.)

using namespace mpp::tensor_ops;

namespace lily {

// int8 activations on the int8 rows of matmul2d (qmm_m5i8, moe_*_m5i8): thread t holds 16 values
// v of one row of a 32-column K step, its partner t ^ 1 (the same simdgroup) the row's other 16.
// Both call this. The row's step is quantized symmetrically: s = max |x| / 127 over the 32 values
// (0 for an all-zero row), codes rint(v / s) clamped to [-127, 127] (0 where s = 0) into xq[0..16).
// Returns s; sum is the code sum over the 32 values (exact in fp32: |sum| <= 32 x 127).
// Reference: lily_py.reference.kernels.int8_rows.
inline float int8_row_codes(thread const float* v, threadgroup int8_t* xq, thread float& sum) {
  float amax = 0.0f;
  for (uint32_t i = 0; i < 16; ++i) amax = max(amax, abs(v[i]));
  amax = max(amax, simd_shuffle_xor(amax, ushort(1)));  // the row's other 16 columns (thread t ^ 1)
  const float s = amax / 127.0f;
  int32_t isum = 0;
  for (uint32_t i = 0; i < 16; ++i) {
    const float q = s > 0.0f ? clamp(rint(v[i] / s), -127.0f, 127.0f) : 0.0f;
    xq[i] = int8_t(q);
    isum += int32_t(q);
  }
  isum += simd_shuffle_xor(isum, ushort(1));
  sum = float(isum);
  return s;
}

// The rescale after an int8 run (dot by reference: a cooperative tensor's operator[] is not const in
// Apple's header): dot (int32) and acc (fp32) are destination cooperative tensors of
// the same op, so element i of one is element i of the other; for element (row r, column c) of the
// op's output, acc += s_x[r0 + r] (s_w[c0 + c] dot + b_w[c0 + c] sum[r0 + r]), since over one K
// step with one weight group sum_k x_k w_k = s_x s_w sum_k xi_k q_k + s_x b_w sum_k xi_k.
template <typename D, typename A>
inline void int8_rescale(thread D& dot, thread A& acc, const threadgroup float* xs, const threadgroup float* xsum,
                         const threadgroup float* ws, const threadgroup float* wb, uint32_t r0, uint32_t c0) {
  for (uint16_t i = 0; i < dot.get_capacity(); ++i) {
    if (!dot.is_valid_element(i)) continue;
    const auto idx = dot.get_multidimensional_index(i);
    const uint32_t r = r0 + uint32_t(idx[1]), c = c0 + uint32_t(idx[0]);
    acc[i] += xs[r] * (ws[c] * float(dot[i]) + wb[c] * xsum[r]);
  }
}

}  // namespace lily
