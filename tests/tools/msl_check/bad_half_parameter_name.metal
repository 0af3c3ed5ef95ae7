// `half` as a parameter's name (was in a shader: `threadgroup uint4* half`).
// expect: [reserved-name] 'half' declared as a name
#include "common/lily_metal.h"
namespace lily {
inline void stage(const device uint4* src, threadgroup uint4* half, uint32_t i) { half[i] = src[i]; }
template <typename T>
[[kernel]] void k(constant uint& n [[buffer(0)]], const device uint4* x [[buffer(1)]], device T* y [[buffer(2)]],
                  LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint4, tile, [32]);
  stage(x, tile, lane);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[grid_pos.x] = T(float(tile[lane].x));
}
LILY_INSTANTIATE("k", k<float>)
}  // namespace lily
