// A static data member (static storage outside `constant`; was common/quant.h's Qmv1Codes::V).
// expect: [constant-storage] 'V': a static data member must be in the constant address space
#include "common/lily_metal.h"
namespace lily {
template <int bits>
struct Codes {
  static constexpr uint32_t V = 32 / bits;
};
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(float(Codes<4>::V));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
