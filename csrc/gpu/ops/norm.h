// RMSNorm (plain and residual-fused). Kernels: shaders/norm.metal.
#pragma once
#include <cstdint>

#include "gpu/dtype.h"
#include "gpu/encoder.h"

namespace lily::gpu::ops {

struct RmsNormOperands {
  Binding x;         // [rows, D] of x_dtype
  Binding residual;  // [rows, D] of x_dtype; unbound (buffer == nullptr) for the plain norm
  Binding weight;    // [D] of w_dtype
  Binding h_out;     // [rows, D] of x_dtype (fused only): x + residual; may be `residual` itself
  Binding y;         // [rows, D] of x_dtype
  DType x_dtype = DType::f32;
  DType w_dtype = DType::f32;
  uint32_t rows = 0, D = 0;
  float eps = 1e-6f;
  float weight_offset = 0.0f;  // 1 for zero-centred (Hugging Face) weights
};

// Threads per threadgroup for a row of D elements (one threadgroup per row).
uint32_t rms_norm_threads(uint32_t D);
KernelId rms_norm_kernel(bool fused, DType x_dtype, DType w_dtype);
void encode_rms_norm(Encoder& enc, const RmsNormOperands& op);

}  // namespace lily::gpu::ops
