// Quantized matmul y = x @ dequant(w)^T (MLX affine layout), routed by the number of rows M.
// Kernels: shaders/qmm.metal. Route and tile constants: shaders/common/args.h.
#pragma once
#include <cstdint>

#include "gpu/dtype.h"
#include "gpu/encoder.h"

namespace lily::gpu::ops {

enum class QmmRoute : uint8_t {
  qmv,  // M <= kQmvMaxRows: matrix-vector, every weight byte read once for all M rows
  qmm,  // M >  kQmvMaxRows: 32x32 output tiles, weights dequantized per tile into threadgroup memory
  qmm_m5,  // M > kQmvMaxRows, 4-bit, on a device with Metal 4 tensor ops: 64x64 tiles, matmul2d
};

// tensor_ops: the encoder's device runs the M5 kernels (Encoder::tensor_ops()).
QmmRoute qmm_route(uint32_t M, uint32_t bits = 4, bool tensor_ops = false);
const char* qmm_route_name(QmmRoute r);

// FLOPs (2 per multiply-add) of y = x @ w^T: useful 2 M N K; executed includes the tile padding
// of the route (encode_quantized_matmul adds both to the encoder's counters).
struct QmmFlops {
  uint64_t executed = 0, useful = 0;
};
QmmFlops qmm_flops(uint32_t M, uint32_t N, uint32_t K, uint32_t bits = 4, bool tensor_ops = false);

struct QmmOperands {
  Binding x;        // [M, x_stride] of x_dtype
  Binding w;        // uint32 [N, K * bits / 32]
  Binding scales;   // [N, K / group_size] of scale_dtype
  Binding biases;   // [N, K / group_size] of scale_dtype
  Binding y;        // [M, y_stride] of x_dtype
  DType x_dtype = DType::f32;
  DType scale_dtype = DType::f32;
  uint32_t M = 0, N = 0, K = 0;
  uint32_t bits = 4, group_size = 64;
  uint32_t x_stride = 0, y_stride = 0;  // 0 means packed (K, N)
};

// The kernel a route uses for these bits / dtypes; throws std::invalid_argument when unsupported.
KernelId qmm_kernel(QmmRoute route, uint32_t bits, DType x_dtype, DType scale_dtype);

// Throws std::invalid_argument naming the bad operand (shape, size, group, bits).
void validate(const QmmOperands& op);

// Encodes one dispatch (no barrier: the caller orders it against its producers/consumers).
void encode_quantized_matmul(Encoder& enc, const QmmOperands& op);

}  // namespace lily::gpu::ops
