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

// simd_sum of N values per lane at once, reduce-scattered: returns one value's total and leaves the
// others undefined; the lane holds the total of value simd_scatter_index<N>(lane) (lanes with the
// same index hold the same total). At stride s = 1, 2, 4, ... a lane keeps half of its values,
// sends the other half to lane ^ s and adds what it receives, until one value is left, then the
// strides that remain add it as a butterfly: N - 1 + 5 - log2(N) shuffles and adds where N
// simd_sums take 5 N. Each total is simd_sum's bit for bit as the emulator and the cuda device
// define it: the same pairwise tree in lane order (an aligned block of s lanes added to the next
// one; a + b == b + a in IEEE arithmetic). Metal leaves simd_sum's order unspecified.
// N a power of two <= 32; v is overwritten; every lane of a full simdgroup (32 lanes) calls it, in
// uniform control flow.
template <uint32_t N>
inline uint32_t simd_scatter_index(uint32_t lane) {
  uint32_t j = 0, n = N;
  LILY_UNROLL
  for (uint32_t s = 1; s < 32u; s *= 2) {
    if (n > 1) {
      n /= 2;
      if ((lane & s) != 0) j += n;
    }
  }
  return j;
}

// One stride s of simd_sum_scatter on the lane's n values (then the next stride), by recursion so
// that every index stays a compile-time constant (registers, never the stack).
template <uint32_t n>
inline float simd_scatter_step(thread float* v, uint32_t lane, ushort s) {
  constexpr uint32_t h = n / 2;
  const bool upper = (lane & s) != 0;  // keeps the upper half of its values
  LILY_UNROLL
  for (uint32_t i = 0; i < h; ++i) {
    const float keep = upper ? v[i + h] : v[i];
    v[i] = keep + simd_shuffle_xor(upper ? v[i] : v[i + h], s);
  }
  return simd_scatter_step<h>(v, lane, ushort(2 * s));
}

template <>
inline float simd_scatter_step<1>(thread float* v, uint32_t lane, ushort s) {
  float t = v[0];
  for (ushort r = s; r < 32; r *= 2) t = t + simd_shuffle_xor(t, r);
  return t;
}

template <uint32_t N>
inline float simd_sum_scatter(thread float* v, uint32_t lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N is a power of two <= 32");
  return simd_scatter_step<N>(v, lane, ushort(1));
}

}  // namespace lily
