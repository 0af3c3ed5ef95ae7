// Gated full attention: partial RoPE, fused q/k RMSNorm + RoPE + KV-cache append, decode attention
// (GQA-packed, single or split-K route + combine) and causal prefill attention, all over a paged
// KV cache (bf16 pools [blocks, kv_heads, block_tokens, head_dim] read through a block table, or
// their int8 / float32 twins: common/kv_blocks.h). Host: csrc/gpu/ops/attention.cpp. References:
// lily_py.reference.kernels (rope, qk_norm_rope, attention). Args and route constants:
// common/args_attention.h.
//
// Precision policy (all kernels): inputs widened to fp32; norms, angles, dot products, softmax and
// the weighted sum of values in fp32 with precise exp/cos/sin; each output rounded once (to the
// activation dtype T, or to bf16 in a bf16 cache; a float32 cache keeps the fp32 rows). RoPE
// angles are float(position) * inv_freq[i] in fp32, exactly as lily_py.reference.ops.rope_cos_sin
// computes them (inv_freq comes from the host).
#include "common/lily_metal.h"
#include "common/mma.h"
#include "common/kv_blocks.h"

namespace lily {

// -infinity, spelled so that Metal, the emulator and the strict pass all accept it.
inline float neg_inf() { return as_type<float>(0xff800000u); }

// ---------------------------------------------------------------------------------------------
// rope: y = partial rotary embedding of x (rotate-half pairing: feature i pairs with i + rd/2 for
// i < rd/2; features >= rd pass through unchanged).
//   grid:    (heads, tokens) threadgroups of kRopeThreads = 32 threads (one simdgroup)
//   thread:  pairs i = lane, lane + 32, ... < rd/2, then pass-through features rd + lane, ...
//   shapes:  x [tokens, heads, head_dim] (x_stride between tokens), y likewise (y_stride)
template <typename T>
[[kernel]] void rope(constant RopeArgs& args [[buffer(0)]],
                     const device T* x [[buffer(1)]],
                     const device float* inv_freq [[buffer(2)]],
                     device T* y [[buffer(3)]],
                     LILY_KERNEL_TAIL) {
  const uint32_t t = group_pos.y;
  const uint32_t D = args.head_dim;
  const device T* xr = x + t * args.x_stride + group_pos.x * D;
  device T* yr = y + t * args.y_stride + group_pos.x * D;
  const uint32_t half_rd = args.rotary_dim / 2;
  const float pos = float(args.position + t);
  for (uint32_t i = thread_pos.x; i < half_rd; i += group_size.x) {
    const float angle = pos * inv_freq[i];
    const float c = cos(angle);
    const float s = sin(angle);
    const float a = float(xr[i]);
    const float b = float(xr[i + half_rd]);
    yr[i] = T(a * c - b * s);
    yr[i + half_rd] = T(b * c + a * s);
  }
  for (uint32_t c = args.rotary_dim + thread_pos.x; c < D; c += group_size.x) yr[c] = xr[c];
}

// ---------------------------------------------------------------------------------------------
// qk_norm_rope: the attention layer's step between the projections and attention, one dispatch:
//   q head rows:  q = rope(rms_norm(qg[t, h, 0:D]) * (q_norm + weight_offset)) -> q_out (T)
//   k head rows:  k = rope(rms_norm(k[t, h]) * (k_norm + weight_offset)) -> k_cache row (h, position + t)
//                 v[t, h] -> v_cache row (h, position + t) (rows through block_table)
//   grid:    (q_heads + kv_heads, tokens) threadgroups of 32 threads (one simdgroup: the sum of
//            squares is one simd_sum, no barrier); group_pos.x < q_heads is a query head
//   thread:  sum of squares over features lane, lane + 32, ...; then RoPE pairs as in `rope`
//   The gate half qg[t, h, D:2D] is left where it is: attention reads it (AttnArgs.use_gate).
// The cache rows' writer: bf16 and f32 pools take each value as it is computed (rounded to bf16,
// or as is); q8 pools (KV = int8_t) stage the row's values in threadgroup memory, then (barrier)
// quantize each row with the scale of its largest magnitude (simd_max over the simdgroup) and
// write codes and scale.
template <typename KV>
struct KvWriter;
template <>
struct KvWriter<bfloat> {
  device bfloat* k;
  device bfloat* v;
  KvRow row;
  threadgroup float* stage;
  void put_k(uint32_t c, float y) { k[row.at + c] = bfloat(y); }
  void put_v(uint32_t c, float y) { v[row.at + c] = bfloat(y); }
  void finish(uint32_t, uint32_t) {}
};
template <>
struct KvWriter<float> {
  device float* k;
  device float* v;
  KvRow row;
  threadgroup float* stage;
  void put_k(uint32_t c, float y) { k[row.at + c] = y; }
  void put_v(uint32_t c, float y) { v[row.at + c] = y; }
  void finish(uint32_t, uint32_t) {}
};
template <>
struct KvWriter<int8_t> {
  device int8_t* k;
  device int8_t* v;
  KvRow row;
  threadgroup float* stage;  // [2 * head_dim]: the K row, then the V row
  void put_k(uint32_t c, float y) { stage[c] = y; }
  void put_v(uint32_t c, float y) { stage[kAttnMaxHeadDim + c] = y; }
  static void quantize(device int8_t* pool, KvRow row, const threadgroup float* x, uint32_t D, uint32_t lane) {
    float amax = 0.0f;
    for (uint32_t c = lane; c < D; c += 32) amax = max(amax, abs(x[c]));
    const float s = kv_q8_scale(simd_max(amax));
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (uint32_t c = lane; c < D; c += 32) pool[row.at + c] = kv_q8_code(x[c], inv);
    if (lane == 0) reinterpret_cast<device float*>(pool)[row.scale] = s;
  }
  void finish(uint32_t D, uint32_t lane) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    quantize(k, row, stage, D, lane);
    quantize(v, row, stage + kAttnMaxHeadDim, D, lane);
  }
};

template <typename T, typename W, typename KV>
[[kernel]] void qk_norm_rope(constant QkNormRopeArgs& args [[buffer(0)]],
                             const device T* qg [[buffer(1)]],
                             const device T* k [[buffer(2)]],
                             const device T* v [[buffer(3)]],
                             const device W* q_norm [[buffer(4)]],
                             const device W* k_norm [[buffer(5)]],
                             const device float* inv_freq [[buffer(6)]],
                             device T* q_out [[buffer(7)]],
                             device KV* k_cache [[buffer(8)]],
                             device KV* v_cache [[buffer(9)]],
                             const device uint32_t* block_table [[buffer(10)]],
                             LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, stage, [2 * kAttnMaxHeadDim]);  // q8 pools only (KvWriter<int8_t>)
  const uint32_t t = group_pos.y;
  const uint32_t D = args.head_dim;
  const bool is_q = group_pos.x < args.q_heads;  // uniform over the threadgroup
  const uint32_t qh = is_q ? group_pos.x : 0;
  const uint32_t kvh = is_q ? 0 : group_pos.x - args.q_heads;
  const device T* src = is_q ? qg + t * args.qg_stride + qh * 2 * D : k + t * args.k_stride + kvh * D;
  const device W* w = is_q ? q_norm : k_norm;
  device T* qo = q_out + (t * args.q_heads + qh) * D;
  KvWriter<KV> cache{k_cache, v_cache,
                     KvRows<KV>::row(block_table, args.block_shift, args.kv_heads, D, kvh, args.position + t), stage};

  float ss = 0.0f;
  for (uint32_t c = lane; c < D; c += 32) {
    const float xv = float(src[c]);
    ss += xv * xv;
  }
  const float scale = rsqrt(simd_sum(ss) / float(D) + args.eps);

  const uint32_t half_rd = args.rotary_dim / 2;
  const float pos = float(args.position + t);
  for (uint32_t i = lane; i < half_rd; i += 32) {
    const float angle = pos * inv_freq[i];
    const float c = cos(angle);
    const float s = sin(angle);
    const float a = float(src[i]) * scale * (float(w[i]) + args.weight_offset);
    const float b = float(src[i + half_rd]) * scale * (float(w[i + half_rd]) + args.weight_offset);
    const float ya = a * c - b * s;
    const float yb = b * c + a * s;
    if (is_q) {
      qo[i] = T(ya);
      qo[i + half_rd] = T(yb);
    } else {
      cache.put_k(i, ya);
      cache.put_k(i + half_rd, yb);
    }
  }
  for (uint32_t c = args.rotary_dim + lane; c < D; c += 32) {
    const float yv = float(src[c]) * scale * (float(w[c]) + args.weight_offset);
    if (is_q) qo[c] = T(yv);
    else cache.put_k(c, yv);
  }
  if (!is_q) {  // uniform over the threadgroup: finish's barrier is reached by every thread
    const device T* vr = v + t * args.v_stride + kvh * D;
    for (uint32_t c = lane; c < D; c += 32) cache.put_v(c, float(vr[c]));
    cache.finish(D, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Attention over the cache. One threadgroup = one KV head x Bq query tokens (x one key range on
// the split route); simdgroup s (< group = q_heads / kv_heads <= 8) owns query head
// kv_head * group + s for those Bq tokens, so each K/V row is read from device memory once per
// threadgroup and used by all group x Bq query rows.
//   grid:     (kv_heads, ceil(tokens / Bq), splits), 32 * group threads
//   per block of kAttnBlockKeys = 32 keys:
//     1. all threads copy the K block (bf16) into threadgroup memory; barrier (f32 pools: the
//        rows are read from device memory where they are used, KvBlock<float>)
//     2. lane j scores key j for each of its simdgroup's rows (dot over head_dim in fp32, q read
//        from device memory: the same address on every lane), online-softmax update of the row's
//        running max m and sum l (simd_max, simd_sum), p_j to threadgroup memory; barrier
//     3. all threads copy the V block into the same threadgroup memory; barrier
//     4. lane owns dims lane, lane + 32, ... (<= 8): o = o * corr + sum_j p_j v_j; barrier
//   registers per thread: o[Bq][8], m[Bq], l[Bq] (Bq = 1 decode, kAttnPrefillTokens prefill)
//   threadgroup memory: K or V block 32 x 256 bf16 (16 KiB) + p 8 x Bq x 32 floats
//   Causal: row (token t) uses keys < position + t + 1. Rows past `tokens` repeat the last
//   token's computation and are not written. Bank conflicts in step 2 (lanes read different rows
//   of the block) are avoided by starting lane j's dot product at feature 2j (mod head_dim).
template <uint32_t Bq>
struct AttnState {
  float o[Bq][kAttnDimsPerLane];
  float m[Bq];
  float l[Bq];
};

// The K or V block of attend_keys. bf16 pools: staged in threadgroup memory by all threads (each
// cache row read from device memory once per threadgroup; 32 x 256 bf16 = 16 KiB). f32 pools: the
// same staging would take 32 KiB, the whole threadgroup limit, so each row is read from device
// memory where it is used (the callers never read rows past the block's keys).
template <typename KV>
struct KvBlock;
template <>
struct KvBlock<bfloat> {
  enum : uint32_t { kStage = kAttnBlockKeys * kAttnMaxHeadDim };  // bf16 elements staged
  threadgroup bfloat* s;
  void load(const device bfloat* pool, uint32_t blk, uint32_t nkeys, uint32_t D, uint32_t tid, uint32_t threads) {
    for (uint32_t e = tid; e < kAttnBlockKeys * D; e += threads) {
      const uint32_t j = e / D;
      s[e] = j < nkeys ? pool[blk + j * D + e % D] : bfloat(0.0f);
    }
  }
  float at(uint32_t j, uint32_t d, uint32_t D) const { return float(s[j * D + d]); }
};
template <>
struct KvBlock<float> {
  enum : uint32_t { kStage = 8 };  // nothing staged
  threadgroup bfloat* s;
  const device float* rows;  // the block's first row
  void load(const device float* pool, uint32_t blk, uint32_t, uint32_t, uint32_t, uint32_t) { rows = pool + blk; }
  float at(uint32_t j, uint32_t d, uint32_t D) const { return rows[j * D + d]; }
};

template <typename T, uint32_t Bq, typename KV>
inline void attend_keys(constant AttnArgs& args, const device T* q, const device KV* k_cache,
                        const device KV* v_cache, const device uint32_t* block_table,
                        threadgroup bfloat* kv_s, threadgroup float* p_s,
                        thread AttnState<Bq>& st, uint32_t kv_head, uint32_t t0, uint32_t key_begin,
                        uint32_t key_end, uint32_t tid, uint32_t threads, uint32_t lane, uint32_t simd_id) {
  const uint32_t D = args.head_dim;
  const uint32_t group = args.q_heads / args.kv_heads;
  const uint32_t h = kv_head * group + simd_id;
  const uint32_t rot = (2 * lane) % D;  // bank-conflict-free start of lane's dot product
  KvBlock<KV> kv{kv_s};

  for (uint32_t r = 0; r < Bq; ++r) {
    st.m[r] = neg_inf();
    st.l[r] = 0.0f;
    for (uint32_t i = 0; i < kAttnDimsPerLane; ++i) st.o[r][i] = 0.0f;
  }

  for (uint32_t kb = key_begin; kb < key_end; kb += kAttnBlockKeys) {
    const uint32_t nkeys = min(uint32_t(kAttnBlockKeys), key_end - kb);
    // Rows kb .. kb + 31 lie in one cache block (kb is a multiple of 32).
    const uint32_t blk = kv_row_offset(block_table, args.block_shift, args.kv_heads, D, kv_head, kb);
    kv.load(k_cache, blk, nkeys, D, tid, threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint32_t kr = min(lane, nkeys - 1);  // lanes past the block's keys score its last one (masked)

    for (uint32_t r = 0; r < Bq; ++r) {
      const uint32_t t = min(t0 + r, args.tokens - 1);
      const uint32_t causal_end = args.position + t + 1;  // keys < causal_end are visible
      const device T* qr = q + t * args.q_stride + h * D;
      const uint32_t key = kb + lane;
      const bool valid = lane < nkeys && key < causal_end;
      float dot = 0.0f;
      for (uint32_t i = 0; i < D; ++i) {
        uint32_t d = i + rot;
        if (d >= D) d -= D;
        dot += float(qr[d]) * kv.at(kr, d, D);
      }
      const float s = dot * args.scale;
      const float block_max = simd_max(valid ? s : neg_inf());
      const float m_new = max(st.m[r], block_max);
      // m_new > m unless nothing new is visible; never evaluates (-inf) - (-inf).
      const float corr = st.m[r] == m_new ? 1.0f : exp(st.m[r] - m_new);
      const float p = valid ? exp(s - m_new) : 0.0f;
      st.l[r] = st.l[r] * corr + simd_sum(p);
      st.m[r] = m_new;
      for (uint32_t i = 0; i < kAttnDimsPerLane; ++i) st.o[r][i] *= corr;
      p_s[(simd_id * Bq + r) * kAttnBlockKeys + lane] = p;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    kv.load(v_cache, blk, nkeys, D, tid, threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint32_t r = 0; r < Bq; ++r) {
      const threadgroup float* pr = p_s + (simd_id * Bq + r) * kAttnBlockKeys;
      for (uint32_t i = 0; i < kAttnDimsPerLane; ++i) {
        const uint32_t d = lane + 32 * i;
        if (d >= D) break;
        float acc = 0.0f;
        for (uint32_t j = 0; j < nkeys; ++j) acc += pr[j] * kv.at(j, d, D);
        st.o[r][i] += acc;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

inline float attn_sigmoid(float g) { return 1.0f / (1.0f + exp(-g)); }

// Single route (decode with <= kAttnSplitKeys keys) and prefill: normalizes, gates, writes out.
//   buffers: q [tokens, q_heads, D] T, k_cache, v_cache paged KV pools (bf16 or f32), block_table
//            (buffer 6), gate T (see AttnArgs), out [tokens, q_heads, D] T
template <typename T, uint32_t Bq, typename KV>
[[kernel]] void attention(constant AttnArgs& args [[buffer(0)]],
                          const device T* q [[buffer(1)]],
                          const device KV* k_cache [[buffer(2)]],
                          const device KV* v_cache [[buffer(3)]],
                          const device T* gate [[buffer(4)]],
                          device T* out [[buffer(5)]],
                          const device uint32_t* block_table [[buffer(6)]],
                          LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(bfloat, kv_s, [KvBlock<KV>::kStage]);
  LILY_TG_ARRAY(float, p_s, [kAttnMaxGroup * Bq * kAttnBlockKeys]);
  const uint32_t t0 = group_pos.y * Bq;
  const uint32_t t_last = min(t0 + Bq, args.tokens) - 1;
  const uint32_t key_end = args.position + t_last + 1;
  AttnState<Bq> st;
  attend_keys<T, Bq, KV>(args, q, k_cache, v_cache, block_table, kv_s, p_s, st, group_pos.x, t0, 0, key_end,
                         thread_pos.x, group_size.x, lane, simd_id);

  const uint32_t D = args.head_dim;
  const uint32_t h = group_pos.x * (args.q_heads / args.kv_heads) + simd_id;
  for (uint32_t r = 0; r < Bq; ++r) {
    const uint32_t t = t0 + r;
    if (t >= args.tokens) break;
    const float inv_l = 1.0f / st.l[r];
    for (uint32_t i = 0; i < kAttnDimsPerLane; ++i) {
      const uint32_t d = lane + 32 * i;
      if (d >= D) break;
      float y = st.o[r][i] * inv_l;
      if (args.use_gate != 0)
        y *= attn_sigmoid(float(gate[t * args.gate_stride + h * args.gate_head_stride + d]));
      out[(t * args.q_heads + h) * D + d] = T(y);
    }
  }
}

// Split route, first pass (decode, tokens = 1): threadgroup (kv head, 0, split) covers keys
// [split * split_keys, min((split + 1) * split_keys, position + 1)) (never empty: the host sizes
// the splits) and writes its unnormalized partials.
//   buffers: q, k_cache, v_cache as above; partial_o float [q_heads, splits, D];
//            partial_ml float [q_heads, splits, 2] (running max m, sum l)
template <typename T, typename KV>
[[kernel]] void attention_split(constant AttnArgs& args [[buffer(0)]],
                                const device T* q [[buffer(1)]],
                                const device KV* k_cache [[buffer(2)]],
                                const device KV* v_cache [[buffer(3)]],
                                device float* partial_o [[buffer(4)]],
                                device float* partial_ml [[buffer(5)]],
                                const device uint32_t* block_table [[buffer(6)]],
                                LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(bfloat, kv_s, [KvBlock<KV>::kStage]);
  LILY_TG_ARRAY(float, p_s, [kAttnMaxGroup * kAttnBlockKeys]);
  const uint32_t split = group_pos.z;
  const uint32_t key_begin = split * args.split_keys;
  const uint32_t key_end = min(key_begin + args.split_keys, args.position + 1);
  AttnState<1> st;
  attend_keys<T, 1, KV>(args, q, k_cache, v_cache, block_table, kv_s, p_s, st, group_pos.x, 0, key_begin, key_end,
                        thread_pos.x, group_size.x, lane, simd_id);

  const uint32_t D = args.head_dim;
  const uint32_t h = group_pos.x * (args.q_heads / args.kv_heads) + simd_id;
  const uint32_t slot = h * args.splits + split;
  for (uint32_t i = 0; i < kAttnDimsPerLane; ++i) {
    const uint32_t d = lane + 32 * i;
    if (d >= D) break;
    partial_o[slot * D + d] = st.o[0][i];
  }
  if (lane == 0) {
    partial_ml[slot * 2] = st.m[0];
    partial_ml[slot * 2 + 1] = st.l[0];
  }
}

// Split route, second pass: out[h] = sum_s e_s o_s / sum_s e_s l_s * sigmoid(gate), with
// e_s = exp(m_s - max_s m_s); splits summed in order.
//   grid: q_heads threadgroups of 32 threads; lane owns dims lane, lane + 32, ...
template <typename T>
[[kernel]] void attention_combine(constant AttnArgs& args [[buffer(0)]],
                                  const device float* partial_o [[buffer(1)]],
                                  const device float* partial_ml [[buffer(2)]],
                                  const device T* gate [[buffer(3)]],
                                  device T* out [[buffer(4)]],
                                  LILY_KERNEL_TAIL) {
  const uint32_t h = group_pos.x;
  const uint32_t D = args.head_dim;
  const uint32_t base = h * args.splits;
  float m_max = neg_inf();
  for (uint32_t s = 0; s < args.splits; ++s) m_max = max(m_max, partial_ml[(base + s) * 2]);
  float l_sum = 0.0f;
  for (uint32_t s = 0; s < args.splits; ++s)
    l_sum += exp(partial_ml[(base + s) * 2] - m_max) * partial_ml[(base + s) * 2 + 1];
  const float inv_l = 1.0f / l_sum;
  for (uint32_t d = lane; d < D; d += 32) {
    float acc = 0.0f;
    for (uint32_t s = 0; s < args.splits; ++s)
      acc += exp(partial_ml[(base + s) * 2] - m_max) * partial_o[(base + s) * D + d];
    float y = acc * inv_l;
    if (args.use_gate != 0) y *= attn_sigmoid(float(gate[h * args.gate_head_stride + d]));
    out[h * D + d] = T(y);
  }
}

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
inline float q8_code(uint32_t word, uint32_t byte) { return float(as_type<int32_t>(word << (24u - 8u * byte)) >> 24); }
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

// ---------------------------------------------------------------------------------------------
// attention_prefill_mma: the prefill route for head_dim % 32 == 0 (and % 64 == 0 above 128), with
// 8x8 simdgroup matrices (common/mma.h). One threadgroup = one KV head x qt = 32 / group query
// tokens: its 32 rows are (token, head) pairs, row = token_in_block * group + head_in_group (rows
// past qt * group are zero padding). Per block of 32 keys:
//   S = Q K^T:  head_dim walked in 32-wide chunks: q rows and k rows of the chunk -> threadgroup
//               (fp32), barrier, simdgroup s multiplies its 16x16 quarter of S (2x2 tiles), barrier;
//               S -> threadgroup memory, barrier
//   softmax:    thread t owns row t / 4, columns 8 (t % 4) .. +8: scale, causal mask, row max and
//               sum over the row's 4 threads (simd_shuffle_xor 1, 2), running m and l in registers,
//               p back into S, the row's rescale factor onto the diagonal of an 8x8 tile; barrier
//   O += P V:   per pass of vc = min(head_dim, 128) columns: V block -> threadgroup (fp32),
//               barrier; simdgroup s owns all 32 rows x columns s * vc / 4 .. +vc / 4: rescales its
//               tiles (diag * O) then accumulates P V (4 k-steps); barrier
//   grid:       (kv_heads, ceil(tokens / qt)) x kAttnMmaThreads = 128 threads
//   registers:  O: 4 row tiles x (head_dim / 32) column tiles of 8x8 fp32 (64 floats per lane at
//               head_dim 256), S quarter 2x2 tiles, m and l of one row
//   threadgroup memory: q, k, S tiles 3 x 32 x 36 floats, V 32 x 132 floats, diagonals 32 x 8:
//               31,744 bytes
// Each K/V row is read from device memory once per threadgroup (q once per key block). The K and V
// tiles are fp32 whatever the pool (KvRows<KV>::value: bf16 widened, q8 code x scale, f32 as is),
// so an f32 cache's rows reach the products unrounded (the route every f32 cache prefill takes at
// these head dims: docs/kernels-attention.md).
template <typename T, typename KV>
[[kernel]] void attention_prefill_mma(constant AttnArgs& args [[buffer(0)]],
                                      const device T* q [[buffer(1)]],
                                      const device KV* k_cache [[buffer(2)]],
                                      const device KV* v_cache [[buffer(3)]],
                                      const device T* gate [[buffer(4)]],
                                      device T* out [[buffer(5)]],
                                      const device uint32_t* block_table [[buffer(6)]],
                                      LILY_KERNEL_TAIL) {
  constexpr uint32_t R = kAttnMmaRows;
  constexpr uint32_t BK = kAttnBlockKeys;
  constexpr uint32_t LD = 36;                     // padded rows of the q, k and S tiles
  constexpr uint32_t LDV = kAttnMmaMaxVCols + 4;  // padded rows of the V tile
  static_assert(R == 32 && BK == 32 && kAttnMmaThreads == 128, "the mapping below assumes 32 x 32 and 128 threads");
  LILY_TG_ARRAY(float, qs, [R * LD]);
  LILY_TG_ARRAY(float, ks, [BK * LD]);
  LILY_TG_ARRAY(float, ss, [R * LD]);
  LILY_TG_ARRAY(float, vs, [BK * LDV]);
  LILY_TG_ARRAY(float, diag, [R * 8]);

  const uint32_t D = args.head_dim;
  const uint32_t group = args.q_heads / args.kv_heads;
  const uint32_t qt = R / group;     // query tokens per threadgroup
  const uint32_t rows = qt * group;  // live rows
  const uint32_t kvh = group_pos.x;
  const uint32_t t0 = group_pos.y * qt;
  const uint32_t t_last = min(t0 + qt, args.tokens) - 1;
  const uint32_t key_end = args.position + t_last + 1;
  const uint32_t t = thread_pos.x;
  const uint32_t row = t / 4;        // the row this thread loads and runs the softmax of
  const uint32_t col = (t % 4) * 8;  // its 8 columns
  const bool row_live = row < rows && t0 + row / group < args.tokens;
  const uint32_t row_tok = min(t0 + min(row, rows - 1) / group, args.tokens - 1);
  const uint32_t row_head = kvh * group + min(row, rows - 1) % group;
  const uint32_t visible_end = args.position + row_tok + 1;  // the row sees keys < visible_end
  const uint32_t vc = D > kAttnMmaMaxVCols ? D / 2 : D;     // V columns per pass
  const uint32_t passes = D / vc;
  const uint32_t tiles = vc / 32;                            // column tiles per simdgroup per pass
  const uint32_t sm = (simd_id / 2) * 16;
  const uint32_t sn = (simd_id % 2) * 16;

  MmaTile<4, 8> o;
  mma_zero(o);
  float m = neg_inf();
  float l = 0.0f;

  for (uint32_t kb = 0; kb < key_end; kb += BK) {
    const uint32_t nkeys = min(BK, key_end - kb);
    const KvRow blk = KvRows<KV>::row(block_table, args.block_shift, args.kv_heads, D, kvh, kb);  // one cache block
    MmaTile<2, 2> sacc;
    mma_zero(sacc);
    for (uint32_t dc = 0; dc < D; dc += 32) {
      const device T* qr = q + row_tok * args.q_stride + row_head * D + dc + col;
      for (uint32_t i = 0; i < 8; ++i) qs[row * LD + col + i] = row_live ? float(qr[i]) : 0.0f;
      const uint32_t kj = min(row, nkeys - 1);
      for (uint32_t i = 0; i < 8; ++i)
        ks[row * LD + col + i] = row < nkeys ? KvRows<KV>::value(k_cache, blk, kj, D, dc + col + i) : 0.0f;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint32_t kk = 0; kk < 32; kk += 8) mma_step(sacc, qs + sm * LD + kk, LD, ks + sn * LD + kk, LD);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    mma_store(sacc, ss + sm * LD + sn, LD);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float sv[8];
    float block_max = neg_inf();
    for (uint32_t i = 0; i < 8; ++i) {
      sv[i] = ss[row * LD + col + i] * args.scale;
      if (kb + col + i < visible_end) block_max = max(block_max, sv[i]);
    }
    block_max = max(block_max, simd_shuffle_xor(block_max, 1));
    block_max = max(block_max, simd_shuffle_xor(block_max, 2));
    const float m_new = max(m, block_max);
    const float corr = m == m_new ? 1.0f : exp(m - m_new);  // never (-inf) - (-inf)
    float psum = 0.0f;
    for (uint32_t i = 0; i < 8; ++i) {
      const float p = kb + col + i < visible_end ? exp(sv[i] - m_new) : 0.0f;
      ss[row * LD + col + i] = p;
      psum += p;
    }
    psum += simd_shuffle_xor(psum, 1);
    psum += simd_shuffle_xor(psum, 2);
    l = l * corr + psum;
    m = m_new;
    for (uint32_t c = (t % 4) * 2; c < (t % 4) * 2 + 2; ++c)
      diag[(row / 8) * 64 + (row % 8) * 8 + c] = c == row % 8 ? corr : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint32_t pass = 0; pass < passes; ++pass) {
      for (uint32_t e = t; e < BK * vc; e += kAttnMmaThreads) {
        const uint32_t j = e / vc;
        const uint32_t c = e % vc;
        vs[j * LDV + c] = j < nkeys ? KvRows<KV>::value(v_cache, blk, j, D, pass * vc + c) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint32_t i = 0; i < 4; ++i) {
        for (uint32_t jj = 0; jj < tiles; ++jj) {
          mma_tile_scale_rows(o.c[i][pass * 4 + jj], diag + i * 64);
          for (uint32_t kk = 0; kk < BK; kk += 8)
            mma_tile_step(o.c[i][pass * 4 + jj], ss + (8 * i) * LD + kk, LD,
                          vs + kk * LDV + simd_id * (vc / 4) + 8 * jj, LDV);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  // Epilogue, per pass: O tiles -> threadgroup memory, then each row's 4 threads normalize, gate
  // and write its columns.
  const float inv_l = 1.0f / l;
  for (uint32_t pass = 0; pass < passes; ++pass) {
    for (uint32_t i = 0; i < 4; ++i)
      for (uint32_t jj = 0; jj < tiles; ++jj)
        mma_tile_store(o.c[i][pass * 4 + jj], vs + (8 * i) * LDV + simd_id * (vc / 4) + 8 * jj, LDV);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (row_live) {
      for (uint32_t c = t % 4; c < vc; c += 4) {
        const uint32_t d = pass * vc + c;
        float y = vs[row * LDV + c] * inv_l;
        if (args.use_gate != 0)
          y *= attn_sigmoid(float(gate[row_tok * args.gate_stride + row_head * args.gate_head_stride + d]));
        out[(row_tok * args.q_heads + row_head) * D + d] = T(y);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// ---------------------------------------------------------------------------------------------
// attention_prefill_tiles: the M1-M4 prefill route for bf16 activations at head_dim D = 64, 128 or
// 256 (learned from the flash form of MLX's steel attention; own code). bf16 operands in
// threadgroup memory, fp32 simdgroup_float8x8 accumulators (simdgroup_multiply_accumulate with
// simdgroup_bfloat8x8 operands). One threadgroup = one KV head x qt = 32 / group query tokens: 32
// (token, head) rows as attention_prefill_mma (row = token_in_block * group + head_in_group,
// padding rows repeat the last live row and are not written); simdgroup s owns rows 8s .. 8s + 7
// whole, so the online softmax never leaves the simdgroup.
//   Q:          staged once through threadgroup memory in 64-column chunks (16-byte loads, bf16 as
//               is) and kept in registers: D / 8 simdgroup_bfloat8x8 per simdgroup
//   key blocks: BK = 2048 / D keys (32, 16, 8): K and V rows of the block [BK][D + 8] bf16, two
//               16-byte loads of each per thread (BK * D / 8 = 256 per operand), issued for block
//               b + 1 into registers before block b's math
//   stages:     two K / V stages, block b in stage b % 2 (double buffered)
//   per block:  registers -> stage b % 2; barrier (the only threadgroup barrier of the block);
//               S = Q K^T (BK / 8 tiles of 8x8, D / 8 k-steps) -> the simdgroup's fp32 scratch;
//               simdgroup barrier; the row's 4 lanes: scale, causal mask, running max and sum
//               (simd_shuffle_xor 1, 2), p -> bf16 P scratch, rescale factor -> the simdgroup's
//               8x8 diagonal; simdgroup barrier; O = diag * O (exact) and O += P V (BK / 8 k-steps
//               x D / 8 tiles). No barrier closes the block: block b + 1 writes stage (b + 1) % 2,
//               whose last readers (block b - 1's math) every thread finished before it reached
//               block b's barrier. 1 threadgroup barrier per block, + 2 per 64-column Q chunk once
//               (attention_prefill_mma: 2 D / 32 + 2 + 2 * passes per 32 keys).
//   epilogue:   per O tile: simdgroup_store to the scratch, simdgroup barrier, each lane writes 2
//               outputs of row lane / 4 (/ l, * sigmoid(gate), rounded to bf16), simdgroup barrier
//   grid:       (kv_heads, ceil(tokens / qt)) x kAttnTilesThreads = 128 threads
//   registers:  Q D / 8 bf16 8x8 (64 bf16 per lane at 256), O D / 8 fp32 8x8 (64 floats per lane at
//               256), S BK / 8 fp32 8x8, the K / V prefetch 4 x uint4, m and l of one row
//   threadgroup memory: K, V 2 stages x 2 x BK x (D + 8) bf16 + per simdgroup S 8 x BK fp32, P 8 x
//               BK bf16, diag 8 x 8 fp32: 25,600 / 21,504 / 19,456 bytes at D = 64 / 128 / 256
//               (2 / 3 / 3 per core in a 64 KiB pool, 1 in a 32 KiB one; docs/kernels-attention.md weighs it)
// Precision: q, K, V are bf16 already (products exact in fp32, sums fp32); P is rounded to bf16 as
// the operand of P V (relative error <= 2^-8 per weight; l sums the unrounded p), so
// |O / l - exact| <= 2^-8 * sum_j w_j |v_j| <= 2^-8 max |v|; one rounding of the output to bf16.
// Alignment (checked by the host, which otherwise takes attention_prefill_mma): q, k_cache and
// v_cache bindings on 16-byte boundaries, q_stride a multiple of 8.
// With an int8 cache (KV = int8_t) each staged unit is 8 codes x the row's scale, rounded to bf16
// (the tiles' operand type): one more rounding of K and V than the bf16 cache's, as large.
inline uint32_t bf16_pair(float a, float b) {
  return uint32_t(as_type<ushort>(bfloat(a))) | (uint32_t(as_type<ushort>(bfloat(b))) << 16);
}
template <typename KV>
struct TileKv;
template <>
struct TileKv<bfloat> {
  static uint4 load(const device bfloat* pool, KvRow r, uint32_t key, uint32_t D, uint32_t col) {
    return *reinterpret_cast<const device uint4*>(pool + r.at + key * D + col);
  }
};
template <>
struct TileKv<int8_t> {
  static uint4 load(const device int8_t* pool, KvRow r, uint32_t key, uint32_t D, uint32_t col) {
    const uint2 c = *reinterpret_cast<const device uint2*>(pool + r.at + key * D + col);
    const float s = KvRows<int8_t>::scale(pool, r.scale + key);
    uint4 u;
    u.x = bf16_pair(q8_code(c.x, 0) * s, q8_code(c.x, 1) * s);
    u.y = bf16_pair(q8_code(c.x, 2) * s, q8_code(c.x, 3) * s);
    u.z = bf16_pair(q8_code(c.y, 0) * s, q8_code(c.y, 1) * s);
    u.w = bf16_pair(q8_code(c.y, 2) * s, q8_code(c.y, 3) * s);
    return u;
  }
};

template <uint32_t D, typename KV>
[[kernel]] void attention_prefill_tiles(constant AttnArgs& args [[buffer(0)]],
                                        const device bfloat* q [[buffer(1)]],
                                        const device KV* k_cache [[buffer(2)]],
                                        const device KV* v_cache [[buffer(3)]],
                                        const device bfloat* gate [[buffer(4)]],
                                        device bfloat* out [[buffer(5)]],
                                        const device uint32_t* block_table [[buffer(6)]],
                                        LILY_KERNEL_TAIL) {
  constexpr uint32_t R = kAttnMmaRows;
  constexpr uint32_t BK = kAttnTilesKeyDims / D;  // keys per block
  constexpr uint32_t LDK = D + 8;                 // padded stage rows (16-byte aligned)
  constexpr uint32_t U = D / 8;                   // 16-byte units per K / V row
  constexpr uint32_t QC = 64;                     // Q staging chunk (columns)
  constexpr uint32_t LDQ = QC + 8;
  constexpr uint32_t NT = kAttnTilesThreads;
  constexpr uint32_t PER = BK * U / NT;           // 16-byte loads per thread per operand
  static_assert(R == 32 && NT == 128 && PER == 2 && BK % 8 == 0 && BK >= 8, "the mapping below");
  constexpr uint32_t STAGE = 2 * BK * LDK;        // one K / V stage (bf16 elements)
  static_assert(STAGE >= R * LDQ, "the Q chunk is staged through the first K / V stage");
  LILY_TG_ARRAY(uint4, kv16, [2 * STAGE / 8]);
  LILY_TG_ARRAY(float, ss_all, [4 * 8 * BK]);
  LILY_TG_ARRAY(bfloat, ps_all, [4 * 8 * BK]);
  LILY_TG_ARRAY(float, diag_all, [4 * 64]);
  threadgroup bfloat* const kv = reinterpret_cast<threadgroup bfloat*>(kv16);
  threadgroup float* ss = ss_all + simd_id * 8 * BK;
  threadgroup bfloat* ps = ps_all + simd_id * 8 * BK;
  threadgroup float* diag = diag_all + simd_id * 64;

  const uint32_t group = args.q_heads / args.kv_heads;
  const uint32_t qt = R / group;
  const uint32_t rows = qt * group;
  const uint32_t kvh = group_pos.x;
  const uint32_t t0 = group_pos.y * qt;
  const uint32_t t_last = min(t0 + qt, args.tokens) - 1;
  const uint32_t key_end = args.position + t_last + 1;
  const uint32_t t = thread_pos.x;
  // The row (0 .. 31) this lane runs the softmax and the output of.
  const uint32_t row = simd_id * 8 + lane / 4;
  const uint32_t sub = lane % 4;
  const bool row_live = row < rows && t0 + row / group < args.tokens;
  const uint32_t row_tok = min(t0 + min(row, rows - 1) / group, args.tokens - 1);
  const uint32_t row_head = kvh * group + min(row, rows - 1) % group;
  const uint32_t visible_end = args.position + row_tok + 1;

  // Q: 64-column chunks through the K / V stages into registers.
  simdgroup_matrix<bfloat, 8, 8> qf[U];
  for (uint32_t c0 = 0; c0 < D; c0 += QC) {
    for (uint32_t u = t; u < R * QC / 8; u += NT) {
      const uint32_t r = u / (QC / 8), c = (u % (QC / 8)) * 8;
      const uint32_t rr = min(r, rows - 1);
      const uint32_t tok = min(t0 + rr / group, args.tokens - 1);
      const uint32_t hd = kvh * group + rr % group;
      *reinterpret_cast<threadgroup uint4*>(kv + r * LDQ + c) =
          *reinterpret_cast<const device uint4*>(q + tok * args.q_stride + hd * D + c0 + c);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t i = 0; i < QC / 8; ++i)
      simdgroup_load(qf[c0 / 8 + i], kv + (simd_id * 8) * LDQ + 8 * i, ulong(LDQ), ulong2(0), false);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  simdgroup_float8x8 o[U];
  for (uint32_t i = 0; i < U; ++i) o[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  float m = neg_inf();
  float l = 0.0f;

  // Thread t stages units t and t + NT of each operand: key row u / U, columns 8 (u % U) ...
  // Block kb's rows (kb, a multiple of BK <= 32, .. min(kb + BK, key_end) - 1) lie in one cache block.
  uint4 kr[PER], vr[PER];
  {
    const KvRow blk = KvRows<KV>::row(block_table, args.block_shift, args.kv_heads, D, kvh, 0);
    for (uint32_t i = 0; i < PER; ++i) {
      const uint32_t u = t + i * NT;
      const uint32_t key = min(u / U, key_end - 1);
      kr[i] = TileKv<KV>::load(k_cache, blk, key, D, (u % U) * 8);
      vr[i] = TileKv<KV>::load(v_cache, blk, key, D, (u % U) * 8);
    }
  }
  for (uint32_t kb = 0, stage = 0; kb < key_end; kb += BK, stage ^= 1) {
    threadgroup bfloat* const ks = kv + stage * STAGE;
    threadgroup bfloat* const vs = ks + BK * LDK;
    for (uint32_t i = 0; i < PER; ++i) {
      const uint32_t u = t + i * NT;
      *reinterpret_cast<threadgroup uint4*>(ks + (u / U) * LDK + (u % U) * 8) = kr[i];
      *reinterpret_cast<threadgroup uint4*>(vs + (u / U) * LDK + (u % U) * 8) = vr[i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (kb + BK < key_end) {  // the next block's loads, in flight during this block's math
      const uint32_t nb = kb + BK;
      const KvRow blk = KvRows<KV>::row(block_table, args.block_shift, args.kv_heads, D, kvh, nb);
      for (uint32_t i = 0; i < PER; ++i) {
        const uint32_t u = t + i * NT;
        const uint32_t key = min(nb + u / U, key_end - 1) - nb;
        kr[i] = TileKv<KV>::load(k_cache, blk, key, D, (u % U) * 8);
        vr[i] = TileKv<KV>::load(v_cache, blk, key, D, (u % U) * 8);
      }
    }

    // S = Q K^T for this simdgroup's 8 rows x BK keys.
    simdgroup_float8x8 sacc[BK / 8];
    for (uint32_t j = 0; j < BK / 8; ++j) sacc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint32_t d = 0; d < U; ++d) {
      for (uint32_t j = 0; j < BK / 8; ++j) {
        simdgroup_matrix<bfloat, 8, 8> kt;
        simdgroup_load(kt, ks + (8 * j) * LDK + 8 * d, ulong(LDK), ulong2(0), true);
        simdgroup_multiply_accumulate(sacc[j], qf[d], kt, sacc[j]);
      }
    }
    for (uint32_t j = 0; j < BK / 8; ++j) simdgroup_store(sacc[j], ss + 8 * j, ulong(BK), ulong2(0), false);
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // Online softmax: the row's 4 lanes own BK / 4 columns each.
    constexpr uint32_t CW = BK / 4;
    const uint32_t r8 = lane / 4;
    float sv[CW];
    float block_max = neg_inf();
    for (uint32_t i = 0; i < CW; ++i) {
      const uint32_t c = sub * CW + i;
      sv[i] = ss[r8 * BK + c] * args.scale;
      if (kb + c < visible_end) block_max = max(block_max, sv[i]);
    }
    block_max = max(block_max, simd_shuffle_xor(block_max, 1));
    block_max = max(block_max, simd_shuffle_xor(block_max, 2));
    const float m_new = max(m, block_max);
    const float corr = m == m_new ? 1.0f : exp(m - m_new);  // never (-inf) - (-inf)
    float psum = 0.0f;
    for (uint32_t i = 0; i < CW; ++i) {
      const uint32_t c = sub * CW + i;
      const float p = kb + c < visible_end ? exp(sv[i] - m_new) : 0.0f;
      ps[r8 * BK + c] = bfloat(p);
      psum += p;
    }
    psum += simd_shuffle_xor(psum, 1);
    psum += simd_shuffle_xor(psum, 2);
    l = l * corr + psum;
    m = m_new;
    for (uint32_t c = sub * 2; c < sub * 2 + 2; ++c) diag[r8 * 8 + c] = c == r8 ? corr : 0.0f;
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // O = diag(corr) O + P V.
    simdgroup_float8x8 dg;
    simdgroup_load(dg, diag, ulong(8), ulong2(0), false);
    simdgroup_matrix<bfloat, 8, 8> pf[BK / 8];
    for (uint32_t kk = 0; kk < BK / 8; ++kk) simdgroup_load(pf[kk], ps + 8 * kk, ulong(BK), ulong2(0), false);
    for (uint32_t d = 0; d < U; ++d) {
      simdgroup_multiply(o[d], dg, o[d]);
      for (uint32_t kk = 0; kk < BK / 8; ++kk) {
        simdgroup_matrix<bfloat, 8, 8> vf;
        simdgroup_load(vf, vs + (8 * kk) * LDK + 8 * d, ulong(LDK), ulong2(0), false);
        simdgroup_multiply_accumulate(o[d], pf[kk], vf, o[d]);
      }
    }
    // No barrier here: the next block writes the other stage (see the header).
  }

  // Epilogue: each 8x8 O tile through the simdgroup's scratch; lane writes 2 outputs of its row.
  const float inv_l = 1.0f / l;
  for (uint32_t d = 0; d < U; ++d) {
    simdgroup_store(o[d], ss, ulong(8), ulong2(0), false);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    if (row_live) {
      for (uint32_t i = 0; i < 2; ++i) {
        const uint32_t c = 8 * d + 2 * sub + i;
        float y = ss[(lane / 4) * 8 + 2 * sub + i] * inv_l;
        if (args.use_gate != 0)
          y *= attn_sigmoid(float(gate[row_tok * args.gate_stride + row_head * args.gate_head_stride + c]));
        out[(row_tok * args.q_heads + row_head) * D + c] = bfloat(y);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
}

LILY_INSTANTIATE("rope_f32", rope<float>)
LILY_INSTANTIATE("rope_bf16", rope<bfloat>)
LILY_INSTANTIATE("qk_norm_rope_xf32_wf32", qk_norm_rope<float, float, bfloat>)
LILY_INSTANTIATE("qk_norm_rope_xf32_wbf16", qk_norm_rope<float, bfloat, bfloat>)
LILY_INSTANTIATE("qk_norm_rope_xbf16_wf32", qk_norm_rope<bfloat, float, bfloat>)
LILY_INSTANTIATE("qk_norm_rope_xbf16_wbf16", qk_norm_rope<bfloat, bfloat, bfloat>)
LILY_INSTANTIATE("qk_norm_rope_q8_xf32_wf32", qk_norm_rope<float, float, int8_t>)
LILY_INSTANTIATE("qk_norm_rope_q8_xf32_wbf16", qk_norm_rope<float, bfloat, int8_t>)
LILY_INSTANTIATE("qk_norm_rope_q8_xbf16_wf32", qk_norm_rope<bfloat, float, int8_t>)
LILY_INSTANTIATE("qk_norm_rope_q8_xbf16_wbf16", qk_norm_rope<bfloat, bfloat, int8_t>)
LILY_INSTANTIATE("qk_norm_rope_kvf32_xf32_wf32", qk_norm_rope<float, float, float>)
LILY_INSTANTIATE("qk_norm_rope_kvf32_xf32_wbf16", qk_norm_rope<float, bfloat, float>)
LILY_INSTANTIATE("qk_norm_rope_kvf32_xbf16_wf32", qk_norm_rope<bfloat, float, float>)
LILY_INSTANTIATE("qk_norm_rope_kvf32_xbf16_wbf16", qk_norm_rope<bfloat, bfloat, float>)
LILY_INSTANTIATE("attn_decode_f32", attention<float, 1, bfloat>)
LILY_INSTANTIATE("attn_decode_bf16", attention<bfloat, 1, bfloat>)
LILY_INSTANTIATE("attn_decode_kvf32_f32", attention<float, 1, float>)
LILY_INSTANTIATE("attn_decode_kvf32_bf16", attention<bfloat, 1, float>)
LILY_INSTANTIATE("attn_decode_split_f32", attention_split<float, bfloat>)
LILY_INSTANTIATE("attn_decode_split_bf16", attention_split<bfloat, bfloat>)
LILY_INSTANTIATE("attn_decode_split_kvf32_f32", attention_split<float, float>)
LILY_INSTANTIATE("attn_decode_split_kvf32_bf16", attention_split<bfloat, float>)
LILY_INSTANTIATE("attn_combine_f32", attention_combine<float>)
LILY_INSTANTIATE("attn_combine_bf16", attention_combine<bfloat>)
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
LILY_INSTANTIATE("attn_prefill_f32", attention<float, kAttnPrefillTokens, bfloat>)
LILY_INSTANTIATE("attn_prefill_bf16", attention<bfloat, kAttnPrefillTokens, bfloat>)
LILY_INSTANTIATE("attn_prefill_kvf32_f32", attention<float, kAttnPrefillTokens, float>)
LILY_INSTANTIATE("attn_prefill_kvf32_bf16", attention<bfloat, kAttnPrefillTokens, float>)
LILY_INSTANTIATE("attn_prefill_mma_f32", attention_prefill_mma<float, bfloat>)
LILY_INSTANTIATE("attn_prefill_mma_q8_f32", attention_prefill_mma<float, int8_t>)
LILY_INSTANTIATE("attn_prefill_mma_bf16", attention_prefill_mma<bfloat, bfloat>)
LILY_INSTANTIATE("attn_prefill_mma_q8_bf16", attention_prefill_mma<bfloat, int8_t>)
LILY_INSTANTIATE("attn_prefill_mma_kvf32_f32", attention_prefill_mma<float, float>)
LILY_INSTANTIATE("attn_prefill_mma_kvf32_bf16", attention_prefill_mma<bfloat, float>)
LILY_INSTANTIATE("attn_prefill_tiles_d64_bf16", attention_prefill_tiles<64, bfloat>)
LILY_INSTANTIATE("attn_prefill_tiles_q8_d64_bf16", attention_prefill_tiles<64, int8_t>)
LILY_INSTANTIATE("attn_prefill_tiles_d128_bf16", attention_prefill_tiles<128, bfloat>)
LILY_INSTANTIATE("attn_prefill_tiles_q8_d128_bf16", attention_prefill_tiles<128, int8_t>)
LILY_INSTANTIATE("attn_prefill_tiles_d256_bf16", attention_prefill_tiles<256, bfloat>)
LILY_INSTANTIATE("attn_prefill_tiles_q8_d256_bf16", attention_prefill_tiles<256, int8_t>)

}  // namespace lily
