// Elementwise activations (SwiGLU, sigmoid gate). Kernels: shaders/elementwise.metal.
#pragma once
#include <cstdint>

#include "gpu/dtype.h"
#include "gpu/encoder.h"

namespace lily::gpu::ops {

enum class Elementwise : uint8_t {
  swiglu,       // y = silu(a) * b
  sigmoid_mul,  // y = a * sigmoid(b); b per element, or one per row when b_per_row
};

struct ElementwiseOperands {
  Elementwise op = Elementwise::swiglu;
  Binding a, b, y;  // [rows, cols] (b: [rows, 1] when b_per_row), dtype
  DType dtype = DType::f32;
  uint32_t rows = 0, cols = 0;
  bool b_per_row = false;
};

KernelId elementwise_kernel(Elementwise op, DType dtype);
void encode_elementwise(Encoder& enc, const ElementwiseOperands& op);

}  // namespace lily::gpu::ops
