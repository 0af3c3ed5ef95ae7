// A cast to a pointer type without an address space.
// expect: [address-space] cast to a pointer to
#include "common/lily_metal.h"
namespace lily {
inline uint32_t low_word(thread const float* p) { return reinterpret_cast<const uint32_t*>(p)[0]; }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  const float v = 1.0f;
  y[grid_pos.x] = T(float(low_word(&v)));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
