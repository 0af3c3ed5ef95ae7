// SIMD-group functions on float, half, uint and int, barriers, math in metal::, fast:: and
// precise::, as_type between types of one size.
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device float* x [[buffer(1)]], device T* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  float v = x[grid_pos.x];
  v = simd_sum(v) + simd_max(v) + simd_shuffle_xor(v, 1) + simd_broadcast(v, 0);
  const half h = simd_sum(half(v));
  const uint32_t u = simd_prefix_exclusive_sum(lane) + uint32_t(simd_min(int(lane)));
  simdgroup_barrier(mem_flags::mem_none);
  const float e = exp(v) + fast::exp(v) + precise::exp(v) + rsqrt(fabs(v) + 1.0f) + max(v, 0.0f);
  const uint32_t bits = as_type<uint32_t>(e) ^ as_type<uint32_t>(half2(h));
  if (simd_any(bits == 0u)) v += 1.0f;
  y[grid_pos.x] = T(v + float(h) + float(u) + clamp(e, 0.0f, 1.0f));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
