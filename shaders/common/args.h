// Kernel argument structs: compiled by the shaders (Metal and the emulator) and by the host.
//
// One struct per kernel family, bound with setBytes at [[buffer(0)]]. Only plain 32-bit fields
// (same layout on every side). Route constants that host code and kernels must agree on live here
// as enumerators, so no number is written twice.
#pragma once
#if !defined(__METAL_VERSION__)
#include <cstdint>
#endif

namespace lily {

// ---- quantized matmul (shaders/qmm.metal, host: csrc/gpu/ops/qmm.cpp) ----------------------
enum : uint32_t {
  kQmvMaxRows = 8,        // qmv route handles M <= kQmvMaxRows rows of x per dispatch
  kQmvRows = 4,           // output features per threadgroup in qmv (every simdgroup works on all of them)
  kQmvLaneCodes = 8,      // codes of a row per lane per K block in qmv (unpacked once for every row of x)
  kQmmTileM = 32,         // qmm output tile: rows of x
  kQmmTileN = 32,         // qmm output tile: output features
  kQmmTileK = 32,         // qmm K step (must divide every supported group size)
  kQmmSimdsPerGroup = 4,  // qmm threadgroup = 4 simdgroups (2 x 2 over the 32 x 32 tile)
  // qmm_bf16 (shaders/qmm.metal, M1-M4 prefill): bf16 simdgroup-matrix tiles, fp32 accumulators
  kQmmBf16MinRows = 33,       // M >= this takes qmm_bf16 (below: qmm's 32-row tiles pad less)
  kQmmBf16TileM = 64,         // output tile: rows of x
  kQmmBf16TileN = 64,         // output tile: output features
  kQmmBf16TileK = 16,         // K step (divides every supported group size)
  kQmmBf16SimdsPerGroup = 4,  // 2 x 2 simdgroups, each a 32 x 32 quarter of the tile
  // qmm_m5 (shaders/m5/qmm_m5.metal, Metal 4 tensor ops): 4- and 8-bit weights
  kQmmM5TileM = 64,         // output tile: rows of x
  kQmmM5TileN = 64,         // output tile: output features
  kQmmM5TileK = 32,         // K step (must divide every supported group size)
  kQmmM5SimdsPerGroup = 4,  // 128 threads per threadgroup: 2 x 2 simdgroups, each one 32 x 32 matmul2d
  // Every M5 kernel's matmul2d runs on execution_simdgroup (one simdgroup per op) with outputs of
  // kTensorOpSubTile x kTensorOpSubTile per simdgroup (16 rows for the MoE 16-row tiles):
  // docs/tensor-ops.md, "Execution scope and tile shape".
  kTensorOpSubTile = 32,
  // int8 activations on the tensor ops (qmm_m5i8, moe_*_m5i8; the opt-in of docs/int8.md):
  // quantize_i8 writes x's int8 codes once per row and kI8Group columns, the consumers walk K in
  // steps of kI8StepK (one weight group: group_size % kI8StepK == 0).
  kI8Group = 32,
  kI8StepK = 64,
};

// quantize_i8 (shaders/m5/qmm_m5.metal): rows x K bf16 values (x_stride apart) into the int8
// activation scratch, laid out as (i8_codes_offset / i8_scales_offset / i8_sums_offset below):
//   codes  int8  [rows][K]          each 8-column block permuted as 0 2 4 6 1 3 5 7 (the order in
//                                   which two masks spread a word of 4-bit weight codes to bytes)
//   scales float [rows][K / 32]     s = max |x| / 127 over the 32 columns (0: all zero)
//   sums   float [rows][K / 32]     s * (the sum of the 32 codes): the dequantized values' sum
struct QuantI8Args {
  uint32_t rows;
  uint32_t K;         // multiple of kI8StepK
  uint32_t x_stride;  // elements between rows of x (>= K)
};
inline uint32_t i8_scales_offset(uint32_t rows, uint32_t K) { return rows * K; }  // bytes
inline uint32_t i8_sums_offset(uint32_t rows, uint32_t K) { return rows * K + rows * (K / kI8Group) * 4u; }
// (its size: ops::qmm_i8_scratch_bytes on the host, in 64 bits: the host checks it fits 32)

// qmv1 (single token, shaders/qmm.metal): y[N] = dequant(w)[N, K] @ f(x), with f(x) = x, or an
// RMSNorm fused in front: f(x) = rmsnorm(h) * norm_w, h = x (+ residual). Threadgroup = R rows x
// `splits` simdgroups that split K into 16-byte-per-lane blocks. R (compile time: the accumulators
// stay in registers) is kQmv1Rows, or 1 (the *_r1 kernels) when ceil(N / kQmv1Rows) * splits
// simdgroups would fall short of kQmv1MinSimdgroups (qmv1_rows in csrc/gpu/ops/qmm.cpp). Where the
// rows alone give kQmv1OneSplitGroups threadgroups (4 x 1280, N > 40,952: lm_head's 31,040) K is not split:
// one simdgroup walks the row's K, with no threadgroup reduction, over kQmv1WideRows rows at 4 and
// 8 bits (the *_r16 kernels: x's per-block loads, conversions and the norm's sum of squares done
// once per 16 rows, not 8). Each lane loads its rows' codes, scales and biases in batches of
// kQmv1LoadBatch before their dot products: that many independent 16-byte loads in flight.
enum : uint32_t {
  kQmv1Rows = 8,       // output rows per threadgroup (every simdgroup works on all of them)
  kQmv1MinSimdgroups = 1024,  // 25.6 simdgroups per core on a 40-core GPU: out_proj's 256 x 4 keeps 8 rows
  kQmv1MaxSplits = 4,  // simdgroups per threadgroup (K split): min(this, K / block)
  kQmv1OneSplitGroups = 4 * 1280,  // threadgroups (N / kQmv1Rows) from which K is not split (lm_head)
  kQmv1WideRows = 16,  // rows per threadgroup where K is not split, at 4 and 8 bits (lm_head)
  kQmv1LoadBatch = 8,  // rows whose codes qmv1 loads before their dot products (loads in flight)
  kQmv1Norm = 1u,      // flags: RMSNorm in front (norm_w, eps); y = rsqrt(mean(h^2) + eps) * (w . (h * norm_w))
  kQmv1Residual = 2u,  // flags: h = round_T(x + residual)
  kQmv1Side = 4u,      // flags: threadgroup 0 also writes h_out = h and xn_out = rmsnorm(h) * norm_w
};

struct Qmv1Args {
  uint32_t N;           // rows of w / outputs
  uint32_t K;           // multiple of group_size
  uint32_t group_shift; // log2(group_size): 5, 6 or 7
  uint32_t flags;       // kQmv1Norm | kQmv1Residual | kQmv1Side
  float eps;            // RMSNorm epsilon (flags & kQmv1Norm)
};

// qmv1_gated (shaders/qmm.metal): a DeltaNet layer's out_proj at one token with its gated RMSNorm
// folded in front. x is the delta rule's raw output o [K = Hv * Dv] (float); the product is taken
// with x_j = round_T(o_j * rsqrt(|o_h|^2 / Dv + eps) * norm_w[j % Dv] * silu(z_j)) (h: j's head),
// gd_chunk_norm's row up to the order of the |o_h|^2 sum. A lane's block of V codes lies in one head: Dv = head_lanes * V,
// head_lanes a power of two <= 32 (ops::qmv1_gated_supported).
struct Qmv1GatedArgs {
  uint32_t N;           // rows of w / outputs
  uint32_t K;           // Hv * Dv, a multiple of group_size
  uint32_t group_shift; // log2(group_size)
  uint32_t Dv;          // value head dim (a power of two)
  uint32_t head_lanes;  // lanes of a simdgroup per head: Dv / V
  float eps;            // the gated RMSNorm's epsilon
};

// y[M, N] = x[M, K] @ dequant(w)[N, K]^T ; w uint32 [N, K*bits/32], scales/biases [N, K/group_size]
struct QmmArgs {
  uint32_t M;           // rows of x / y
  uint32_t N;           // output features (rows of w)
  uint32_t K;           // input features; multiple of group_size
  uint32_t group_size;  // 32, 64 or 128
  uint32_t x_stride;    // elements between rows of x (>= K)
  uint32_t y_stride;    // elements between rows of y (>= N)
};

// ---- RMSNorm (shaders/norm.metal, host: csrc/gpu/ops/norm.cpp) ---------------------------------
enum : uint32_t {
  kNormMaxThreads = 1024,  // one threadgroup per row, at most this many threads
};

// y = h * rsqrt(mean(h^2) + eps) * (weight + weight_offset), per row of D elements, where
// h = x (plain) or h = round_T(x + residual) (fused; h is also written to h_out).
struct RmsNormArgs {
  uint32_t rows;
  uint32_t D;
  float eps;
  float weight_offset;  // 0: weight is the multiplier (MLX files); 1: zero-centred (HF) weight
};

// ---- quantized embedding lookup (shaders/embedding.metal, host: csrc/gpu/ops/embedding.cpp) ----
enum : uint32_t {
  kEmbedThreads = 64,      // threads per threadgroup
  kEmbedPerThread = 8,     // consecutive values each thread dequantizes
};

// out[t, :] = dequant(table[ids[t], :]); ids outside [0, vocab) give a row of NaN.
struct EmbeddingArgs {
  uint32_t tokens;
  uint32_t vocab;
  uint32_t D;
  uint32_t group_size;
};

// ---- elementwise (shaders/elementwise.metal, host: csrc/gpu/ops/elementwise.cpp) -------------
enum : uint32_t {
  kElementwiseThreads = 256,
};

// swiglu:      y[r, c] = silu(a[r, c]) * b[r, c]
// sigmoid_mul: y[r, c] = a[r, c] * sigmoid(b[r, c * b_col_step])   (b_col_step 0: one gate per row)
struct ElementwiseArgs {
  uint32_t rows;
  uint32_t cols;
  uint32_t a_stride;    // elements between rows of a
  uint32_t b_stride;    // elements between rows of b
  uint32_t y_stride;    // elements between rows of y
  uint32_t b_col_step;  // 1, or 0 to broadcast b[r, 0] along the row
};

}  // namespace lily
#include "common/args_gated_delta.h"  // Gated DeltaNet (conv1d, gated_delta)

#include "common/args_moe.h"  // mixture of experts (shaders/moe_*.metal)

#include "common/args_attention.h"  // attention family: rope, qk norm, KV cache, decode/prefill

#include "common/args_sampling.h"  // argmax / sampling (shaders/sampling*.metal)
