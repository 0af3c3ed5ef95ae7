#include "gpu/ops/elementwise.h"

#include <stdexcept>
#include <string>

namespace lily::gpu::ops {

KernelId elementwise_kernel(Elementwise op, DType t) {
  const bool bf = t == DType::bf16;
  if (op == Elementwise::swiglu) return bf ? KernelId::swiglu_bf16 : KernelId::swiglu_f32;
  return bf ? KernelId::sigmoid_mul_bf16 : KernelId::sigmoid_mul_f32;
}

void encode_elementwise(Encoder& enc, const ElementwiseOperands& op) {
  const char* name = op.op == Elementwise::swiglu ? "swiglu" : "sigmoid_mul";
  auto fail = [&](const std::string& m) { throw std::invalid_argument(std::string(name) + ": " + m); };
  if (op.rows == 0 || op.cols == 0) fail("empty shape");
  if (op.b_per_row && op.op != Elementwise::sigmoid_mul) fail("a per-row b is only for sigmoid_mul");
  const uint64_t es = dtype_size(op.dtype);
  const uint64_t full = uint64_t(op.rows) * op.cols * es;
  const uint64_t b_bytes = op.b_per_row ? uint64_t(op.rows) * es : full;
  auto need = [&](Binding b, uint64_t bytes, const char* what) {
    if (b.buffer == nullptr) fail(std::string(what) + " not bound");
    if (b.bytes < bytes) fail(std::string(what) + " range has " + std::to_string(b.bytes) + " bytes, needs " + std::to_string(bytes));
    b.bytes = bytes;
    return b;
  };
  ElementwiseArgs args{op.rows, op.cols, op.cols, op.b_per_row ? 1u : op.cols, op.cols, op.b_per_row ? 0u : 1u};
  enc.set_kernel(elementwise_kernel(op.op, op.dtype));
  enc.set_args(args);
  enc.set_buffer(1, need(op.a, full, "a"));
  enc.set_buffer(2, need(op.b, b_bytes, "b"));
  enc.set_buffer(3, need(op.y, full, "y"));
  enc.dispatch({(op.cols + kElementwiseThreads - 1) / kElementwiseThreads, op.rows, 1}, {kElementwiseThreads, 1, 1});
}

}  // namespace lily::gpu::ops
