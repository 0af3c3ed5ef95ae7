// msl_check: version=320
// The same fence at MSL 3.2, and relaxed device / threadgroup atomics (any version).
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], device atomic_uint* ticket [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, count, [1]);
  y[grid_pos.x] = T(1.0f);
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
  const uint32_t t = atomic_fetch_add_explicit(ticket, 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(reinterpret_cast<threadgroup atomic_uint*>(&count[0]), t, memory_order_relaxed);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
