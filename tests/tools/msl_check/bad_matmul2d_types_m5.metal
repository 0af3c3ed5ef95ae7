// A matmul2d run on bfloat operands: not a row of the types the kernels use (half x half ->
// float / half, int8 x int8 -> int32).
// expect: matmul2d: operand / destination element types not in the table
#include "common/lily_metal.h"
#include "common/tensor_ops.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device float* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(bfloat, a, [32 * 32]);
  LILY_TG_ARRAY(float, c, [32 * 32]);
  constexpr auto desc = matmul2d_descriptor(32, 32, 32);
  matmul2d<desc, execution_simdgroup> op;
  auto at = tensor<threadgroup bfloat, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(32, 32));
  auto ct = tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline>(c, dextents<int32_t, 2>(32, 32));
  op.run(at, at, ct);
  y[lane] = c[lane];
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
