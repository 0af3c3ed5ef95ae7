// Quantized matmul y[M, N] = x[M, K] @ dequant(w)[N, K]^T on Metal 4 tensor ops (M5 path).
// Same buffers, args and MLX affine layout as shaders/qmm.metal (4- and 8-bit weights: the template
// parameter `bits`; 8-bit is the MoE router + shared-expert gate of MLX conversions); host:
// csrc/gpu/ops/qmm.cpp (route qmm_m5, taken when the device reports tensor ops). Compiled with
// -std=metal4.0 into lily_m5.metallib (CMakeLists.txt), by the emulator, and by the strict pass
// against csrc/emu/tensor_ops_strict.h. Reference: lily_py.reference.kernels.
//
//   grid:      (ceil(N / 64), ceil(M / 64)) threadgroups of 128 threads (4 simdgroups)
//   tile:      64 rows of x by 64 output features, K walked in steps of kQmmM5TileK = 32
//   staging:   thread t rounds x[m0 + t/2, k0 + 16*(t%2) .. +16] to half and dequantizes the same
//              coordinates of w (16 codes = 16 * bits / 32 words: 2 at 4 bits, 4 at 8 bits, one
//              group since 16 divides every group size; fp32 s * q + b, rounded to half) into
//              threadgroup memory; zeros past M / N. Two stages: step s+1 is staged while
//              matmul2d multiplies step s, one threadgroup barrier per step.
//   multiply:  each simdgroup g owns the 32 x 32 quarter (rows 32 * (g / 2), features
//              32 * (g % 2)) of the tile: matmul2d_descriptor(32, 32, 32, transpose_left = false,
//              transpose_right = true, relaxed_precision = false, multiply_accumulate) on
//              execution_simdgroup, its x rows as left (extents (32, 32)), its w rows [n][k] as
//              right transposed (extents (32, 32)); the 32 x 32 fp32 accumulator is a cooperative
//              tensor of the simdgroup. Why one simdgroup per op and 32 x 32: docs/metal.md,
//              "Execution scope and tile shape" (the only public measurement: a single simdgroup
//              scope ran best, several simdgroups slower; 32 x 32 outputs or larger optimal).
//   epilogue:  each thread writes its cooperative-tensor elements, masked to M x N, rounded to Y
//              (Y = T, or fp32 for bf16 x: the *_yf32 variants, lm_head's logits).
// Precision: operands are half (the half x half -> float row of Apple's matmul2d types): x and
// the dequantized weights are rounded to half once; products and accumulation are fp32.
#include "common/lily_metal.h"
#include "common/quant.h"
#include "common/tensor_ops.h"

namespace lily {

// The 16 codes of weight row n from column k (16 | every group size: one group), with its scale
// and bias: what qmm_m5 and qmm_m5i8 stage for each thread.
template <int bits, typename S>
inline void qmm_m5_w_codes(constant QmmArgs& args, const device uint32_t* w, const device S* scales,
                           const device S* biases, uint32_t n, uint32_t k, thread float* q, thread float& s,
                           thread float& b) {
  constexpr uint32_t per_word = 32 / bits;  // codes per uint32 word
  unpack_codes<bits, 16>(w + n * (args.K / per_word) + k / per_word, q);
  const uint32_t g = n * (args.K / args.group_size) + k / args.group_size;
  s = float(scales[g]);
  b = float(biases[g]);
}

// Stages K step k0 of the x and w tiles (thread t: one row, 16 consecutive columns).
template <int bits, typename T, typename S>
inline void qmm_m5_stage(constant QmmArgs& args, const device T* x, const device uint32_t* w,
                         const device S* scales, const device S* biases, uint32_t m0, uint32_t n0,
                         uint32_t k0, uint32_t t, threadgroup half* xs, threadgroup half* ws) {
  constexpr uint32_t BK = kQmmM5TileK;
  const uint32_t row = t / 2;
  const uint32_t col = (t % 2) * 16;
  const uint32_t m = m0 + row;
  for (uint32_t i = 0; i < 16; ++i)
    xs[row * BK + col + i] = m < args.M ? half(float(x[m * args.x_stride + k0 + col + i])) : half(0.0f);
  const uint32_t n = n0 + row;
  if (n < args.N) {
    float q[16], s, b;
    qmm_m5_w_codes<bits>(args, w, scales, biases, n, k0 + col, q, s, b);
    for (uint32_t i = 0; i < 16; ++i) ws[row * BK + col + i] = half(s * q[i] + b);
  } else {
    for (uint32_t i = 0; i < 16; ++i) ws[row * BK + col + i] = half(0.0f);
  }
}

template <typename T, typename S, int bits = 4, typename Y = T>
[[kernel]] void qmm_m5(constant QmmArgs& args [[buffer(0)]],
                       const device T* x [[buffer(1)]],
                       const device uint32_t* w [[buffer(2)]],
                       const device S* scales [[buffer(3)]],
                       const device S* biases [[buffer(4)]],
                       device Y* y [[buffer(5)]],
                       LILY_KERNEL_TAIL) {
  constexpr uint32_t BM = kQmmM5TileM, BN = kQmmM5TileN, BK = kQmmM5TileK, SUB = kTensorOpSubTile;
  static_assert(bits == 4 || bits == 8, "MLX affine 4- or 8-bit codes");
  static_assert(BM == 64 && BN == 64 && BK == 32 && kQmmM5SimdsPerGroup == 4 && SUB == 32,
                "the staging map and the 2 x 2 simdgroup quarters below assume 64x64x32 tiles, 128 threads");
  LILY_TG_ARRAY(half, xs, [2 * BM * BK]);  // two stages of the x tile [64][32]
  LILY_TG_ARRAY(half, ws, [2 * BN * BK]);  // two stages of the w tile [64][32]

  const uint32_t t = thread_pos.x;
  const uint32_t m0 = group_pos.y * BM;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t sm = (simd_id / 2) * SUB;  // this simdgroup's quarter: rows sm.., features sn..
  const uint32_t sn = (simd_id % 2) * SUB;

  constexpr auto desc = matmul2d_descriptor(int(SUB), int(SUB), int(BK), false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> op;
  auto x0 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(xs + sm * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto x1 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(xs + BM * BK + sm * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto w0 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(ws + sn * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto w1 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(ws + BN * BK + sn * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto acc = op.template get_destination_cooperative_tensor<decltype(x0), decltype(w0), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) acc[i] = 0.0f;

  const uint32_t steps = args.K / BK;
  qmm_m5_stage<bits>(args, x, w, scales, biases, m0, n0, 0, t, xs, ws);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t next = (s + 1) & 1;
    if (s + 1 < steps)  // stage s+1 into the buffers the previous step's run read (barrier between)
      qmm_m5_stage<bits>(args, x, w, scales, biases, m0, n0, (s + 1) * BK, t, xs + next * BM * BK, ws + next * BN * BK);
    if ((s & 1) == 0) op.run(x0, w0, acc);
    else op.run(x1, w1, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    const uint32_t n = n0 + sn + uint32_t(idx[0]);
    const uint32_t m = m0 + sm + uint32_t(idx[1]);
    if (m < args.M && n < args.N) y[m * args.y_stride + n] = Y(acc[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// qmm_m5i8: qmm_m5 with int8 activations on the int8 rows of matmul2d (int8_t x uint8_t -> int32_t),
// for bf16 x and 4-bit weights. Same buffers, args, grid, tile and simdgroup quarters as qmm_m5.
//   staging:   per K step of 32 (one scale group), thread t takes x[m0 + t/2, k0 + 16 (t%2) .. + 16]
//              and quantizes the row's 32 values with its partner t ^ 1 (int8_row_codes,
//              common/tensor_ops.h): s_x = max |x| / 127 (0 for an all-zero row), codes xi =
//              rint(x / s_x) clamped to [-127, 127], the row's code sum sum(xi) (exact); and the same coordinates
//              of w as their uint8 codes with the group's scale and bias (one group per step:
//              32 divides every group size). Two stages, one barrier per step, as qmm_m5.
//   multiply:  per step, simdgroup g's quarter with matmul2d_descriptor(32, 32, 32, false, true,
//              false, multiply) into an int32 cooperative tensor (exact: |sum| <= 32 x 127 x 255),
//              then each thread rescales its elements into fp32 accumulators of the same op:
//              acc += s_x[row] (s_w[col] I + b_w[col] sum(xi)[row]), since
//              sum_k x_k w_k = s_x s_w sum_k xi_k q_k + s_x b_w sum_k xi_k over the step.
//   Precision: x is rounded to int8 per row and 32 columns (relative to the group's max, error
//              <= s_x / 2 per element); the codes and the integer sums are exact; the rescale is
//              fp32. benchmarks/int8_activation_study.py and docs/performance.md give the model-level
//              error; the kernel test compares with the reference on the same int8 codes.
template <typename T, typename S>
inline void qmm_m5i8_stage(constant QmmArgs& args, const device T* x, const device uint32_t* w,
                           const device S* scales, const device S* biases, uint32_t m0, uint32_t n0,
                           uint32_t k0, uint32_t t, threadgroup int8_t* xq, threadgroup uint8_t* wq,
                           threadgroup float* xs, threadgroup float* xsum, threadgroup float* ws,
                           threadgroup float* wb) {
  constexpr uint32_t BK = kQmmM5TileK;
  const uint32_t row = t / 2;
  const uint32_t col = (t % 2) * 16;
  const uint32_t m = m0 + row;
  float v[16];
  for (uint32_t i = 0; i < 16; ++i) v[i] = m < args.M ? float(x[m * args.x_stride + k0 + col + i]) : 0.0f;
  float isum;
  const float sx = int8_row_codes(v, xq + row * BK + col, isum);
  const uint32_t n = n0 + row;
  float sw = 0.0f, bw = 0.0f;
  if (n < args.N) {
    float q[16];
    qmm_m5_w_codes<4>(args, w, scales, biases, n, k0 + col, q, sw, bw);
    for (uint32_t i = 0; i < 16; ++i) wq[row * BK + col + i] = uint8_t(q[i]);
  } else {
    for (uint32_t i = 0; i < 16; ++i) wq[row * BK + col + i] = uint8_t(0);
  }
  if (t % 2 == 0) {
    xs[row] = sx;
    xsum[row] = isum;
    ws[row] = sw;
    wb[row] = bw;
  }
}

template <typename T, typename S>
[[kernel]] void qmm_m5i8(constant QmmArgs& args [[buffer(0)]],
                         const device T* x [[buffer(1)]],
                         const device uint32_t* w [[buffer(2)]],
                         const device S* scales [[buffer(3)]],
                         const device S* biases [[buffer(4)]],
                         device T* y [[buffer(5)]],
                         LILY_KERNEL_TAIL) {
  constexpr uint32_t BM = kQmmM5TileM, BN = kQmmM5TileN, BK = kQmmM5TileK, SUB = kTensorOpSubTile;
  static_assert(BM == 64 && BN == 64 && BK == 32 && kQmmM5SimdsPerGroup == 4 && SUB == 32,
                "the staging map and the 2 x 2 simdgroup quarters below assume 64x64x32 tiles, 128 threads");
  LILY_TG_ARRAY(int8_t, xq, [2 * BM * BK]);   // two stages of the x codes [64][32]
  LILY_TG_ARRAY(uint8_t, wq, [2 * BN * BK]);  // two stages of the w codes [64][32]
  LILY_TG_ARRAY(float, xs, [2 * BM]);         // s_x per row and stage
  LILY_TG_ARRAY(float, xsum, [2 * BM]);       // sum of the row's codes per stage
  LILY_TG_ARRAY(float, ws, [2 * BN]);         // the weight group's scale per feature and stage
  LILY_TG_ARRAY(float, wb, [2 * BN]);         // ... and bias

  const uint32_t t = thread_pos.x;
  const uint32_t m0 = group_pos.y * BM;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t sm = (simd_id / 2) * SUB;  // this simdgroup's quarter: rows sm.., features sn..
  const uint32_t sn = (simd_id % 2) * SUB;

  constexpr auto desc = matmul2d_descriptor(int(SUB), int(SUB), int(BK), false, true, false,
                                            matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroup> op;
  auto x0 = tensor<threadgroup int8_t, dextents<int32_t, 2>, tensor_inline>(xq + sm * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto x1 = tensor<threadgroup int8_t, dextents<int32_t, 2>, tensor_inline>(xq + BM * BK + sm * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto w0 = tensor<threadgroup uint8_t, dextents<int32_t, 2>, tensor_inline>(wq + sn * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto w1 = tensor<threadgroup uint8_t, dextents<int32_t, 2>, tensor_inline>(wq + BN * BK + sn * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto acc = op.template get_destination_cooperative_tensor<decltype(x0), decltype(w0), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) acc[i] = 0.0f;

  const uint32_t steps = args.K / BK;
  qmm_m5i8_stage(args, x, w, scales, biases, m0, n0, 0, t, xq, wq, xs, xsum, ws, wb);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t cur = s & 1, next = (s + 1) & 1;
    if (s + 1 < steps)  // stage s+1 into the buffers the previous step read (barrier between)
      qmm_m5i8_stage(args, x, w, scales, biases, m0, n0, (s + 1) * BK, t, xq + next * BM * BK,
                     wq + next * BN * BK, xs + next * BM, xsum + next * BM, ws + next * BN, wb + next * BN);
    auto dot = op.template get_destination_cooperative_tensor<decltype(x0), decltype(w0), int32_t>();
    if (cur == 0) op.run(x0, w0, dot);
    else op.run(x1, w1, dot);
    int8_rescale(dot, acc, xs, xsum, ws, wb, cur * BM + sm, cur * BN + sn);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    const uint32_t n = n0 + sn + uint32_t(idx[0]);
    const uint32_t m = m0 + sm + uint32_t(idx[1]);
    if (m < args.M && n < args.N) y[m * args.y_stride + n] = T(acc[i]);
  }
}

// Instantiations: exactly the qmm_m5 rows of csrc/gpu/kernel_ids.h (x dtype, scale dtype, bits[,
// fp32 y: 4-bit only]).
LILY_INSTANTIATE("qmm_m5_b4_xf32_sf32", qmm_m5<float, float>)
LILY_INSTANTIATE("qmm_m5_b4_xf32_sbf16", qmm_m5<float, bfloat>)
LILY_INSTANTIATE("qmm_m5_b4_xbf16_sf32", qmm_m5<bfloat, float>)
LILY_INSTANTIATE("qmm_m5_b4_xbf16_sbf16", qmm_m5<bfloat, bfloat>)
LILY_INSTANTIATE("qmm_m5_b4_xbf16_sf32_yf32", qmm_m5<bfloat, float, 4, float>)
LILY_INSTANTIATE("qmm_m5_b4_xbf16_sbf16_yf32", qmm_m5<bfloat, bfloat, 4, float>)
LILY_INSTANTIATE("qmm_m5_b8_xf32_sf32", qmm_m5<float, float, 8>)
LILY_INSTANTIATE("qmm_m5_b8_xf32_sbf16", qmm_m5<float, bfloat, 8>)
LILY_INSTANTIATE("qmm_m5_b8_xbf16_sf32", qmm_m5<bfloat, float, 8>)
LILY_INSTANTIATE("qmm_m5_b8_xbf16_sbf16", qmm_m5<bfloat, bfloat, 8>)
LILY_INSTANTIATE("qmm_m5i8_b4_xbf16_sf32", qmm_m5i8<bfloat, float>)
LILY_INSTANTIATE("qmm_m5i8_b4_xbf16_sbf16", qmm_m5i8<bfloat, bfloat>)

}  // namespace lily
