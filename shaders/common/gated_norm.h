// The DeltaNet's gated RMSNorm, per element: y = rmsnorm(o) * norm_weight * silu(z), in fp32, as
// one expression shared by every kernel that writes or reads it (gd_chunk_norm, qmv1_gated), so
// their values are the same. Reference: lily_py.reference.ops (sigmoid, gated RMSNorm).
#pragma once
#include "common/lily_metal.h"

namespace lily {

// sigmoid(x) with exp of a non-positive number only (never overflows); same formula as
// lily_py.reference.ops.sigmoid.
inline float gn_sigmoid(float x) {
  const float e = exp(-abs(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// One gated, normalized value: o * inv_rms * norm_weight * silu(z), left to right in fp32.
inline float gated_norm_value(float o, float inv_rms, float norm_weight, float z) {
  return o * inv_rms * norm_weight * (z * gn_sigmoid(z));
}

}  // namespace lily
