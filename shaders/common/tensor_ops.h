// The only shader header that uses Metal 4 tensors and MetalPerformancePrimitives' tensor ops
// (mpp::tensor_ops::matmul2d; Apple GPU family 10 / M5 neural accelerators, macOS 26).
//   Metal:     Apple's headers; the including shader is compiled with -std=metal4.0 into the
//              second library (lily_m5.metallib), never into lily.metallib (CMakeLists.txt).
//   emulator:  csrc/emu/tensor_ops_emu.h (included by csrc/emu/metal_emu.h): the documented
//              semantics, execution-scope checks and the stated rounding.
//   strict:    csrc/emu/tensor_ops_strict.h: the same declarations with address spaces.
// What of this rests on Apple's documentation rather than on a compiler: docs/tensor-ops.md,
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

// ---- int8 activations on the int8 rows of matmul2d (qmm_m5i8, moe_*_m5i8) -----------------------
// x (or h) comes as codes from quantize_i8 (shaders/m5/qmm_m5.metal; layout: common/args.h,
// QuantI8Args); a K step of kI8StepK = 64 columns is one weight group and two 32-column halves,
// each half its own tile of 32-byte rows.

// The scales and the sums of an int8 scratch of `rows` rows of K values (common/args.h).
inline const device float* i8_scales(const device uint8_t* scratch, uint32_t rows, uint32_t K) {
  return reinterpret_cast<const device float*>(scratch + i8_scales_offset(rows, K));
}
inline const device float* i8_sums(const device uint8_t* scratch, uint32_t rows, uint32_t K) {
  return reinterpret_cast<const device float*>(scratch + i8_sums_offset(rows, K));
}

// The two masks: the 8 4-bit codes of a word to 8 bytes, in the order 0 2 4 6 1 3 5 7 (the order
// quantize_i8 writes x's codes in).
inline void i8_spread_codes(uint32_t word, threadgroup uint32_t* dst) {
  dst[0] = word & 0x0F0F0F0Fu;
  dst[1] = (word >> 4) & 0x0F0F0F0Fu;
}

// ROWS rows of a half tile (32-byte rows of codes) from row r0, as a matmul2d operand (E: int8_t
// for x, uint8_t for the weights).
template <typename E, int ROWS>
inline tensor<threadgroup E, dextents<int32_t, 2>, tensor_inline> i8_half_tile(threadgroup uint4* tile, uint32_t r0) {
  return tensor<threadgroup E, dextents<int32_t, 2>, tensor_inline>(
      reinterpret_cast<threadgroup E*>(tile) + r0 * kI8Group, dextents<int32_t, 2>(int(kI8Group), ROWS));
}

// Stages one row's 64-column step of codes (two halves: 32 bytes at half_a[row], half_b[row]; the
// calling thread copies half `part`'s 32 bytes, two 16-byte loads) and, from the scales and sums
// of its two 32-column groups, s_xa, s_xb (part 0) or the step's code sum s_xa C_a + s_xb C_b
// (part 1). Zeros for an absent row. codes: the row's codes at the step; sc / su: the row's scale
// and sum entries at the step's first group.
inline void i8_stage_row(const device uint8_t* codes, const device float* sc, const device float* su, bool valid,
                         uint32_t row, uint32_t part, threadgroup uint4* halves, uint32_t half_stride,
                         threadgroup float* xsa, threadgroup float* xsb, threadgroup float* xsum) {
  threadgroup uint4* dst = halves + part * half_stride + row * (kI8Group / 16);
  if (valid) {
    const device uint4* src = reinterpret_cast<const device uint4*>(codes + part * kI8Group);
    dst[0] = src[0];
    dst[1] = src[1];
  } else {
    dst[0] = uint4(0u);
    dst[1] = uint4(0u);
  }
  if (part == 0) {
    xsa[row] = valid ? sc[0] : 0.0f;
    xsb[row] = valid ? sc[1] : 0.0f;
  } else {
    xsum[row] = valid ? su[0] + su[1] : 0.0f;
  }
}

// Stages 16 weight codes of feature n (row `row` of the weight halves), columns 16 part2 .. + 16 of
// half `part` of the step at k0, as bytes; and (first = true) the feature's group scale and bias.
// Zeros for n >= N. wpr: code words per row; gpr: groups per row.
template <typename S>
inline void i8_stage_w16(const device uint32_t* w, const device S* sc, const device S* bi, uint32_t n, uint32_t N,
                         uint32_t k0, uint32_t wpr, uint32_t gpr, uint32_t group_size, uint32_t row, uint32_t part,
                         uint32_t part2, bool first, threadgroup uint4* halves, uint32_t half_stride,
                         threadgroup float* ws, threadgroup float* wb) {
  threadgroup uint32_t* dst =
      reinterpret_cast<threadgroup uint32_t*>(halves + part * half_stride + row * (kI8Group / 16)) + part2 * 4;
  if (n < N) {
    const device uint32_t* src = w + n * wpr + (k0 + part * kI8Group + part2 * 16) / 8;
    i8_spread_codes(src[0], dst);
    i8_spread_codes(src[1], dst + 2);
  } else {
    for (uint32_t j = 0; j < 4; ++j) dst[j] = 0u;
  }
  if (first) {
    const uint32_t g = n * gpr + k0 / group_size;
    ws[row] = n < N ? float(sc[g]) : 0.0f;
    wb[row] = n < N ? float(bi[g]) : 0.0f;
  }
}

// The int8 routes' fp32 accumulators are int32 destination cooperative tensors of the same op as
// the int8 products, holding float bits: an int8 x int8 matmul2d writes int32 destinations only
// (macOS 26.1 SDK), and Apple documents that elements pair by index only between destinations of
// one op with one element type (MPPTensorOpsMatMul2d.h: the bias example), not between an int32
// and a float one. The emulator's layouts differ by element type, so a mixed pairing fails there.
template <typename A>
inline float i8_acc_get(thread A& acc, uint16_t i) {
  return as_type<float>(acc[i]);
}
template <typename A>
inline void i8_acc_set(thread A& acc, uint16_t i, float v) {
  acc[i] = as_type<int32_t>(v);
}

// The rescale of one 64-column step (dot by reference: a cooperative tensor's operator[] is not const
// in Apple's header): da, db (int32, the two halves) and acc (fp32 bits in int32: i8_acc_get) are
// destination cooperative tensors of the same op and element type, so element i of each is the same
// output (row r0 + r, feature c0 + c):
// acc += s_w (s_xa D_a + s_xb D_b) + b_w (s_xa C_a + s_xb C_b), i.e. x_int8 . w over the step
// (w = s_w q + b_w, one weight group). 6 ALU ops an element: 2 converts, a multiply, 3 FMAs.
template <typename D>
inline void i8_rescale(thread D& da, thread D& db, thread D& acc, const threadgroup float* xsa,
                       const threadgroup float* xsb, const threadgroup float* xsum, const threadgroup float* ws,
                       const threadgroup float* wb, uint32_t r0, uint32_t c0) {
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    const uint32_t r = r0 + uint32_t(idx[1]), c = c0 + uint32_t(idx[0]);
    const float dot = xsa[r] * float(da[i]) + xsb[r] * float(db[i]);
    i8_acc_set(acc, i, fma(wb[c], xsum[r], fma(ws[c], dot, i8_acc_get(acc, i))));
  }
}

}  // namespace lily
