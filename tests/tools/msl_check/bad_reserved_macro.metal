// An MSL reserved word defined as a macro.
// expect: [reserved-name] 'mesh' declared as a name
#include "common/lily_metal.h"
#define mesh 4u
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(float(mesh));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
