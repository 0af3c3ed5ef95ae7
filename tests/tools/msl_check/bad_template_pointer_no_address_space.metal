// A pointer to a template parameter type without an address space (`const T*`), a struct field
// and a function's return type without one.
// expect: [address-space] 'p': pointer to 'const T'
#include "common/lily_metal.h"
namespace lily {
template <typename T>
inline float first(const T* p) { return float(p[0]); }
struct View {
  float* rows;
};
inline float* rows_of(View v) { return v.rows; }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  float v[2] = {1.0f, 2.0f};
  y[grid_pos.x] = T(first<float>(v));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
