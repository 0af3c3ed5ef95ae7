// `bfloat` (a built-in type from MSL 3.1) as a name.
// expect: [reserved-name] 'bfloat' declared as a name
#include "common/lily_metal.h"
namespace lily {
inline float scaled(float x, float bfloat) { return x * bfloat; }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(scaled(1.0f, 2.0f));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
