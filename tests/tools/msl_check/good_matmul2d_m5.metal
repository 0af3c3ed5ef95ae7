// half x half -> float on a cooperative destination, a float tensor of the same op's layout, and
// int8 x uint8 -> int32 (Metal 4 with tensor ops: the _m5 suffix).
#include "common/lily_metal.h"
#include "common/tensor_ops.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device half* x [[buffer(1)]], device float* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(half, a, [32 * 32]);
  LILY_TG_ARRAY(int8_t, q, [32 * 32]);
  LILY_TG_ARRAY(uint8_t, w, [32 * 32]);
  constexpr auto desc = matmul2d_descriptor(32, 32, 32, false, true, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> op;
  auto at = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(32, 32));
  auto xt = tensor<device half, dextents<int32_t, 2>, tensor_inline>(const_cast<device half*>(x), dextents<int32_t, 2>(32, 32));
  auto acc = op.get_destination_cooperative_tensor<decltype(at), decltype(xt), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) acc[i] = 0.0f;
  op.run(at, xt, acc);
  auto qt = tensor<threadgroup int8_t, dextents<int32_t, 2>, tensor_inline>(q, dextents<int32_t, 2>(32, 32));
  auto wt = tensor<threadgroup uint8_t, dextents<int32_t, 2>, tensor_inline>(w, dextents<int32_t, 2>(32, 32));
  auto d = op.get_destination_cooperative_tensor<decltype(qt), decltype(wt), int32_t>();
  op.run(qt, wt, d);
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);
    y[idx[1] * 32 + idx[0]] = acc[i] + float(d[i]);
  }
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
