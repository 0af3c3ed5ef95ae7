// The same constant as an enumerator (what common/quant.h does now).
#include "common/lily_metal.h"
namespace lily {
template <int bits>
struct Codes {
  enum : uint32_t { V = 32 / bits };
  static float scale(uint32_t i) { return float(i) * 0.5f; }  // static member functions are fine
};
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(Codes<4>::scale(Codes<4>::V));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
