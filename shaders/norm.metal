// RMSNorm, plain and with the residual add fused in. Host: csrc/gpu/ops/norm.cpp.
// Reference: lily_py.reference.kernels.rms_norm / rms_norm_residual.
//
//   grid:      one threadgroup per row (rows threadgroups); threads: the host picks
//              min(1024, max(32, round_up(ceil(D / 8), 32))), lowered to the pipeline's
//              maxTotalThreadsPerThreadgroup (any multiple of 32 works: threads stride the row);
//              declared max_total_threads_per_threadgroup(1024)
//   thread:    elements c = thread_pos.x, + threads, ... of the row (coalesced)
//   weight:    y = h * rsqrt(mean(h^2) + eps) * (weight + weight_offset). Checkpoints in MLX format
//              store the multiplier (weight_offset = 0); Hugging Face's zero-centred RMSNorm
//              weights (y * (1 + w)) use weight_offset = 1. The gated DeltaNet norm is plain (0).
//   precision: squares summed in fp32 (per thread, then simd_sum, then over simdgroups in order),
//              scale in fp32, y rounded to T once.
//   fused:     h = round_T(x + residual) is written to h_out (the new residual stream; h_out may
//              be the residual buffer itself) and normalized as stored, exactly as an unfused
//              add followed by rms_norm would do.
#include "common/lily_metal.h"
#include "common/reduce.h"

namespace lily {

template <typename T, typename W>
[[kernel, max_total_threads_per_threadgroup(1024)]] void rms_norm(constant RmsNormArgs& args [[buffer(0)]],
                         const device T* x [[buffer(1)]],
                         const device W* weight [[buffer(2)]],
                         device T* y [[buffer(3)]],
                         LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, partials, [32]);
  const uint32_t D = args.D;
  const device T* xr = x + group_pos.x * D;
  device T* yr = y + group_pos.x * D;
  float ss = 0.0f;
  for (uint32_t c = thread_pos.x; c < D; c += group_size.x) {
    const float v = float(xr[c]);
    ss += v * v;
  }
  const float total = threadgroup_sum(ss, partials, lane, simd_id, group_size.x);
  const float scale = rsqrt(total / float(D) + args.eps);
  for (uint32_t c = thread_pos.x; c < D; c += group_size.x)
    yr[c] = T(float(xr[c]) * scale * (float(weight[c]) + args.weight_offset));
}

template <typename T, typename W>
[[kernel, max_total_threads_per_threadgroup(1024)]] void rms_norm_residual(constant RmsNormArgs& args [[buffer(0)]],
                                  const device T* x [[buffer(1)]],
                                  const device T* residual [[buffer(2)]],
                                  const device W* weight [[buffer(3)]],
                                  device T* h_out [[buffer(4)]],
                                  device T* y [[buffer(5)]],
                                  LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, partials, [32]);
  const uint32_t D = args.D;
  const uint32_t base = group_pos.x * D;
  float ss = 0.0f;
  for (uint32_t c = thread_pos.x; c < D; c += group_size.x) {
    const T h = T(float(x[base + c]) + float(residual[base + c]));
    h_out[base + c] = h;
    const float hf = float(h);
    ss += hf * hf;
  }
  const float total = threadgroup_sum(ss, partials, lane, simd_id, group_size.x);
  const float scale = rsqrt(total / float(D) + args.eps);
  // Each thread reads back only what it wrote above (safe when h_out aliases residual).
  for (uint32_t c = thread_pos.x; c < D; c += group_size.x)
    y[base + c] = T(float(h_out[base + c]) * scale * (float(weight[c]) + args.weight_offset));
}

LILY_INSTANTIATE("rms_norm_xf32_wf32", rms_norm<float, float>)
LILY_INSTANTIATE("rms_norm_xf32_wbf16", rms_norm<float, bfloat>)
LILY_INSTANTIATE("rms_norm_xbf16_wf32", rms_norm<bfloat, float>)
LILY_INSTANTIATE("rms_norm_xbf16_wbf16", rms_norm<bfloat, bfloat>)
LILY_INSTANTIATE("rms_norm_residual_xf32_wf32", rms_norm_residual<float, float>)
LILY_INSTANTIATE("rms_norm_residual_xf32_wbf16", rms_norm_residual<float, bfloat>)
LILY_INSTANTIATE("rms_norm_residual_xbf16_wf32", rms_norm_residual<bfloat, float>)
LILY_INSTANTIATE("rms_norm_residual_xbf16_wbf16", rms_norm_residual<bfloat, bfloat>)

}  // namespace lily
