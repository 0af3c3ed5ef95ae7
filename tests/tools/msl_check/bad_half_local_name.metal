// `half` as a local variable's name, a later declarator of a list (was shaders/m5/qmm_m5.metal's
// `const uint32_t row = t / 2, half = t % 2;`).
// expect: [reserved-name] 'half' declared as a name
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  const uint32_t row = thread_pos.x / 2, half = thread_pos.x % 2;
  y[grid_pos.x] = T(float(row + half));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
