#include "gpu/ops/norm.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace lily::gpu::ops {

uint32_t rms_norm_threads(uint32_t D) {
  const uint32_t per_8 = (D + 7) / 8;
  return std::min<uint32_t>(kNormMaxThreads, std::max<uint32_t>(32, (per_8 + 31) / 32 * 32));
}

KernelId rms_norm_kernel(bool fused, DType x, DType w) {
  const bool xb = x == DType::bf16, wb = w == DType::bf16;
  if (!fused)
    return xb ? (wb ? KernelId::rms_norm_xbf16_wbf16 : KernelId::rms_norm_xbf16_wf32)
              : (wb ? KernelId::rms_norm_xf32_wbf16 : KernelId::rms_norm_xf32_wf32);
  return xb ? (wb ? KernelId::rms_norm_residual_xbf16_wbf16 : KernelId::rms_norm_residual_xbf16_wf32)
            : (wb ? KernelId::rms_norm_residual_xf32_wbf16 : KernelId::rms_norm_residual_xf32_wf32);
}

void encode_rms_norm(Encoder& enc, const RmsNormOperands& op) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("rms_norm: " + m); };
  if (op.rows == 0 || op.D == 0) fail("empty shape");
  if (!(op.eps > 0.0f)) fail("eps must be > 0");
  const bool fused = op.residual.buffer != nullptr;
  const uint64_t row_bytes = uint64_t(op.D) * dtype_size(op.x_dtype);
  const uint64_t act = row_bytes * op.rows;
  auto need = [&](const Binding& b, uint64_t bytes, const char* what) {
    if (b.buffer == nullptr) fail(std::string(what) + " not bound");
    if (b.bytes < bytes) fail(std::string(what) + " range has " + std::to_string(b.bytes) + " bytes, needs " + std::to_string(bytes));
    Binding r = b;
    r.bytes = bytes;
    return r;
  };
  RmsNormArgs args{op.rows, op.D, op.eps, op.weight_offset};
  const KernelId kernel = rms_norm_kernel(fused, op.x_dtype, op.w_dtype);
  // Any multiple of 32 threads works (the kernel strides over the row): fit the pipeline's limit.
  const uint32_t limit = enc.thread_limit(kernel) / 32 * 32;
  if (limit == 0) fail("the pipeline's limit of " + std::to_string(enc.thread_limit(kernel)) + " threads is below one simdgroup");
  const uint32_t threads = std::min(rms_norm_threads(op.D), limit);
  enc.set_kernel(kernel);
  enc.set_args(args);
  uint32_t i = 1;
  enc.set_buffer(i++, need(op.x, act, "x"));
  if (fused) enc.set_buffer(i++, need(op.residual, act, "residual"));
  enc.set_buffer(i++, need(op.weight, uint64_t(op.D) * dtype_size(op.w_dtype), "weight"));
  if (fused) enc.set_buffer(i++, need(op.h_out, act, "h_out"));
  enc.set_buffer(i++, need(op.y, act, "y"));
  enc.dispatch({op.rows, 1, 1}, {threads, 1, 1});
}

}  // namespace lily::gpu::ops
