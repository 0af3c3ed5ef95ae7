// A program-scope variable outside `constant` (was shaders/moe.metal's kMoeTaken).
// expect: program scope variable must reside in constant address space
#include "common/lily_metal.h"
namespace lily {
constexpr float kTaken = -1.0f;
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(kTaken);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
