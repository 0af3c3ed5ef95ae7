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
#include "common/gated_norm.h"

namespace lily {

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
  y[t * args.y_stride + c] = T(gn_silu(acc));
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
    const float decay = exp(neg_A * gn_softplus(float(a[uint64_t(t) * args.ab_stride + h]) + dt_b));
    const float beta = gn_sigmoid(float(b[uint64_t(t) * args.ab_stride + h]));

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
          T(gated_norm_value(o[lane], inv_rms, w_norm[lane], zz[lane]));
  }

  for (uint32_t r = 0; r < kGdRowsPerLane; ++r) {
    const uint32_t i = lane + 32 * r;
    for (uint32_t c = 0; c < kGdColsPerSimd; ++c)
      if (i < Dk && j0 + c < Dv) state[s_base + uint64_t(j0 + c) * Dk + i] = s[r][c];
  }
}

// ---------------------------------------------------------------------------------------------
// gated_delta_decode: one decode token of a DeltaNet layer, conv1d fused into the delta rule, each
// value head split over col_blocks threadgroups by value columns (the columns of S [Dk, Dv] are
// independent given the shared q, k, beta, decay).
//   grid:      (col_blocks, Hv) threadgroups of n threads (n = 32 * simdgroups, <= 256: the host
//              takes min(256, the pipeline's limit, what Dv needs)); threadgroup (blk, h) owns
//              value columns [blk * cols, blk * cols + cols) of head h, cols = 2 * simdgroups;
//              simdgroup g owns columns blk * cols + 2 g + c (c < 2)
//   1. conv:   the threads of the threadgroup compute the 2 Dk q/k channels of key head h / (Hv/Hk)
//              and the cols v channels of its columns: taps over concat(conv_in, x) in fp32, SiLU,
//              rounded to T (what conv1d writes), into threadgroup memory; one barrier. Exactly
//              one threadgroup writes each channel's new window into conv_out (the q/k channels:
//              blk 0 of the first value head of the key head; the v channels: their column's
//              threadgroup); conv_in is only read, so no threadgroup reads a slot another writes.
//   2. rule:   lane l holds S[i, j] for key rows i = 4 l + r (r < 4) of its 2 columns: two float4,
//              read with one 16-byte load per column when args.vec4 (device layout [Hv, Dv, Dk]);
//              every simdgroup L2-normalises q, k from threadgroup memory (one simd_sum), decay and
//              beta are recomputed per thread; S *= decay, kv = simd_sum(S^T k) (float2),
//              u = beta (v - kv), S += k u^T, o = simd_sum(S^T q); S written back; lanes 0, 1
//              write o (fp32) of their column to o_raw.
//   3. norm:   not here. The gated RMSNorm needs |o|^2 over the whole head, i.e. the columns of
//              other threadgroups of this dispatch; MSL 3.1 gives no way to see them (device
//              memory is coherent within a threadgroup only; a threadgroup_barrier's mem_device
//              orders its own threadgroup; relaxed atomics order nothing). The host encodes
//              gd_chunk_norm (shaders/gated_delta_chunk.metal) on o_raw after a barrier.
//   buffers:   1 x [>= C] T (the token's conv input q | k | v), 2 a [Hv] T, 3 b [Hv] T,
//              4 conv weight [C, K] W, 5 conv_in [K-1, C] T, 6 conv_out [K-1, C] T,
//              7 A_log [Hv] float, 8 dt_bias [Hv] W, 9 state [Hv, Dv, Dk] float (in place),
//              10 o_raw [Hv * Dv] float (the raw outputs, before the gated norm)
template <typename T, typename W>
[[kernel, max_total_threads_per_threadgroup(256)]] void gated_delta_decode(
    constant GdDecodeArgs& args [[buffer(0)]],
    const device T* x [[buffer(1)]],
    const device T* a [[buffer(2)]],
    const device T* b [[buffer(3)]],
    const device W* conv_w [[buffer(4)]],
    const device T* conv_in [[buffer(5)]],
    device T* conv_out [[buffer(6)]],
    const device float* A_log [[buffer(7)]],
    const device W* dt_bias [[buffer(8)]],
    device float* state [[buffer(9)]],
    device float* o_raw [[buffer(10)]],
    LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, qk, [2 * kGdMaxDk]);
  LILY_TG_ARRAY(float, vin, [kGdDecodeMaxCols]);
  const uint32_t Dk = args.Dk, Dv = args.Dv, C = args.C, K = args.K, hist = args.K - 1;
  const uint32_t blk = group_pos.x, h = group_pos.y;
  const uint32_t ratio = args.Hv / args.Hk, kh = h / ratio;
  const uint32_t n = group_size.x, tid = thread_pos.x;
  const uint32_t c0 = blk * args.cols;
  const bool qk_writer = blk == 0 && h % ratio == 0;

  // 1. conv of the channels this threadgroup needs (q, k of key head kh; v of its columns).
  const uint32_t nqk = 2 * Dk;
  for (uint32_t e = tid; e < nqk + args.cols; e += n) {
    uint32_t ch = 0;
    bool valid = true, write = qk_writer;
    if (e < Dk) {
      ch = kh * Dk + e;
    } else if (e < nqk) {
      ch = args.Hk * Dk + kh * Dk + (e - Dk);
    } else {
      const uint32_t j = c0 + (e - nqk);
      valid = j < Dv;
      ch = 2 * args.Hk * Dk + h * Dv + j;
      write = true;
    }
    float out = 0.0f;
    if (valid) {
      float acc = 0.0f;
      for (uint32_t j = 0; j < K; ++j) {
        const float v = j < hist ? float(conv_in[j * C + ch]) : float(x[ch]);
        acc += float(conv_w[ch * K + j]) * v;
      }
      out = float(T(gn_silu(acc)));
      if (write)
        for (uint32_t r = 0; r < hist; ++r) conv_out[r * C + ch] = r + 1 < hist ? conv_in[(r + 1) * C + ch] : x[ch];
    }
    if (e < nqk) qk[e] = out;
    else vin[e - nqk] = out;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 2. the delta rule on this simdgroup's two columns.
  const uint32_t jl = simd_id * kGdDecodeColsPerSimd;
  const uint32_t j0 = c0 + jl;
  float4 qr = float4(0.0f), kr = float4(0.0f);
  for (uint32_t r = 0; r < 4; ++r) {
    const uint32_t i = 4 * lane + r;
    if (i < Dk) {
      qr[r] = qk[i];
      kr[r] = qk[Dk + i];
    }
  }
  float2 ss = float2(0.0f);
  for (uint32_t r = 0; r < 4; ++r) {
    ss.x += qr[r] * qr[r];
    ss.y += kr[r] * kr[r];
  }
  ss = simd_sum(ss);
  qr *= rsqrt(ss.x + 1e-6f) * args.q_scale;
  kr *= rsqrt(ss.y + 1e-6f);
  const float decay = exp(-exp(A_log[h]) * gn_softplus(float(a[h]) + float(dt_bias[h])));
  const float beta = gn_sigmoid(float(b[h]));

  float4 s[kGdDecodeColsPerSimd];
  float2 vv = float2(0.0f);
  for (uint32_t c = 0; c < kGdDecodeColsPerSimd; ++c) {
    s[c] = float4(0.0f);
    const uint32_t j = j0 + c;
    if (j < Dv) {
      vv[c] = vin[jl + c];
      const uint64_t base = (uint64_t(h) * Dv + j) * Dk;
      if (args.vec4 != 0) {
        if (4 * lane < Dk) s[c] = *reinterpret_cast<const device float4*>(state + base + 4 * lane);
      } else {
        for (uint32_t r = 0; r < 4; ++r)
          if (4 * lane + r < Dk) s[c][r] = state[base + 4 * lane + r];
      }
    }
  }
  float2 kv = float2(0.0f);
  for (uint32_t c = 0; c < kGdDecodeColsPerSimd; ++c) {
    s[c] *= decay;
    for (uint32_t r = 0; r < 4; ++r) kv[c] += s[c][r] * kr[r];
  }
  kv = simd_sum(kv);
  const float2 u = (vv - kv) * beta;
  float2 o = float2(0.0f);
  for (uint32_t c = 0; c < kGdDecodeColsPerSimd; ++c) {
    s[c] += kr * u[c];
    for (uint32_t r = 0; r < 4; ++r) o[c] += s[c][r] * qr[r];
  }
  o = simd_sum(o);
  for (uint32_t c = 0; c < kGdDecodeColsPerSimd; ++c) {
    const uint32_t j = j0 + c;
    if (j < Dv) {
      const uint64_t base = (uint64_t(h) * Dv + j) * Dk;
      if (args.vec4 != 0) {
        if (4 * lane < Dk) *reinterpret_cast<device float4*>(state + base + 4 * lane) = s[c];
      } else {
        for (uint32_t r = 0; r < 4; ++r)
          if (4 * lane + r < Dk) state[base + 4 * lane + r] = s[c][r];
      }
    }
  }
  if (lane < kGdDecodeColsPerSimd && j0 + lane < Dv) o_raw[uint64_t(h) * Dv + j0 + lane] = o[lane];
}

LILY_INSTANTIATE("conv1d_xf32_wf32", conv1d<float, float>)
LILY_INSTANTIATE("conv1d_xf32_wbf16", conv1d<float, bfloat>)
LILY_INSTANTIATE("conv1d_xbf16_wf32", conv1d<bfloat, float>)
LILY_INSTANTIATE("conv1d_xbf16_wbf16", conv1d<bfloat, bfloat>)
LILY_INSTANTIATE("gated_delta_xf32_wf32", gated_delta<float, float>)
LILY_INSTANTIATE("gated_delta_xf32_wbf16", gated_delta<float, bfloat>)
LILY_INSTANTIATE("gated_delta_xbf16_wf32", gated_delta<bfloat, float>)
LILY_INSTANTIATE("gated_delta_xbf16_wbf16", gated_delta<bfloat, bfloat>)
LILY_INSTANTIATE("gated_delta_decode_xf32_wf32", gated_delta_decode<float, float>)
LILY_INSTANTIATE("gated_delta_decode_xf32_wbf16", gated_delta_decode<float, bfloat>)
LILY_INSTANTIATE("gated_delta_decode_xbf16_wf32", gated_delta_decode<bfloat, float>)
LILY_INSTANTIATE("gated_delta_decode_xbf16_wbf16", gated_delta_decode<bfloat, bfloat>)

}  // namespace lily
