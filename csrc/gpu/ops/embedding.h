// Embedding lookup from the quantized table. Kernels: shaders/embedding.metal.
#pragma once
#include <cstdint>

#include "gpu/dtype.h"
#include "gpu/encoder.h"

namespace lily::gpu::ops {

struct EmbeddingOperands {
  Binding ids;     // uint32 [tokens]
  Binding table;   // uint32 [vocab, D * bits / 32]
  Binding scales;  // [vocab, D / group_size] of scale_dtype
  Binding biases;  // [vocab, D / group_size] of scale_dtype
  Binding out;     // [tokens, D] of out_dtype
  DType out_dtype = DType::f32;
  DType scale_dtype = DType::f32;
  uint32_t tokens = 0, vocab = 0, D = 0, bits = 4, group_size = 64;
};

KernelId embedding_kernel(uint32_t bits, DType out_dtype, DType scale_dtype);
void encode_embedding(Encoder& enc, const EmbeddingOperands& op);

}  // namespace lily::gpu::ops
