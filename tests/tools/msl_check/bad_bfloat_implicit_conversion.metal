// float -> bfloat without an explicit conversion (MSL 3.1: float and half convert to bfloat only
// explicitly), in a kernel instantiated with T = bfloat.
// expect: [bfloat-implicit] implicit conversion
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  const float acc = 0.5f * float(lane);
  y[grid_pos.x] = acc;
}
LILY_INSTANTIATE("k", k<float>)
LILY_INSTANTIATE("k_bf16", k<bfloat>)
}  // namespace lily
