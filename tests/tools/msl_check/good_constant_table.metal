// A lookup table at program scope in `constant`, and constexpr locals (thread memory).
#include "common/lily_metal.h"
namespace lily {
constant float kTable[2] = {0.5f, 2.0f};
inline float lookup(uint32_t i) {
  constexpr float kScale = 4.0f;
  return kScale * kTable[i & 1u];
}
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(lookup(lane));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
