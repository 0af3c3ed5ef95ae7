// Helpers shared by the chunked delta rule's kernels on the simdgroup path
// (shaders/gated_delta_chunk.metal) and on the M5 tensor-op path (shaders/m5/gated_delta_chunk_m5.metal):
// the 8x8 fp32 simdgroup products over one 64-token chunk and the WY steps that follow the Gram
// matrix A (forward substitution, u, wn). Algebra: the header of shaders/gated_delta_chunk.metal.
#pragma once

#include "common/lily_metal.h"

namespace lily {

// C = A B over one chunk, A [64, 64] lower triangular in threadgroup memory (leading dim 64),
// B [64, ncols] rows `ldb` apart in device memory, C to device memory (leading dim ldb); simdgroup
// s of `simds` computes the 8-wide column tiles s, s + simds, ... (tile row i needs k tiles <= i).
inline void gdc_lower_times(const threadgroup float* A, const device float* B, device float* C, uint32_t ldb,
                            uint32_t col_tiles, uint32_t simd_id, uint32_t simds) {
  for (uint32_t ct = simd_id; ct < col_tiles; ct += simds) {
    for (uint32_t i = 0; i < kGdChunk / 8; ++i) {
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint32_t j = 0; j <= i; ++j) {
        simdgroup_float8x8 at;
        simdgroup_float8x8 bt;
        simdgroup_load(at, A + (8 * i) * kGdChunk + 8 * j, ulong(kGdChunk), ulong2(0), false);
        simdgroup_load(bt, B + uint64_t(8 * j) * ldb + 8 * ct, ulong(ldb), ulong2(0), false);
        simdgroup_multiply_accumulate(acc, at, bt, acc);
      }
      simdgroup_store(acc, C + uint64_t(8 * i) * ldb + 8 * ct, ulong(ldb), ulong2(0), false);
    }
  }
}

// M[i, j] = X_i . Y_j for the 36 lower-triangle 8x8 tiles (j <= i) of a chunk; X, Y [64, Dk] rows
// Dk apart in device memory; M [64, 64] in threadgroup memory. Upper tiles are left untouched.
inline void gdc_lower_gram(const device float* X, const device float* Y, threadgroup float* M, uint32_t Dk,
                           uint32_t simd_id, uint32_t simds) {
  for (uint32_t tile = simd_id; tile < 36; tile += simds) {
    uint32_t i = 0;  // tile -> (i, j), j <= i, row by row
    while ((i + 1) * (i + 2) / 2 <= tile) ++i;
    const uint32_t j = tile - i * (i + 1) / 2;
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint32_t r = 0; r < Dk / 8; ++r) {
      simdgroup_float8x8 xt;
      simdgroup_float8x8 yt;
      simdgroup_load(xt, X + uint64_t(8 * i) * Dk + 8 * r, ulong(Dk), ulong2(0), false);
      simdgroup_load(yt, Y + uint64_t(8 * j) * Dk + 8 * r, ulong(Dk), ulong2(0), true);
      simdgroup_multiply_accumulate(acc, xt, yt, acc);
    }
    simdgroup_store(acc, M + (8 * i) * kGdChunk + 8 * j, ulong(kGdChunk), ulong2(0), false);
  }
}

// Steps 4 - 8 of gd_chunk_wy (both paths), after M holds A = b_i exp(G_i - G_j) k_i.k_j in its
// strictly lower triangle (anything in the upper triangle and on the diagonal is overwritten):
//   4 T by forward substitution: thread c < 64 owns column c of T and stores T[i, c] (i > c) at
//     M[c, i] (the upper triangle), reading A[i, j] = M[i, j] (j < i) and its own T[j, c] only:
//     no thread reads what another writes
//   5 M = T diag(b) (lower, the upper zeroed)                  6 u = M V -> device
//   7 M = M diag(-e^G)                                         8 wn = M K -> device
// Call after a threadgroup barrier that orders the writes of A; it has a barrier between the
// steps, none after step 8 (M is still read there). kGdChunkWyThreads threads.
inline void gdc_wy_factors(threadgroup float* M, const threadgroup float* Gs, const threadgroup float* bs,
                           const device float* Kc, const device float* Vc, device float* uc, device float* wnc,
                           uint32_t Dk, uint32_t Dv, uint32_t tid, uint32_t simd_id) {
  constexpr uint32_t C = kGdChunk;
  constexpr uint32_t simds = kGdChunkWyThreads / 32;
  if (tid < C) {  // 4
    const uint32_t c = tid;
    for (uint32_t i = c + 1; i < C; ++i) {
      float acc = -M[i * C + c];
      for (uint32_t j = c + 1; j < i; ++j) acc -= M[i * C + j] * M[c * C + j];
      M[c * C + i] = acc;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t e = tid; e < C * C; e += kGdChunkWyThreads) {  // 5 (each pair i > j by one thread)
    const uint32_t i = e / C, j = e % C;
    if (i > j) {
      const float tij = M[j * C + i];
      M[i * C + j] = tij * bs[j];
      M[j * C + i] = 0.0f;
    } else if (i == j) {
      M[e] = bs[i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  gdc_lower_times(M, Vc, uc, Dv, Dv / 8, simd_id, simds);  // 6
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t e = tid; e < C * C; e += kGdChunkWyThreads) M[e] *= -exp(Gs[e % C]);  // 7
  threadgroup_barrier(mem_flags::mem_threadgroup);
  gdc_lower_times(M, Kc, wnc, Dk, Dk / 8, simd_id, simds);  // 8
}

}  // namespace lily
