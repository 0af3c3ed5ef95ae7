// bfloat(x) and T(x) conversions; bfloat -> float is implicit in MSL (a greater rank).
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device bfloat* x [[buffer(1)]], device T* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  const float v = x[lane];
  const bfloat b = bfloat(2.0f * v);
  y[grid_pos.x] = T(v + float(b));
}
LILY_INSTANTIATE("k", k<float>)
LILY_INSTANTIATE("k_bf16", k<bfloat>)
}  // namespace lily
