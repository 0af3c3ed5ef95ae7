// Gated DeltaNet argument structs and route constants (shaders/gated_delta.metal, host:
// csrc/gpu/ops/gated_delta.cpp). Included once from common/args.h.
#pragma once
#if !defined(__METAL_VERSION__)
#include <cstdint>
#endif

namespace lily {

enum : uint32_t {
  kConvThreads = 256,     // conv1d: channels per threadgroup (one thread per channel and token)
  kConvMaxKernel = 8,     // conv1d: largest kernel size (the model uses 4)
  kGdColsPerSimd = 4,     // gated_delta: value columns (Dv) one simdgroup owns (one float4)
  kGdRowsPerLane = 4,     // gated_delta: key rows (Dk) one lane owns, rows lane + 32 r
  kGdMaxDk = 32 * kGdRowsPerLane,  // 128: largest key head dim
  kGdMaxDv = 32 * kGdColsPerSimd,  // 128: largest value head dim (32 simdgroups = 1024 threads)
  // gated_delta_decode (one token, conv fused, a value head split over threadgroups by columns):
  kGdDecodeColsPerSimd = 2,   // value columns one simdgroup owns (lane: 4 key rows x 2 columns)
  kGdDecodeThreads = 256,     // preferred threads per threadgroup (declared to the compiler; the
                              // host takes fewer, a multiple of 32, under a lower pipeline limit)
  kGdDecodeMaxCols = (kGdDecodeThreads / 32) * kGdDecodeColsPerSimd,  // 16 columns per threadgroup
};

// Depthwise causal conv + SiLU with a rolling state of the last K-1 inputs:
//   xx = concat(state_in [K-1, C], x [T, C]);  y[t, c] = silu(sum_j w[c, j] * xx[t + j, c])
//   state_out = xx[T .. T+K-2]  (state_out may alias state_in only when T == 1)
struct Conv1dArgs {
  uint32_t T;         // tokens
  uint32_t C;         // channels
  uint32_t K;         // kernel size, <= kConvMaxKernel
  uint32_t x_stride;  // elements between rows of x (>= C): x may be a column slice of a wider row
  uint32_t y_stride;  // elements between rows of y (>= C)
};

// The fused gated delta rule over T tokens of one value head per threadgroup, state in registers:
//   q, k <- l2norm(q), l2norm(k) (eps 1e-6); q *= Dk^-1/2
//   decay = exp(-exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])); beta = sigmoid(b[t, h])
//   S <- decay S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q
//   y[t, h, :] = rmsnorm(o) * norm_w * silu(z[t, h, :])
// Device state layout: float32 [Hv, Dv, Dk] (row j of a head = column j of the reference's
// [Dk, Dv] matrix), updated in place.
struct GatedDeltaArgs {
  uint32_t T;
  uint32_t Hk;         // key heads
  uint32_t Hv;         // value heads, a multiple of Hk; value head h uses key head h / (Hv/Hk)
  uint32_t Dk;         // key head dim, <= kGdMaxDk
  uint32_t Dv;         // value head dim, <= kGdMaxDv
  uint32_t qkv_stride; // elements between token rows of qkv (q | k | v, >= 2 Hk Dk + Hv Dv)
  uint32_t z_stride;   // elements between token rows of z (>= Hv Dv)
  uint32_t ab_stride;  // elements between token rows of a and of b (>= Hv)
  float q_scale;       // Dk^-1/2 rounded to float32 by the host (the reference's np.float32(Dk ** -0.5))
  float eps;           // gated RMSNorm epsilon (rms_norm_eps)
};

// One decode token of the whole DeltaNet core, conv1d fused (gated_delta_decode):
//   xx = concat(conv_in [K-1, C], x [C]);  qkv[c] = silu(sum_j w[c, j] xx[j, c]) (rounded to T)
//   conv_out = xx[1 .. K-1]  (a different buffer from conv_in: the engine's parity pair)
//   then the rule of GatedDeltaArgs on q | k | v = qkv; o (before the gated RMSNorm) in fp32
//   scratch, which gd_chunk_norm (GdChunkArgs, T = Tp = 1) normalises in a second dispatch.
// Grid (col_blocks, Hv): threadgroup (blk, h) owns value columns [blk * cols, blk * cols + cols).
struct GdDecodeArgs {
  uint32_t Hk, Hv, Dk, Dv;
  uint32_t C;           // conv channels 2 Hk Dk + Hv Dv (row length of the conv state)
  uint32_t K;           // conv kernel size, <= kConvMaxKernel
  uint32_t cols;        // value columns per threadgroup = simdgroups * kGdDecodeColsPerSimd
  uint32_t col_blocks;  // threadgroups per value head = ceil(Dv / cols)
  uint32_t vec4;        // 1: state columns are 16-byte aligned rows of Dk % 4 == 0 floats (float4 loads)
  float q_scale;        // Dk^-1/2 rounded to float32
};

}  // namespace lily

namespace lily {

// ---- chunked (WY) prefill of the gated delta rule (shaders/gated_delta_chunk.metal) ----------
enum : uint32_t {
  kGdChunk = 64,              // tokens per chunk
  kGdChunkMinTokens = 64,     // route: T >= this (and Dk, Dv multiples of 8) -> chunked, else the scan
  kGdChunkWyThreads = 256,    // gd_chunk_wy: 8 simdgroups per (chunk, value head)
  kGdChunkStateCols = 8,      // gd_chunk_state: value columns per threadgroup (one simdgroup)
  kGdChunkMaxTiles = 16,      // Dk / 8 and Dv / 8 at most (head dims <= 128)
  kGdChunkM5StepK = 32,       // gd_chunk_wy_m5: key dims per matmul2d step of the Gram products
  kGdChunkM5StateCols = 32,   // gd_chunk_state_m5: value columns per threadgroup (8 per simdgroup)
  kGdChunkM5StateThreads = 128,  // gd_chunk_state_m5: 4 simdgroups
};

// Scratch (float32, sections of one buffer, rows padded to Tp = ceil(T / 64) * 64 with zeros;
// offsets in elements from gd_chunk_offsets on the host):
//   qn [Hk, Tp, Dk]  l2-normalised q * Dk^-1/2          kn [Hk, Tp, Dk]  l2-normalised k
//   vo [Hv, Tp, Dv]  v (prep) then the raw outputs o (state pass)
//   g  [Hv, Tp]      log decay (prep) then its within-chunk cumulative sum G (wy)
//   beta [Hv, Tp]
//   wn [Hv, Tp, Dk]  -W = -T diag(beta e^G) K per chunk      u [Hv, Tp, Dv]  T diag(beta) V
//   p  [Hv, Tp, 64]  (Q K^T) o exp(G_i - G_j), lower triangle (j <= i) of each chunk
struct GdChunkArgs {
  uint32_t T;           // tokens
  uint32_t Tp;          // T rounded up to a multiple of kGdChunk
  uint32_t Hk, Hv, Dk, Dv;
  uint32_t qkv_stride;  // prep: elements between token rows of qkv
  uint32_t ab_stride;   // prep: elements between token rows of a and b
  uint32_t z_stride;    // norm: elements between token rows of z
  float q_scale;        // Dk^-1/2 rounded to float32 (as GatedDeltaArgs)
  float eps;            // gated RMSNorm epsilon
  uint32_t conv_k;      // gd_chunk_prep_conv: conv kernel size K (<= kConvMaxKernel); 0 elsewhere
};

}  // namespace lily
