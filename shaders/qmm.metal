// Quantized matmul y[M, N] = x[M, K] @ dequant(w)[N, K]^T, MLX affine layout (common/quant.h).
// Host: csrc/gpu/ops/qmm.cpp (route, grid, bindings). Reference: lily_py.reference.kernels.
//
// Buffers (both kernels): 1 x [M, x_stride] T, 2 w uint32 [N, K*bits/32], 3 scales [N, K/gs] S,
// 4 biases [N, K/gs] S, 5 y [M, y_stride] T.  T = activation dtype (float or bfloat),
// S = scale/bias dtype (float or bfloat); bits 4 or 8; group size 32, 64 or 128 (runtime).
//
// Precision: codes, scales, biases and x are widened to fp32; dequantisation, products and
// accumulation are fp32; y is rounded to T once at the end. Nothing dequantized reaches device
// memory.
#include "common/lily_metal.h"
#include "common/mma.h"
#include "common/quant.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// qmv: the small-M route (M <= kQmvMaxRows; decode and tiny expert batches).
//   grid:        ceil(N / 8) threadgroups of 64 threads (kQmvSimdsPerGroup = 2 simdgroups)
//   simdgroup:   kQmvRowsPerSimd = 4 consecutive output features n0..n0+3, for all M rows of x
//   lane:        a strip of V codes per row per step (V = 16 for 4-bit, 8 for 8-bit: 8 bytes),
//                strips of the 32 lanes are consecutive; the simdgroup walks K in 32*V steps
//   reduction:   per group-strip s * dot(x, q) + b * sum(x), accumulated per lane, then one
//                simd_sum(float4) per row of x; lane 0 writes the 4 outputs.
// Every weight byte is read once per dispatch whatever M is.
template <typename T, typename S, int bits>
[[kernel]] void qmv(constant QmmArgs& args [[buffer(0)]],
                    const device T* x [[buffer(1)]],
                    const device uint32_t* w [[buffer(2)]],
                    const device S* scales [[buffer(3)]],
                    const device S* biases [[buffer(4)]],
                    device T* y [[buffer(5)]],
                    LILY_KERNEL_TAIL) {
  constexpr uint32_t V = 64 / bits;         // codes per lane per step (two uint32 words)
  constexpr uint32_t step = 32 * V;         // codes per simdgroup per step
  const uint32_t K = args.K;
  const uint32_t words_per_row = K * bits / 32;
  const uint32_t groups_per_row = K / args.group_size;
  const uint32_t n0 = (group_pos.x * kQmvSimdsPerGroup + simd_id) * kQmvRowsPerSimd;

  float4 acc[kQmvMaxRows];
  for (uint32_t m = 0; m < kQmvMaxRows; ++m) acc[m] = float4(0.0f);

  for (uint32_t k = lane * V; k < K; k += step) {
    const uint32_t g = k / args.group_size;  // the strip lies inside one group (V divides 32)
    for (uint32_t r = 0; r < kQmvRowsPerSimd; ++r) {
      const uint32_t n = n0 + r;
      if (n >= args.N) break;
      float q[V];
      unpack_codes<bits, V>(w + n * words_per_row + k * bits / 32, q);
      const float s = float(scales[n * groups_per_row + g]);
      const float b = float(biases[n * groups_per_row + g]);
      for (uint32_t m = 0; m < args.M; ++m) {
        const device T* xm = x + m * args.x_stride + k;
        float dot = 0.0f;
        float xsum = 0.0f;
        for (uint32_t i = 0; i < V; ++i) {
          const float xv = float(xm[i]);
          dot += xv * q[i];
          xsum += xv;
        }
        acc[m][r] += s * dot + b * xsum;
      }
    }
  }

  for (uint32_t m = 0; m < args.M; ++m) {  // args.M is uniform: every lane makes the same calls
    const float4 total = simd_sum(acc[m]);
    if (lane == 0) {
      for (uint32_t r = 0; r < kQmvRowsPerSimd; ++r)
        if (n0 + r < args.N) y[m * args.y_stride + n0 + r] = T(total[r]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// qmm: the tiled route (M > kQmvMaxRows; prefill).
//   grid:        (ceil(N / 32), ceil(M / 32)) threadgroups of 128 threads (4 simdgroups)
//   tile:        32 rows of x by 32 output features; K walked in steps of kQmmTileK = 32
//   per step:    thread t loads x[m0 + t/4, k0 + 8*(t%4) .. +8] and dequantizes the same
//                coordinates of w into threadgroup memory (fp32; zeros past M / N); barrier;
//                simdgroup s multiplies its 16x16 quarter (rows 16*(s/2), cols 16*(s%2)) as
//                2x2 8x8 simdgroup matrices; barrier.
//   epilogue:    accumulators go through threadgroup memory; thread t writes row t/4,
//                columns 8*(t%4) .. +8 of the tile, masked to M x N.
// A 32-wide K step lies inside one quantization group (group sizes are multiples of 32).
template <typename T, typename S, int bits>
[[kernel]] void qmm(constant QmmArgs& args [[buffer(0)]],
                    const device T* x [[buffer(1)]],
                    const device uint32_t* w [[buffer(2)]],
                    const device S* scales [[buffer(3)]],
                    const device S* biases [[buffer(4)]],
                    device T* y [[buffer(5)]],
                    LILY_KERNEL_TAIL) {
  constexpr uint32_t BM = kQmmTileM, BN = kQmmTileN, BK = kQmmTileK;
  constexpr uint32_t LD = BK + 4;   // padded rows of the x and w tiles
  constexpr uint32_t LDY = BN + 4;  // padded rows of the output tile
  static_assert(BM == 32 && BN == 32 && BK == 32 && kQmmSimdsPerGroup == 4,
                "the thread-to-tile mapping below assumes 32x32x32 tiles and 128 threads");
  LILY_TG_ARRAY(float, xs, [BM * LD]);
  LILY_TG_ARRAY(float, ws, [BN * LD]);
  LILY_TG_ARRAY(float, ys, [BM * LDY]);

  const uint32_t t = thread_pos.x;
  const uint32_t row = t / 4;        // tile row this thread loads / writes
  const uint32_t col = (t % 4) * 8;  // first of its 8 columns
  const uint32_t m0 = group_pos.y * BM;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t words_per_row = args.K * bits / 32;
  const uint32_t groups_per_row = args.K / args.group_size;
  const uint32_t sm = (simd_id / 2) * 16;  // this simdgroup's quarter of the tile
  const uint32_t sn = (simd_id % 2) * 16;

  MmaTile<2, 2> acc;
  mma_zero(acc);

  for (uint32_t k0 = 0; k0 < args.K; k0 += BK) {
    const uint32_t m = m0 + row;
    for (uint32_t i = 0; i < 8; ++i)
      xs[row * LD + col + i] = m < args.M ? float(x[m * args.x_stride + k0 + col + i]) : 0.0f;

    const uint32_t n = n0 + row;
    if (n < args.N) {
      float q[8];
      unpack_codes<bits, 8>(w + n * words_per_row + (k0 + col) * bits / 32, q);
      const uint32_t g = n * groups_per_row + (k0 + col) / args.group_size;
      const float s = float(scales[g]);
      const float b = float(biases[g]);
      for (uint32_t i = 0; i < 8; ++i) ws[row * LD + col + i] = s * q[i] + b;
    } else {
      for (uint32_t i = 0; i < 8; ++i) ws[row * LD + col + i] = 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint32_t kk = 0; kk < BK; kk += 8)
      mma_step(acc, xs + sm * LD + kk, LD, ws + sn * LD + kk, LD);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  mma_store(acc, ys + sm * LDY + sn, LDY);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint32_t m = m0 + row;
  if (m < args.M) {
    for (uint32_t i = 0; i < 8; ++i) {
      const uint32_t n = n0 + col + i;
      if (n < args.N) y[m * args.y_stride + n] = T(ys[row * LDY + col + i]);
    }
  }
}

// Instantiations: exactly the rows of csrc/gpu/kernel_ids.h (x dtype, scale dtype, bits).
LILY_INSTANTIATE("qmv_b4_xf32_sf32", qmv<float, float, 4>)
LILY_INSTANTIATE("qmv_b4_xf32_sbf16", qmv<float, bfloat, 4>)
LILY_INSTANTIATE("qmv_b4_xbf16_sf32", qmv<bfloat, float, 4>)
LILY_INSTANTIATE("qmv_b4_xbf16_sbf16", qmv<bfloat, bfloat, 4>)
LILY_INSTANTIATE("qmv_b8_xf32_sf32", qmv<float, float, 8>)
LILY_INSTANTIATE("qmv_b8_xf32_sbf16", qmv<float, bfloat, 8>)
LILY_INSTANTIATE("qmv_b8_xbf16_sf32", qmv<bfloat, float, 8>)
LILY_INSTANTIATE("qmv_b8_xbf16_sbf16", qmv<bfloat, bfloat, 8>)
LILY_INSTANTIATE("qmm_b4_xf32_sf32", qmm<float, float, 4>)
LILY_INSTANTIATE("qmm_b4_xf32_sbf16", qmm<float, bfloat, 4>)
LILY_INSTANTIATE("qmm_b4_xbf16_sf32", qmm<bfloat, float, 4>)
LILY_INSTANTIATE("qmm_b4_xbf16_sbf16", qmm<bfloat, bfloat, 4>)
LILY_INSTANTIATE("qmm_b8_xf32_sf32", qmm<float, float, 8>)
LILY_INSTANTIATE("qmm_b8_xf32_sbf16", qmm<float, bfloat, 8>)
LILY_INSTANTIATE("qmm_b8_xbf16_sf32", qmm<bfloat, float, 8>)
LILY_INSTANTIATE("qmm_b8_xbf16_sbf16", qmm<bfloat, bfloat, 8>)

}  // namespace lily
