// MSL reserved words that are ordinary identifiers to clang (not C++ or OpenCL keywords) as names.
// expect: [reserved-name] 'vertex'
#include "common/lily_metal.h"
namespace lily {
struct Hit {
  uint32_t vertex;
  float sampler;
};
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  Hit h;
  h.vertex = lane;
  h.sampler = 1.0f;
  const uint32_t patch = h.vertex + 1;
  y[grid_pos.x] = T(h.sampler * float(patch));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
