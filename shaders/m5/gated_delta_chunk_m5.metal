// The chunked delta rule's WY kernel with its two Gram products on Metal 4 tensor ops (M5 path):
// gd_chunk_wy_m5 replaces gd_chunk_wy_f32 (shaders/gated_delta_chunk.metal) when the device
// reports tensor ops; same buffers, args, grid and outputs; the other three kernels of the route
// (prep, state, norm) are unchanged. Host: csrc/gpu/ops/gated_delta.cpp. Compiled with
// -std=metal4.0 into lily_m5.metallib, by the emulator, and by the strict pass against
// csrc/emu/tensor_ops_strict.h. Reference: the chunked form of lily_py.reference.gated_delta with
// q and k rounded to half in the two Gram products (tests/kernels/test_gated_delta_chunk_m5.py).
//
//   grid:     (Tp / 64, Hv) threadgroups of kGdChunkWyThreads = 256 threads (8 simdgroups)
//   1 G = cumsum(g) (one thread), b of the chunk -> threadgroup
//   2 per step of 32 key dims (zeros past Dk): thread t rounds K[t / 4, k0 + 8 (t % 4) .. + 8] and
//     the same coordinates of Q to half into threadgroup memory; barrier; K K^T and Q K^T in
//     eight 32 x 32 quarters, one per simdgroup (execution_simdgroup; why: docs/metal.md,
//     "Execution scope and tile shape"): simdgroup s multiplies quarter s % 4 (rows 32 (q / 2),
//     columns 32 (q % 2)) of K K^T (s < 4) or Q K^T (s >= 4) with matmul2d_descriptor(32, 32, 32,
//     false, transpose_right = true, false, multiply_accumulate) into its fp32 cooperative
//     tensor; barrier
//   3 A = b_i exp(G_i - G_j) (K K^T)_ij, j < i: the K K^T simdgroups write their cooperative
//     elements to M (64 x 64 fp32, threadgroup); G -> g; barrier
//   4 - 8 the fp32 simdgroup steps of gd_chunk_wy (common/gated_delta_chunk.h): T by forward
//     substitution, u = T diag(b) V, wn = -T diag(b e^G) K
//   10 p_ij = exp(G_i - G_j) (Q K^T)_ij for j <= i, else 0, from the Q K^T simdgroups'
//     cooperative elements straight to device memory (no threadgroup round trip)
//   threadgroup memory: M 16,384 + K, Q steps 2 x 64 x 32 half (8,192) + G, b 512 = 25,088 bytes
// Precision: the Gram operands are half (the half x half -> float row of Apple's matmul2d types):
// q and k are L2-normalised (|k| <= 1, |q| <= Dk^-1/2), so each element rounds with relative error
// <= 2^-11 (absolute <= 2^-25 below half's normal range) and each Gram entry moves by at most
// (2^-10 + 2^-22) |q_i| |k_j| (<= 2^-10 for K K^T, <= 2^-10 Dk^-1/2 for Q K^T) plus the fp32 sum;
// accumulation fp32. The solve, u, wn, the state pass and the DeltaNet state stay fp32: those
// products carry the state or the WY factors, whose rounding would feed back into the state.
#include "common/lily_metal.h"
#include "common/gated_delta_chunk.h"
#include "common/tensor_ops.h"

namespace lily {

template <typename F>
[[kernel]] void gd_chunk_wy_m5(constant GdChunkArgs& args [[buffer(0)]],
                               const device half* qn [[buffer(1)]],
                               const device F* kn [[buffer(2)]],
                               const device F* vo [[buffer(3)]],
                               device F* g [[buffer(4)]],
                               const device F* beta [[buffer(5)]],
                               device F* wn [[buffer(6)]],
                               device F* u [[buffer(7)]],
                               device half* p [[buffer(8)]],
                               LILY_KERNEL_TAIL) {
  constexpr uint32_t C = kGdChunk, BK = kGdChunkM5StepK;
  static_assert(C == 64 && BK == 32 && kGdChunkWyThreads == 256,
                "the staging map and descriptor below assume 64-token chunks, 32-wide steps, 256 threads");
  LILY_TG_ARRAY(float, M, [C * C]);
  LILY_TG_ARRAY(half, ks, [C * BK]);  // K step [token][dim]
  LILY_TG_ARRAY(half, qs, [C * BK]);  // Q step [token][dim]
  LILY_TG_ARRAY(float, Gs, [C]);
  LILY_TG_ARRAY(float, bs, [C]);
  const uint32_t chunk = group_pos.x, h = group_pos.y, tid = thread_pos.x;
  const uint32_t Dk = args.Dk, Dv = args.Dv, kh = h / (args.Hv / args.Hk);
  const uint64_t t0 = uint64_t(chunk) * C;
  const device F* Kc = kn + (uint64_t(kh) * args.Tp + t0) * Dk;
  const device half* Qc = qn + (uint64_t(kh) * args.Tp + t0) * Dk;
  const uint64_t gh = uint64_t(h) * args.Tp + t0;

  if (tid == 0) {  // 1
    float acc = 0.0f;
    for (uint32_t i = 0; i < C; ++i) {
      acc += float(g[gh + i]);
      Gs[i] = acc;
    }
  }
  if (tid < C) bs[tid] = float(beta[gh + tid]);

  constexpr uint32_t SUB = kTensorOpSubTile;
  static_assert(SUB == 32 && kGdChunkWyThreads / 32 == 2 * (C / SUB) * (C / SUB), "one 32 x 32 quarter per simdgroup");
  const bool gram_q = simd_id >= 4;  // uniform over the simdgroup: Q K^T (else K K^T)
  const uint32_t qr0 = ((simd_id % 4) / 2) * SUB, qc0 = (simd_id % 2) * SUB;  // its quarter
  constexpr auto desc = matmul2d_descriptor(int(SUB), int(SUB), int(BK), false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> op;
  auto l_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>((gram_q ? qs : ks) + qr0 * BK,
                                                                           dextents<int32_t, 2>(int(BK), int(SUB)));
  auto r_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(ks + qc0 * BK, dextents<int32_t, 2>(int(BK), int(SUB)));
  auto acc = op.template get_destination_cooperative_tensor<decltype(l_t), decltype(r_t), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) acc[i] = 0.0f;
  const uint32_t row = tid / 4, c0 = (tid % 4) * 8;  // this thread's staging coordinates
  for (uint32_t k0 = 0; k0 < Dk; k0 += BK) {  // 2
    for (uint32_t c = 0; c < 8; ++c) {
      const uint32_t d = k0 + c0 + c;
      ks[row * BK + c0 + c] = d < Dk ? half(float(Kc[uint64_t(row) * Dk + d])) : half(0.0f);
      qs[row * BK + c0 + c] = d < Dk ? Qc[uint64_t(row) * Dk + d] : half(0.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(l_t, r_t, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step overwrites ks, qs
  }

  for (uint16_t i = 0; !gram_q && i < acc.get_capacity(); ++i) {  // 3 (upper triangle, diagonal: step 4 overwrites)
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    const uint32_t j = qc0 + uint32_t(idx[0]), r = qr0 + uint32_t(idx[1]);
    M[r * C + j] = j < r ? bs[r] * exp(Gs[r] - Gs[j]) * acc[i] : acc[i];
  }
  if (tid < C) g[gh + tid] = F(Gs[tid]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  gdc_wy_factors(M, Gs, bs, Kc, vo + (uint64_t(h) * args.Tp + t0) * Dv, u + (uint64_t(h) * args.Tp + t0) * Dv,
                 wn + (uint64_t(h) * args.Tp + t0) * Dk, Dk, Dv, tid, simd_id);  // 4 - 8
  for (uint16_t i = 0; gram_q && i < acc.get_capacity(); ++i) {  // 10
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    const uint32_t j = qc0 + uint32_t(idx[0]), r = qr0 + uint32_t(idx[1]);
    p[gh * C + r * C + j] = half(j <= r ? exp(Gs[r] - Gs[j]) * acc[i] : 0.0f);
  }
}

// Rounds the 8x8 fp32 tile x to half into dst (rows `ld` apart), through this simdgroup's 8x8
// float stage in threadgroup memory (MSL gives no per-lane access to a simdgroup matrix's
// elements): store, simdgroup barrier, lane l converts elements 2l and 2l + 1, simdgroup barrier.
inline void gdc_m5_tile_to_half(simdgroup_float8x8 x, threadgroup float* stage, threadgroup half* dst, uint32_t ld,
                                uint32_t lane) {
  simdgroup_store(x, stage, ulong(8), ulong2(0), false);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t e = 2 * lane; e < 2 * lane + 2; ++e) dst[(e / 8) * ld + e % 8] = half(stage[e]);
  simdgroup_barrier(mem_flags::mem_threadgroup);
}

// ---------------------------------------------------------------------------------------------
// gd_chunk_state_m5: gd_chunk_state with the chunk's output O = diag(e^G) Q S + P U on tensor ops;
// the state and everything that feeds it back stays on fp32 simdgroup matrices.
//   grid:      (ceil(Dv / 32), Hv) threadgroups of 128 threads: simdgroup s owns the value columns
//              j0 = 32 x + 8 s .. + 8 (none past Dv: its columns of Sh and Uh stay zero), S [Dk, 8]
//              in registers as in gd_chunk_state
//   per chunk: 1 e^{G_i}, exp(G_C - G_i) as diagonal tiles (two copies alternate by parity); barrier
//              2 each simdgroup: U = u + W S (fp32 8x8, W = wn), then S and U rounded to half into
//                Sh [128][32] and Uh [64][32] (its 8 columns); barrier
//              3 simdgroup s: tokens 16 s .. + 16 of the output, one simdgroup per op
//                (execution_simdgroup; docs/metal.md, "Execution scope and tile shape"):
//                O1 = Q Sh: matmul2d_descriptor(16, 32, 128, false, false, false, multiply), Q's
//                16 rows [16][Dk] half read from device (prep q16; key dims past Dk read 0 by the
//                tensor's extents) into its rows of a threadgroup float tensor [64][32];
//                O2 = P Uh: matmul2d_descriptor(16, 32, 64, ..., multiply) into an fp32
//                cooperative tensor, P's 16 rows [16][64] half from device (gd_chunk_wy_m5);
//                barrier
//              4 each thread: o = O2 + e^{G_row} O1[row][col] for its cooperative elements -> vo
//              5 each simdgroup: U = diag(exp(G_C - G_j)) U, S = e^{G_C} S + K^T U (fp32 8x8)
//   threadgroup memory: diag 8,192 + Sh 8,192 + Uh 4,096 + O1 8,192 + 4 x 8 x 8 floats 1,024 =
//              29,696 bytes; 3 threadgroup barriers per chunk
//   buffers:   as gd_chunk_state (1 qn half, 6 p half; not written, non-const for the tensor type)
template <typename F>
[[kernel]] void gd_chunk_state_m5(constant GdChunkArgs& args [[buffer(0)]],
                                  device half* qn [[buffer(1)]],
                                  const device F* kn [[buffer(2)]],
                                  const device F* G [[buffer(3)]],
                                  const device F* wn [[buffer(4)]],
                                  const device F* u [[buffer(5)]],
                                  device half* p [[buffer(6)]],
                                  device float* state [[buffer(7)]],
                                  device F* vo [[buffer(8)]],
                                  LILY_KERNEL_TAIL) {
  constexpr uint32_t C = kGdChunk, CT = kGdChunk / 8, MT = kGdChunkMaxTiles, NC = kGdChunkM5StateCols;
  constexpr uint32_t DK = 8 * kGdChunkMaxTiles;
  static_assert(C == 64 && NC == 32 && DK == 128 && kGdChunkM5StateThreads == 128,
                "the descriptors below assume 64-token chunks, 32 value columns, Dk <= 128, 4 simdgroups");
  LILY_TG_ARRAY(float, diag, [2][2 * CT][64]);  // [parity][e^G tiles | tail tiles][8 x 8]
  LILY_TG_ARRAY(half, sh, [DK * NC]);           // S rounded to half [key dim][column]
  LILY_TG_ARRAY(half, uh, [C * NC]);            // U rounded to half [token][column]
  LILY_TG_ARRAY(float, o1, [C * NC]);           // Q S [token][column]
  LILY_TG_ARRAY(float, stage, [4][64]);         // per simdgroup: one 8x8 tile on its way to half
  const uint32_t h = group_pos.y, tid = thread_pos.x;
  const uint32_t c0 = group_pos.x * NC, j0 = c0 + 8 * simd_id;
  const uint32_t Dk = args.Dk, Dv = args.Dv, kh = h / (args.Hv / args.Hk), nk = Dk / 8;
  const bool live = j0 < Dv;  // uniform over the simdgroup
  device float* st = state + uint64_t(h) * Dv * Dk + uint64_t(j0) * Dk;

  for (uint32_t e = tid; e < 2 * 2 * CT * 64; e += kGdChunkM5StateThreads)
    diag[e / (2 * CT * 64)][(e / 64) % (2 * CT)][e % 64] = 0.0f;
  for (uint32_t e = lane; e < DK * 8; e += 32) sh[(e / 8) * NC + 8 * simd_id + e % 8] = half(0.0f);
  for (uint32_t e = lane; e < C * 8; e += 32) uh[(e / 8) * NC + 8 * simd_id + e % 8] = half(0.0f);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // zeros -> the per-chunk writes

  simdgroup_float8x8 S[MT];
  for (uint32_t r = 0; r < MT; ++r) {
    S[r] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    if (live && r < nk) simdgroup_load(S[r], st + 8 * r, ulong(Dk), ulong2(0), true);  // S[8r.., j0..] = state^T
  }

  constexpr uint32_t OR = C / 4;         // output tokens per simdgroup
  const uint32_t r0 = OR * simd_id;     // this simdgroup's first output token of the chunk
  constexpr auto desc_qs = matmul2d_descriptor(int(OR), int(NC), int(DK), false, false, false,
                                               matmul2d_descriptor::mode::multiply);
  constexpr auto desc_pu = matmul2d_descriptor(int(OR), int(NC), int(C), false, false, false,
                                               matmul2d_descriptor::mode::multiply);
  matmul2d<desc_qs, execution_simdgroup> op_qs;
  matmul2d<desc_pu, execution_simdgroup> op_pu;
  auto sh_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(sh, dextents<int32_t, 2>(int(NC), int(Dk)));
  auto uh_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(uh, dextents<int32_t, 2>(int(NC), int(C)));
  auto o1_t = tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline>(o1 + r0 * NC, dextents<int32_t, 2>(int(NC), int(OR)));

  for (uint32_t c = 0; c * C < args.T; ++c) {
    const uint32_t par = c & 1;
    const uint64_t t0 = uint64_t(c) * C;
    const uint64_t gh = uint64_t(h) * args.Tp + t0;
    const float G_last = float(G[gh + C - 1]);
    if (tid < C) {  // 1
      const float Gi = float(G[gh + tid]);
      diag[par][tid / 8][(tid % 8) * 9] = exp(Gi);
      diag[par][CT + tid / 8][(tid % 8) * 9] = exp(G_last - Gi);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const device F* Kc = kn + (uint64_t(kh) * args.Tp + t0) * Dk;
    const device F* Wc = wn + gh * Dk;

    simdgroup_float8x8 U[CT];
    if (live) {  // 2
      for (uint32_t i = 0; i < CT; ++i) {
        simdgroup_load(U[i], u + gh * Dv + uint64_t(8 * i) * Dv + j0, ulong(Dv), ulong2(0), false);
        for (uint32_t r = 0; r < MT; ++r) {
          if (r >= nk) break;
          simdgroup_float8x8 wt;
          simdgroup_load(wt, Wc + uint64_t(8 * i) * Dk + 8 * r, ulong(Dk), ulong2(0), false);
          simdgroup_multiply_accumulate(U[i], wt, S[r], U[i]);
        }
        gdc_m5_tile_to_half(U[i], stage[simd_id], uh + (8 * i) * NC + 8 * simd_id, NC, lane);
      }
      for (uint32_t r = 0; r < MT; ++r) {
        if (r >= nk) break;
        gdc_m5_tile_to_half(S[r], stage[simd_id], sh + (8 * r) * NC + 8 * simd_id, NC, lane);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    auto q_t = tensor<device half, dextents<int32_t, 2>, tensor_inline>(qn + (uint64_t(kh) * args.Tp + t0 + r0) * Dk,
                                                                         dextents<int32_t, 2>(int(Dk), int(OR)));
    auto p_t = tensor<device half, dextents<int32_t, 2>, tensor_inline>(p + (gh + r0) * C, dextents<int32_t, 2>(int(C), int(OR)));
    op_qs.run(q_t, sh_t, o1_t);  // 3
    auto o2 = op_pu.template get_destination_cooperative_tensor<decltype(p_t), decltype(uh_t), float>();
    op_pu.run(p_t, uh_t, o2);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint16_t i = 0; i < o2.get_capacity(); ++i) {  // 4
      if (!o2.is_valid_element(i)) continue;
      const auto idx = o2.get_multidimensional_index(i);
      const uint32_t col = uint32_t(idx[0]), row = r0 + uint32_t(idx[1]);
      if (c0 + col < Dv)
        vo[gh * Dv + uint64_t(row) * Dv + c0 + col] = F(o2[i] + diag[par][row / 8][(row % 8) * 9] * o1[row * NC + col]);
    }

    if (live) {  // 5
      for (uint32_t j = 0; j < CT; ++j) {
        simdgroup_float8x8 d;
        simdgroup_load(d, &diag[par][CT + j][0], ulong(8), ulong2(0), false);
        simdgroup_multiply(U[j], d, U[j]);
      }
      simdgroup_float8x8 decay(exp(G_last));
      for (uint32_t r = 0; r < MT; ++r) {
        if (r >= nk) break;
        simdgroup_multiply(S[r], decay, S[r]);
        for (uint32_t j = 0; j < CT; ++j) {
          simdgroup_float8x8 kt;
          simdgroup_load(kt, Kc + uint64_t(8 * j) * Dk + 8 * r, ulong(Dk), ulong2(0), true);
          simdgroup_multiply_accumulate(S[r], kt, U[j], S[r]);
        }
      }
    }
  }

  for (uint32_t r = 0; r < MT; ++r)
    if (live && r < nk) simdgroup_store(S[r], st + 8 * r, ulong(Dk), ulong2(0), true);
}

LILY_INSTANTIATE("gd_chunk_wy_m5_f32", gd_chunk_wy_m5<float>)
LILY_INSTANTIATE("gd_chunk_state_m5_f32", gd_chunk_state_m5<float>)

}  // namespace lily
