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
//     the same coordinates of Q to half into threadgroup memory; barrier; K K^T and Q K^T as
//     matmul2d_descriptor(64, 64, 32, false, transpose_right = true, false, multiply_accumulate)
//     on execution_simdgroups<8> into two fp32 cooperative tensors; barrier
//   3 A = b_i exp(G_i - G_j) (K K^T)_ij, j < i: each thread writes its cooperative elements to M
//     (64 x 64 fp32, threadgroup); G -> g; barrier
//   4 - 8 the fp32 simdgroup steps of gd_chunk_wy (common/gated_delta_chunk.h): T by forward
//     substitution, u = T diag(b) V, wn = -T diag(b e^G) K
//   10 p_ij = exp(G_i - G_j) (Q K^T)_ij for j <= i, else 0, from each thread's cooperative
//     elements straight to device memory (no threadgroup round trip)
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
                               const device F* qn [[buffer(1)]],
                               const device F* kn [[buffer(2)]],
                               const device F* vo [[buffer(3)]],
                               device F* g [[buffer(4)]],
                               const device F* beta [[buffer(5)]],
                               device F* wn [[buffer(6)]],
                               device F* u [[buffer(7)]],
                               device F* p [[buffer(8)]],
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
  const device F* Qc = qn + (uint64_t(kh) * args.Tp + t0) * Dk;
  const uint64_t gh = uint64_t(h) * args.Tp + t0;

  if (tid == 0) {  // 1
    float acc = 0.0f;
    for (uint32_t i = 0; i < C; ++i) {
      acc += float(g[gh + i]);
      Gs[i] = acc;
    }
  }
  if (tid < C) bs[tid] = float(beta[gh + tid]);

  constexpr auto desc = matmul2d_descriptor(int(C), int(C), int(BK), false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<kGdChunkWyThreads / 32>> op;
  auto k_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(ks, dextents<int32_t, 2>(int(BK), int(C)));
  auto q_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(qs, dextents<int32_t, 2>(int(BK), int(C)));
  auto kk = op.template get_destination_cooperative_tensor<decltype(k_t), decltype(k_t), float>();
  auto qk = op.template get_destination_cooperative_tensor<decltype(q_t), decltype(k_t), float>();
  for (uint16_t i = 0; i < kk.get_capacity(); ++i) {
    if (kk.is_valid_element(i)) kk[i] = 0.0f;
    if (qk.is_valid_element(i)) qk[i] = 0.0f;
  }
  const uint32_t row = tid / 4, c0 = (tid % 4) * 8;  // this thread's staging coordinates
  for (uint32_t k0 = 0; k0 < Dk; k0 += BK) {  // 2
    for (uint32_t c = 0; c < 8; ++c) {
      const uint32_t d = k0 + c0 + c;
      ks[row * BK + c0 + c] = d < Dk ? half(float(Kc[uint64_t(row) * Dk + d])) : half(0.0f);
      qs[row * BK + c0 + c] = d < Dk ? half(float(Qc[uint64_t(row) * Dk + d])) : half(0.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(k_t, k_t, kk);
    op.run(q_t, k_t, qk);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step overwrites ks, qs
  }

  for (uint16_t i = 0; i < kk.get_capacity(); ++i) {  // 3 (the upper triangle and diagonal: step 4 overwrites)
    if (!kk.is_valid_element(i)) continue;
    const auto idx = kk.get_multidimensional_index(i);
    const uint32_t j = uint32_t(idx[0]), r = uint32_t(idx[1]);
    M[r * C + j] = j < r ? bs[r] * exp(Gs[r] - Gs[j]) * kk[i] : kk[i];
  }
  if (tid < C) g[gh + tid] = F(Gs[tid]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  gdc_wy_factors(M, Gs, bs, Kc, vo + (uint64_t(h) * args.Tp + t0) * Dv, u + (uint64_t(h) * args.Tp + t0) * Dv,
                 wn + (uint64_t(h) * args.Tp + t0) * Dk, Dk, Dv, tid, simd_id);  // 4 - 8
  for (uint16_t i = 0; i < qk.get_capacity(); ++i) {  // 10
    if (!qk.is_valid_element(i)) continue;
    const auto idx = qk.get_multidimensional_index(i);
    const uint32_t j = uint32_t(idx[0]), r = uint32_t(idx[1]);
    p[gh * C + r * C + j] = F(j <= r ? exp(Gs[r] - Gs[j]) * qk[i] : 0.0f);
  }
}

LILY_INSTANTIATE("gd_chunk_wy_m5_f32", gd_chunk_wy_m5<float>)

}  // namespace lily
