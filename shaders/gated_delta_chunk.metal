// Gated DeltaNet prefill in the chunked (WY / UT-transform) form: the per-token recurrence of
// shaders/gated_delta.metal rewritten, per chunk of kGdChunk = 64 tokens, as matrix products on
// 8x8 simdgroup matrices. Host: csrc/gpu/ops/gated_delta.cpp (route, scratch, dispatches).
// Reference: lily_py.reference.gated_delta.chunked_gated_delta (the same algebra in NumPy).
//
// Per value head h (key head h / (Hv/Hk)), a chunk of tokens 1..C with incoming state S0
// [Dk, Dv], log decays g_i, G_i = g_1 + ... + g_i (within the chunk), betas b_i:
//   A    = strictly lower, A_ij = b_i exp(G_i - G_j) (k_i . k_j)          [C, C]
//   T    = (I + A)^-1 (unit lower triangular; forward substitution)
//   Ut   = T diag(b) V,  W = T diag(b e^G) K                                (the WY form)
//   U    = Ut - W S0                                  (the chunk's delta-rule updates u_i)
//   O    = diag(e^G) Q S0 + P U,  P_ij = (q_i . k_j) exp(G_i - G_j) for j <= i, else 0
//   S_C  = e^{G_C} S0 + K^T diag(exp(G_C - G_j)) U
// Every exponent is <= 0 (G decreases): nothing overflows. Four kernels, one dispatch each:
//   gd_chunk_prep   (parallel over tokens)  q/k L2 norms, decay, beta; head-major padded scratch
//   gd_chunk_wy     (parallel over chunks)  G, A, T, Ut, -W, P of every (chunk, value head)
//   gd_chunk_state  (sequential over chunks, parallel over heads x 8 value columns) U, O, S
//   gd_chunk_norm   (parallel over tokens)  y = rmsnorm(o) * norm_weight * silu(z)
// Scratch layout and the args: common/args_gated_delta.h (GdChunkArgs). Padded rows (t >= T) hold
// q = k = v = 0, g = 0, beta = 0, so they contribute nothing and need no masks.
//
// Precision: fp32 everywhere (inputs widened once in the prep); products accumulate in fp32 in
// the simdgroup matrices; exp / rsqrt precise (-fno-fast-math). The state is fp32 and only
// touches device memory before the first chunk and after the last. It differs from the scan by
// rounding only (different association of the same sums); tests/kernels/test_gated_delta.py
// derives the tolerance.
//
// Activation type T is a template parameter of the kernels that read or write activations
// (prep, norm), so bf16 activations need only new instantiations.
#include "common/lily_metal.h"
#include "common/reduce.h"
#include "common/gated_delta_chunk.h"
#include "common/gated_norm.h"

namespace lily {

// Channel c of token t (t < T) as the prep reads it, in fp32. Conv = false: qkv is the conv's
// output, row t. Conv = true (gd_chunk_prep_conv): qkv is the conv's input (the in_proj columns),
// and the value is conv1d's, computed the same way (shaders/gated_delta.metal: taps j = 0..K-1 of
// xx = concat(conv_in [K-1, C], qkv [T, C]) summed in order in fp32, SiLU, rounded to T), so the
// fused route gives bit for bit what conv1d + gd_chunk_prep give.
template <bool Conv, typename T, typename W>
inline float gdc_channel(constant GdChunkArgs& args, const device T* qkv, const device W* conv_w,
                         const device T* conv_in, uint32_t t, uint32_t c) {
  if (!Conv) return float(qkv[uint64_t(t) * args.qkv_stride + c]);
  const uint32_t K = args.conv_k, hist = K - 1, C = 2 * args.Hk * args.Dk + args.Hv * args.Dv;
  float acc = 0.0f;
  for (uint32_t j = 0; j < K; ++j) {
    const uint32_t p = t + j;  // position in xx
    const float v = p < hist ? float(conv_in[p * C + c]) : float(qkv[uint64_t(p - hist) * args.qkv_stride + c]);
    acc += float(conv_w[c * K + j]) * v;
  }
  return float(T(gn_silu(acc)));
}

// The conv window after the chunk, channel c: conv_out[r] = xx[T + r], r < K - 1 (the conv's raw
// input, as conv1d's last-token threads write it). conv_out must not alias conv_in (host check).
template <typename T>
inline void gdc_keep_window(constant GdChunkArgs& args, const device T* qkv, const device T* conv_in,
                            device T* conv_out, uint32_t c) {
  const uint32_t hist = args.conv_k - 1, C = 2 * args.Hk * args.Dk + args.Hv * args.Dv;
  for (uint32_t r = 0; r < hist; ++r) {
    const uint32_t p = args.T + r;
    conv_out[r * C + c] = p < hist ? conv_in[p * C + c] : qkv[uint64_t(p - hist) * args.qkv_stride + c];
  }
}

// ---------------------------------------------------------------------------------------------
// gd_chunk_prep / gd_chunk_prep_conv: per token t < Tp and value head h (one simdgroup each).
//   grid:    (Tp, Hv) threadgroups of 32 threads
//   writes:  vo[h, t, :] = v; g[h, t] = -exp(A_log) softplus(a + dt_bias); beta[h, t] = sigmoid(b);
//            the first value head of each key head also writes qn / kn (L2-normalised over Dk
//            with one simd_sum(float2), eps 1e-6, q times q_scale). Rows t >= T: zeros.
//   buffers: 1 qkv [T, qkv_stride] T, 2 a [T, ab_stride] T, 3 b [T, ab_stride] T, 4 A_log [Hv]
//            float, 5 dt_bias [Hv] W, 6 qn (QN), 7 kn, 8 vo, 9 g, 10 beta (float scratch)
//   conv:    gd_chunk_prep_conv (the engine's prefill route) fuses the causal conv1d + SiLU: qkv
//            holds the conv's input (args.conv_k = K taps), 11 conv_weight [C, K] W, 12 conv_in
//            [K-1, C] T (the window before the chunk), 13 conv_out [K-1, C] T (after it: written
//            by token T - 1's simdgroups, each for the channels it reads). One level and the conv
//            output's round trip through device memory less than conv1d + gd_chunk_prep.
//   QN:      float, or half on the M5 route (gd_chunk_prep_q16_*: q is only a half operand of
//            matmul2d there, rounded once here; it fills the first half of the qn section)
template <bool Conv, typename T, typename W, typename QN>
inline void gdc_prep(constant GdChunkArgs& args, const device T* qkv, const device T* a, const device T* b,
                     const device float* A_log, const device W* dt_bias, device QN* qn, device float* kn,
                     device float* vo, device float* g, device float* beta, const device W* conv_w,
                     const device T* conv_in, device T* conv_out, uint32_t t, uint32_t h, uint32_t lane) {
  const uint32_t Dk = args.Dk, Dv = args.Dv, ratio = args.Hv / args.Hk, kh = h / ratio;
  const bool live = t < args.T;  // uniform over the threadgroup
  const bool keep = Conv && t + 1 == args.T;  // uniform: the last token writes the conv window
  const uint64_t vrow = (uint64_t(h) * args.Tp + t) * Dv;
  const uint32_t v0 = 2 * args.Hk * Dk + h * Dv;
  for (uint32_t d = lane; d < Dv; d += 32) {
    vo[vrow + d] = live ? gdc_channel<Conv, T, W>(args, qkv, conv_w, conv_in, t, v0 + d) : 0.0f;
    if (keep) gdc_keep_window<T>(args, qkv, conv_in, conv_out, v0 + d);
  }
  if (lane == 0) {
    const uint64_t ab = uint64_t(live ? t : 0) * args.ab_stride + h;
    g[uint64_t(h) * args.Tp + t] = live ? -exp(A_log[h]) * gn_softplus(float(a[ab]) + float(dt_bias[h])) : 0.0f;
    beta[uint64_t(h) * args.Tp + t] = live ? gn_sigmoid(float(b[ab])) : 0.0f;
  }
  if (h % ratio == 0) {  // uniform: one value head per key head writes q and k
    float qr[kGdRowsPerLane], kr[kGdRowsPerLane];
    float2 ss = float2(0.0f);
    const uint32_t q0 = kh * Dk, k0 = args.Hk * Dk + kh * Dk;
    for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
      const uint32_t i = lane + 32 * r;
      qr[r] = live && i < Dk ? gdc_channel<Conv, T, W>(args, qkv, conv_w, conv_in, t, q0 + i) : 0.0f;
      kr[r] = live && i < Dk ? gdc_channel<Conv, T, W>(args, qkv, conv_w, conv_in, t, k0 + i) : 0.0f;
      if (keep && i < Dk) {
        gdc_keep_window<T>(args, qkv, conv_in, conv_out, q0 + i);
        gdc_keep_window<T>(args, qkv, conv_in, conv_out, k0 + i);
      }
      ss.x += qr[r] * qr[r];
      ss.y += kr[r] * kr[r];
    }
    ss = simd_sum(ss);
    const float q_norm = rsqrt(ss.x + 1e-6f) * args.q_scale;
    const float k_norm = rsqrt(ss.y + 1e-6f);
    const uint64_t krow = (uint64_t(kh) * args.Tp + t) * Dk;
    for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
      const uint32_t i = lane + 32 * r;
      if (i < Dk) {
        qn[krow + i] = QN(qr[r] * q_norm);
        kn[krow + i] = kr[r] * k_norm;
      }
    }
  }
}

template <typename T, typename W, typename QN>
[[kernel]] void gd_chunk_prep(constant GdChunkArgs& args [[buffer(0)]],
                              const device T* qkv [[buffer(1)]],
                              const device T* a [[buffer(2)]],
                              const device T* b [[buffer(3)]],
                              const device float* A_log [[buffer(4)]],
                              const device W* dt_bias [[buffer(5)]],
                              device QN* qn [[buffer(6)]],
                              device float* kn [[buffer(7)]],
                              device float* vo [[buffer(8)]],
                              device float* g [[buffer(9)]],
                              device float* beta [[buffer(10)]],
                              LILY_KERNEL_TAIL) {
  gdc_prep<false, T, W, QN>(args, qkv, a, b, A_log, dt_bias, qn, kn, vo, g, beta, nullptr, nullptr, nullptr,
                            group_pos.x, group_pos.y, lane);
}

template <typename T, typename W, typename QN>
[[kernel]] void gd_chunk_prep_conv(constant GdChunkArgs& args [[buffer(0)]],
                                   const device T* qkv [[buffer(1)]],
                                   const device T* a [[buffer(2)]],
                                   const device T* b [[buffer(3)]],
                                   const device float* A_log [[buffer(4)]],
                                   const device W* dt_bias [[buffer(5)]],
                                   device QN* qn [[buffer(6)]],
                                   device float* kn [[buffer(7)]],
                                   device float* vo [[buffer(8)]],
                                   device float* g [[buffer(9)]],
                                   device float* beta [[buffer(10)]],
                                   const device W* conv_weight [[buffer(11)]],
                                   const device T* conv_in [[buffer(12)]],
                                   device T* conv_out [[buffer(13)]],
                                   LILY_KERNEL_TAIL) {
  gdc_prep<true, T, W, QN>(args, qkv, a, b, A_log, dt_bias, qn, kn, vo, g, beta, conv_weight, conv_in, conv_out,
                           group_pos.x, group_pos.y, lane);
}

// ---------------------------------------------------------------------------------------------
// gd_chunk_wy: everything of one (chunk, value head) that does not depend on the state.
//   grid:    (Tp / 64, Hv) threadgroups of kGdChunkWyThreads = 256 threads (8 simdgroups)
//   steps (threadgroup barrier between each):
//     1 G = cumsum(g) of the chunk (one thread, in token order), written back over g
//     2 M = K K^T (lower tiles, simdgroups round-robin)        3 M_ij *= b_i exp(G_i - G_j), j < i
//     4 T by forward substitution: thread c < 64 owns column c of T and stores T[i, c] (i > c) at
//       M[c, i] (the upper triangle), reading A[i, j] = M[i, j] (j < i) and its own T[j, c] only:
//       no thread reads what another writes
//     5 M = T diag(b) (lower, the upper zeroed)                  6 u = M V -> device
//     7 M = M diag(-e^G)                                         8 wn = M K -> device
//     9 M = Q K^T (lower tiles)                                 10 p = M o exp(G_i - G_j) (j <= i)
//   threadgroup memory: M 64 x 64 floats (16 KiB), G and b of the chunk.
//   buffers: 1 qn, 2 kn, 3 vo, 4 g (in: g, out: G), 5 beta, 6 wn, 7 u, 8 p (float scratch)
template <typename F>
[[kernel]] void gd_chunk_wy(constant GdChunkArgs& args [[buffer(0)]],
                            const device F* qn [[buffer(1)]],
                            const device F* kn [[buffer(2)]],
                            const device F* vo [[buffer(3)]],
                            device F* g [[buffer(4)]],
                            const device F* beta [[buffer(5)]],
                            device F* wn [[buffer(6)]],
                            device F* u [[buffer(7)]],
                            device F* p [[buffer(8)]],
                            LILY_KERNEL_TAIL) {
  constexpr uint32_t C = kGdChunk;
  constexpr uint32_t simds = kGdChunkWyThreads / 32;
  LILY_TG_ARRAY(float, M, [C * C]);
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
  gdc_lower_gram(Kc, Kc, M, Dk, simd_id, simds);  // 2
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < C) g[gh + tid] = F(Gs[tid]);
  for (uint32_t e = tid; e < C * C; e += kGdChunkWyThreads) {  // 3
    const uint32_t i = e / C, j = e % C;
    if (j < i) M[e] = bs[i] * exp(Gs[i] - Gs[j]) * M[e];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  gdc_wy_factors(M, Gs, bs, Kc, vo + (uint64_t(h) * args.Tp + t0) * Dv, u + (uint64_t(h) * args.Tp + t0) * Dv,
                 wn + (uint64_t(h) * args.Tp + t0) * Dk, Dk, Dv, tid, simd_id);  // 4 - 8
  threadgroup_barrier(mem_flags::mem_threadgroup);
  gdc_lower_gram(Qc, Kc, M, Dk, simd_id, simds);  // 9
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t e = tid; e < C * C; e += kGdChunkWyThreads) {  // 10
    const uint32_t i = e / C, j = e % C;
    p[gh * C + e] = F(j <= i ? exp(Gs[i] - Gs[j]) * M[e] : 0.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// gd_chunk_state: the chunks of one value head in order, for kGdChunkStateCols = 8 value columns
// (one simdgroup; columns of S evolve independently).
//   grid:      (Dv / 8, Hv) threadgroups of 32 threads
//   registers: S [Dk, 8] as Dk / 8 tiles (fp32), the chunk's U [64, 8] as 8 tiles
//   per chunk: diagonals e^{G_i} and exp(G_C - G_j) -> threadgroup memory (two copies alternate
//              by chunk parity: one barrier per chunk); U_i = u_i + sum_r wn[i, r] S_r;
//              O_i = diag(e^G)_i (sum_r Q[i, r] S_r) + sum_{j <= i} p[i, j] U_j -> vo;
//              U_j = diag(exp(G_C - G_j)) U_j; S_r = e^{G_C} S_r + sum_j K[j, r]^T U_j
//   state:     device layout [Hv, Dv, Dk] (row = value column): tiles load and store transposed
//   buffers:   1 qn, 2 kn, 3 g (G), 4 wn, 5 u, 6 p, 7 state [Hv, Dv, Dk] float (in place), 8 vo (o)
template <typename F>
[[kernel]] void gd_chunk_state(constant GdChunkArgs& args [[buffer(0)]],
                               const device F* qn [[buffer(1)]],
                               const device F* kn [[buffer(2)]],
                               const device F* G [[buffer(3)]],
                               const device F* wn [[buffer(4)]],
                               const device F* u [[buffer(5)]],
                               const device F* p [[buffer(6)]],
                               device float* state [[buffer(7)]],
                               device F* vo [[buffer(8)]],
                               LILY_KERNEL_TAIL) {
  constexpr uint32_t C = kGdChunk, CT = kGdChunk / 8, MT = kGdChunkMaxTiles;
  LILY_TG_ARRAY(float, diag, [2][2 * CT][64]);  // [parity][e^G tiles | tail tiles][8 x 8]
  const uint32_t h = group_pos.y, j0 = group_pos.x * kGdChunkStateCols;
  const uint32_t Dk = args.Dk, Dv = args.Dv, kh = h / (args.Hv / args.Hk), nk = Dk / 8;
  device float* st = state + uint64_t(h) * Dv * Dk + uint64_t(j0) * Dk;

  for (uint32_t e = lane; e < 2 * 2 * CT * 64; e += 32) diag[e / (2 * CT * 64)][(e / 64) % (2 * CT)][e % 64] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // zeros -> the diagonals written per chunk

  simdgroup_float8x8 S[MT];
  for (uint32_t r = 0; r < MT; ++r) {
    S[r] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    if (r < nk) simdgroup_load(S[r], st + 8 * r, ulong(Dk), ulong2(0), true);  // S[8r.., j0..] = state^T
  }

  for (uint32_t c = 0; c * C < args.T; ++c) {
    const uint32_t par = c & 1;
    const uint64_t t0 = uint64_t(c) * C;
    const uint64_t gh = uint64_t(h) * args.Tp + t0;
    const float G_last = float(G[gh + C - 1]);
    for (uint32_t i = lane; i < C; i += 32) {
      const float Gi = float(G[gh + i]);
      diag[par][i / 8][(i % 8) * 9] = exp(Gi);
      diag[par][CT + i / 8][(i % 8) * 9] = exp(G_last - Gi);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const device F* Qc = qn + (uint64_t(kh) * args.Tp + t0) * Dk;
    const device F* Kc = kn + (uint64_t(kh) * args.Tp + t0) * Dk;
    const device F* Wc = wn + gh * Dk;
    const device F* Pc = p + gh * C;

    simdgroup_float8x8 U[CT];
    for (uint32_t i = 0; i < CT; ++i) {
      simdgroup_load(U[i], u + gh * Dv + uint64_t(8 * i) * Dv + j0, ulong(Dv), ulong2(0), false);
      for (uint32_t r = 0; r < MT; ++r) {
        if (r >= nk) break;
        simdgroup_float8x8 wt;
        simdgroup_load(wt, Wc + uint64_t(8 * i) * Dk + 8 * r, ulong(Dk), ulong2(0), false);
        simdgroup_multiply_accumulate(U[i], wt, S[r], U[i]);
      }
    }
    for (uint32_t i = 0; i < CT; ++i) {
      simdgroup_float8x8 o = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint32_t r = 0; r < MT; ++r) {
        if (r >= nk) break;
        simdgroup_float8x8 qt;
        simdgroup_load(qt, Qc + uint64_t(8 * i) * Dk + 8 * r, ulong(Dk), ulong2(0), false);
        simdgroup_multiply_accumulate(o, qt, S[r], o);
      }
      simdgroup_float8x8 d;
      simdgroup_load(d, &diag[par][i][0], ulong(8), ulong2(0), false);
      simdgroup_multiply(o, d, o);
      for (uint32_t j = 0; j <= i; ++j) {
        simdgroup_float8x8 pt;
        simdgroup_load(pt, Pc + (8 * i) * C + 8 * j, ulong(C), ulong2(0), false);
        simdgroup_multiply_accumulate(o, pt, U[j], o);
      }
      simdgroup_store(o, vo + gh * Dv + uint64_t(8 * i) * Dv + j0, ulong(Dv), ulong2(0), false);
    }
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

  for (uint32_t r = 0; r < MT; ++r)
    if (r < nk) simdgroup_store(S[r], st + 8 * r, ulong(Dk), ulong2(0), true);
}

// ---------------------------------------------------------------------------------------------
// gd_chunk_norm: y[t, h, :] = rmsnorm(o[h, t, :]) * norm_weight * silu(z[t, h, :]) (as the scan's
// epilogue). grid (T, Hv) threadgroups of 32 threads; lanes own columns lane + 32 r.
//   buffers: 1 vo (o) float, 2 z [T, z_stride] T, 3 norm_weight [Dv] W, 4 y [T, Hv * Dv] T
template <typename T, typename W>
[[kernel]] void gd_chunk_norm(constant GdChunkArgs& args [[buffer(0)]],
                              const device float* vo [[buffer(1)]],
                              const device T* z [[buffer(2)]],
                              const device W* norm_weight [[buffer(3)]],
                              device T* y [[buffer(4)]],
                              LILY_KERNEL_TAIL) {
  const uint32_t t = group_pos.x, h = group_pos.y, Dv = args.Dv;
  const device float* o = vo + (uint64_t(h) * args.Tp + t) * Dv;
  float ss = 0.0f;
  for (uint32_t d = lane; d < Dv; d += 32) ss += o[d] * o[d];
  ss = simd_sum(ss);
  const float inv_rms = rsqrt(ss / float(Dv) + args.eps);
  for (uint32_t d = lane; d < Dv; d += 32) {
    const float zz = float(z[uint64_t(t) * args.z_stride + h * Dv + d]);
    y[uint64_t(t) * args.Hv * Dv + h * Dv + d] = T(gated_norm_value(o[d], inv_rms, float(norm_weight[d]), zz));
  }
}

LILY_INSTANTIATE("gd_chunk_prep_xf32_wf32", gd_chunk_prep<float, float, float>)
LILY_INSTANTIATE("gd_chunk_prep_xf32_wbf16", gd_chunk_prep<float, bfloat, float>)
LILY_INSTANTIATE("gd_chunk_wy_f32", gd_chunk_wy<float>)
LILY_INSTANTIATE("gd_chunk_state_f32", gd_chunk_state<float>)
LILY_INSTANTIATE("gd_chunk_norm_xf32_wf32", gd_chunk_norm<float, float>)
LILY_INSTANTIATE("gd_chunk_norm_xf32_wbf16", gd_chunk_norm<float, bfloat>)
LILY_INSTANTIATE("gd_chunk_prep_xbf16_wf32", gd_chunk_prep<bfloat, float, float>)
LILY_INSTANTIATE("gd_chunk_prep_xbf16_wbf16", gd_chunk_prep<bfloat, bfloat, float>)
LILY_INSTANTIATE("gd_chunk_norm_xbf16_wf32", gd_chunk_norm<bfloat, float>)
LILY_INSTANTIATE("gd_chunk_norm_xbf16_wbf16", gd_chunk_norm<bfloat, bfloat>)
LILY_INSTANTIATE("gd_chunk_prep_q16_xf32_wf32", gd_chunk_prep<float, float, half>)
LILY_INSTANTIATE("gd_chunk_prep_q16_xf32_wbf16", gd_chunk_prep<float, bfloat, half>)
LILY_INSTANTIATE("gd_chunk_prep_q16_xbf16_wf32", gd_chunk_prep<bfloat, float, half>)
LILY_INSTANTIATE("gd_chunk_prep_q16_xbf16_wbf16", gd_chunk_prep<bfloat, bfloat, half>)
// the engine's prefill route: conv1d + SiLU fused into the prep
LILY_INSTANTIATE("gd_chunk_prep_conv_xf32_wf32", gd_chunk_prep_conv<float, float, float>)
LILY_INSTANTIATE("gd_chunk_prep_conv_xf32_wbf16", gd_chunk_prep_conv<float, bfloat, float>)
LILY_INSTANTIATE("gd_chunk_prep_conv_xbf16_wf32", gd_chunk_prep_conv<bfloat, float, float>)
LILY_INSTANTIATE("gd_chunk_prep_conv_xbf16_wbf16", gd_chunk_prep_conv<bfloat, bfloat, float>)
LILY_INSTANTIATE("gd_chunk_prep_conv_q16_xf32_wf32", gd_chunk_prep_conv<float, float, half>)
LILY_INSTANTIATE("gd_chunk_prep_conv_q16_xf32_wbf16", gd_chunk_prep_conv<float, bfloat, half>)
LILY_INSTANTIATE("gd_chunk_prep_conv_q16_xbf16_wf32", gd_chunk_prep_conv<bfloat, float, half>)
LILY_INSTANTIATE("gd_chunk_prep_conv_q16_xbf16_wbf16", gd_chunk_prep_conv<bfloat, bfloat, half>)

}  // namespace lily
