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
// A lane's slice of a K or V row is fetched as raw words (VecWords: E bf16 = one 4-, 8- or 16-byte
// load; E int8 codes = one 2-, 4- or 8-byte load; E floats = one or two 8- / 16-byte loads) and
// widened to floats only when its key is taken, so the rows of the next keys can be in flight
// (in registers as words, half the registers of floats for bf16) while this key's arithmetic runs.
// A slice is n loads of one word type (n = 2 only for E = 8 floats).
template <uint32_t E, typename KV>
struct VecWords;
template <>
struct VecWords<2, bfloat> { typedef uint32_t type; enum { n = 1 }; };
template <>
struct VecWords<4, bfloat> { typedef uint2 type; enum { n = 1 }; };
template <>
struct VecWords<8, bfloat> { typedef uint4 type; enum { n = 1 }; };
template <>
struct VecWords<2, int8_t> { typedef ushort type; enum { n = 1 }; };
template <>
struct VecWords<4, int8_t> { typedef uint32_t type; enum { n = 1 }; };
template <>
struct VecWords<8, int8_t> { typedef uint2 type; enum { n = 1 }; };
template <>
struct VecWords<2, float> { typedef float2 type; enum { n = 1 }; };
template <>
struct VecWords<4, float> { typedef float4 type; enum { n = 1 }; };
template <>
struct VecWords<8, float> { typedef float4 type; enum { n = 2 }; };

// Words -> E floats (bf16: the high half of a float; int8: the codes, unscaled).
inline void vec_unpack(uint32_t u, thread float* out) {
  out[0] = as_type<float>(u << 16);
  out[1] = as_type<float>(u & 0xffff0000u);
}
inline void vec_unpack(uint2 u, thread float* out) {
  vec_unpack(u.x, out);
  vec_unpack(u.y, out + 2);
}
inline void vec_unpack(uint4 u, thread float* out) {
  vec_unpack(u.x, out);
  vec_unpack(u.y, out + 2);
  vec_unpack(u.z, out + 4);
  vec_unpack(u.w, out + 6);
}
// int8 codes by the magic number: a byte b = code + 128 (the word's sign bits flipped) under the
// exponent of 2^23 is the float 2^23 + b exactly, so subtracting 2^23 + 128 gives the code exactly:
// a shift-and-or and a subtract per code, no integer-to-float conversion (a quarter-rate
// instruction on NVIDIA's GPUs). The same values as q8_code, bit for bit.
inline float q8_magic(uint32_t biased, uint32_t byte) {
  return as_type<float>(0x4B000000u | ((biased >> (8u * byte)) & 0xffu)) - 8388736.0f;
}
inline void vec_unpack_q8(ushort u, thread float* out) {
  const uint32_t b = uint32_t(u) ^ 0x8080u;
  out[0] = q8_magic(b, 0);
  out[1] = q8_magic(b, 1);
}
inline void vec_unpack_q8(uint32_t u, thread float* out) {
  const uint32_t b = u ^ 0x80808080u;
  for (uint32_t i = 0; i < 4; ++i) out[i] = q8_magic(b, i);
}
inline void vec_unpack_q8(uint2 u, thread float* out) {
  vec_unpack_q8(u.x, out);
  vec_unpack_q8(u.y, out + 4);
}
inline void vec_unpack(float2 v, thread float* out) {
  out[0] = v.x;
  out[1] = v.y;
}
inline void vec_unpack(float4 v, thread float* out) {
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}

// One key's slices of a lane: the K and V words and the rows' scales (bf16, f32: 1; q8: the codes
// come unscaled, the kernel applies the scales to the dot product and to p, once per key rather
// than once per value).
template <uint32_t E, typename KV>
struct VecKey {
  typename VecWords<E, KV>::type k[VecWords<E, KV>::n];
  typename VecWords<E, KV>::type v[VecWords<E, KV>::n];
  float ks;
  float vs;
};

// The vec route's cache reader over the threadgroup's block: fetch() issues the loads of key
// `key`, unpack() widens them.
template <uint32_t E, typename KV>
struct VecKv {
  typedef typename VecWords<E, KV>::type W;
  enum { N = VecWords<E, KV>::n };
  const device W* k;
  const device W* v;
  VecKv(const device KV* k_cache, const device KV* v_cache, KvRow r, uint32_t d0)
      : k(reinterpret_cast<const device W*>(k_cache + r.at + d0)),
        v(reinterpret_cast<const device W*>(v_cache + r.at + d0)) {}
  void fetch(uint32_t key, thread VecKey<E, KV>& r) const {
    for (uint32_t i = 0; i < N; ++i) {  // a row is 32 lanes' slices of N words
      r.k[i] = k[key * 32 * N + i];
      r.v[i] = v[key * 32 * N + i];
    }
    r.ks = 1.0f;
    r.vs = 1.0f;
  }
  static void unpack(thread const VecKey<E, KV>& r, thread float* kv, thread float* vv) {
    for (uint32_t i = 0; i < N; ++i) {
      vec_unpack(r.k[i], kv + i * (E / N));
      vec_unpack(r.v[i], vv + i * (E / N));
    }
  }
};
template <uint32_t E>
struct VecKv<E, int8_t> {
  typedef typename VecWords<E, int8_t>::type W;
  const device W* k;
  const device W* v;
  const device float* ks;
  const device float* vs;
  VecKv(const device int8_t* k_cache, const device int8_t* v_cache, KvRow r, uint32_t d0)
      : k(reinterpret_cast<const device W*>(k_cache + r.at + d0)),
        v(reinterpret_cast<const device W*>(v_cache + r.at + d0)),
        ks(reinterpret_cast<const device float*>(k_cache) + r.scale),
        vs(reinterpret_cast<const device float*>(v_cache) + r.scale) {}
  void fetch(uint32_t key, thread VecKey<E, int8_t>& r) const {
    r.k[0] = k[key * 32];
    r.v[0] = v[key * 32];
    r.ks = ks[key];
    r.vs = vs[key];
  }
  static void unpack(thread const VecKey<E, int8_t>& r, thread float* kv, thread float* vv) {
    vec_unpack_q8(r.k[0], kv);
    vec_unpack_q8(r.v[0], vv);
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
// the 8 sums by one reduce-scatter (lane j: head j / 4), then the online softmax with a lazy base
// (after FlashAttention-3): m_h is not the running maximum but a base that trails it by at most
// kAttnVecRebase, so p = exp(s - m_h) <= e^8 and o, l stay finite in fp32. Only when some head's
// score passes its base by more than that (simd_any: uniform, so the broadcasts below are too)
// are the bases raised to the maxima and every head's o and l scaled by exp(old - new) (first key:
// base -inf, so the factor is 0 and p = 1). The merge and the combine use the base as the max:
// o / l is the same quotient. Per key otherwise: one exp, then per head p broadcast from lane 4 h
// and E fused multiply-adds into o [8][E] flat (no multiply by a factor of 1); the products of
// the scores are fused multiply-adds too (fma: one instruction on Apple's and NVIDIA's GPUs, one
// rounding). Every index is a
// compile-time constant once unrolled: registers.
template <uint32_t E>
inline void vec_attend_key(thread const float* qr, thread const float* kv, thread const float* vv, float k_scale,
                           float v_scale, uint32_t lane, thread float& m_h, thread float& l_h, thread float* o) {
  constexpr uint32_t G = kAttnMaxGroup;
  float dot[G];
  for (uint32_t g = 0; g < G; ++g) {
    dot[g] = 0.0f;
    for (uint32_t e = 0; e < E; ++e) dot[g] = fma(qr[g * E + e], kv[e], dot[g]);
  }
  const float s = reduce_scatter8(dot, lane) * k_scale;
  if (simd_any(s > m_h + float(kAttnVecRebase))) {
    const float base = max(m_h, s);
    const float corr = exp(m_h - base);
    l_h *= corr;
    m_h = base;
    for (uint32_t g = 0; g < G; ++g) {
      const float cg = simd_broadcast(corr, ushort(4 * g));
      for (uint32_t d = 0; d < E; ++d) o[g * E + d] *= cg;
    }
  }
  const float p = exp(s - m_h);
  l_h += p;
  const float pv = p * v_scale;
  for (uint32_t g = 0; g < G; ++g) {
    const float pg = simd_broadcast(pv, ushort(4 * g));
    for (uint32_t d = 0; d < E; ++d) o[g * E + d] = fma(pg, vv[d], o[g * E + d]);
  }
}

// attention_vec: first pass. Threadgroup (kv head, block) covers keys
// [block * split_keys, min((block + 1) * split_keys, position + 1)) (never empty: the host sizes
// the blocks); simdgroup s walks keys begin + s, begin + s + 8, ... (8 simdgroups read 8 adjacent
// cache rows at a time). Lane j holds dims [E j, E j + E) of the query of every head of the KV
// head's group (pre-scaled by the softmax scale, in registers), of one K row and one V row, and of
// the group's running outputs. Per key: E products per head; the 8 heads' sums by one
// reduce-scatter (reduce_scatter8: lane j ends with head j / 4's score); one online-softmax
// update with one exp on every lane, for head j / 4 (its base and sum live on its quad), the
// bases raised only when a score passes one by more than kAttnVecRebase; then per head p
// broadcast from lane 4 h and E multiply-adds into o (vec_attend_key). Two keys per iteration,
// the next two keys' rows fetched before this pair's arithmetic.
// Unrolled over kAttnMaxGroup heads with no branch, so no private array is indexed at run time.
// Then the 8 simdgroups' (m, l, o) are merged through threadgroup memory (one head at a time) and
// written as the block's unnormalized partial.
//   grid:    (kv_heads, blocks) threadgroups of kAttnVecSimds * 32 = 256 threads
//   buffers: q [q_heads, D] T, k_cache, v_cache paged KV pools (bf16, q8 or f32), block_table (buffer 6);
//            partial_o float [q_heads, blocks, D]; partial_ml float [q_heads, blocks, 2]
//   registers per lane: q and o 2 x 8 x E floats, m and l 2 x 8, four K and four V slices as
//   words (two keys' taken, two keys' in flight) and one K and one V slice as E floats
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
  // Two keys per iteration (keys key and key + 8 of the simdgroup's sequence), taken one after the
  // other in the sequence's order; the next pair's rows are fetched before this pair's arithmetic,
  // so each simdgroup has up to four K and four V rows in flight. A fetch past the simdgroup's
  // last key reads a row of its own instead (never used): no read past the block's keys.
  const uint32_t n = key_end - key_begin;
  VecKey<E, KV> a0, a1;
  if (simd_id < n) {
    rows.fetch(simd_id, a0);
    rows.fetch(simd_id + NS < n ? simd_id + NS : simd_id, a1);
  }
  for (uint32_t key = simd_id; key < n; key += 2 * NS) {
    const uint32_t next = key + 2 * NS;
    VecKey<E, KV> b0, b1;
    rows.fetch(next < n ? next : key, b0);
    rows.fetch(next + NS < n ? next + NS : key, b1);
    float kv[E], vv[E];
    VecKv<E, KV>::unpack(a0, kv, vv);
    vec_attend_key<E>(&qr[0][0], kv, vv, a0.ks, a0.vs, lane, m_h, l_h, &o[0][0]);
    if (key + NS < n) {  // uniform over the simdgroup
      VecKv<E, KV>::unpack(a1, kv, vv);
      vec_attend_key<E>(&qr[0][0], kv, vv, a1.ks, a1.vs, lane, m_h, l_h, &o[0][0]);
    }
    a0 = b0;
    a1 = b1;
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
