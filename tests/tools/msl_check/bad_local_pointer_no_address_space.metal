// A local pointer variable without an address space.
// expect: [address-space] 'p': pointer to
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  float v[2] = {1.0f, 2.0f};
  float* p = v;
  y[grid_pos.x] = T(p[lane & 1u]);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
