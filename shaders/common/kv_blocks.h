// The paged KV cache's addressing, shared by the attention kernels (shaders/attention*.metal,
// shaders/m5/attention_m5.metal). Three pool formats, one per attention layer and K / V:
//   bf16: [pool_blocks, kv_heads, block_tokens, head_dim] bf16;
//   f32:  the same layout in float (kv_dtype="float32": the rows as computed, no rounding);
//   q8:   per pool block, [kv_heads, block_tokens, head_dim] int8 codes, then [kv_heads,
//         block_tokens] float scales (head_dim + 4 bytes a row); a row's values are
//         float(code) * scale (symmetric int8, scale = max |x| / 127 of the row: kv_q8_scale,
//         lily_py.reference.kvquant.int8_row).
// Logical block b of the sequence (positions [b * block_tokens, (b + 1) * block_tokens)) lives in
// pool block block_table[b]. block_tokens is a power of two and a multiple of kAttnKvMinBlock, so a
// kernel's key block (32 keys or fewer, 32-aligned) never straddles two cache blocks.
#pragma once
#include "common/lily_metal.h"

namespace lily {

// Element offset of cache row (kv head kvh, position key) of a bf16 or f32 pool: rows key .. the end of
// its cache block follow it contiguously (head_dim elements apart).
inline uint32_t kv_row_offset(const device uint32_t* block_table, uint32_t block_shift, uint32_t kv_heads,
                              uint32_t head_dim, uint32_t kvh, uint32_t key) {
  const uint32_t blk = block_table[key >> block_shift];
  const uint32_t in_blk = key & ((1u << block_shift) - 1u);
  return (((blk * kv_heads + kvh) << block_shift) + in_blk) * head_dim;
}

// A cache row: `at` is the element offset of its values (bf16 / float elements or int8 codes), `scale` the
// index of its scale among the pool's floats (q8 only). The rows after it in its cache block are at
// + j * head_dim and scale + j.
struct KvRow {
  uint32_t at;
  uint32_t scale;
};

template <typename KV>
struct KvRows;

template <>
struct KvRows<bfloat> {
  static KvRow row(const device uint32_t* block_table, uint32_t block_shift, uint32_t kv_heads, uint32_t head_dim,
                   uint32_t kvh, uint32_t key) {
    return KvRow{kv_row_offset(block_table, block_shift, kv_heads, head_dim, kvh, key), 0u};
  }
  // Value c of row r.at + j (j rows after r in its cache block).
  static float value(const device bfloat* pool, KvRow r, uint32_t j, uint32_t head_dim, uint32_t c) {
    return float(pool[r.at + j * head_dim + c]);
  }
};

template <>
struct KvRows<float> {
  static KvRow row(const device uint32_t* block_table, uint32_t block_shift, uint32_t kv_heads, uint32_t head_dim,
                   uint32_t kvh, uint32_t key) {
    return KvRow{kv_row_offset(block_table, block_shift, kv_heads, head_dim, kvh, key), 0u};
  }
  static float value(const device float* pool, KvRow r, uint32_t j, uint32_t head_dim, uint32_t c) {
    return pool[r.at + j * head_dim + c];
  }
};

template <>
struct KvRows<int8_t> {
  static KvRow row(const device uint32_t* block_table, uint32_t block_shift, uint32_t kv_heads, uint32_t head_dim,
                   uint32_t kvh, uint32_t key) {
    const uint32_t blk = block_table[key >> block_shift];
    const uint32_t rows = kv_heads << block_shift;                          // rows of a pool block
    const uint32_t r = (kvh << block_shift) + (key & ((1u << block_shift) - 1u));
    const uint32_t base = blk * rows * (head_dim + 4u);                    // bytes; a multiple of 128
    return KvRow{base + r * head_dim, (base + rows * head_dim) / 4u + r};
  }
  static float scale(const device int8_t* pool, uint32_t index) {
    return reinterpret_cast<const device float*>(pool)[index];
  }
  static float value(const device int8_t* pool, KvRow r, uint32_t j, uint32_t head_dim, uint32_t c) {
    return float(pool[r.at + j * head_dim + c]) * scale(pool, r.scale + j);
  }
};

// The q8 scale of a row whose largest magnitude is amax, and the code of x under it: round to
// nearest even of x / scale, within [-127, 127] (the reference: kvquant.int8_row).
inline float kv_q8_scale(float amax) { return amax / 127.0f; }
inline int8_t kv_q8_code(float x, float inv_scale) {
  return int8_t(clamp(rint(x * inv_scale), -127.0f, 127.0f));
}

}  // namespace lily
