// Argument structs and route constants of the attention family (shaders/attention*.metal, host:
// csrc/gpu/ops/attention.cpp). Included once from common/args.h; compiled by the shaders (Metal,
// emulator, strict pass) and by the host.
#pragma once
#if !defined(__METAL_VERSION__)
#include <cstdint>
#endif

namespace lily {

enum : uint32_t {
  kRopeThreads = 32,         // rope / qk_norm_rope: one simdgroup per (token, head) row
  kAttnMaxHeadDim = 256,     // attention: head_dim <= this (each lane owns <= 8 dims)
  kAttnDimsPerLane = kAttnMaxHeadDim / 32,
  kAttnMaxGroup = 8,         // query heads per KV head (one simdgroup each), <= 8
  kAttnBlockKeys = 32,       // keys per block staged in threadgroup memory (one per lane)
  kAttnPrefillTokens = 4,    // prefill: query tokens per threadgroup (K/V block reused by all)
  kAttnSplitKeys = 256,      // decode: contexts longer than this take the split-K route ...
  kAttnMaxSplits = 32,       // ... with at most this many splits (keys per split a multiple of 32)
  kAttnMmaRows = 32,         // prefill (mma route): query rows (token, head) per threadgroup
  kAttnMmaThreads = 128,     // prefill (mma route): 4 simdgroups
  kAttnMmaMaxVCols = 128,    // prefill (mma route): V columns staged per pass (head_dim 256: 2 passes)
  kAttnTilesThreads = 128,   // prefill (bf16 tiles route, M1-M4): 4 simdgroups, 8 rows each
  kAttnTilesKeyDims = 2048,  // ... keys per block x head_dim (blocks of 32 / 16 / 8 keys at 64 / 128 / 256)
  kAttnM5Rows = 16,          // prefill (M5 tensor-op route, shaders/m5/attention_m5.metal): query rows
  kAttnM5BlockKeys = 32,     // ... keys per block (S = Q K^T and O += P V per block)
  kAttnM5Threads = 128,      // ... 4 simdgroups, one matmul2d each (execution_simdgroup)
  // decode, vec route (head_dim 64, 128 or 256: each lane holds head_dim / 32 dims):
  kAttnVecSimds = 8,         // simdgroups per threadgroup (256 threads), each walks every 8th key
  kAttnVecMaxBlocks = 80,    // key blocks per KV head: 2 KV heads x 80 x 8 = 1280 simdgroups = 32
                             // per core on a 40-core GPU; a block holds >= kAttnVecSimds keys
  kAttnVecRebase = 8,        // the softmax base trails a score by at most this (p <= e^8)
  // paged KV cache (common/kv_blocks.h): tokens per cache block are a power of two >= this, so
  // no kernel's 32-key block straddles two cache blocks
  kAttnKvMinBlock = 32,
};

// Partial rotary embedding (rotate-half pairing) of the first rotary_dim features of rows of x.
// x/y: [tokens, heads, head_dim] with x_stride / y_stride elements between tokens. The angle of
// token t, pair i is float(position + t) * inv_freq[i] in fp32 (inv_freq[rotary_dim / 2], fp32,
// computed by the host as lily_py.reference.ops.rope_cos_sin does).
struct RopeArgs {
  uint32_t tokens;
  uint32_t heads;
  uint32_t head_dim;
  uint32_t rotary_dim;  // even, <= head_dim
  uint32_t position;    // absolute position of token 0
  uint32_t x_stride;    // elements between tokens of x (>= heads * head_dim)
  uint32_t y_stride;    // elements between tokens of y
};

// Fused q/k RMSNorm + partial RoPE + KV-cache append (+ the query/gate split of q_proj).
//   qg [tokens, q_heads, 2 * head_dim] (q_proj output: per head the query, then the gate),
//   k, v [tokens, kv_heads, head_dim] -> q [tokens, q_heads, head_dim],
//   k_cache / v_cache: paged pools (common/kv_blocks.h), rows position .. position + tokens - 1
//   written through block_table.
struct QkNormRopeArgs {
  uint32_t tokens;
  uint32_t q_heads;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t rotary_dim;
  uint32_t position;       // absolute position of token 0 = cache row it is written to
  uint32_t block_shift;    // log2 of the tokens per cache block (common/kv_blocks.h)
  uint32_t qg_stride;      // elements between tokens of qg (>= q_heads * 2 * head_dim)
  uint32_t k_stride;       // elements between tokens of k
  uint32_t v_stride;       // elements between tokens of v
  float eps;
  float weight_offset;     // 0: norm weights are the multiplier (MLX files); 1: zero-centred (HF)
};

// Attention of query rows over the paged bf16 KV cache (common/kv_blocks.h), GQA heads packed (query head h uses KV head
// h / group). Decode: tokens = 1, keys [0, position + 1). Prefill: token t attends keys
// [0, position + t + 1) (causal); the cache already holds the tokens' own keys.
//   q [tokens, q_heads, head_dim] (q_stride between tokens), gate rows [tokens, q_heads, head_dim]
//   at gate_stride between tokens and gate_head_stride between heads (the q_proj output);
//   out [tokens, q_heads, head_dim] = softmax(q k^T * scale) v * (use_gate ? sigmoid(gate) : 1).
// Split route (decode): threadgroup (kv head, split) covers keys [split * split_keys, ...) and
// writes unnormalized partials; attn_combine merges them. The vec route (decode) uses the same
// fields: splits = key blocks per KV head, split_keys = keys per block (a power of two that
// divides the cache block: each threadgroup reads within one cache block).
struct AttnArgs {
  uint32_t tokens;
  uint32_t q_heads;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t position;         // absolute position of query token 0
  uint32_t block_shift;      // log2 of the tokens per cache block (common/kv_blocks.h)
  uint32_t q_stride;         // elements between tokens of q
  uint32_t gate_stride;      // elements between tokens of gate
  uint32_t gate_head_stride; // elements between heads of gate
  uint32_t use_gate;         // 1: multiply by sigmoid(gate); 0: gate buffer unused
  uint32_t splits;           // split route: number of key ranges (1 on the single route)
  uint32_t split_keys;       // split route: keys per range (a multiple of kAttnBlockKeys)
  float scale;               // softmax scale, float32(head_dim ** -0.5)
};

}  // namespace lily
