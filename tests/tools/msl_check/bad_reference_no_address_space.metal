// A reference parameter without an address space.
// expect: [address-space] 'out': reference to
#include "common/lily_metal.h"
namespace lily {
inline void accumulate(float& out, float v) { out += v; }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  float acc = 0.0f;
  accumulate(acc, 1.0f);
  y[grid_pos.x] = T(acc);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
