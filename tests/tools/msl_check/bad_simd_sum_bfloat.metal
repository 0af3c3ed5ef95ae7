// The SIMD-group reductions take float, half and integer types, not bfloat: a bfloat argument
// matches no declaration exactly (Metal converts it to float and returns float, which then does
// not convert back to bfloat implicitly).
// expect: call to 'simd_sum' is ambiguous
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device bfloat* x [[buffer(1)]], device T* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  const bfloat s = simd_sum(x[grid_pos.x]);
  y[grid_pos.x] = T(float(s));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
