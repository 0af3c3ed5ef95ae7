// The model spec and its checks: ModelSpec::validate() (dims, quantization classes, the names of
// every quantized weight) and ModelSpec::summary().
#include "core/engine.h"

#include <map>
#include <sstream>
#include <string>

#include "core/engine_internal.h"
#include "gpu/ops/moe.h"

namespace lily::core {

using detail::fail;
using detail::num;

namespace {

template <size_t N>
std::string list(const uint32_t (&v)[N]) {
  std::string s;
  for (uint32_t x : v) s += (s.empty() ? "" : "/") + num(x);
  return s;
}

// experts: read by the MoE expert kernels (kEngineExpertBits), else by the quantized matmul or
// the embedding (kEngineBits).
void check_quant(const QuantSpec& q, const std::string& what, bool experts = false) {
  const bool bits_ok = experts ? std::ranges::find(kEngineExpertBits, q.bits) != std::end(kEngineExpertBits)
                               : std::ranges::find(kEngineBits, q.bits) != std::end(kEngineBits);
  if (!bits_ok)
    fail(what + ": bits=" + num(q.bits) + " unsupported (" + (experts ? list(kEngineExpertBits) : list(kEngineBits)) +
         ")");
  if (std::ranges::find(kEngineGroupSizes, q.group_size) == std::end(kEngineGroupSizes))
    fail(what + ": group_size=" + num(q.group_size) + " unsupported (" + list(kEngineGroupSizes) + ")");
}

std::string describe(const QuantSpec& q) { return num(q.bits) + "-bit group " + num(q.group_size); }

// Every name ModelSpec::quant_overrides may hold -> whether the MoE expert kernels read it.
std::map<std::string, bool> quant_names(const ModelSpec& s) {
  std::map<std::string, bool> n{{"embed", false}, {"lm_head", false}};
  for (uint32_t i = 0; i < s.layers; ++i) {
    const std::string p = "layers." + num(i) + ".";
    if (s.full_attention[i]) {
      for (const char* part : kQkvParts) n[p + "qkv_proj:" + part] = false;
      n[p + "o_proj"] = false;
    } else {
      for (const char* part : kInProjParts) n[p + "in_proj:" + part] = false;
      n[p + "out_proj"] = false;
    }
    for (const char* part : kRouterParts) n[p + "router:" + part] = false;
    for (const char* w : {"experts.gate", "experts.up", "experts.down", "shared.gate", "shared.up", "shared.down"})
      n[p + w] = true;
  }
  return n;
}

}  // namespace

void ModelSpec::validate() const {
  if (vocab == 0 || hidden == 0 || layers == 0) fail("empty model (vocab, hidden, layers)");
  if (full_attention.size() != layers) fail("full_attention has " + num(full_attention.size()) + " entries for " + num(layers) + " layers");
  if (lin_k_heads == 0 || lin_v_heads == 0 || lin_k_dim == 0 || lin_v_dim == 0) fail("empty DeltaNet dims");
  if (experts == 0 || top_k == 0 || moe_inter == 0 || shared_inter == 0) fail("empty MoE dims");
  if (context_length == 0) fail("context_length must be >= 1");
  if (kv_block_tokens < 32 || (kv_block_tokens & (kv_block_tokens - 1)) != 0)
    fail("kv_block_tokens must be a power of two >= 32, got " + num(kv_block_tokens));
  if (kv_format == gpu::KvFormat::q8 && head_dim != 64 && head_dim != 128 && head_dim != 256 && std::count(full_attention.begin(), full_attention.end(), 1))
    fail("kv_dtype int8 needs head_dim 64, 128 or 256 (the int8 attention routes), got " + num(head_dim));
  if (prefill_chunk == 0) fail("prefill_chunk must be >= 1");
  if (logit_rows == 0 || logit_rows > prefill_chunk) fail("logit_rows must be in [1, prefill_chunk]");
  check_quant(embed, "embed");
  check_quant(lm_head, "lm_head");
  check_quant(mixer, "mixer projections");
  check_quant(experts_q, "experts", true);
  check_quant(router, "router");
  const std::map<std::string, bool> names = quant_names(*this);
  for (const auto& [name, q] : quant_overrides) {
    auto it = names.find(name);
    if (it == names.end()) fail("quant_overrides: the model has no weight (or fused part) '" + name + "'");
    check_quant(q, name, it->second);
  }
  // The MoE kernels read the routed and the shared expert in one dispatch per stage: gate + up
  // (experts.gate, experts.up, shared.gate, shared.up) and down (experts.down, shared.down). The
  // routed matrices of a stage agree, and so do the shared ones; the shared expert may have its
  // own width where a kernel is built for the pair (gpu::ops::moe_shared_width_built), in the
  // stage's group size.
  for (uint32_t i = 0; i < layers; ++i) {
    const std::string p = "layers." + num(i) + ".";
    for (const auto& stage : {std::vector<std::string>{"experts.gate", "experts.up", "shared.gate", "shared.up"},
                              std::vector<std::string>{"experts.down", "shared.down"}}) {
      const QuantSpec& first = quant(p + stage[0], experts_q);
      const QuantSpec& shared = quant(p + (stage.size() == 4 ? stage[2] : stage[1]), experts_q);
      for (const std::string& w : stage) {
        const QuantSpec& q = quant(p + w, experts_q);
        const QuantSpec& want = w.starts_with("shared.") ? shared : first;
        if (!(q == want) || q.group_size != first.group_size || q.scale_dtype != first.scale_dtype)
          fail(p + w + " is " + describe(q) + " but " + p + stage[0] + " is " + describe(first) +
               ": one MoE kernel reads both (the routed matrices of a stage must agree in quantization, the "
               "shared ones too, and the shared expert may differ from the routed ones in bits only)");
      }
      if (shared.bits != first.bits && !gpu::ops::moe_shared_width_built(first.bits, shared.bits))
        fail(p + stage.back() + " is " + describe(shared) + " but " + p + stage[0] + " is " + describe(first) +
             ": the MoE kernels take the shared expert at its own width for routed/shared bits " +
             gpu::ops::moe_shared_widths_text());
    }
  }
  if (!(eps > 0)) fail("eps must be > 0");
}

std::string ModelSpec::summary() const {
  std::ostringstream o;
  uint32_t attn = 0;
  for (uint8_t a : full_attention) attn += a;
  o << layers << " layers (" << layers - attn << " DeltaNet, " << attn << " attention), hidden " << hidden << ", vocab "
    << vocab << ", " << experts << " experts top-" << top_k << ", context " << context_length << ", chunk "
    << prefill_chunk;
  if (kv_format != gpu::KvFormat::bf16) o << ", " << gpu::kv_format_name(kv_format) << " KV cache";
  return o.str();
}

}  // namespace lily::core
