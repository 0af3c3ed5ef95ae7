// The DeltaNet's elementwise math in fp32: sigmoid, softplus, SiLU and the gated RMSNorm's value.
// One definition for every kernel that computes them (the conv's SiLU, beta, the decay, the scan,
// gd_chunk_norm, qmv1_gated), so their values agree. Reference: lily_py.reference.ops.
#pragma once
#include "common/lily_metal.h"

namespace lily {

// sigmoid(x) with exp of a non-positive number only (never overflows); same formula as
// lily_py.reference.ops.sigmoid.
inline float gn_sigmoid(float x) {
  const float e = exp(-abs(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// softplus(x) = max(x, 0) + log1p(exp(-|x|)); log1p(e) as log(u) * e / (u - 1) with u = 1 + e
// (exact to a few ulp even when e is far below 1 ulp of 1, where log(1 + e) would return 0).
inline float gn_softplus(float x) {
  const float e = exp(-abs(x));
  const float u = 1.0f + e;
  const float log1p_e = u == 1.0f ? e : log(u) * (e / (u - 1.0f));
  return max(x, 0.0f) + log1p_e;
}

inline float gn_silu(float x) { return x * gn_sigmoid(x); }

// One gated, normalized value: o * inv_rms * norm_weight * silu(z), left to right in fp32.
inline float gated_norm_value(float o, float inv_rms, float norm_weight, float z) {
  return o * inv_rms * norm_weight * gn_silu(z);
}

}  // namespace lily
