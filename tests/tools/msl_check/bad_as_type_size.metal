// as_type between types of different sizes.
// expect: no matching function for call to 'as_type'
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  const uint2 w = as_type<uint2>(float(lane));
  y[grid_pos.x] = T(float(w.x));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
