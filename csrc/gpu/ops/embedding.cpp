#include "gpu/ops/embedding.h"

#include <stdexcept>
#include <string>

namespace lily::gpu::ops {

KernelId embedding_kernel(uint32_t bits, DType o, DType s) {
  if (bits < 2 || bits > 8 || bits == 7)
    throw std::invalid_argument("embedding: bits=" + std::to_string(bits) + " unsupported (2, 3, 4, 5, 6 or 8)");
  const bool ob = o == DType::bf16, sb = s == DType::bf16;
  if (bits != 4 && bits != 8) {
    if (!sb) throw std::invalid_argument("embedding: " + std::to_string(bits) + "-bit tables take bfloat16 scales");
    return width_kernel(ob ? WidthFamily::embedding_xbf16 : WidthFamily::embedding_xf32, bits);
  }
  if (bits == 4)
    return ob ? (sb ? KernelId::embedding_b4_xbf16_sbf16 : KernelId::embedding_b4_xbf16_sf32)
              : (sb ? KernelId::embedding_b4_xf32_sbf16 : KernelId::embedding_b4_xf32_sf32);
  return ob ? (sb ? KernelId::embedding_b8_xbf16_sbf16 : KernelId::embedding_b8_xbf16_sf32)
            : (sb ? KernelId::embedding_b8_xf32_sbf16 : KernelId::embedding_b8_xf32_sf32);
}

void encode_embedding(Encoder& enc, const EmbeddingOperands& op) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("embedding: " + m); };
  if (op.tokens == 0 || op.vocab == 0 || op.D == 0) fail("empty shape");
  if (op.group_size != 32 && op.group_size != 64 && op.group_size != 128)
    fail("group_size=" + std::to_string(op.group_size) + " unsupported (32, 64 or 128)");
  if (op.D % op.group_size) fail("D is not a multiple of group_size");
  const KernelId k = embedding_kernel(op.bits, op.out_dtype, op.scale_dtype);
  auto need = [&](const Binding& b, uint64_t bytes, const char* what) {
    if (b.buffer == nullptr) fail(std::string(what) + " not bound");
    if (b.bytes < bytes) fail(std::string(what) + " range has " + std::to_string(b.bytes) + " bytes, needs " + std::to_string(bytes));
    return b;  // the table is bound whole: which rows are read depends on the ids
  };
  const uint64_t groups = uint64_t(op.vocab) * (op.D / op.group_size);
  EmbeddingArgs args{op.tokens, op.vocab, op.D, op.group_size};
  enc.set_kernel(k);
  enc.set_args(args);
  Binding ids = need(op.ids, uint64_t(op.tokens) * 4, "ids");
  ids.bytes = uint64_t(op.tokens) * 4;
  enc.set_buffer(1, ids);
  enc.set_buffer(2, need(op.table, uint64_t(op.vocab) * op.D * op.bits / 8, "table"));
  enc.set_buffer(3, need(op.scales, groups * dtype_size(op.scale_dtype), "scales"));
  enc.set_buffer(4, need(op.biases, groups * dtype_size(op.scale_dtype), "biases"));
  // Read: one row of codes, scales and biases per token (the table is bound whole).
  const uint64_t row_groups = uint64_t(op.tokens) * (op.D / op.group_size);
  enc.set_touched(2, uint64_t(op.tokens) * op.D * op.bits / 8);
  enc.set_touched(3, row_groups * dtype_size(op.scale_dtype));
  enc.set_touched(4, row_groups * dtype_size(op.scale_dtype));
  Binding out = need(op.out, uint64_t(op.tokens) * op.D * dtype_size(op.out_dtype), "out");
  out.bytes = uint64_t(op.tokens) * op.D * dtype_size(op.out_dtype);
  enc.set_buffer(5, out);
  const uint32_t per_group = kEmbedThreads * kEmbedPerThread;
  enc.dispatch({(op.D + per_group - 1) / per_group, op.tokens, 1}, {kEmbedThreads, 1, 1});
}

}  // namespace lily::gpu::ops
