// A static local variable: static storage outside `constant`.
// expect: [constant-storage] 'table': a static local variable must be in the constant address space
#include "common/lily_metal.h"
namespace lily {
inline float lookup(uint32_t i) {
  static const float table[2] = {0.5f, 2.0f};
  return table[i & 1u];
}
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(lookup(lane));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
