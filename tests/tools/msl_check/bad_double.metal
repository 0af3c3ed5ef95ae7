// MSL has no double.
// expect: use of type 'double' requires cl_khr_fp64
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  const double d = 0.5f;
  y[grid_pos.x] = T(float(d));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
