// A device pointer in a threadgroup tensor (Metal 4: the element type carries the address space).
// expect: no matching constructor for initialization of '__private tensor<__local half
#include "common/lily_metal.h"
#include "common/tensor_ops.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device half* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  auto t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(y, dextents<int32_t, 2>(8, 8));
  (void)t;
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
