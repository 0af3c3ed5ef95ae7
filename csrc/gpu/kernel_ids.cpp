#include "gpu/kernel_ids.h"

#include <array>
#include <stdexcept>
#include <string>

namespace lily::gpu {

std::optional<KernelId> find_kernel(std::string_view name) {
  for (const KernelInfo& k : kKernelTable)
    if (k.name == name) return k.id;
  return std::nullopt;
}

namespace {

struct WidthPattern {
  const char* head;
  const char* tail;
};
// In WidthFamily's order; all with bfloat16 scales (the only scales the generic widths are built for).
constexpr WidthPattern kWidthPatterns[] = {
    {"qmv", "_xf32_sbf16"}, {"qmv", "_xbf16_sbf16"}, {"qmv", "_xbf16_sbf16_yf32"},
    {"qmv1", "_xf32_sbf16"}, {"qmv1", "_xbf16_sbf16"}, {"qmv1", "_xbf16_sbf16_yf32"},
    {"qmv1", "_xf32_sbf16_r1"}, {"qmv1", "_xbf16_sbf16_r1"}, {"qmv1", "_xbf16_sbf16_yf32_r1"},
    {"qmm", "_xf32_sbf16"}, {"qmm", "_xbf16_sbf16"}, {"qmm", "_xbf16_sbf16_yf32"},
    {"embedding", "_xf32_sbf16"}, {"embedding", "_xbf16_sbf16"},
    {"moe_gate_up_mv", "_xf32_sbf16"}, {"moe_gate_up_mv", "_xbf16_sbf16"},
    {"moe_down_mv", "_xf32_sbf16"}, {"moe_down_mv", "_xbf16_sbf16"},
    {"moe_gate_up_mm32", "_xf32_sbf16"}, {"moe_gate_up_mm32", "_xbf16_sbf16"},
    {"moe_gate_up_mm64", "_xf32_sbf16"}, {"moe_gate_up_mm64", "_xbf16_sbf16"},
    {"moe_gate_up_few", "_xf32_sbf16"}, {"moe_gate_up_few", "_xbf16_sbf16"},
    {"moe_down_mm32", "_sbf16"}, {"moe_down_mm64", "_sbf16"}, {"moe_down_few", "_sbf16"},
};
static_assert(sizeof(kWidthPatterns) / sizeof(kWidthPatterns[0]) == size_t(WidthFamily::count),
              "one pattern per WidthFamily");
constexpr uint32_t kMaxBits = 8;

std::string width_name(WidthFamily f, uint32_t bits, uint32_t sbits) {
  const WidthPattern& p = kWidthPatterns[size_t(f)];
  const std::string s = sbits != 0 && sbits != bits ? "s" + std::to_string(sbits) : "";
  return std::string(p.head) + "_b" + std::to_string(bits) + s + p.tail;
}

// table[f][bits][sbits]: the kernel, or kNumKernels where none is built (filled once, thread-safe);
// sbits == bits is the uniform kernel.
const auto& width_table() {
  using Table = std::array<std::array<std::array<uint16_t, kMaxBits + 1>, kMaxBits + 1>, size_t(WidthFamily::count)>;
  static const Table table = [] {
    Table t{};
    for (size_t f = 0; f < t.size(); ++f)
      for (uint32_t b = 0; b <= kMaxBits; ++b)
        for (uint32_t s = 0; s <= kMaxBits; ++s) {
          const auto id = b >= 2 && s >= 2 ? find_kernel(width_name(WidthFamily(f), b, s)) : std::nullopt;
          t[f][b][s] = id ? uint16_t(*id) : uint16_t(kNumKernels);
        }
    return t;
  }();
  return table;
}

}  // namespace

bool width_kernel_built(WidthFamily family, uint32_t bits, uint32_t shared_bits) {
  const uint32_t s = shared_bits ? shared_bits : bits;
  return bits <= kMaxBits && s <= kMaxBits && width_table()[size_t(family)][bits][s] != kNumKernels;
}

KernelId width_kernel(WidthFamily family, uint32_t bits, uint32_t shared_bits) {
  const uint32_t s = shared_bits ? shared_bits : bits;
  if (width_kernel_built(family, bits, s)) return KernelId(width_table()[size_t(family)][bits][s]);
  std::string built;
  for (uint32_t b = 2; b <= kMaxBits; ++b)
    for (uint32_t c = 2; c <= kMaxBits; ++c)
      if (width_table()[size_t(family)][b][c] != kNumKernels)
        built += (built.empty() ? "" : ", ") + (b == c ? std::to_string(b) : std::to_string(b) + "/" + std::to_string(c));
  throw std::invalid_argument("no kernel " + width_name(family, bits, s) + ": " + kWidthPatterns[size_t(family)].head +
                              " is built for bits " + built + " (b/s: routed / shared expert) with bfloat16 scales");
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
