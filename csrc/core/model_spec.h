// What the engine needs to know about one qwen3_5_moe checkpoint: the text config's dimensions,
// the per-class quantization (MLX affine) and the run-time sizes (context, prefill chunk).
// Filled by lily_py (src/lily_py/_engine.py: spec_from_config) from the validated ModelConfig
// and the loaded weights, or from the real 35B config alone to count dispatches without weights.
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "gpu/dtype.h"

namespace lily::core {

// MLX affine quantization of one class of weights: uint32 codes, one scale + bias per group.
struct QuantSpec {
  uint32_t bits = 4;
  uint32_t group_size = 64;
  gpu::DType scale_dtype = gpu::DType::bf16;
  bool operator==(const QuantSpec&) const = default;
};

// The parts of the projections row-concatenated at load (fused uploads), in row order. Their
// names in ModelSpec::quant_overrides are "<fused>:<part>" ("layers.3.qkv_proj:v"). Parts that
// agree in quantization share one weight and one dispatch; where they differ, each run of
// agreeing neighbours is its own weight "<fused>:<part>+<part>" (core/engine_buffers.cpp alloc_fused),
// one dispatch each.
inline constexpr const char* kQkvParts[] = {"q", "k", "v"};                       // attention qkv_proj
inline constexpr const char* kInProjParts[] = {"qkv", "z", "b", "a"};             // DeltaNet in_proj
inline constexpr const char* kRouterParts[] = {"router", "shared_expert_gate"};  // MoE router

struct ModelSpec {
  // text config (MODEL_FACTS.md section 3)
  uint32_t vocab = 0, hidden = 0, layers = 0;
  std::vector<uint8_t> full_attention;  // [layers]: 1 = gated full attention, 0 = Gated DeltaNet
  uint32_t q_heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  double rope_theta = 1e7;
  uint32_t lin_k_heads = 0, lin_v_heads = 0, lin_k_dim = 0, lin_v_dim = 0, conv_kernel = 4;
  uint32_t experts = 0, top_k = 0, moe_inter = 0, shared_inter = 0;
  float eps = 1e-6f;
  // quantization per weight class: the default of every weight of the class
  QuantSpec embed, lm_head, mixer, experts_q, router;
  // Mixed-bit checkpoints: the weights (or parts of a fused weight) whose quantization differs
  // from their class's default, by engine name: "embed", "lm_head", "layers.0.out_proj",
  // "layers.0.in_proj:z", "layers.3.qkv_proj:q", "layers.3.o_proj", "layers.1.router:router",
  // "layers.1.router:shared_expert_gate", "layers.1.experts.gate" (.up, .down), "layers.1.shared.gate"
  // (.up, .down). validate() refuses a name the model does not have.
  std::map<std::string, QuantSpec> quant_overrides;
  // Element type of the activations between kernels (residual stream, norm outputs, projection
  // inputs and outputs, conv window, MoE x / logits): bfloat16 as MLX computes a bf16 checkpoint,
  // or float32. Accumulation, the DeltaNet state, MoE intermediates and the logits stay fp32.
  gpu::DType activations = gpu::DType::f32;
  // run-time sizes
  uint32_t context_length = 0;  // KV cache rows per attention layer
  uint32_t kv_block_tokens = 1024;  // tokens per KV cache block (docs/memory.md: a power of two >= 32)
  uint32_t kv_pool_blocks = 0;      // blocks allocated per K / V pool (0: kv_blocks(), the whole context)
  uint32_t kv_blocks() const { return (context_length + kv_block_tokens - 1) / kv_block_tokens; }
  uint32_t kv_pool() const { return kv_pool_blocks ? std::min(kv_pool_blocks, kv_blocks()) : kv_blocks(); }
  // KV cache element type (lily_py's kv_dtype; shaders/common/kv_blocks.h): bf16, int8 codes with
  // a float scale per row, or float32; bytes of one position of one KV head in a K or V pool
  gpu::KvFormat kv_format = gpu::KvFormat::bf16;
  uint64_t kv_row_bytes() const { return gpu::kv_row_bytes(kv_format, head_dim); }
  uint32_t prefill_chunk = 0;   // most tokens one step encodes (scratch is sized for it)
  uint32_t logit_rows = 0;      // most rows of logits one step writes (all_logits)

  uint32_t conv_dim() const { return 2 * lin_k_heads * lin_k_dim + lin_v_heads * lin_v_dim; }
  uint32_t value_dim() const { return lin_v_heads * lin_v_dim; }
  uint32_t attn_qkv_rows() const { return 2 * q_heads * head_dim + 2 * kv_heads * head_dim; }

  // The quantization of weight (or part) `name` of class default `cls`.
  const QuantSpec& quant(const std::string& name, const QuantSpec& cls) const {
    auto it = quant_overrides.find(name);
    return it == quant_overrides.end() ? cls : it->second;
  }

  // Throws std::invalid_argument naming the first unsupported or inconsistent field.
  void validate() const;
  std::string summary() const;
};

}  // namespace lily::core
