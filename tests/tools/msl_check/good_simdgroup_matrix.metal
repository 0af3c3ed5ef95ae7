// bfloat x bfloat into float accumulators, loads from device and threadgroup memory.
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device T* x [[buffer(1)]], device float* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(T, tile, [64]);
  tile[lane] = x[lane];
  tile[lane + 32] = x[lane + 32];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<T, 8, 8> a, b;
  simdgroup_load(a, x, 8);
  simdgroup_load(b, tile, 8, ulong2(0), true);
  simdgroup_float8x8 c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_multiply_accumulate(c, a, b, c);
  simdgroup_store(c, y, 8);
}
LILY_INSTANTIATE("k_bf16", k<bfloat>)
LILY_INSTANTIATE("k_f16", k<half>)
}  // namespace lily
