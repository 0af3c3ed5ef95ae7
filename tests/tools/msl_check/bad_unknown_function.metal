// A function the stand-in does not declare (not in the MSL spec: there is no simd_mean) fails, so a
// new MSL call is checked against the spec and declared in tools/msl_check/include.
// expect: use of undeclared identifier 'simd_mean'
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(simd_mean(float(lane)));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
