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
//              tensor of the simdgroup. Why one simdgroup per op and 32 x 32: docs/tensor-ops.md,
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
// quantize_i8: bf16 x[rows, K] (fp32: the MoE's h) into the int8 activation scratch that qmm_m5i8 and moe_*_m5i8 read
// (layout: common/args.h, QuantI8Args). One thread per row and 32 columns (kI8Group): s = max |x| /
// 127 in fp32 (0 for an all-zero group), codes rint(x / s) clamped to [-127, 127] (0 where s = 0),
// written in the permuted order 0 2 4 6 1 3 5 7 of each 8 columns; the group's dequantized sum
// s * sum(codes) (the code sum exact as an integer, one fp32 rounding). Plain ALU code, bytes-bound
// (reads 2 bytes a value, writes 1.25).
// Reference: lily_py.reference.kernels.int8_rows / quantize_i8.
template <typename T>
[[kernel]] void quantize_i8(constant QuantI8Args& args [[buffer(0)]],
                            const device T* x [[buffer(1)]],
                            device uint8_t* out [[buffer(2)]],
                            LILY_KERNEL_TAIL) {
  constexpr uint32_t G = kI8Group;
  const uint32_t groups = args.K / G;
  const uint32_t i = grid_pos.x;
  if (i >= args.rows * groups) return;
  const uint32_t row = i / groups, g = i % groups;
  float v[G];
  float amax = 0.0f;
  for (uint32_t j = 0; j < G; ++j) {
    v[j] = float(x[row * args.x_stride + g * G + j]);
    amax = max(amax, abs(v[j]));
  }
  int32_t isum = 0;
  const float s = amax / 127.0f;
  device uint32_t* words = reinterpret_cast<device uint32_t*>(out + row * args.K + g * G);
  for (uint32_t c = 0; c < G / 8; ++c) {
    uint32_t lo = 0, hi = 0;  // columns 0 2 4 6 and 1 3 5 7 of the block, one byte each
    for (uint32_t j = 0; j < 4; ++j) {
      const float q0 = s > 0.0f ? clamp(rint(v[8 * c + 2 * j] / s), -127.0f, 127.0f) : 0.0f;
      const float q1 = s > 0.0f ? clamp(rint(v[8 * c + 2 * j + 1] / s), -127.0f, 127.0f) : 0.0f;
      lo |= (uint32_t(int32_t(q0)) & 0xFFu) << (8 * j);
      hi |= (uint32_t(int32_t(q1)) & 0xFFu) << (8 * j);
      isum += int32_t(q0) + int32_t(q1);
    }
    words[2 * c] = lo;
    words[2 * c + 1] = hi;
  }
  device float* scales = reinterpret_cast<device float*>(out + i8_scales_offset(args.rows, args.K));
  device float* sums = reinterpret_cast<device float*>(out + i8_sums_offset(args.rows, args.K));
  scales[i] = s;
  sums[i] = s * float(isum);
}

// ---------------------------------------------------------------------------------------------
// qmm_m5i8: qmm_m5 with int8 activations on the int8 rows of matmul2d (int8_t x uint8_t -> int32_t),
// for x quantized by quantize_i8 (buffer 1: the int8 activation scratch of x's M rows) and 4-bit
// weights with group_size % 64 == 0. Same args, grid, output tile and simdgroup quarters as qmm_m5.
//   staging:   per K step of 64 (kI8StepK: one weight group), thread t copies the 32 codes of x row
//              m0 + t/2 at columns 32 (t%2) .. + 32 (two 16-byte loads), and spreads the same 32
//              4-bit codes of w row n0 + t/2 to bytes with two masks a word (w & 0x0F0F0F0F,
//              (w >> 4) & 0x0F0F0F0F: the order 0 2 4 6 1 3 5 7 quantize_i8 wrote x's codes in);
//              the row's two x scales and its 64-column code sum (s_xa C_a + s_xb C_b), the feature's weight
//              scale and bias; zeros past M / N. Each half (32 columns) is its own [64][32] tile.
//              Two stages: step s+1 is staged while step s multiplies, one barrier per step.
//   multiply:  per step, simdgroup g's quarter runs matmul2d_descriptor(32, 32, 32, false, true,
//              false, multiply) on each half into int32 cooperative tensors D_a, D_b (exact:
//              |D| <= 32 x 127 x 15), then each thread rescales its elements into fp32 accumulators
//              of the same op: acc += s_w (s_xa D_a + s_xb D_b) + b_w sum_x, since over one weight
//              group sum_k x_k w_k = s_w sum_k x_k q_k + b_w sum_k x_k (x_k here the dequantized
//              codes, their sums from quantize_i8): 6 ALU ops an output per 64 MACs.
//   Precision: x is rounded to int8 per row and 32 columns (error <= s_x / 2 per element) in both
//              terms (with x's exact sum in the bias term instead, the errors of the two terms no
//              longer cancel: w = s q + b is centred, s q is not, and the engine's logits nmse
//              grew 5-25x); the integer dots are exact; the rescale is fp32. benchmarks/int8_activation_study.py and docs/int8.md give
//              the model-level error; the kernel test compares with the reference of the same
//              semantics (lily_py.reference.kernels.quantized_matmul_i8).

constant constexpr uint32_t kI8HalfTile = kQmmM5TileM * kI8Group / 16;  // uint4 in a [64][32]-byte half

// Stages K step k0 of qmm_m5i8's tiles: thread t, row t / 2 of x and feature n0 + t / 2 of w, half
// t % 2 of the step (32 columns).
template <typename S>
inline void qmm_m5i8_stage(constant QmmArgs& args, const device uint8_t* xq, const device uint32_t* w,
                           const device S* scales, const device S* biases, uint32_t m0, uint32_t n0,
                           uint32_t k0, uint32_t t, threadgroup uint4* xt, threadgroup uint4* wt,
                           threadgroup float* xsa, threadgroup float* xsb, threadgroup float* xsum,
                           threadgroup float* ws, threadgroup float* wb) {
  const uint32_t row = t / 2, part = t % 2;
  const uint32_t m = m0 + row, n = n0 + row;
  const uint32_t g32 = m * (args.K / kI8Group) + k0 / kI8Group;
  i8_stage_row(xq + m * args.K + k0, i8_scales(xq, args.M, args.K) + g32, i8_sums(xq, args.M, args.K) + g32, m < args.M, row, part, xt, kI8HalfTile, xsa, xsb, xsum);
  const uint32_t wpr = args.K / 8, gpr = args.K / args.group_size;
  for (uint32_t part2 = 0; part2 < 2; ++part2)
    i8_stage_w16(w, scales, biases, n, args.N, k0, wpr, gpr, args.group_size, row, part, part2,
                 part == 1 && part2 == 0, wt, kI8HalfTile, ws, wb);
}

template <typename T, typename S>
[[kernel]] void qmm_m5i8(constant QmmArgs& args [[buffer(0)]],
                         const device uint8_t* xq [[buffer(1)]],
                         const device uint32_t* w [[buffer(2)]],
                         const device S* scales [[buffer(3)]],
                         const device S* biases [[buffer(4)]],
                         device T* y [[buffer(5)]],
                         LILY_KERNEL_TAIL) {
  constexpr uint32_t BM = kQmmM5TileM, BN = kQmmM5TileN, H = kI8Group, SUB = kTensorOpSubTile, HT = kI8HalfTile;
  static_assert(BM == 64 && BN == 64 && kI8StepK == 2 * H && H == 32 && kQmmM5SimdsPerGroup == 4 && SUB == 32,
                "the staging map and the 2 x 2 simdgroup quarters below assume 64x64 tiles, K steps of 2 x 32, 128 threads");
  LILY_TG_ARRAY(uint4, xt, [2 * 2 * HT]);  // x codes: [stage][half][64][32] bytes
  LILY_TG_ARRAY(uint4, wt, [2 * 2 * HT]);  // w codes spread to bytes, the same
  LILY_TG_ARRAY(float, xsa, [2 * BM]);     // per stage: s_x of the row's first 32 columns
  LILY_TG_ARRAY(float, xsb, [2 * BM]);     // ... of its second 32
  LILY_TG_ARRAY(float, xsum, [2 * BM]);    // ... the sum of its 64 values
  LILY_TG_ARRAY(float, ws, [2 * BN]);      // ... the feature's weight scale
  LILY_TG_ARRAY(float, wb, [2 * BN]);      // ... and bias

  const uint32_t t = thread_pos.x;
  const uint32_t m0 = group_pos.y * BM;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t sm = (simd_id / 2) * SUB;  // this simdgroup's quarter: rows sm.., features sn..
  const uint32_t sn = (simd_id % 2) * SUB;

  constexpr auto desc = matmul2d_descriptor(int(SUB), int(SUB), int(H), false, true, false,
                                            matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroup> op;
  using XT = tensor<threadgroup int8_t, dextents<int32_t, 2>, tensor_inline>;
  using WT = tensor<threadgroup uint8_t, dextents<int32_t, 2>, tensor_inline>;
  auto acc = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();  // fp32 bits (i8_acc_get)
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) i8_acc_set(acc, i, 0.0f);

  const uint32_t steps = args.K / kI8StepK;
  qmm_m5i8_stage(args, xq, w, scales, biases, m0, n0, 0, t, xt, wt, xsa, xsb, xsum, ws, wb);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t cur = s & 1, next = (s + 1) & 1;
    if (s + 1 < steps)  // stage s+1 into the buffers the previous step read (barrier between)
      qmm_m5i8_stage(args, xq, w, scales, biases, m0, n0, (s + 1) * kI8StepK, t, xt + 2 * next * HT,
                     wt + 2 * next * HT, xsa + next * BM, xsb + next * BM, xsum + next * BM, ws + next * BN,
                     wb + next * BN);
    auto da = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
    auto db = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
    auto xa = i8_half_tile<int8_t, SUB>(xt + 2 * cur * HT, sm);  // (run takes its operands by reference)
    auto wa = i8_half_tile<uint8_t, SUB>(wt + 2 * cur * HT, sn);
    auto xb = i8_half_tile<int8_t, SUB>(xt + (2 * cur + 1) * HT, sm);
    auto wbt = i8_half_tile<uint8_t, SUB>(wt + (2 * cur + 1) * HT, sn);
    op.run(xa, wa, da);
    op.run(xb, wbt, db);
    // the stage's scales as base pointers: each element's row / column (sm, sn + its index) is the
    // same every step, so the compiler may keep it out of the K loop
    i8_rescale(da, db, acc, xsa + cur * BM, xsb + cur * BM, xsum + cur * BM, ws + cur * BN, wb + cur * BN, sm, sn);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    const uint32_t n = n0 + sn + uint32_t(idx[0]);
    const uint32_t m = m0 + sm + uint32_t(idx[1]);
    if (m < args.M && n < args.N) y[m * args.y_stride + n] = T(i8_acc_get(acc, i));
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
LILY_INSTANTIATE("quantize_i8_xbf16", quantize_i8<bfloat>)
LILY_INSTANTIATE("quantize_i8_xf32", quantize_i8<float>)

}  // namespace lily
