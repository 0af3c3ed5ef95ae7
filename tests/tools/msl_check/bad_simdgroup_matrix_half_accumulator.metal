// bfloat operands into a half accumulator: not a simdgroup_multiply_accumulate of MSL.
// expect: no matching function for call to 'simdgroup_multiply_accumulate'
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device half* y [[buffer(1)]], LILY_KERNEL_TAIL) {
  simdgroup_bfloat8x8 a = make_filled_simdgroup_matrix<bfloat, 8, 8>(bfloat(1.0f));
  simdgroup_half8x8 c = make_filled_simdgroup_matrix<half, 8, 8>(half(0.0f));
  simdgroup_multiply_accumulate(c, a, a, c);
  simdgroup_store(c, y, 8);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
