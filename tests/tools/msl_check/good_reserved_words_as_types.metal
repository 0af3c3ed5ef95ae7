// half and bfloat as types (values, pointers, casts, template arguments) and names that only contain
// reserved words (half_stride, vertex_count, thread_pos, device_rows): all legal MSL.
#include "common/lily_metal.h"
namespace lily {
template <typename T>
inline T twice(T v) { return v + v; }
template <typename T>
[[kernel]] void k(constant uint& half_stride [[buffer(0)]], const device half* x [[buffer(1)]],
                  device T* y [[buffer(2)]], LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(half, staged, [32]);
  const uint32_t vertex_count = half_stride + thread_pos.x, device_rows = 2;
  staged[lane] = x[lane * half_stride];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup half* p = staged;
  const half h = twice<half>(p[lane]);
  const bfloat b = bfloat(float(h));
  y[grid_pos.x] = T(float(b) + float(vertex_count + device_rows) + float(sizeof(half)));
}
LILY_INSTANTIATE("k", k<float>)
LILY_INSTANTIATE("k_bf16", k<bfloat>)
}  // namespace lily
