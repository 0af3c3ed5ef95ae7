// The same constant in the constant address space, as MSL requires.
#include "common/lily_metal.h"
namespace lily {
constant constexpr float kTaken = -1.0f;
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(kTaken);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
