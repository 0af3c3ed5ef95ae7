// Gated full attention, the causal prefill routes on 8x8 simdgroup matrices: attention_prefill_mma
// (fp32 tiles, head_dim % 32 == 0) and attention_prefill_tiles (M1-M4, bf16 activations at
// head_dim 64 / 128 / 256). The general route: attention.metal; M5: m5/attention_m5.metal.
// Over a paged KV cache (bf16 pools [blocks, kv_heads, block_tokens, head_dim] read through a
// block table, or their int8 / float32 twins: common/kv_blocks.h). Host:
// csrc/gpu/ops/attention.cpp. References: lily_py.reference.kernels (rope, qk_norm_rope,
// attention). Args and route constants: common/args_attention.h.
//
// Precision policy (all kernels): inputs widened to fp32; norms, angles, dot products, softmax and
// the weighted sum of values in fp32 with precise exp/cos/sin; each output rounded once (to the
// activation dtype T, or to bf16 in a bf16 cache; a float32 cache keeps the fp32 rows).
#include "common/lily_metal.h"
#include "common/mma.h"
#include "common/kv_blocks.h"
#include "common/attention.h"

namespace lily {

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

// Instantiations: the prefill matrix rows of csrc/gpu/kernel_ids.h.
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
