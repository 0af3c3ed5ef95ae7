// Member functions on thread objects (a copy of a device struct), one declared for device
// objects, and static member functions.
#include "common/lily_metal.h"
namespace lily {
struct Pair {
  float a, b;
  float scaled(float s) const { return s * (a + b); }
  float sum() const device { return a + b; }
  static float twice(float v) { return 2.0f * v; }
};
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device Pair* p [[buffer(1)]], device T* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  const Pair q = p[grid_pos.x];
  y[grid_pos.x] = T(q.scaled(2.0f) + p[grid_pos.x].sum() + Pair::twice(q.a));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
