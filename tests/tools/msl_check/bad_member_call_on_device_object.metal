// A member function called on a device object: Metal's member functions take a thread object
// unless declared for another address space.
// expect: [address-space] 'scaled' called on a device object
#include "common/lily_metal.h"
namespace lily {
struct Pair {
  float a, b;
  float scaled(float s) const { return s * (a + b); }
};
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device Pair* p [[buffer(1)]], device T* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(p[grid_pos.x].scaled(2.0f));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
