// Gated full attention: partial RoPE, fused q/k RMSNorm + RoPE + KV-cache append, and the
// general attention over the cache (decode single or split-K route + combine; prefill at head
// dims the matrix routes do not take). The vec decode route: attention_decode.metal; the prefill
// matrix routes: attention_prefill.metal (M5: m5/attention_m5.metal).
// Over a paged KV cache (bf16 pools [blocks, kv_heads, block_tokens, head_dim] read through a
// block table, or their int8 / float32 twins: common/kv_blocks.h). Host:
// csrc/gpu/ops/attention.cpp. References: lily_py.reference.kernels (rope, qk_norm_rope,
// attention). Args and route constants: common/args_attention.h.
//
// Precision policy (all kernels): inputs widened to fp32; norms, angles, dot products, softmax and
// the weighted sum of values in fp32 with precise exp/cos/sin; each output rounded once (to the
// activation dtype T, or to bf16 in a bf16 cache; a float32 cache keeps the fp32 rows).
// RoPE angles are float(position) * inv_freq[i] in fp32, exactly as
// lily_py.reference.ops.rope_cos_sin computes them (inv_freq comes from the host).
#include "common/lily_metal.h"
#include "common/kv_blocks.h"
#include "common/attention.h"

namespace lily {

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

// Instantiations: the RoPE, q/k norm + RoPE and general attention rows of csrc/gpu/kernel_ids.h.
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
LILY_INSTANTIATE("attn_prefill_f32", attention<float, kAttnPrefillTokens, bfloat>)
LILY_INSTANTIATE("attn_prefill_bf16", attention<bfloat, kAttnPrefillTokens, bfloat>)
LILY_INSTANTIATE("attn_prefill_kvf32_f32", attention<float, kAttnPrefillTokens, float>)
LILY_INSTANTIATE("attn_prefill_kvf32_bf16", attention<bfloat, kAttnPrefillTokens, float>)

}  // namespace lily
