// A pointer parameter without an address space (MSL: every pointer names device, constant,
// threadgroup or thread).
// expect: [address-space] 'xs': pointer to
#include "common/lily_metal.h"
namespace lily {
inline float sum4(const float* xs) { return xs[0] + xs[1] + xs[2] + xs[3]; }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  float v[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  y[grid_pos.x] = T(sum4(v));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
