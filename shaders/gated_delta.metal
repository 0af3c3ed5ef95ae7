// Gated DeltaNet: causal depthwise conv1d with its rolling state, and the fused gated delta rule
// (L2-normed q/k, decay and beta gates, delta-rule update of the fp32 state in registers, output,
// gated RMSNorm) over T tokens. Decode is the T = 1 case of the same kernels.
// Host: csrc/gpu/ops/gated_delta.cpp. Reference: lily_py.reference.kernels.causal_conv1d /
// gated_delta (and lily_py.reference.gated_delta for the model-level math).
//
// Precision: everything is widened to fp32; the recurrent state is fp32 and never leaves fp32;
// exp/log/rsqrt are the precise functions (the Metal library is built with -fno-fast-math);
// outputs are rounded to the activation dtype T once.
#include "common/lily_metal.h"
#include "common/reduce.h"

namespace lily {

// sigmoid(x) with exp of a non-positive number only (never overflows); same formula as
// lily_py.reference.ops.sigmoid.
inline float gd_sigmoid(float x) {
  const float e = exp(-abs(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

inline float gd_silu(float x) { return x * gd_sigmoid(x); }

// softplus(x) = max(x, 0) + log1p(exp(-|x|)); log1p(e) as log(u) * e / (u - 1) with u = 1 + e
// (exact to a few ulp even when e is far below 1 ulp of 1, where log(1 + e) would return 0).
inline float gd_softplus(float x) {
  const float e = exp(-abs(x));
  const float u = 1.0f + e;
  const float log1p_e = u == 1.0f ? e : log(u) * (e / (u - 1.0f));
  return max(x, 0.0f) + log1p_e;
}

// ---------------------------------------------------------------------------------------------
// conv1d: y[t, c] = silu(sum_j w[c, j] * xx[t + j, c]), xx = concat(state_in [K-1, C], x [T, C]).
//   grid:      (ceil(C / kConvThreads), T) threadgroups of kConvThreads threads
//   thread:    one channel c of one token t; sums the K taps in order j = 0..K-1 in fp32
//   state:     the threads of the last token write state_out = xx[T .. T+K-2] for their channel
//              (state_in is read by the threads of tokens t < K-1: the host requires state_out to
//              be a different buffer unless T == 1, where one thread does both)
//   buffers:   1 x [T, x_stride] T, 2 weight [C, K] W, 3 state_in [K-1, C] T, 4 y [T, y_stride] T,
//              5 state_out [K-1, C] T
// No barriers or collectives: threads past C return at once.
template <typename T, typename W>
[[kernel]] void conv1d(constant Conv1dArgs& args [[buffer(0)]],
                       const device T* x [[buffer(1)]],
                       const device W* weight [[buffer(2)]],
                       const device T* state_in [[buffer(3)]],
                       device T* y [[buffer(4)]],
                       device T* state_out [[buffer(5)]],
                       LILY_KERNEL_TAIL) {
  const uint32_t c = group_pos.x * group_size.x + thread_pos.x;
  const uint32_t t = group_pos.y;
  const uint32_t C = args.C, K = args.K, hist = args.K - 1;
  if (c >= C) return;
  float acc = 0.0f;
  for (uint32_t j = 0; j < K; ++j) {
    const uint32_t p = t + j;  // position in xx
    const float v = p < hist ? float(state_in[p * C + c]) : float(x[(p - hist) * args.x_stride + c]);
    acc += float(weight[c * K + j]) * v;
  }
  y[t * args.y_stride + c] = T(gd_silu(acc));
  if (t + 1 == args.T) {
    T keep[kConvMaxKernel];
    for (uint32_t r = 0; r < hist; ++r) {
      const uint32_t p = args.T + r;
      keep[r] = p < hist ? state_in[p * C + c] : x[(p - hist) * args.x_stride + c];
    }
    for (uint32_t r = 0; r < hist; ++r) state_out[r * C + c] = keep[r];
  }
}

// ---------------------------------------------------------------------------------------------
// gated_delta: the whole recurrence of one value head per threadgroup over T tokens, in order.
//   grid:      Hv threadgroups (value head h = group_pos.x; key head h / (Hv / Hk)) of
//              ceil(Dv / 4) * 32 threads (one simdgroup per 4 value columns; Dv = 128 -> 1024)
//   registers: lane l of simdgroup g holds the fp32 state S[i, j] for key rows i = l + 32 r
//              (r < 4) and value columns j = 4 g + c (c < 4): one float4 per r, 16 floats; rows
//              >= Dk and columns >= Dv stay 0. The state is read from device memory once before
//              the first token and written once after the last (device layout [Hv, Dv, Dk]:
//              lanes read consecutive floats).
//   per token: every lane loads its 4 q and 4 k values; one simd_sum(float2) gives |q|^2, |k|^2
//              (each simdgroup normalises redundantly: no barrier); S *= decay;
//              kv = simd_sum(sum_r S[r] k_r) (float4, 4 columns at once); u = beta (v - kv);
//              S += k_r u; o = simd_sum(sum_r S[r] q_r); the gated RMSNorm needs |o|^2 over the
//              head: per-simdgroup partials in threadgroup memory, one barrier (two partial
//              buffers alternate by token parity, so one barrier per token suffices); lanes
//              0..3 write y for their column.
//   buffers:   1 qkv [T, qkv_stride] T (q | k | v after the conv), 2 z [T, z_stride] T,
//              3 a [T, ab_stride] T, 4 b [T, ab_stride] T, 5 A_log [Hv] float, 6 dt_bias [Hv] W,
//              7 norm_weight [Dv] W, 8 state [Hv, Dv, Dk] float (in place), 9 y [T, Hv * Dv] T
// Gates: decay = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b), in fp32.
// 1024 threads at Dv = 128 (the model): declared, so Apple's compiler allocates registers for it.
template <typename T, typename W>
[[kernel, max_total_threads_per_threadgroup(1024)]] void gated_delta(constant GatedDeltaArgs& args [[buffer(0)]],
                            const device T* qkv [[buffer(1)]],
                            const device T* z [[buffer(2)]],
                            const device T* a [[buffer(3)]],
                            const device T* b [[buffer(4)]],
                            const device float* A_log [[buffer(5)]],
                            const device W* dt_bias [[buffer(6)]],
                            const device W* norm_weight [[buffer(7)]],
                            device float* state [[buffer(8)]],
                            device T* y [[buffer(9)]],
                            LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, partials, [2][32]);
  const uint32_t Dk = args.Dk, Dv = args.Dv;
  const uint32_t h = group_pos.x;
  const uint32_t kh = h / (args.Hv / args.Hk);
  const uint32_t j0 = simd_id * kGdColsPerSimd;
  const uint32_t q_off = kh * Dk;
  const uint32_t k_off = args.Hk * Dk + kh * Dk;
  const uint32_t v_off = 2 * args.Hk * Dk + h * Dv;
  const uint64_t s_base = uint64_t(h) * Dv * Dk;

  float4 s[kGdRowsPerLane];
  for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
    s[r] = float4(0.0f);
    const uint32_t i = lane + 32 * r;
    for (uint32_t c = 0; c < kGdColsPerSimd; ++c)
      if (i < Dk && j0 + c < Dv) s[r][c] = state[s_base + uint64_t(j0 + c) * Dk + i];
  }

  const float neg_A = -exp(A_log[h]);
  const float dt_b = float(dt_bias[h]);
  float4 w_norm = float4(0.0f);
  for (uint32_t c = 0; c < kGdColsPerSimd; ++c)
    if (j0 + c < Dv) w_norm[c] = float(norm_weight[j0 + c]);

  for (uint32_t t = 0; t < args.T; ++t) {
    const device T* row = qkv + uint64_t(t) * args.qkv_stride;
    float qr[kGdRowsPerLane], kr[kGdRowsPerLane];
    float2 ss = float2(0.0f);
    for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
      const uint32_t i = lane + 32 * r;
      qr[r] = i < Dk ? float(row[q_off + i]) : 0.0f;
      kr[r] = i < Dk ? float(row[k_off + i]) : 0.0f;
      ss.x += qr[r] * qr[r];
      ss.y += kr[r] * kr[r];
    }
    ss = simd_sum(ss);
    const float q_norm = rsqrt(ss.x + 1e-6f) * args.q_scale;
    const float k_norm = rsqrt(ss.y + 1e-6f);
    for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
      qr[r] *= q_norm;
      kr[r] *= k_norm;
    }
    const float decay = exp(neg_A * gd_softplus(float(a[uint64_t(t) * args.ab_stride + h]) + dt_b));
    const float beta = gd_sigmoid(float(b[uint64_t(t) * args.ab_stride + h]));

    float4 vv = float4(0.0f), zz = float4(0.0f);
    for (uint32_t c = 0; c < kGdColsPerSimd; ++c) {
      if (j0 + c < Dv) {
        vv[c] = float(row[v_off + j0 + c]);
        zz[c] = float(z[uint64_t(t) * args.z_stride + h * Dv + j0 + c]);
      }
    }
    float4 kv = float4(0.0f);
    for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
      s[r] *= decay;
      kv += s[r] * kr[r];
    }
    kv = simd_sum(kv);
    const float4 u = (vv - kv) * beta;
    float4 o = float4(0.0f);
    for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
      s[r] += kr[r] * u;
      o += s[r] * qr[r];
    }
    o = simd_sum(o);

    // Gated RMSNorm over the head's Dv outputs (columns >= Dv hold o = 0).
    const float part = o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w;
    const float total = threadgroup_sum(lane == 0 ? part : 0.0f, partials[t & 1], lane, simd_id,
                                        group_size.x);
    const float inv_rms = rsqrt(total / float(Dv) + args.eps);
    if (lane < kGdColsPerSimd && j0 + lane < Dv)
      y[uint64_t(t) * args.Hv * Dv + h * Dv + j0 + lane] =
          T(o[lane] * inv_rms * w_norm[lane] * gd_silu(zz[lane]));
  }

  for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
    const uint32_t i = lane + 32 * r;
    for (uint32_t c = 0; c < kGdColsPerSimd; ++c)
      if (i < Dk && j0 + c < Dv) state[s_base + uint64_t(j0 + c) * Dk + i] = s[r][c];
  }
}

LILY_INSTANTIATE("conv1d_xf32_wf32", conv1d<float, float>)
LILY_INSTANTIATE("conv1d_xf32_wbf16", conv1d<float, bfloat>)
LILY_INSTANTIATE("conv1d_xbf16_wf32", conv1d<bfloat, float>)
LILY_INSTANTIATE("conv1d_xbf16_wbf16", conv1d<bfloat, bfloat>)
LILY_INSTANTIATE("gated_delta_xf32_wf32", gated_delta<float, float>)
LILY_INSTANTIATE("gated_delta_xf32_wbf16", gated_delta<float, bfloat>)
LILY_INSTANTIATE("gated_delta_xbf16_wf32", gated_delta<bfloat, float>)
LILY_INSTANTIATE("gated_delta_xbf16_wbf16", gated_delta<bfloat, bfloat>)

}  // namespace lily
