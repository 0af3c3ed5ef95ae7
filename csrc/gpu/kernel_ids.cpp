#include "gpu/kernel_ids.h"

namespace lily::gpu {

std::optional<KernelId> find_kernel(std::string_view name) {
  for (const KernelInfo& k : kKernelTable)
    if (k.name == name) return k.id;
  return std::nullopt;
}

}  // namespace lily::gpu

#include "gpu/encoder.h"

namespace lily::gpu {

// The unit each kernel's arithmetic runs on (estimates by unit: benchmarks/prefill_estimate.py).
// A new kernel: tensor-op kernels are found by kernel_needs_tensor_ops; add simdgroup-matrix
// kernels to the prefixes below (everything else counts as plain ALU code), or set the unit per
// dispatch in the host code (Encoder::set_unit).
ExecUnit kernel_default_unit(KernelId id) {
  // quantize_i8 is built into lily_m5.metallib (only the int8 opt-in uses it) but is plain ALU code
  if (id == KernelId::quantize_i8_xbf16 || id == KernelId::quantize_i8_xf32) return ExecUnit::alu;
  if (kernel_needs_tensor_ops(id)) return ExecUnit::tensor;
  const std::string_view n = kernel_info(id).name;
  // bf16 simdgroup-matrix tiles, double-buffered, one barrier per K step (issue 11 item 2)
  for (std::string_view p : {"qmm_bf16_", "moe_gate_up_bf16_", "moe_down_bf16_", "attn_prefill_tiles_"})
    if (n.starts_with(p)) return ExecUnit::simdgroup_bf16;
  // fp32 8x8 simdgroup-matrix tiles: qmm's 32 x 32 tiles, the MoE fp32 grouped tiles, the fp32
  // prefill attention mma, the chunked delta rule's WY and state products
  for (std::string_view p : {"qmm_b", "moe_gate_up_mm", "moe_down_mm", "attn_prefill_mma_", "gd_chunk_wy_",
                             "gd_chunk_state_"})
    if (n.starts_with(p)) return ExecUnit::simdgroup_fp32;
  return ExecUnit::alu;
}

}  // namespace lily::gpu
