// A store through a constant pointer: the constant address space is read-only in MSL.
// expect: read-only variable is not assignable
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint* n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  n[0] = 1u;
  y[grid_pos.x] = T(1.0f);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
