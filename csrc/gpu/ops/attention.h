// Gated-attention kernels: partial RoPE, fused q/k norm + RoPE + KV append, decode attention
// (single or split-K route) and causal prefill attention. Kernels: shaders/attention.metal,
// attention_decode.metal, attention_prefill.metal.
// Route and tile constants: shaders/common/args_attention.h.
#pragma once
#include <cstdint>
#include <vector>

#include "gpu/dtype.h"
#include "gpu/encoder.h"
#include "gpu/ops/qmm.h"

namespace lily::gpu::ops {

// inv_freq[i] = float32(1 / theta^(2i / rotary_dim)), computed in double and rounded once, exactly
// as lily_py.reference.ops.rope_cos_sin does (must match it: tests compare bit for bit).
std::vector<float> rope_inv_freq(uint32_t rotary_dim, double theta);

struct RopeOperands {
  Binding x;         // [tokens, heads, head_dim] of dtype
  Binding inv_freq;  // float32 [rotary_dim / 2]
  Binding y;         // [tokens, heads, head_dim] of dtype (may alias x)
  DType dtype = DType::f32;
  uint32_t tokens = 0, heads = 0, head_dim = 0, rotary_dim = 0, position = 0;
};
KernelId rope_kernel(DType dtype);
void encode_rope(Encoder& enc, const RopeOperands& op);

// The paged KV cache (shaders/common/kv_blocks.h): each K / V pool is bf16 [pool_blocks, kv_heads,
// block_tokens, head_dim]; logical block b (positions [b B, (b + 1) B)) is pool block table[b].
// With q8 the pools are int8 (common/kv_blocks.h): per block [kv_heads, block_tokens, head_dim]
// codes, then [kv_heads, block_tokens] float scales; written by qk_norm_rope_q8_*, read by the vec
// decode route and the tensor-op (M5), bf16 tiles (M1-M4, bf16 activations) or mma prefill routes
// (attn_decode_vec_q8_*, attn_prefill_m5_q8_*, attn_prefill_tiles_q8_*, attn_prefill_mma_q8_*).
// With f32 the pools are the bf16 layout in float: written by qk_norm_rope_kvf32_*, read by the
// decode routes (attn_decode_vec_kvf32_*, attn_decode_kvf32_*, attn_decode_split_kvf32_*) and the
// mma or simd prefill routes on every device (attn_prefill_mma_kvf32_*, attn_prefill_kvf32_*): the
// M5 and tiles routes stage K / V in half / bf16, and their staging in fp32 does not fit 32 KiB.
struct KvPaging {
  Binding table;              // uint32 [>= ceil(rows / block_tokens)] pool block of each logical block
  uint32_t block_tokens = 0;  // a power of two >= kAttnKvMinBlock
  uint32_t pool_blocks = 0;   // blocks in each pool (the bound K / V ranges)
  KvFormat format = KvFormat::bf16;
};
// Bytes of a cache row: kv_row_bytes(KvFormat, head_dim) in gpu/dtype.h.
// Whether an int8 cache can serve a model of this head_dim (the vec decode and mma prefill routes).
bool kv_q8_supported(uint32_t head_dim);
// Checks block_tokens and the pool size; `rows` positions [0, rows) must have table entries.
// Returns log2(block_tokens).
uint32_t check_kv_paging(const char* fn, const KvPaging& kv, uint32_t kv_heads, uint32_t head_dim, uint64_t rows);

struct QkNormRopeOperands {
  Binding qg;        // [tokens, q_heads, 2 * head_dim] of x_dtype (q_proj output: query | gate)
  Binding k, v;      // [tokens, kv_heads, head_dim] of x_dtype
  Binding q_norm;    // [head_dim] of w_dtype
  Binding k_norm;    // [head_dim] of w_dtype
  Binding inv_freq;  // float32 [rotary_dim / 2]
  Binding q_out;     // [tokens, q_heads, head_dim] of x_dtype
  Binding k_cache;   // paged pool (KvPaging); rows position .. position+tokens-1 written
  Binding v_cache;   // paged pool
  KvPaging kv;
  DType x_dtype = DType::f32;
  DType w_dtype = DType::f32;
  uint32_t tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  uint32_t position = 0;
  uint32_t qg_stride = 0, k_stride = 0, v_stride = 0;  // elements between tokens; 0: packed
  float eps = 1e-6f;
  float weight_offset = 0.0f;  // 1 for zero-centred (Hugging Face) norm weights
};
KernelId qk_norm_rope_kernel(DType x_dtype, DType w_dtype, KvFormat kv = KvFormat::bf16);
void encode_qk_norm_rope(Encoder& enc, const QkNormRopeOperands& op);

// Decode route for a context of `length` keys (the new token's included) and head_dim:
//  vec    head_dim 64, 128 or 256 (32 E, E = 2, 4, 8), any length: attn_decode_vec_e<E> over
//         `splits` key blocks of `split_keys` keys (min(kAttnVecMaxBlocks, ceil(length / 8))
//         blocks wanted; split_keys is that share rounded down to a power of two >= 8 (so at
//         most twice as many blocks), at most block_tokens, so each threadgroup reads within one
//         cache block; none empty), barrier,
//         attn_vec_combine_e<E>
//  single other head_dims, length <= kAttnSplitKeys: one pass (attn_decode_*)
//  split  other head_dims, longer: attn_decode_split_* + barrier + attn_combine_*
// Each first pass has its twin per cache format (attention_decode_kernel); the combines read fp32
// partials whatever the cache.
struct AttnRoute {
  bool split = false;       // true: two passes (vec or split) with partials in the scratch
  bool vec = false;         // the vec route
  uint32_t splits = 1;      // key ranges (blocks)
  uint32_t split_keys = 0;  // keys per range; 0 on the single route
};
bool attention_decode_uses_vec(uint32_t head_dim);
AttnRoute attention_decode_route(uint32_t length, uint32_t head_dim, uint32_t block_tokens);

struct AttentionOperands {
  Binding q;           // [tokens, q_heads, head_dim] of dtype, q_stride elements between tokens
  Binding k_cache;     // paged pool (KvPaging)
  Binding v_cache;     // paged pool
  KvPaging kv;
  Binding gate;        // optional (buffer == nullptr: no gate): rows at gate_stride / gate_head_stride
  Binding out;         // [tokens, q_heads, head_dim] of dtype
  Binding scratch;     // split route only: attention_scratch_bytes() bytes of float partials
  DType dtype = DType::f32;
  uint32_t tokens = 1, q_heads = 0, kv_heads = 0, head_dim = 0;
  uint32_t position = 0;  // absolute position of query token 0; token t sees keys [0, position + t]
  uint32_t q_stride = 0;          // 0: packed (q_heads * head_dim)
  uint32_t gate_stride = 0;       // 0: packed (q_heads * gate_head_stride)
  uint32_t gate_head_stride = 0;  // 0: head_dim
};
// Bytes of the two-pass routes' partials (o and (m, l) per query head and split); enough for
// every context up to `length` keys at cache blocks of block_tokens.
uint64_t attention_scratch_bytes(uint32_t q_heads, uint32_t head_dim, uint32_t length, uint32_t block_tokens);
// Decode (tokens == 1): one dispatch, or two passes + barrier (route from position + 1, head_dim).
// phase first / combine: only the first pass (the single route's one dispatch) or only the
// combine (nothing on the single route), no barrier: batched decode encodes every sequence's first
// pass, one barrier, every combine.
enum class AttnDecodePhase : uint8_t { both, first, combine };
void encode_attention_decode(Encoder& enc, const AttentionOperands& op, AttnDecodePhase phase = AttnDecodePhase::both);
// Prefill route: "mma" (simdgroup matrices) when head_dim % 32 == 0 and, above 128, % 64 == 0
// (64, 128, 256, ...); otherwise "simd" (scalar fp32, any head_dim <= 256).
bool attention_prefill_uses_mma(uint32_t head_dim);
enum class PrefillRoute : uint8_t { m5, tiles, mma, simd };
// The route of a head_dim, activation dtype, cache format and device, with bindings that are
// 16-byte aligned or not (the tiles need it): m5, then tiles, then mma, then simd. An f32 cache
// takes mma or simd on every device (fp32 K / V tiles; the m5 and tiles routes stage K / V in half
// and bf16 and do not fit 32 KiB of threadgroup memory in fp32).
PrefillRoute attention_prefill_route(uint32_t head_dim, DType dtype, KvFormat kv, bool tensor_ops, bool aligned = true);
const char* prefill_route_name(PrefillRoute r);
// M5 route (Metal 4 tensor ops, shaders/m5/attention_m5.metal): on a device with tensor ops for
// head_dim 64, 128 or 256: (kv_heads, ceil(tokens / (32 / group))) x 128 threads; before mma.
bool attention_prefill_uses_m5(uint32_t head_dim, bool tensor_ops);
// M1-M4 bf16 tiles route (shaders/attention_prefill.metal attention_prefill_tiles): bf16 activations at
// head_dim 64, 128 or 256 on a device without tensor ops (and 16-byte aligned q / cache bindings,
// q_stride % 8 == 0, checked at encode: otherwise mma); fp32 and other head dims keep mma / simd.
bool attention_prefill_uses_tiles(uint32_t head_dim, DType dtype, bool tensor_ops);
// The prefill kernel of a head_dim, activation dtype, cache format and device (tensor_ops), with
// bindings that are 16-byte aligned or not: attention_prefill_route's; every route of the bf16
// cache has its int8 twin (simd excepted: int8 needs head_dim 64, 128 or 256, which mma takes),
// the mma and simd routes their f32 twins. m5 with the int8 cache and bf16 activations is
// attn_prefill_m5i8_q8 (S on int8 operands, Q quantized per row as the cache quantizes K:
// docs/kernels-attention.md); with fp32 activations attn_prefill_m5_q8 (S in half).
KernelId attention_prefill_kernel(uint32_t head_dim, DType dtype, KvFormat kv, bool tensor_ops, bool aligned = true);
// The vec decode route's first pass (head_dim 64, 128 or 256).
KernelId attention_vec_kernel(uint32_t head_dim, DType dtype, KvFormat kv);
// The first pass of the decode route of a context of `length` keys (vec, single or split).
KernelId attention_decode_kernel(const AttnRoute& route, uint32_t head_dim, DType dtype, KvFormat kv);
// Prefill: one dispatch. mma: (kv_heads, ceil(tokens / (32 / group))) x 128 threads;
// simd: (kv_heads, ceil(tokens / kAttnPrefillTokens)) x 32 * group threads.
void encode_attention_prefill(Encoder& enc, const AttentionOperands& op);

// The whole gated-attention token mixer of one layer (the model's attention layer minus its input
// norm and residual add), for decode (tokens == 1) and prefill chunks:
//   qmv/qmm q_proj, k_proj, v_proj (one dispatch each, independent) | barrier | qk_norm_rope |
//   barrier | attention (decode: single route, or split | barrier | combine; prefill) | barrier |
//   qmv/qmm o_proj
// With qkv_proj bound (q_proj, k_proj and v_proj row-concatenated at load, [Nq + 2 Nkv, hidden])
// the three projections are one dispatch into the qkv temporary, read in place with strides.
// The projections' QmmOperands carry the weights (their x / y / M are filled in here).
// One sequence of a batched decode step: its KV pools and position, its split-route partials.
struct AttnSequence {
  Binding k_cache, v_cache;  // paged pools of pool_blocks blocks (the table: AttentionMixerOperands::kv)
  uint32_t pool_blocks = 0;
  uint32_t position = 0;     // tokens already in this sequence; its token goes to row `position`
  Binding scratch;           // attention_scratch_bytes() for its context, its own
};
// Batched decode (seqs bound, tokens = seqs.size() > 1: token t is sequence t's one token): the
// projections over every row (each weight byte read once), then per sequence q/k norm + RoPE + KV
// append, attention (first passes, barrier, combines) on its own pools: the levels of one token.
struct AttentionMixerOperands {
  Binding x;                       // [tokens, hidden] of dtype
  QmmOperands q_proj, k_proj, v_proj, o_proj;  // weights, bits, group size, scale dtype
  QmmOperands qkv_proj;            // fused alternative to q/k/v_proj (used when qkv_proj.w is bound or
                                   // it has blocks: q|k|v runs of different quantization)
  Binding qkv;                     // fused only: [tokens, q_heads * 2D + 2 * kv_heads * D] of dtype
  Binding q_norm, k_norm;          // [head_dim] of w_dtype
  Binding inv_freq;                // float32 [rotary_dim / 2]
  Binding k_cache, v_cache;        // paged pools (KvPaging)
  KvPaging kv;
  Binding qg, k, v, q, attn;       // temporaries: [tokens, q_heads * 2D], [tokens, kv_heads * D] x2,
                                   // [tokens, q_heads * D] x2, all of dtype
  Binding scratch;                 // split-route partials (attention_scratch_bytes), decode only
  Binding x_i8;                    // int8 activation scratch (qmm_i8_scratch_bytes(tokens, max(hidden,
                                   // q_heads * D))) for the fused qkv_proj and o_proj; unbound: no int8
  Binding out;                     // [tokens, hidden] of dtype
  std::vector<AttnSequence> seqs;  // batched decode: one per token (k_cache, v_cache, position, scratch unused)
  Binding in_norm;                 // optional float32 [hidden] (tokens == 1 only): the projections
                                   // normalize x themselves (RMSNorm fused in front, qmv1 route)
  float in_norm_eps = 1e-6f;
  DType dtype = DType::f32;
  DType w_dtype = DType::f32;
  uint32_t tokens = 0, hidden = 0, q_heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  uint32_t position = 0;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
};
void encode_attention_mixer(Encoder& enc, const AttentionMixerOperands& op);

}  // namespace lily::gpu::ops
