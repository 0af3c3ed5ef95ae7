// Gated full attention, the vec decode route (head_dim = 32 * E, E = 2, 4 or 8; GQA heads packed):
// attention_vec over key blocks, then attention_vec_combine. The general route and the q/k norm +
// RoPE + KV write: attention.metal.
// Over a paged KV cache (bf16 pools [blocks, kv_heads, block_tokens, head_dim] read through a
// block table, or their int8 / float32 twins: common/kv_blocks.h). Host:
// csrc/gpu/ops/attention.cpp. References: lily_py.reference.kernels (rope, qk_norm_rope,
// attention). Args and route constants: common/args_attention.h.
//
// Precision policy (all kernels): inputs widened to fp32; norms, angles, dot products, softmax and
// the weighted sum of values in fp32 with precise exp/cos/sin; each output rounded once (to the
// activation dtype T, or to bf16 in a bf16 cache; a float32 cache keeps the fp32 rows).
#include "common/lily_metal.h"
#include "common/kv_blocks.h"
#include "common/attention.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// Decode, vec route (head_dim = 32 * E, E = 2, 4 or 8), after MLX's sdpa_vector and Lily's decode
// attention: no threadgroup staging of K/V, every lane holds E consecutive dims of the head.
// Wide loads of E bf16 (E = 8: one 16-byte load; 4: 8 bytes; 2: 4 bytes) and of E floats.
template <uint32_t E>
struct VecRow;
template <>
struct VecRow<2> {
  static void bf16(const device bfloat* p, thread float* out) {
    const uint32_t u = *reinterpret_cast<const device uint32_t*>(p);
    out[0] = as_type<float>(u << 16);
    out[1] = as_type<float>(u & 0xffff0000u);
  }
  static void f32(const device float* p, thread float* out) {
    const float2 v = *reinterpret_cast<const device float2*>(p);
    out[0] = v.x;
    out[1] = v.y;
  }
};
template <>
struct VecRow<4> {
  static void bf16(const device bfloat* p, thread float* out) {
    const uint2 u = *reinterpret_cast<const device uint2*>(p);
    out[0] = as_type<float>(u.x << 16);
    out[1] = as_type<float>(u.x & 0xffff0000u);
    out[2] = as_type<float>(u.y << 16);
    out[3] = as_type<float>(u.y & 0xffff0000u);
  }
  static void f32(const device float* p, thread float* out) {
    const float4 v = *reinterpret_cast<const device float4*>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  }
};
template <>
struct VecRow<8> {
  static void bf16(const device bfloat* p, thread float* out) {
    const uint4 u = *reinterpret_cast<const device uint4*>(p);
    out[0] = as_type<float>(u.x << 16);
    out[1] = as_type<float>(u.x & 0xffff0000u);
    out[2] = as_type<float>(u.y << 16);
    out[3] = as_type<float>(u.y & 0xffff0000u);
    out[4] = as_type<float>(u.z << 16);
    out[5] = as_type<float>(u.z & 0xffff0000u);
    out[6] = as_type<float>(u.w << 16);
    out[7] = as_type<float>(u.w & 0xffff0000u);
  }
  static void f32(const device float* p, thread float* out) {
    VecRow<4>::f32(p, out);
    VecRow<4>::f32(p + 4, out + 4);
  }
};

// int8 codes: E consecutive codes (E bytes: one 2-, 4- or 8-byte load) times the row's scale.
template <uint32_t E>
inline void vec_row_q8(const device int8_t* p, thread float* out) {
  // E / 4 words of 4 codes (E = 4, 8; E = 2 below: one 2-byte load)
  for (uint32_t w = 0; w < E / 4; ++w) {
    const uint32_t u = reinterpret_cast<const device uint32_t*>(p)[w];
    for (uint32_t b = 0; b < 4; ++b) out[4 * w + b] = q8_code(u, b);
  }
}
template <>
inline void vec_row_q8<2>(const device int8_t* p, thread float* out) {
  const uint32_t u = uint32_t(*reinterpret_cast<const device ushort*>(p));
  out[0] = q8_code(u, 0);
  out[1] = q8_code(u, 1);
}

// The vec route's cache reader: a lane's E values of key `key` of the threadgroup's block, and the
// rows' scales (bf16, f32: 1; q8: the codes come unscaled, the kernel applies the scales to the dot
// product and to p, once per key rather than once per value). f32 rows: E floats (E = 8: two
// 16-byte loads; 4: one; 2: one 8-byte load).
template <uint32_t E, typename KV>
struct VecKv;
template <uint32_t E>
struct VecKv<E, bfloat> {
  const device bfloat* k;
  const device bfloat* v;
  VecKv(const device bfloat* k_cache, const device bfloat* v_cache, KvRow r, uint32_t d0)
      : k(k_cache + r.at + d0), v(v_cache + r.at + d0) {}
  void load(uint32_t key, thread float* kv, thread float* vv, thread float& ks, thread float& vs) const {
    VecRow<E>::bf16(k + key * (32 * E), kv);
    VecRow<E>::bf16(v + key * (32 * E), vv);
    ks = 1.0f;
    vs = 1.0f;
  }
};
template <uint32_t E>
struct VecKv<E, float> {
  const device float* k;
  const device float* v;
  VecKv(const device float* k_cache, const device float* v_cache, KvRow r, uint32_t d0)
      : k(k_cache + r.at + d0), v(v_cache + r.at + d0) {}
  void load(uint32_t key, thread float* kv, thread float* vv, thread float& ks, thread float& vs) const {
    VecRow<E>::f32(k + key * (32 * E), kv);
    VecRow<E>::f32(v + key * (32 * E), vv);
    ks = 1.0f;
    vs = 1.0f;
  }
};
template <uint32_t E>
struct VecKv<E, int8_t> {
  const device int8_t* k;
  const device int8_t* v;
  const device float* ks;
  const device float* vs;
  VecKv(const device int8_t* k_cache, const device int8_t* v_cache, KvRow r, uint32_t d0)
      : k(k_cache + r.at + d0), v(v_cache + r.at + d0),
        ks(reinterpret_cast<const device float*>(k_cache) + r.scale),
        vs(reinterpret_cast<const device float*>(v_cache) + r.scale) {}
  void load(uint32_t key, thread float* kv, thread float* vv, thread float& k_scale, thread float& v_scale) const {
    vec_row_q8<E>(k + key * (32 * E), kv);
    vec_row_q8<E>(v + key * (32 * E), vv);
    k_scale = ks[key];
    v_scale = vs[key];
  }
};

// The 8 heads' partial dot products of a lane -> the whole dot product of head lane / 4 (the same
// on the 4 lanes of a quad): a reduce-scatter over the simdgroup. At xor 16, 8 and 4 each lane
// keeps half of its values and adds its partner's of that half (4 + 2 + 1 shuffles), then xor 2
// and 1 sum the quad: 9 shuffles and 9 adds for the 8 sums, where 8 simd_sums take 40 and 40.
inline float reduce_scatter8(thread const float* v, uint32_t lane) {
  const bool b4 = (lane & 16u) != 0, b3 = (lane & 8u) != 0, b2 = (lane & 4u) != 0;
  float w4[4];
  for (uint32_t i = 0; i < 4; ++i) w4[i] = (b4 ? v[i + 4] : v[i]) + simd_shuffle_xor(b4 ? v[i] : v[i + 4], ushort(16));
  float w2[2];
  for (uint32_t i = 0; i < 2; ++i)
    w2[i] = (b3 ? w4[i + 2] : w4[i]) + simd_shuffle_xor(b3 ? w4[i] : w4[i + 2], ushort(8));
  float w = (b2 ? w2[1] : w2[0]) + simd_shuffle_xor(b2 ? w2[0] : w2[1], ushort(4));
  w += simd_shuffle_xor(w, ushort(2));
  return w + simd_shuffle_xor(w, ushort(1));
}

// One key of attention_vec for the 8 heads of a simdgroup: E products per head (qr [8][E] flat),
// the 8 sums by one reduce-scatter (lane j: head j / 4), one online-softmax update with one exp
// (the larger of (m, s) gets weight 1, the other exp(-|s - m|); first key: m = -inf, so corr = 0
// and p = 1), then per head its correction and p broadcast from lane 4 h and E multiply-adds
// into o [8][E] flat. Every index is a compile-time constant once unrolled: registers.
template <uint32_t E>
inline void vec_attend_key(thread const float* qr, thread const float* kv, thread const float* vv, float k_scale,
                           float v_scale, uint32_t lane, thread float& m_h, thread float& l_h, thread float* o) {
  constexpr uint32_t G = kAttnMaxGroup;
  float dot[G];
  for (uint32_t g = 0; g < G; ++g) {
    dot[g] = 0.0f;
    for (uint32_t e = 0; e < E; ++e) dot[g] += qr[g * E + e] * kv[e];
  }
  const float s = reduce_scatter8(dot, lane) * k_scale;
  const bool up = s > m_h;
  const float ex = exp(up ? m_h - s : s - m_h);
  const float corr = up ? ex : 1.0f;
  const float p = up ? 1.0f : ex;
  l_h = l_h * corr + p;
  m_h = up ? s : m_h;
  const float pv = p * v_scale;
  for (uint32_t g = 0; g < G; ++g) {
    const float cg = simd_broadcast(corr, ushort(4 * g));
    const float pg = simd_broadcast(pv, ushort(4 * g));
    for (uint32_t d = 0; d < E; ++d) o[g * E + d] = o[g * E + d] * cg + pg * vv[d];
  }
}

// attention_vec: first pass. Threadgroup (kv head, block) covers keys
// [block * split_keys, min((block + 1) * split_keys, position + 1)) (never empty: the host sizes
// the blocks); simdgroup s walks keys begin + s, begin + s + 8, ... (8 simdgroups read 8 adjacent
// cache rows at a time). Lane j holds dims [E j, E j + E) of the query of every head of the KV
// head's group (pre-scaled by the softmax scale, in registers), of one K row and one V row, and of
// the group's running outputs. Per key: E products per head; the 8 heads' sums by one
// reduce-scatter (reduce_scatter8: lane j ends with head j / 4's score); one online-softmax
// update with one exp on every lane, for head j / 4 (its running max and sum live on its quad);
// then per head its correction and p broadcast from lane 4 h and E multiply-adds into o
// (vec_attend_key). Two keys per iteration: both rows loaded before either is used.
// Unrolled over kAttnMaxGroup heads with no branch, so no private array is indexed at run time.
// Then the 8 simdgroups' (m, l, o) are merged through threadgroup memory (one head at a time) and
// written as the block's unnormalized partial.
//   grid:    (kv_heads, blocks) threadgroups of kAttnVecSimds * 32 = 256 threads
//   buffers: q [q_heads, D] T, k_cache, v_cache paged KV pools (bf16, q8 or f32), block_table (buffer 6);
//            partial_o float [q_heads, blocks, D]; partial_ml float [q_heads, blocks, 2]
//   registers per lane: q and o 2 x 8 x E floats, m and l 2 x 8, two K and two V slices (E each)
//   threadgroup memory: 8 x D floats (o) + 8 x 8 x 2 floats (m, l)
// No integer division or modulo inside the key loop.
template <typename T, uint32_t E, typename KV>
[[kernel]] void attention_vec(constant AttnArgs& args [[buffer(0)]],
                              const device T* q [[buffer(1)]],
                              const device KV* k_cache [[buffer(2)]],
                              const device KV* v_cache [[buffer(3)]],
                              device float* partial_o [[buffer(4)]],
                              device float* partial_ml [[buffer(5)]],
                              const device uint32_t* block_table [[buffer(6)]],
                              LILY_KERNEL_TAIL) {
  constexpr uint32_t G = kAttnMaxGroup;
  static_assert(G == 8, "reduce_scatter8 puts head j / 4 on lane j: 8 heads");
  constexpr uint32_t NS = kAttnVecSimds;
  constexpr uint32_t D = 32 * E;
  LILY_TG_ARRAY(float, o_s, [kAttnVecSimds * kAttnMaxHeadDim]);
  LILY_TG_ARRAY(float, ml_s, [kAttnVecSimds * kAttnMaxGroup * 2]);
  const uint32_t group = args.q_heads / args.kv_heads;
  const uint32_t kvh = group_pos.x;
  const uint32_t block = group_pos.y;
  const uint32_t key_begin = block * args.split_keys;
  const uint32_t key_end = min(key_begin + args.split_keys, args.position + 1);
  const uint32_t d0 = lane * E;

  float qr[G][E];
  float o[G][E];
  float m[G];
  float l[G];
  for (uint32_t g = 0; g < G; ++g) {
    const uint32_t h = kvh * group + min(g, group - 1);  // heads past the group: never used
    for (uint32_t e = 0; e < E; ++e) {
      qr[g][e] = float(q[h * D + d0 + e]) * args.scale;
      o[g][e] = 0.0f;
    }
    m[g] = neg_inf();
    l[g] = 0.0f;
  }

  // The block's keys lie in one cache block (split_keys divides the cache block): one table read.
  const VecKv<E, KV> rows(k_cache, v_cache,
                          KvRows<KV>::row(block_table, args.block_shift, args.kv_heads, D, kvh, key_begin), d0);
  // Lane j keeps the running max and sum of head j / 4 of the group (m_h, l_h): one online-softmax
  // update per key for all 8 heads at once, on the lanes' quads.
  float m_h = neg_inf();
  float l_h = 0.0f;
  // Two keys per iteration (keys key and key + 8 of the simdgroup's sequence): both rows' loads are
  // issued before either key's arithmetic, so each simdgroup has two K and two V rows in flight;
  // the keys are then taken one after the other, in the same order as one key per iteration.
  const uint32_t n = key_end - key_begin;
  for (uint32_t key = simd_id; key < n; key += 2 * NS) {
    const bool two = key + NS < n;  // uniform over the simdgroup
    float kv0[E], vv0[E], kv1[E], vv1[E];
    float ks0, vs0, ks1, vs1;
    rows.load(key, kv0, vv0, ks0, vs0);
    rows.load(two ? key + NS : key, kv1, vv1, ks1, vs1);  // no second key: key's row again, unused
    vec_attend_key<E>(&qr[0][0], kv0, vv0, ks0, vs0, lane, m_h, l_h, &o[0][0]);
    if (two) vec_attend_key<E>(&qr[0][0], kv1, vv1, ks1, vs1, lane, m_h, l_h, &o[0][0]);
  }
  for (uint32_t g = 0; g < G; ++g) {
    m[g] = simd_broadcast(m_h, ushort(4 * g));
    l[g] = simd_broadcast(l_h, ushort(4 * g));
  }

  // Merge the 8 simdgroups. A simdgroup that saw no key has m = -inf, l = 0, o = 0: weight 0.
  if (lane == 0) {
    for (uint32_t g = 0; g < G; ++g) {
      ml_s[(simd_id * G + g) * 2] = m[g];
      ml_s[(simd_id * G + g) * 2 + 1] = l[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t g = 0; g < G; ++g) {
    if (g < group) {  // uniform: every thread reaches the barriers below
      float m_blk = neg_inf();
      for (uint32_t s = 0; s < NS; ++s) m_blk = max(m_blk, ml_s[(s * G + g) * 2]);  // finite: block non-empty
      const float f = exp(m[g] - m_blk);
      for (uint32_t e = 0; e < E; ++e) o_s[simd_id * D + d0 + e] = o[g][e] * f;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const uint32_t slot = (kvh * group + g) * args.splits + block;
      for (uint32_t d = thread_pos.x; d < D; d += NS * 32) {
        float acc = 0.0f;
        for (uint32_t s = 0; s < NS; ++s) acc += o_s[s * D + d];
        partial_o[slot * D + d] = acc;
      }
      if (thread_pos.x == 0) {
        float l_blk = 0.0f;
        for (uint32_t s = 0; s < NS; ++s) l_blk += exp(ml_s[(s * G + g) * 2] - m_blk) * ml_s[(s * G + g) * 2 + 1];
        partial_ml[slot * 2] = m_blk;
        partial_ml[slot * 2 + 1] = l_blk;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

// attention_vec_combine: second pass. out[h] = sum_b e_b o_b / sum_b e_b l_b * sigmoid(gate),
// e_b = exp(m_b - max_b m_b). Threadgroup (query head h, 32-dim chunk c) of kAttnVecSimds
// simdgroups: lane j owns dim 32 c + j (4-byte loads, 128 contiguous bytes per simdgroup and
// block); simdgroup s sums blocks s, s + 8, ... in order; the 8 sums are added in simdgroup
// order through threadgroup memory. Every simdgroup finds max_b m_b itself (lanes read the
// maxima in strips, then simd_max): no barrier before the loop.
//   grid: (q_heads, head_dim / 32) threadgroups of 32 * kAttnVecSimds threads
//   (real config: 16 x 8 x 8 = 1024 simdgroups, 25.6 per core on a 40-core GPU)
template <typename T, uint32_t E>
[[kernel]] void attention_vec_combine(constant AttnArgs& args [[buffer(0)]],
                                      const device float* partial_o [[buffer(1)]],
                                      const device float* partial_ml [[buffer(2)]],
                                      const device T* gate [[buffer(3)]],
                                      device T* out [[buffer(4)]],
                                      LILY_KERNEL_TAIL) {
  constexpr uint32_t D = 32 * E;
  constexpr uint32_t NS = kAttnVecSimds;
  LILY_TG_ARRAY(float, acc_s, [kAttnVecSimds * 32]);
  LILY_TG_ARRAY(float, l_s, [kAttnVecSimds]);
  const uint32_t h = group_pos.x;
  const uint32_t d = group_pos.y * 32 + lane;
  const uint32_t base = h * args.splits;
  float m_max = neg_inf();
  for (uint32_t b = lane; b < args.splits; b += 32) m_max = max(m_max, partial_ml[(base + b) * 2]);
  m_max = simd_max(m_max);
  float acc = 0.0f;
  float l_sum = 0.0f;
  for (uint32_t b = simd_id; b < args.splits; b += NS) {
    const float w = exp(partial_ml[(base + b) * 2] - m_max);
    l_sum += w * partial_ml[(base + b) * 2 + 1];
    acc += w * partial_o[(base + b) * D + d];
  }
  acc_s[simd_id * 32 + lane] = acc;
  if (lane == 0) l_s[simd_id] = l_sum;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_id == 0) {
    float y = 0.0f;
    float l = 0.0f;
    for (uint32_t s = 0; s < NS; ++s) {
      y += acc_s[s * 32 + lane];
      l += l_s[s];
    }
    y /= l;
    if (args.use_gate != 0) y *= attn_sigmoid(float(gate[h * args.gate_head_stride + d]));
    out[h * D + d] = T(y);
  }
}

// Instantiations: the vec decode rows of csrc/gpu/kernel_ids.h.
LILY_INSTANTIATE("attn_decode_vec_e2_f32", attention_vec<float, 2, bfloat>)
LILY_INSTANTIATE("attn_decode_vec_q8_e2_f32", attention_vec<float, 2, int8_t>)
LILY_INSTANTIATE("attn_decode_vec_e2_bf16", attention_vec<bfloat, 2, bfloat>)
LILY_INSTANTIATE("attn_decode_vec_q8_e2_bf16", attention_vec<bfloat, 2, int8_t>)
LILY_INSTANTIATE("attn_decode_vec_kvf32_e2_f32", attention_vec<float, 2, float>)
LILY_INSTANTIATE("attn_decode_vec_kvf32_e2_bf16", attention_vec<bfloat, 2, float>)
LILY_INSTANTIATE("attn_decode_vec_e4_f32", attention_vec<float, 4, bfloat>)
LILY_INSTANTIATE("attn_decode_vec_q8_e4_f32", attention_vec<float, 4, int8_t>)
LILY_INSTANTIATE("attn_decode_vec_e4_bf16", attention_vec<bfloat, 4, bfloat>)
LILY_INSTANTIATE("attn_decode_vec_q8_e4_bf16", attention_vec<bfloat, 4, int8_t>)
LILY_INSTANTIATE("attn_decode_vec_kvf32_e4_f32", attention_vec<float, 4, float>)
LILY_INSTANTIATE("attn_decode_vec_kvf32_e4_bf16", attention_vec<bfloat, 4, float>)
LILY_INSTANTIATE("attn_decode_vec_e8_f32", attention_vec<float, 8, bfloat>)
LILY_INSTANTIATE("attn_decode_vec_q8_e8_f32", attention_vec<float, 8, int8_t>)
LILY_INSTANTIATE("attn_decode_vec_e8_bf16", attention_vec<bfloat, 8, bfloat>)
LILY_INSTANTIATE("attn_decode_vec_q8_e8_bf16", attention_vec<bfloat, 8, int8_t>)
LILY_INSTANTIATE("attn_decode_vec_kvf32_e8_f32", attention_vec<float, 8, float>)
LILY_INSTANTIATE("attn_decode_vec_kvf32_e8_bf16", attention_vec<bfloat, 8, float>)
LILY_INSTANTIATE("attn_vec_combine_e2_f32", attention_vec_combine<float, 2>)
LILY_INSTANTIATE("attn_vec_combine_e2_bf16", attention_vec_combine<bfloat, 2>)
LILY_INSTANTIATE("attn_vec_combine_e4_f32", attention_vec_combine<float, 4>)
LILY_INSTANTIATE("attn_vec_combine_e4_bf16", attention_vec_combine<bfloat, 4>)
LILY_INSTANTIATE("attn_vec_combine_e8_f32", attention_vec_combine<float, 8>)
LILY_INSTANTIATE("attn_vec_combine_e8_bf16", attention_vec_combine<bfloat, 8>)

}  // namespace lily
