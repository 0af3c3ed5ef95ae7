// atomic_thread_fence (with memory_order_seq_cst and thread_scope) is MSL 3.2: the base library is
// built at MSL 3.1.
// expect: use of undeclared identifier 'memory_order_seq_cst'
#include "common/lily_metal.h"
namespace lily {
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], device T* y [[buffer(1)]], device atomic_uint* ticket [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  y[grid_pos.x] = T(1.0f);
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
  atomic_fetch_add_explicit(ticket, 1u, memory_order_relaxed);
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
