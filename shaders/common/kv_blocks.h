// The paged KV cache's addressing, shared by the attention kernels (shaders/attention.metal,
// shaders/m5/attention_m5.metal). Layout of each K / V pool (one per attention layer):
//   bf16 [pool_blocks, kv_heads, block_tokens, head_dim], block_tokens = 1 << block_shift;
// logical block b of the sequence (positions [b * block_tokens, (b + 1) * block_tokens)) lives in
// pool block block_table[b]. block_tokens is a power of two and a multiple of kAttnKvMinBlock, so a
// kernel's key block (32 keys or fewer, 32-aligned) never straddles two cache blocks.
#pragma once
#include "common/lily_metal.h"

namespace lily {

// Element offset of cache row (kv head kvh, position key): rows key .. the end of its cache block
// follow it contiguously (head_dim elements apart).
inline uint32_t kv_row_offset(const device uint32_t* block_table, uint32_t block_shift, uint32_t kv_heads,
                              uint32_t head_dim, uint32_t kvh, uint32_t key) {
  const uint32_t blk = block_table[key >> block_shift];
  const uint32_t in_blk = key & ((1u << block_shift) - 1u);
  return (((blk * kv_heads + kvh) << block_shift) + in_blk) * head_dim;
}

}  // namespace lily
