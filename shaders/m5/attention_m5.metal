// Causal prefill attention on Metal 4 tensor ops (M5 path): S = Q K^T and O += P V as matmul2d over
// the bf16 or int8 KV cache, online softmax per row, GQA heads packed, sigmoid gate. Same buffers and args
// (AttnArgs) as attention_prefill_mma (shaders/attention_prefill.metal); host: csrc/gpu/ops/attention.cpp
// (taken for prefill when the device reports tensor ops and head_dim is 64, 128 or 256). Compiled
// with -std=metal4.0 into lily_m5.metallib, by the emulator, and by the strict pass against
// csrc/emu/tensor_ops_strict.h. Reference: lily_py.reference.kernels.attention. The structure
// follows the flash-attention form of MLX's steel attention and Lily's prefill attention (a query
// block in threadgroup memory, key blocks streamed, running max and sum per row); the code is ours.
//
//   grid:      (kv_heads, ceil(tokens / qt)) threadgroups of 128 threads (4 simdgroups), qt = 16 /
//              group query tokens: the R = 16 rows are (token, head) pairs, row = token_in_block *
//              group + head_in_group (rows past qt * group repeat a live row's keys, not written)
//   once:      the Q block [16][D] rounded to half into threadgroup memory as two halves of D
//              [2][16][D / 2] (packed operands, as every staged block below; thread t: row t / 8,
//              D / 8 columns)
//   Every matmul2d runs on one simdgroup (execution_simdgroup) on a shape the only public
//   measurement ran at >= 91% of its peak (docs/tensor-ops.md, "Execution scope and tile shape"): 16
//   rows, K >= 32. Simdgroup g below.
//   per block of BK = 32 keys, up to the block's last token's causal end:
//     1. K rows [32][D] (bf16 -> half; int8: the codes, exact in half, columns permuted as Q's:
//        attn_m5_kcol; zeros past the end) -> threadgroup as two halves of D [2][32][D / 2]; barrier
//     2. S = Q K^T in four parts: simdgroup g multiplies Q by keys 16 (g % 2) .. + 16 over the
//        half g / 2 of D: matmul2d_descriptor(16, 16, D / 2, false, transpose_right = true, false,
//        multiply) into S part [g / 2][g % 2] (threadgroup float [2][2][16][16]); barrier
//     3. softmax (thread t: row t / 8, 4 keys): s = the two D halves' sum, times the key's K
//        scale (int8) and the softmax scale, causal mask, block max over the row's 8 threads
//        (simd_shuffle_xor 1, 2, 4), running max m and sum l in registers, p = exp(s - m) (int8:
//        times 128 x the key's V scale) rounded to half -> P [16][32], the row's rescale factor
//        -> threadgroup; the V rows of the block (int8: codes) -> the K buffer as four column
//        blocks [4][32][D/4] (its run is done); barrier
//     4. simdgroup g owns O's columns g D/4 .. + D/4 (an fp32 cooperative tensor [16][D/4]): if
//        any row's factor is not 1 (simd_any: a running max moved), its elements scaled by their
//        row's factor (get_multidimensional_index); O_g += P V_g:
//        matmul2d_descriptor(16, D / 4, 32, false, false, false, multiply_accumulate); barrier
//        (the next block overwrites the K/V buffer)
//   epilogue:  l per row -> threadgroup; barrier; each thread writes its O elements / l (int8:
//              / 128, to column attn_m5_kcol), times sigmoid(gate), for live rows
//   threadgroup memory (D = 256): Q 8,192 + K/V 16,384 + S 4,096 + P 1,024 + 2 x 64 = 29,824 B
//   (until 2026-12-01: 32 rows x 16-key blocks, which made O += P V a K = 16 op: 71% of the
//   measured peak for 32 x 32 x 16 against 96% for 16 x 32 x 32)
// Precision: Q, K, V and P are half operands (the half x half -> float row of Apple's matmul2d
// types): bf16 K/V values are exact in half within its normal range (|v| in [2^-14, 65504]), int8
// codes always; Q and P are rounded once (2^-11 relative); S, the softmax, l and O are fp32.
// ALU work per thread and block (D = 256, int8; issue ops, loads and stores not counted; the
// prefill estimate's tensor_alu_ops_per_mac): K and V codes 128 each (8 a word), softmax ~71,
// the rescale test 3 (+64 in a block where a running max moved): ~330 for 262,144 MACs.
#include "common/lily_metal.h"
#include "common/tensor_ops.h"
#include "common/kv_blocks.h"

namespace lily {

inline float attn_m5_neg_inf() { return as_type<float>(0xff800000u); }
inline float attn_m5_sigmoid(float v) { return 1.0f / (1.0f + exp(-v)); }

// Element (row, d) of a [ROWS][D] block staged as NB packed column blocks [NB][ROWS][D / NB]
// (the layout every staged operand below uses: Q and K in halves of D, V in quarters).
template <uint32_t D, uint32_t NB, uint32_t ROWS>
inline uint32_t attn_m5_blocked(uint32_t row, uint32_t d) {
  constexpr uint32_t CB = D / NB;
  return (d / CB) * ROWS * CB + row * CB + d % CB;
}

// The int8 cache's K and V are staged as their codes, exact in half; the row scales multiply in fp32
// outside the ops: K's each score of its key (S is the same sum, K unrounded), V's each P weight of
// its key (P' = p x 128 scale_v, rounded to half once where half(p) and half(code x scale) were
// rounded before; O's epilogue takes the 1 / 128 back: docs/kernels-attention.md). The codes are
// unpacked two at a time in half arithmetic: a word of 4 codes c0..c3 gives the half2 (c0, c2) and
// (c1, c3), stored as staged columns 4i .. 4i + 3 in that order. attn_m5_kcol maps a column to its
// staged position (a permutation that is its own inverse): Q is staged with it, so S is the same
// sum, and O's columns come out permuted, written back through it.
inline uint32_t attn_m5_kcol(const device int8_t*, uint32_t d) {
  return (d & ~3u) | ((d & 1u) << 1) | ((d >> 1) & 1u);  // columns 1 and 2 of each 4 swapped
}
inline uint32_t attn_m5_kcol(const device bfloat*, uint32_t d) { return d; }

// Keys kb .. kb + 32 of one KV head (rows within one cache block from blk) staged as NB packed
// matmul2d operands kvs[NB][32][D / NB] (K: NB = 2 halves of D, V: NB = 4 quarters).
// The int8 cache's as codes: thread t
// copies row t / 4, D / 4 columns as D / 16 words. A word's bytes are two's-complement codes; xor
// 0x80 makes them u = c + 128 in 0..255, masked two at a time into the low mantissa bits of two
// halves of exponent 1024 (0x6400): 1024 + u exactly, minus 1152 = c exactly. Per word: an xor, a
// shift, 2 masks, 2 ors and 2 half2 subtractions (where 4 conversions, 4 multiplies by the scale, 4
// conversions to half and 4 selects were).
template <uint32_t D, uint32_t NB>
inline void attn_m5_stage(const device int8_t* cache, KvRow blk, uint32_t nkeys, uint32_t t, threadgroup half* kvs) {
  constexpr uint32_t PER = D / 4;
  const uint32_t j = t / 4, c0 = (t % 4) * PER;
  threadgroup half2* dst = reinterpret_cast<threadgroup half2*>(kvs);
  if (j < nkeys) {
    const device uint32_t* src = reinterpret_cast<const device uint32_t*>(cache + blk.at + j * D + c0);
    const half2 bias = half2(half(1152.0f));
    for (uint32_t w = 0; w < PER / 4; ++w) {
      const uint32_t u = src[w] ^ 0x80808080u;
      const uint32_t at = attn_m5_blocked<D, NB, kAttnM5BlockKeys>(j, c0 + 4 * w) / 2;
      dst[at] = as_type<half2>((u & 0x00FF00FFu) | 0x64006400u) - bias;             // codes 0, 2
      dst[at + 1] = as_type<half2>(((u >> 8) & 0x00FF00FFu) | 0x64006400u) - bias;  // codes 1, 3
    }
  } else {
    for (uint32_t w = 0; w < PER / 4; ++w) {
      const uint32_t at = attn_m5_blocked<D, NB, kAttnM5BlockKeys>(j, c0 + 4 * w) / 2;
      dst[at] = half2(half(0.0f));
      dst[at + 1] = half2(half(0.0f));
    }
  }
}
// The bf16 cache's keys kb .. kb + 32 rounded to half the same way (one value at a time; exact
// within half's normal range): thread t copies row t / 4, D / 4 columns; zeros past nkeys.
template <uint32_t D, uint32_t NB>
inline void attn_m5_stage(const device bfloat* cache, KvRow blk, uint32_t nkeys, uint32_t t, threadgroup half* kvs) {
  constexpr uint32_t PER = D / 4;
  const uint32_t j = t / 4, c0 = (t % 4) * PER;
  const uint32_t jr = min(j, nkeys - 1);  // rows past the block's keys are staged as 0
  for (uint32_t c = 0; c < PER; ++c)
    kvs[attn_m5_blocked<D, NB, kAttnM5BlockKeys>(j, c0 + c)] =
        j < nkeys ? half(KvRows<bfloat>::value(cache, blk, jr, D, c0 + c)) : half(0.0f);
}

// The factor of a score of key j of the block (K's row scale; 1 for bf16), of a P weight (128 x V's
// row scale: exact, keeps P' = p x amax_v x 128 / 127 where half(p) was, rather than 128 times
// smaller near half's subnormals), and of O in the epilogue.
inline float attn_m5_k_factor(const device int8_t* cache, KvRow blk, uint32_t j) {
  return KvRows<int8_t>::scale(cache, blk.scale + j);
}
inline float attn_m5_k_factor(const device bfloat*, KvRow, uint32_t) { return 1.0f; }
inline float attn_m5_v_factor(const device int8_t* cache, KvRow blk, uint32_t j) {
  return KvRows<int8_t>::scale(cache, blk.scale + j) * 128.0f;
}
inline float attn_m5_v_factor(const device bfloat*, KvRow, uint32_t) { return 1.0f; }
inline float attn_m5_o_factor(const device int8_t*) { return 1.0f / 128.0f; }
inline float attn_m5_o_factor(const device bfloat*) { return 1.0f; }

// How S = Q K^T is formed. Half operands (I8 = false): Q rounded to half once, in the staged column
// order of K (attn_m5_kcol), K staged by attn_m5_stage, S in fp32. Int8 operands (I8 = true: the
// int8 cache with bf16 activations, attn_prefill_m5i8_q8_*): each Q row (token, head) quantized as
// the cache quantizes its rows (kv_q8_scale / kv_q8_code: symmetric, scale = max |q| / 127, the
// row's 8 threads reduce the max by simd_shuffle_xor 1, 2, 4), K's codes copied as they are (16
// bytes a load: no ALU work), S in int32 (exact) times the two row scales in fp32; the int8 x int8
// -> int32 row of matmul2d runs at about twice the half rate (docs/tensor-ops.md). stage_q returns
// the factor of the thread's row's scores (Q's scale; 1 for half).
template <bool I8>
struct AttnM5Scores;

template <>
struct AttnM5Scores<false> {
  typedef half q_type;
  typedef float s_type;
  template <uint32_t D, typename T, typename KV>
  static float stage_q(const device T* qr, bool live, uint32_t row, uint32_t c0, const device KV* k_cache,
                       threadgroup half* qs) {
    for (uint32_t c = 0; c < D / 8; ++c)
      qs[attn_m5_blocked<D, 2, kAttnM5Rows>(row, attn_m5_kcol(k_cache, c0 + c))] = live ? half(float(qr[c])) : half(0.0f);
    return 1.0f;
  }
  template <uint32_t D, typename KV>
  static void stage_k(const device KV* cache, KvRow blk, uint32_t nkeys, uint32_t t, threadgroup half* kvs) {
    attn_m5_stage<D, 2>(cache, blk, nkeys, t, kvs);
  }
};

template <>
struct AttnM5Scores<true> {
  typedef int8_t q_type;
  typedef int32_t s_type;
  template <uint32_t D, typename T>
  static float stage_q(const device T* qr, bool live, uint32_t row, uint32_t c0, const device int8_t*,
                       threadgroup int8_t* qs) {
    float amax = 0.0f;
    for (uint32_t c = 0; c < D / 8; ++c) amax = max(amax, live ? abs(float(qr[c])) : 0.0f);
    amax = max(amax, simd_shuffle_xor(amax, 1));
    amax = max(amax, simd_shuffle_xor(amax, 2));
    amax = max(amax, simd_shuffle_xor(amax, 4));
    const float s = kv_q8_scale(amax);
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (uint32_t c = 0; c < D / 8; ++c)
      qs[attn_m5_blocked<D, 2, kAttnM5Rows>(row, c0 + c)] = live ? kv_q8_code(float(qr[c]), inv) : int8_t(0);
    return s;
  }
  // K [2][32][D / 2] int8 in the K/V buffer: thread t copies row t / 4, D / 4 bytes (zeros past nkeys)
  template <uint32_t D>
  static void stage_k(const device int8_t* cache, KvRow blk, uint32_t nkeys, uint32_t t, threadgroup half* kvs) {
    constexpr uint32_t PER = D / 4;
    const uint32_t j = t / 4, c0 = (t % 4) * PER;
    threadgroup uint4* dst = reinterpret_cast<threadgroup uint4*>(
        reinterpret_cast<threadgroup int8_t*>(kvs) + attn_m5_blocked<D, 2, kAttnM5BlockKeys>(j, c0));
    if (j < nkeys) {
      const device uint4* src = reinterpret_cast<const device uint4*>(cache + blk.at + j * D + c0);
      for (uint32_t w = 0; w < PER / 16; ++w) dst[w] = src[w];
    } else {
      for (uint32_t w = 0; w < PER / 16; ++w) dst[w] = uint4(0u);
    }
  }
};

template <typename T, uint32_t D, typename KV, bool I8>
[[kernel]] void attention_prefill_m5(constant AttnArgs& args [[buffer(0)]],
                                     const device T* q [[buffer(1)]],
                                     const device KV* k_cache [[buffer(2)]],
                                     const device KV* v_cache [[buffer(3)]],
                                     const device T* gate [[buffer(4)]],
                                     device T* out [[buffer(5)]],
                                     const device uint32_t* block_table [[buffer(6)]],
                                     LILY_KERNEL_TAIL) {
  constexpr uint32_t R = kAttnM5Rows, BK = kAttnM5BlockKeys;
  static_assert(R == 16 && BK == 32 && kAttnM5Threads == 128 && D % 32 == 0 && D <= kAttnMaxHeadDim &&
                    kAttnMaxGroup <= R,
                "the staging maps below assume 16 rows, 32 keys, 128 threads");
  constexpr uint32_t DH = D / 2, CB = D / 4, KH = BK / 2;  // D half, O column block, S key block
  typedef AttnM5Scores<I8> Sc;
  typedef typename Sc::q_type QE;
  typedef typename Sc::s_type SE;
  LILY_TG_ARRAY(QE, qs, [R * D]);             // Q block [D half][row][D / 2]
  // K block [D half][key][D / 2] (QE), then V [quarter][key][D / 4]; declared as uint4 for the
  // 16-byte stores of the int8 K copy (a threadgroup array is aligned to its element type)
  LILY_TG_ARRAY(uint4, kv16, [BK * D * sizeof(half) / sizeof(uint4)]);
  threadgroup half* kvs = reinterpret_cast<threadgroup half*>(kv16);
  LILY_TG_ARRAY(SE, ss, [2 * 2 * R * KH]);    // S parts [D half][key block][row][key]
  LILY_TG_ARRAY(half, ps, [R * BK]);          // P [row][key]
  LILY_TG_ARRAY(float, corr_s, [R]);          // per row: rescale factor of the block, then 1 / l

  const uint32_t group = args.q_heads / args.kv_heads;
  const uint32_t qt = R / group;     // query tokens per threadgroup
  const uint32_t rows = qt * group;  // live rows (padding rows past them)
  const uint32_t kvh = group_pos.x;
  const uint32_t t0 = group_pos.y * qt;
  const uint32_t t_last = min(t0 + qt, args.tokens) - 1;
  const uint32_t key_end = args.position + t_last + 1;
  const uint32_t t = thread_pos.x;
  const uint32_t row = t / 8;  // the row this thread stages and runs the softmax of
  const bool row_live = row < rows && t0 + row / group < args.tokens;
  const uint32_t row_tok = min(t0 + min(row, rows - 1) / group, args.tokens - 1);
  const uint32_t row_head = kvh * group + min(row, rows - 1) % group;
  const uint32_t visible_end = args.position + row_tok + 1;  // the row sees keys < visible_end

  const uint32_t cq = (t % 8) * (D / 8);  // the thread's columns of its row's Q
  const float row_scale =
      args.scale * Sc::template stage_q<D>(q + row_tok * args.q_stride + row_head * D + cq, row_live, row, cq, k_cache, qs);

  const uint32_t sg_half = simd_id / 2, sg_keys = simd_id % 2, sg_cols = simd_id * CB;
  constexpr auto desc_s = matmul2d_descriptor(int(R), int(KH), int(DH), false, true, false,
                                              matmul2d_descriptor::mode::multiply);
  constexpr auto desc_o = matmul2d_descriptor(int(R), int(CB), int(BK), false, false, false,
                                              matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc_s, execution_simdgroup> op_s;
  matmul2d<desc_o, execution_simdgroup> op_o;
  auto q_t = tensor<threadgroup QE, dextents<int32_t, 2>, tensor_inline>(qs + sg_half * R * DH, dextents<int32_t, 2>(int(DH), int(R)));
  auto k_t = tensor<threadgroup QE, dextents<int32_t, 2>, tensor_inline>(
      reinterpret_cast<threadgroup QE*>(kvs) + sg_half * BK * DH + sg_keys * KH * DH, dextents<int32_t, 2>(int(DH), int(KH)));
  auto s_t = tensor<threadgroup SE, dextents<int32_t, 2>, tensor_inline>(ss + (sg_half * 2 + sg_keys) * R * KH,
                                                                         dextents<int32_t, 2>(int(KH), int(R)));
  auto v_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(kvs + simd_id * BK * CB, dextents<int32_t, 2>(int(CB), int(BK)));
  auto p_t = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(ps, dextents<int32_t, 2>(int(BK), int(R)));
  auto o = op_o.template get_destination_cooperative_tensor<decltype(p_t), decltype(v_t), float>();
  for (uint16_t i = 0; i < o.get_capacity(); ++i)
    if (o.is_valid_element(i)) o[i] = 0.0f;

  float m = attn_m5_neg_inf();
  float l = 0.0f;
  const uint32_t c0 = (t % 8) * 4;  // this thread's 4 keys of the block (one S key block: c0 / 16)
  const uint32_t s_at = (c0 / KH) * R * KH + row * KH + c0 % KH;  // in S part [0][c0 / 16]
  for (uint32_t kb = 0; kb < key_end; kb += BK) {
    const uint32_t nkeys = min(BK, key_end - kb);
    const KvRow blk = KvRows<KV>::row(block_table, args.block_shift, args.kv_heads, D, kvh, kb);  // one cache block
    Sc::template stage_k<D>(k_cache, blk, nkeys, t, kvs);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op_s.run(q_t, k_t, s_t);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float sv[4];
    float block_max = attn_m5_neg_inf();
    for (uint32_t i = 0; i < 4; ++i) {
      const float ks = attn_m5_k_factor(k_cache, blk, min(c0 + i, nkeys - 1));
      sv[i] = float(ss[s_at + i] + ss[2 * R * KH + s_at + i]) * ks * row_scale;
      if (kb + c0 + i < visible_end) block_max = max(block_max, sv[i]);
    }
    block_max = max(block_max, simd_shuffle_xor(block_max, 1));
    block_max = max(block_max, simd_shuffle_xor(block_max, 2));
    block_max = max(block_max, simd_shuffle_xor(block_max, 4));
    const float m_new = max(m, block_max);
    const float corr = m == m_new ? 1.0f : exp(m - m_new);  // never (-inf) - (-inf)
    float psum = 0.0f;
    for (uint32_t i = 0; i < 4; ++i) {
      const float p = kb + c0 + i < visible_end ? exp(sv[i] - m_new) : 0.0f;
      ps[row * BK + c0 + i] = half(p * attn_m5_v_factor(v_cache, blk, min(c0 + i, nkeys - 1)));
      psum += p;
    }
    psum += simd_shuffle_xor(psum, 1);
    psum += simd_shuffle_xor(psum, 2);
    psum += simd_shuffle_xor(psum, 4);
    l = l * corr + psum;
    m = m_new;
    if (t % 8 == 0) corr_s[row] = corr;
    attn_m5_stage<D, 4>(v_cache, blk, nkeys, t, kvs);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // O's rows are rescaled only when a row's running max moved in this block (every row's factor
    // is then exactly 1 otherwise: the branch is uniform over the simdgroup, whose O block spans
    // all R rows); late in a long prompt most blocks leave every max where it was
    if (simd_any(corr_s[lane % R] != 1.0f)) {
      for (uint16_t i = 0; i < o.get_capacity(); ++i) {
        if (!o.is_valid_element(i)) continue;
        const auto idx = o.get_multidimensional_index(i);
        o[i] *= corr_s[idx[1]];
      }
    }
    op_o.run(p_t, v_t, o);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (t % 8 == 0) corr_s[row] = 1.0f / l;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint16_t i = 0; i < o.get_capacity(); ++i) {
    if (!o.is_valid_element(i)) continue;
    const auto idx = o.get_multidimensional_index(i);
    const uint32_t d = attn_m5_kcol(v_cache, sg_cols + uint32_t(idx[0]));  // O's column, staged permuted
    const uint32_t r = uint32_t(idx[1]);
    const uint32_t tok = t0 + r / group;
    if (r >= rows || tok >= args.tokens) continue;
    const uint32_t head = kvh * group + r % group;
    float y = o[i] * corr_s[r] * attn_m5_o_factor(v_cache);
    if (args.use_gate != 0) y *= attn_m5_sigmoid(float(gate[tok * args.gate_stride + head * args.gate_head_stride + d]));
    out[(tok * args.q_heads + head) * D + d] = T(y);
  }
}

// Instantiations: exactly the attn_prefill_m5 and attn_prefill_m5i8 rows of csrc/gpu/kernel_ids.h.
LILY_INSTANTIATE("attn_prefill_m5_d64_f32", attention_prefill_m5<float, 64, bfloat, false>)
LILY_INSTANTIATE("attn_prefill_m5_q8_d64_f32", attention_prefill_m5<float, 64, int8_t, false>)
LILY_INSTANTIATE("attn_prefill_m5_d64_bf16", attention_prefill_m5<bfloat, 64, bfloat, false>)
LILY_INSTANTIATE("attn_prefill_m5_d128_f32", attention_prefill_m5<float, 128, bfloat, false>)
LILY_INSTANTIATE("attn_prefill_m5_q8_d128_f32", attention_prefill_m5<float, 128, int8_t, false>)
LILY_INSTANTIATE("attn_prefill_m5_d128_bf16", attention_prefill_m5<bfloat, 128, bfloat, false>)
LILY_INSTANTIATE("attn_prefill_m5_d256_f32", attention_prefill_m5<float, 256, bfloat, false>)
LILY_INSTANTIATE("attn_prefill_m5_q8_d256_f32", attention_prefill_m5<float, 256, int8_t, false>)
LILY_INSTANTIATE("attn_prefill_m5_d256_bf16", attention_prefill_m5<bfloat, 256, bfloat, false>)
// the int8 cache with bf16 activations: S on int8 operands (fp32 activations: attn_prefill_m5_q8)
LILY_INSTANTIATE("attn_prefill_m5i8_q8_d64_bf16", attention_prefill_m5<bfloat, 64, int8_t, true>)
LILY_INSTANTIATE("attn_prefill_m5i8_q8_d128_bf16", attention_prefill_m5<bfloat, 128, int8_t, true>)
LILY_INSTANTIATE("attn_prefill_m5i8_q8_d256_bf16", attention_prefill_m5<bfloat, 256, int8_t, true>)

}  // namespace lily
