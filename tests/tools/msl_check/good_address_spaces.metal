// Pointers and references that name their address space: parameters, locals, fields, return
// types, casts, typedefs, template parameter pointees, and `auto` (the type deduced from a
// pointer or reference that has one).
#include "common/lily_metal.h"
namespace lily {
typedef const device float* DeviceRow;
struct Rows {
  device float* out;
  const constant uint* sizes;
};
template <typename T>
inline float first(const device T* p) { return float(p[0]); }
inline void accumulate(thread float& out, float v) { out += v; }
inline threadgroup float* slot(threadgroup float* base, uint32_t i) { return base + i; }
inline uint32_t bits_of(thread const float* p) { return *reinterpret_cast<thread const uint32_t*>(p); }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device T* x [[buffer(1)]], device float* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, partial, [32]);
  float acc = first(x + lane);
  accumulate(acc, 1.0f);
  thread float& ref = acc;
  auto* tg = slot(partial, lane);
  *tg = ref;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  DeviceRow row = y;
  const auto& self = partial[lane];
  Rows r;
  r.out = y;
  r.sizes = &n;
  r.out[grid_pos.x] = row[0] + self + float(bits_of(&acc) & 1u) + float(r.sizes[0]);
}
LILY_INSTANTIATE("k", k<float>)
LILY_INSTANTIATE("k_bf16", k<bfloat>)
}  // namespace lily
