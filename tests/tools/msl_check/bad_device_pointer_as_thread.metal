// A device pointer passed where a thread pointer is expected: distinct address spaces.
// expect: no matching function for call to 'sum2'
#include "common/lily_metal.h"
namespace lily {
inline float sum2(thread const float* v) { return v[0] + v[1]; }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device float* x [[buffer(1)]], device T* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(sum2(x + 2 * lane));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
