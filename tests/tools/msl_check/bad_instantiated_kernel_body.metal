// An error that only the instantiation shows (the body is dependent on T): LILY_INSTANTIATE must
// type-check each kernel body with its template arguments. Here a device T* goes into a
// threadgroup T*.
// expect: cannot initialize a variable of type '__local
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  threadgroup T* p = y;
  p[lane] = T(0.0f);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
