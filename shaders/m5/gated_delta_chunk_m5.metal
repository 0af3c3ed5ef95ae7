// The chunked delta rule's WY kernel with its two Gram products on Metal 4 tensor ops (M5 path):
// gd_chunk_wy_m5 replaces gd_chunk_wy_f32 (shaders/gated_delta_chunk.metal) when the device
// reports tensor ops; same buffers, args, grid and outputs; the other three kernels of the route
// (prep, state, norm) keep their buffers; gd_chunk_state_m5 below replaces gd_chunk_state_f32. Host: csrc/gpu/ops/gated_delta.cpp. Compiled with
// -std=metal4.0 into lily_m5.metallib, by the emulator, and by the strict pass against
// csrc/emu/tensor_ops_strict.h. Reference: the chunked form of lily_py.reference.gated_delta with
// q and k rounded to half in the two Gram products (tests/kernels/test_gated_delta_chunk_m5.py).
//
//   grid:     (Tp / 64, Hv) threadgroups of kGdChunkWyThreads = 256 threads (8 simdgroups)
//   1 G = cumsum(g) (one thread), b of the chunk -> threadgroup
//   2 per step of 32 key dims (zeros past Dk): thread t rounds K[t / 4, k0 + 8 (t % 4) .. + 8] and
//     the same coordinates of Q to half into threadgroup memory; barrier; K K^T and Q K^T in
//     eight 32 x 32 quarters, one per simdgroup (execution_simdgroup; why: docs/tensor-ops.md,
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
// accumulation fp32. The solve, u and wn stay fp32 (they are the WY factors). The state pass
// (gd_chunk_state_m5, below) rounds S, W, U and diag(tail) K to half as operands of its products
// and keeps the state itself fp32.
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

// ---------------------------------------------------------------------------------------------
// gd_chunk_state_m5: gd_chunk_state with every product of the chunk on tensor ops: the output
// O = diag(e^G) Q S + P U and the state feedback U = u + W S, S = e^{G_C} S + K^T diag(tail) U.
// The state stays fp32 (a cooperative tensor, accumulated by matmul2d in fp32 across chunks); its
// products take half copies of S, W, U and diag(tail) K (as FLA's chunked kernels take bf16
// copies of the state: docs/kernels-deltanet.md, "Chunked delta rule (prefill)", precision).
//   grid:      (ceil(Dv / 32), Hv) threadgroups of 128 threads; value columns c0 = 32 x .. + 32 (none
//              past Dv: their S, U and Sh stay zero, their outputs are not written)
//   state:     simdgroup s holds S[32 s .. + 32][c0 .. + 32] (key dims past Dk stay zero) in the fp32
//              cooperative destination of op_ks; Sh = half(S) [128][32] in threadgroup memory
//   per chunk (every op on one simdgroup, execution_simdgroup: docs/tensor-ops.md, "Execution scope and
//              tile shape"; op16 = matmul2d_descriptor(16, 32, dynamic_extent, false, false, false,
//              multiply_accumulate): k from the operands, Dk for W Sh and Q Sh, 64 for P Uh):
//              1 threads < 64: e^{G_t}, exp(G_C - G_t) -> eg; simdgroup s, tokens r0 = 16 s .. + 16:
//                W's 16 rows rounded to half into its stage; U = u + Wh Sh (op16, into a
//                cooperative tensor initialised from u); half(U) -> Uh [64][32];
//                O = Q Sh (op16, Q the prep's half q in device memory); barrier
//              2 simdgroup s: O = diag(e^G) O + P Uh (op16 again, k = 64: P's 64 columns)
//                -> vo; its stage refilled with half(diag(tail) K)[64][32 s .. + 32] (packed,
//                transposed operand); S = e^{G_C} S + Kh^T Uh (op_ks =
//                matmul2d_descriptor(32, 32, 64, true, false, false, multiply_accumulate));
//                half(S) -> its rows of Sh; barrier
//   threadgroup memory: Sh 8,192 + Uh 4,096 + 4 stages x 4,096 (W, then K) + eg 512 = 29,184 bytes;
//              2 threadgroup barriers per chunk (+1 before the first)
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
  constexpr uint32_t C = kGdChunk, NC = kGdChunkM5StateCols, DK = 8 * kGdChunkMaxTiles;
  constexpr uint32_t OR = C / 4, SR = DK / 4;  // output tokens and state key dims per simdgroup
  static_assert(C == 64 && NC == 32 && DK == 128 && kGdChunkM5StateThreads == 128,
                "the descriptors below assume 64-token chunks, 32 value columns, Dk <= 128, 4 simdgroups");
  LILY_TG_ARRAY(half, sh, [DK * NC]);      // S rounded to half [key dim][column]
  LILY_TG_ARRAY(half, uh, [C * NC]);       // U rounded to half [token][column]
  LILY_TG_ARRAY(half, stage, [4][C * SR]); // per simdgroup: W [16][Dk], then diag(tail) K [64][32]
  LILY_TG_ARRAY(float, eg, [2][C]);        // e^{G_t}, exp(G_C - G_t)
  const uint32_t h = group_pos.y, tid = thread_pos.x;
  const uint32_t c0 = group_pos.x * NC, r0 = OR * simd_id, k0 = SR * simd_id;
  const uint32_t Dk = args.Dk, Dv = args.Dv, kh = h / (args.Hv / args.Hk);
  device float* st = state + uint64_t(h) * Dv * Dk;  // [Dv][Dk]

  // K from the operands (dynamic): their key extent is Dk (64 or 128), not the staging's DK.
  constexpr auto desc16 = matmul2d_descriptor(int(OR), int(NC), static_cast<int>(dynamic_extent), false, false, false,
                                              matmul2d_descriptor::mode::multiply_accumulate);
  constexpr auto desc_ks = matmul2d_descriptor(int(SR), int(NC), int(C), true, false, false,
                                               matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc16, execution_simdgroup> op16;
  matmul2d<desc_ks, execution_simdgroup> op_ks;
  auto sh_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(sh, dextents<int32_t, 2>(int(NC), int(Dk)));
  auto uh_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(uh, dextents<int32_t, 2>(int(NC), int(C)));
  auto wh_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(stage[simd_id], dextents<int32_t, 2>(int(Dk), int(OR)));
  auto kh_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(stage[simd_id], dextents<int32_t, 2>(int(SR), int(C)));

  // S from device (state^T), zero past Dk and Dv; its half copy into Sh.
  auto S = op_ks.template get_destination_cooperative_tensor<decltype(kh_t), decltype(uh_t), float>();
  for (uint16_t i = 0; i < S.get_capacity(); ++i) {
    if (!S.is_valid_element(i)) continue;
    const auto idx = S.get_multidimensional_index(i);
    const uint32_t col = uint32_t(idx[0]), r = k0 + uint32_t(idx[1]);
    S[i] = (r < Dk && c0 + col < Dv) ? st[uint64_t(c0 + col) * Dk + r] : 0.0f;
    sh[r * NC + col] = half(S[i]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // Sh -> every simdgroup's products

  for (uint32_t c = 0; c * C < args.T; ++c) {
    const uint64_t t0 = uint64_t(c) * C;
    const uint64_t gh = uint64_t(h) * args.Tp + t0;
    const float G_last = float(G[gh + C - 1]);
    if (tid < C) {  // 1
      const float Gi = float(G[gh + tid]);
      eg[0][tid] = exp(Gi);
      eg[1][tid] = exp(G_last - Gi);
    }
    for (uint32_t row = 0; row < OR; ++row)
      for (uint32_t k = lane; k < Dk; k += 32) stage[simd_id][row * Dk + k] = half(wn[(gh + r0 + row) * Dk + k]);
    simdgroup_barrier(mem_flags::mem_threadgroup);  // this simdgroup's W rows -> its op
    auto U = op16.template get_destination_cooperative_tensor<decltype(wh_t), decltype(sh_t), float>();
    for (uint16_t i = 0; i < U.get_capacity(); ++i) {
      if (!U.is_valid_element(i)) continue;
      const auto idx = U.get_multidimensional_index(i);
      const uint32_t col = uint32_t(idx[0]), row = r0 + uint32_t(idx[1]);
      U[i] = c0 + col < Dv ? float(u[(gh + row) * Dv + c0 + col]) : 0.0f;
    }
    op16.run(wh_t, sh_t, U);
    for (uint16_t i = 0; i < U.get_capacity(); ++i) {
      if (!U.is_valid_element(i)) continue;
      const auto idx = U.get_multidimensional_index(i);
      uh[(r0 + uint32_t(idx[1])) * NC + uint32_t(idx[0])] = half(U[i]);
    }
    auto q_t = tensor<device half, dextents<int32_t, 2>, tensor_inline>(qn + (uint64_t(kh) * args.Tp + t0 + r0) * Dk,
                                                                         dextents<int32_t, 2>(int(Dk), int(OR)));
    auto p_t = tensor<device half, dextents<int32_t, 2>, tensor_inline>(p + (gh + r0) * C, dextents<int32_t, 2>(int(C), int(OR)));
    auto O = op16.template get_destination_cooperative_tensor<decltype(q_t), decltype(sh_t), float>();
    for (uint16_t i = 0; i < O.get_capacity(); ++i)
      if (O.is_valid_element(i)) O[i] = 0.0f;
    op16.run(q_t, sh_t, O);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // Uh, eg -> 2; every read of Sh done

    for (uint16_t i = 0; i < O.get_capacity(); ++i) {  // 2
      if (!O.is_valid_element(i)) continue;
      O[i] *= eg[0][r0 + uint32_t(O.get_multidimensional_index(i)[1])];
    }
    op16.run(p_t, uh_t, O);
    for (uint16_t i = 0; i < O.get_capacity(); ++i) {
      if (!O.is_valid_element(i)) continue;
      const auto idx = O.get_multidimensional_index(i);
      const uint32_t col = uint32_t(idx[0]), row = r0 + uint32_t(idx[1]);
      if (c0 + col < Dv) vo[(gh + row) * Dv + c0 + col] = F(O[i]);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // this simdgroup's W op done -> its stage is K's
    for (uint32_t e = lane; e < C * SR; e += 32) {
      const uint32_t t = e / SR, r = k0 + e % SR;
      stage[simd_id][e] = half(r < Dk ? float(kn[(uint64_t(kh) * args.Tp + t0 + t) * Dk + r]) * eg[1][t] : 0.0f);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // this simdgroup's K rows -> its op
    const float decay = exp(G_last);
    for (uint16_t i = 0; i < S.get_capacity(); ++i)
      if (S.is_valid_element(i)) S[i] *= decay;
    op_ks.run(kh_t, uh_t, S);
    for (uint16_t i = 0; i < S.get_capacity(); ++i) {
      if (!S.is_valid_element(i)) continue;
      const auto idx = S.get_multidimensional_index(i);
      sh[(k0 + uint32_t(idx[1])) * NC + uint32_t(idx[0])] = half(S[i]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // Sh -> the next chunk; Uh, eg, reads done
  }

  for (uint16_t i = 0; i < S.get_capacity(); ++i) {
    if (!S.is_valid_element(i)) continue;
    const auto idx = S.get_multidimensional_index(i);
    const uint32_t col = uint32_t(idx[0]), r = k0 + uint32_t(idx[1]);
    if (r < Dk && c0 + col < Dv) st[uint64_t(c0 + col) * Dk + r] = S[i];
  }
}

LILY_INSTANTIATE("gd_chunk_wy_m5_f32", gd_chunk_wy_m5<float>)
LILY_INSTANTIATE("gd_chunk_state_m5_f32", gd_chunk_state_m5<float>)

}  // namespace lily
