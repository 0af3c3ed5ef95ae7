// Threadgroup reductions shared by the kernels.
#pragma once
#include "common/lily_metal.h"

namespace lily {

// Sum of one float per thread over the whole threadgroup; every thread returns the same total
// (partials summed in simdgroup order). `partials` is threadgroup scratch of >= 32 floats that
// the caller must not reuse without another barrier. Every thread must call it (one barrier).
inline float threadgroup_sum(float v, threadgroup float* partials, uint32_t lane, uint32_t simd_id,
                             uint32_t threads) {
  const float s = simd_sum(v);
  if (lane == 0) partials[simd_id] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint32_t i = 0; i < (threads + 31) / 32; ++i) total += partials[i];
  return total;
}

}  // namespace lily
