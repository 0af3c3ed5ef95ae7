// Mixture of experts, the tiled routes' expert kernels (prefill, T > kMoeMvMaxTokens): the
// 64- and 32-row tiles on 8x8 simdgroup matrices with fp32 operands (moe_gate_up_mm /
// moe_down_mm) and the few-row tiles, matvec-style (moe_gate_up_few / moe_down_few). Tiles come
// from moe_plan (moe_plan.metal: its block maps, row -> token map and row weights); the three
// kinds of one stage write disjoint rows. The M1-M4 bf16 tiles: moe_prefill_bf16.metal.
//
// Precision (every kernel): codes, scales, biases and activations widened to fp32; dot products,
// softmax, SwiGLU, routing weights and sums in fp32 (no fast math); nothing dequantized reaches
// device memory; the intermediate h and the per-row expert outputs y are fp32; out is rounded to
// T once. The block's routes: shaders/moe_plan.metal. Reference: lily_py.reference.kernels.moe_route
// / moe (which match lily_py.reference.moe). Host: csrc/gpu/ops/moe.cpp.
#include "common/lily_metal.h"
#include "common/mma.h"
#include "common/moe.h"
#include "common/quant.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// moe_gate_up_mm: tiled routes. For each tile of the block map (rows [r0, r1) of group g) and
// 32 output features: h[row, n] = silu(x_tok(row) . gate_g[n]) * (x_tok(row) . up_g[n]).
// The gather is fused: x rows are read through the plan's row -> token map.
//   grid:    (ceil(max(I, Is) / 32), list bound) threadgroups of 128 threads (4 simdgroups): BM =
//            64 runs the 64-row list, BM = 32 the 32-row list; tiles >= the plan's count for the
//            list (host bound > actual) do no work (uniformly)
//   tile:    BM rows x 32 features, K = H walked in steps of 32: thread t loads BM/32 rows of x
//            (row t/4 + 32 i, 8 values) and dequantizes 8 gate and 8 up weights of feature t/4
//            into threadgroup memory (fp32, zeros past the tile), barrier; simdgroup s
//            multiplies its (BM/2) x 16 quarter into two accumulators (gate, up) with
//            common/mma.h, barrier. Epilogue: gate and up tiles through threadgroup memory,
//            SwiGLU, masked write of h (fp32).
//   widths:  the routed experts at `bits`, the shared expert (group E) at `sbits` (a mixed
//            checkpoint: the branch is uniform over the threadgroup; sbits == bits compiles one)
template <typename T, typename S, int bits, int sbits, int BM>
[[kernel]] void moe_gate_up_mm(constant MoeArgs& args [[buffer(0)]],
                               const device T* x [[buffer(1)]],
                               const device uint32_t* plan [[buffer(2)]],
                               const device uint32_t* gate_w [[buffer(3)]],
                               const device S* gate_s [[buffer(4)]],
                               const device S* gate_b [[buffer(5)]],
                               const device uint32_t* up_w [[buffer(6)]],
                               const device S* up_s [[buffer(7)]],
                               const device S* up_b [[buffer(8)]],
                               const device uint32_t* sh_gate_w [[buffer(9)]],
                               const device S* sh_gate_s [[buffer(10)]],
                               const device S* sh_gate_b [[buffer(11)]],
                               const device uint32_t* sh_up_w [[buffer(12)]],
                               const device S* sh_up_s [[buffer(13)]],
                               const device S* sh_up_b [[buffer(14)]],
                               device float* h [[buffer(15)]],
                               LILY_KERNEL_TAIL) {
  constexpr uint32_t BN = kMoeTileN, BK = kMoeTileK, LD = BK + 4, RPT = BM / 32;
  static_assert(BN == 32 && BK == 32 && kMoeTileSimds == 4 && (BM == 32 || BM == 64),
                "the thread-to-tile mapping below assumes 32-wide tiles, 128 threads, BM 32 or 64");
  LILY_TG_ARRAY(float, xs, [BM * LD]);   // x tile; after the K loop: the up accumulators
  LILY_TG_ARRAY(float, wgt, [BN * LD]);  // gate weights [n][k]
  LILY_TG_ARRAY(float, wut, [BN * LD]);  // up weights [n][k]
  LILY_TG_ARRAY(float, ys, [BM * LD]);   // gate accumulators

  const uint32_t tile = group_pos.y;
  const uint32_t list = BM == 64 ? moe_plan_list64() : moe_plan_list32(args.max_tiles, args.max_tiles32, args.max_few);
  const bool active = tile < plan[BM == 64 ? 0 : 1];  // uniform over the threadgroup
  const uint32_t g = active ? plan[list + 3 * tile] : 0u;
  const uint32_t r0 = active ? plan[list + 3 * tile + 1] : 0u;
  const uint32_t r1 = active ? plan[list + 3 * tile + 2] : 0u;
  const bool shared = g == args.experts;
  const uint32_t N = shared ? args.shared_inter : args.inter;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t H = args.hidden;
  const uint32_t K_end = (active && n0 < N) ? H : 0u;  // uniform: no work, no barrier mismatch
  const bool own = sbits != bits && shared;  // the shared expert at its own width
  const uint32_t wpr = H * (own ? sbits : bits) / 32, gpr = H / args.group_size;
  const device uint32_t* wg = shared ? sh_gate_w : gate_w + g * N * wpr;
  const device S* sg = shared ? sh_gate_s : gate_s + g * N * gpr;
  const device S* bg = shared ? sh_gate_b : gate_b + g * N * gpr;
  const device uint32_t* wu = shared ? sh_up_w : up_w + g * N * wpr;
  const device S* su = shared ? sh_up_s : up_s + g * N * gpr;
  const device S* bu = shared ? sh_up_b : up_b + g * N * gpr;

  const uint32_t tp = thread_pos.x;
  const uint32_t col = (tp % 4) * 8;
  const uint32_t row_token = moe_plan_row_token(args.max_tiles);
  uint32_t tok[RPT];
  bool valid[RPT];
  for (uint32_t i = 0; i < RPT; ++i) {
    const uint32_t r = r0 + tp / 4 + 32 * i;
    valid[i] = r < r1;
    tok[i] = valid[i] ? plan[row_token + r] : 0u;
  }
  const uint32_t sm = (simd_id / 2) * (BM / 2), sn = (simd_id % 2) * 16;
  MmaTile<BM / 16, 2> acc_g;
  MmaTile<BM / 16, 2> acc_u;
  mma_zero(acc_g);
  mma_zero(acc_u);

  for (uint32_t k0 = 0; k0 < K_end; k0 += BK) {
    for (uint32_t i = 0; i < RPT; ++i) {
      const uint32_t row = tp / 4 + 32 * i;
      for (uint32_t c = 0; c < 8; ++c)
        xs[row * LD + col + c] = valid[i] ? float(x[tok[i] * H + k0 + col + c]) : 0.0f;
    }
    const uint32_t n = n0 + tp / 4;
    if (n < N) {
      const uint32_t gi = n * gpr + (k0 + col) / args.group_size;
      float q[8];
      if (own) unpack_row<sbits, 8>(wg + n * wpr, k0 + col, q);
      else unpack_row<bits, 8>(wg + n * wpr, k0 + col, q);
      const float s1 = float(sg[gi]), b1 = float(bg[gi]);
      for (uint32_t c = 0; c < 8; ++c) wgt[(tp / 4) * LD + col + c] = s1 * q[c] + b1;
      if (own) unpack_row<sbits, 8>(wu + n * wpr, k0 + col, q);
      else unpack_row<bits, 8>(wu + n * wpr, k0 + col, q);
      const float s2 = float(su[gi]), b2 = float(bu[gi]);
      for (uint32_t c = 0; c < 8; ++c) wut[(tp / 4) * LD + col + c] = s2 * q[c] + b2;
    } else {
      for (uint32_t c = 0; c < 8; ++c) {
        wgt[(tp / 4) * LD + col + c] = 0.0f;
        wut[(tp / 4) * LD + col + c] = 0.0f;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t kk = 0; kk < BK; kk += 8) {
      mma_step(acc_g, xs + sm * LD + kk, LD, wgt + sn * LD + kk, LD);
      mma_step(acc_u, xs + sm * LD + kk, LD, wut + sn * LD + kk, LD);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  mma_store(acc_g, ys + sm * LD + sn, LD);
  mma_store(acc_u, xs + sm * LD + sn, LD);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (K_end != 0u) {
    for (uint32_t i = 0; i < RPT; ++i) {
      if (!valid[i]) continue;
      const uint32_t row = tp / 4 + 32 * i;
      const uint32_t r = r0 + row;
      for (uint32_t c = 0; c < 8; ++c) {
        const uint32_t n = n0 + col + c;
        if (n < N) h[r * args.h_stride + n] = moe_silu(ys[row * LD + col + c]) * xs[row * LD + col + c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// moe_down_mm: tiled routes. y[row, n] = row_weight[row] * (h[row] . down_g[n]) for each tile of
// the block map and 32 of the H output features (y in permuted row order, fp32).
//   grid:    (ceil(H / 32), list bound) threadgroups of 128 threads (4 simdgroups), lists as above
//   tile:    as moe_gate_up_mm with one matrix: K = I (Is for the shared group), the rows of h
//            are contiguous [r0, r1); epilogue through threadgroup memory, scaled by the row's
//            routing weight (the sigmoid gate for shared rows), masked write.
//   widths:  as moe_gate_up_mm (the shared expert's down at `sbits`)
template <typename S, int bits, int sbits, int BM>
[[kernel]] void moe_down_mm(constant MoeArgs& args [[buffer(0)]],
                            const device uint32_t* plan [[buffer(1)]],
                            const device float* row_weight [[buffer(2)]],
                            const device float* h [[buffer(3)]],
                            const device uint32_t* down_w [[buffer(4)]],
                            const device S* down_s [[buffer(5)]],
                            const device S* down_b [[buffer(6)]],
                            const device uint32_t* sh_down_w [[buffer(7)]],
                            const device S* sh_down_s [[buffer(8)]],
                            const device S* sh_down_b [[buffer(9)]],
                            device float* y [[buffer(10)]],
                            LILY_KERNEL_TAIL) {
  constexpr uint32_t BN = kMoeTileN, BK = kMoeTileK, LD = BK + 4, RPT = BM / 32;
  static_assert(BN == 32 && BK == 32 && kMoeTileSimds == 4 && (BM == 32 || BM == 64),
                "the thread-to-tile mapping below assumes 32-wide tiles, 128 threads, BM 32 or 64");
  LILY_TG_ARRAY(float, xs, [BM * LD]);
  LILY_TG_ARRAY(float, ws, [BN * LD]);
  LILY_TG_ARRAY(float, ys, [BM * LD]);

  const uint32_t tile = group_pos.y;
  const uint32_t list = BM == 64 ? moe_plan_list64() : moe_plan_list32(args.max_tiles, args.max_tiles32, args.max_few);
  const bool active = tile < plan[BM == 64 ? 0 : 1];  // uniform over the threadgroup
  const uint32_t g = active ? plan[list + 3 * tile] : 0u;
  const uint32_t r0 = active ? plan[list + 3 * tile + 1] : 0u;
  const uint32_t r1 = active ? plan[list + 3 * tile + 2] : 0u;
  const bool shared = g == args.experts;
  const uint32_t H = args.hidden;
  const uint32_t K = shared ? args.shared_inter : args.inter;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t K_end = active ? K : 0u;
  const bool own = sbits != bits && shared;  // the shared expert at its own width
  const uint32_t wpr = K * (own ? sbits : bits) / 32, gpr = K / args.group_size;
  const device uint32_t* w = shared ? sh_down_w : down_w + g * H * wpr;
  const device S* sc = shared ? sh_down_s : down_s + g * H * gpr;
  const device S* bi = shared ? sh_down_b : down_b + g * H * gpr;

  const uint32_t tp = thread_pos.x;
  const uint32_t col = (tp % 4) * 8;
  const uint32_t sm = (simd_id / 2) * (BM / 2), sn = (simd_id % 2) * 16;
  MmaTile<BM / 16, 2> acc;
  mma_zero(acc);

  for (uint32_t k0 = 0; k0 < K_end; k0 += BK) {
    for (uint32_t i = 0; i < RPT; ++i) {
      const uint32_t row = tp / 4 + 32 * i;
      const uint32_t r = r0 + row;
      for (uint32_t c = 0; c < 8; ++c)
        xs[row * LD + col + c] = r < r1 ? h[r * args.h_stride + k0 + col + c] : 0.0f;
    }
    const uint32_t n = n0 + tp / 4;
    if (n < H) {
      const uint32_t gi = n * gpr + (k0 + col) / args.group_size;
      float q[8];
      if (own) unpack_row<sbits, 8>(w + n * wpr, k0 + col, q);
      else unpack_row<bits, 8>(w + n * wpr, k0 + col, q);
      const float s = float(sc[gi]), b = float(bi[gi]);
      for (uint32_t c = 0; c < 8; ++c) ws[(tp / 4) * LD + col + c] = s * q[c] + b;
    } else {
      for (uint32_t c = 0; c < 8; ++c) ws[(tp / 4) * LD + col + c] = 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t kk = 0; kk < BK; kk += 8) mma_step(acc, xs + sm * LD + kk, LD, ws + sn * LD + kk, LD);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  mma_store(acc, ys + sm * LD + sn, LD);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (active) {
    for (uint32_t i = 0; i < RPT; ++i) {
      const uint32_t row = tp / 4 + 32 * i;
      const uint32_t r = r0 + row;
      if (r >= r1) continue;
      const float wr = row_weight[r];
      for (uint32_t c = 0; c < 8; ++c) {
        const uint32_t n = n0 + col + c;
        if (n < H) y[r * H + n] = wr * ys[row * LD + col + c];
      }
    }
  }
}

// The K loop of a few-row gate/up block at `bits`: strips of strip_codes<bits>() codes per lane;
// the strip's codes of feature n0 + r dequantized once (w = s * q + b, fp32), then
// ag[m][r] / au[m][r] += x . w for row m of the block: no sum of x and no scale or bias per row.
template <typename T, typename S, int bits>
inline void moe_few_gate_up_strips(const device T* x, const thread uint32_t* tok, uint32_t rows,
                                   const device uint32_t* wg, const device S* sg, const device S* bg,
                                   const device uint32_t* wu, const device S* su, const device S* bu,
                                   uint32_t n0, uint32_t N, uint32_t H, uint32_t K_end, uint32_t group_size,
                                   uint32_t lane, thread float4* ag, thread float4* au) {
  constexpr uint32_t V = strip_codes<bits>(), step = 32 * V;
  const uint32_t wpr = H * bits / 32, gpr = H / group_size;
  for (uint32_t kk = lane * V; kk < K_end; kk += step) {
    const uint32_t grp = kk / group_size;  // the strip lies inside one group
    for (uint32_t r = 0; r < kMoeMvRowsPerSimd; ++r) {
      const uint32_t n = n0 + r;
      if (n >= N) break;
      float qg[V];
      float qu[V];
      unpack_row<bits, V>(wg + n * wpr, kk, qg);
      unpack_row<bits, V>(wu + n * wpr, kk, qu);
      const float s1 = float(sg[n * gpr + grp]), b1 = float(bg[n * gpr + grp]);
      const float s2 = float(su[n * gpr + grp]), b2 = float(bu[n * gpr + grp]);
      for (uint32_t i = 0; i < V; ++i) {
        qg[i] = fma(s1, qg[i], b1);
        qu[i] = fma(s2, qu[i], b2);
      }
      for (uint32_t m = 0; m < kMoeFewBlockRows; ++m) {
        if (m >= rows) break;
        const device T* xm = x + tok[m] * H + kk;
        float dg = 0.0f, du = 0.0f;
        for (uint32_t i = 0; i < V; ++i) {
          const float xv = float(xm[i]);
          dg = fma(xv, qg[i], dg);
          du = fma(xv, qu[i], du);
        }
        ag[m][r] += dg;
        au[m][r] += du;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// moe_gate_up_few: tiled route, the few-row tiles (a group's remainder of <= args.few_rows <= 16
// rows, e.g. an expert that received few tokens): matvec-style, like qmv (qmm.metal), every
// weight row read once per block of <= kMoeFewBlockRows = 8 of the tile's rows (a 16-row tile
// reads its 8 features' weights twice, the second time from cache) and nothing computed for
// absent rows.
//   grid:       (ceil(max(I, Is) / 8), max_few) threadgroups of 64 threads (2 simdgroups);
//               tiles >= the plan's few-row count do no work (uniformly)
//   simdgroup:  4 consecutive features n0..n0+3 of gate and up for the tile's rows (<= 8)
//   lane:       strips of strip_codes<bits>() codes per step, dequantized once per feature (s * q + b),
//               then per (feature, row) x . w;
//               one simd_sum(float4) per row and matrix; lane 0 writes h = silu(gate) * up
//   buffers:    as moe_gate_up_mm (x rows gathered through the plan's row -> token map)
//   widths:     as moe_gate_up_mm: the shared group's strips at `sbits` (its own strip size)
template <typename T, typename S, int bits, int sbits>
[[kernel]] void moe_gate_up_few(constant MoeArgs& args [[buffer(0)]],
                                const device T* x [[buffer(1)]],
                                const device uint32_t* plan [[buffer(2)]],
                                const device uint32_t* gate_w [[buffer(3)]],
                                const device S* gate_s [[buffer(4)]],
                                const device S* gate_b [[buffer(5)]],
                                const device uint32_t* up_w [[buffer(6)]],
                                const device S* up_s [[buffer(7)]],
                                const device S* up_b [[buffer(8)]],
                                const device uint32_t* sh_gate_w [[buffer(9)]],
                                const device S* sh_gate_s [[buffer(10)]],
                                const device S* sh_gate_b [[buffer(11)]],
                                const device uint32_t* sh_up_w [[buffer(12)]],
                                const device S* sh_up_s [[buffer(13)]],
                                const device S* sh_up_b [[buffer(14)]],
                                device float* h [[buffer(15)]],
                                LILY_KERNEL_TAIL) {
  constexpr uint32_t FEW = kMoeFewBlockRows;
  const uint32_t tile = group_pos.y;
  const uint32_t list = moe_plan_list_few(args.max_tiles, args.max_few);
  const bool active = tile < plan[2];  // uniform over the threadgroup
  const uint32_t g = active ? plan[list + 3 * tile] : 0u;
  const uint32_t r0 = active ? plan[list + 3 * tile + 1] : 0u;
  const uint32_t rows_all = active ? plan[list + 3 * tile + 2] - r0 : 0u;  // <= args.few_rows
  const bool shared = g == args.experts;
  const bool own = sbits != bits && shared;  // the shared expert at its own width
  const uint32_t N = shared ? args.shared_inter : args.inter;
  const uint32_t H = args.hidden, wpr = H * bits / 32, gpr = H / args.group_size;
  const device uint32_t* wg = shared ? sh_gate_w : gate_w + g * N * wpr;
  const device S* sg = shared ? sh_gate_s : gate_s + g * N * gpr;
  const device S* bg = shared ? sh_gate_b : gate_b + g * N * gpr;
  const device uint32_t* wu = shared ? sh_up_w : up_w + g * N * wpr;
  const device S* su = shared ? sh_up_s : up_s + g * N * gpr;
  const device S* bu = shared ? sh_up_b : up_b + g * N * gpr;
  const uint32_t row_token = moe_plan_row_token(args.max_tiles);
  const uint32_t n0 = (group_pos.x * kMoeMvSimdsPerGroup + simd_id) * kMoeMvRowsPerSimd;
  for (uint32_t b0 = 0; b0 < rows_all; b0 += FEW) {  // blocks of <= FEW rows (registers); uniform
    const uint32_t rows = min(FEW, rows_all - b0), rb = r0 + b0;
    uint32_t tok[FEW];
    for (uint32_t m = 0; m < FEW; ++m) tok[m] = m < rows ? plan[row_token + rb + m] : 0u;
    const uint32_t K_end = rows > 0 && n0 < N ? H : 0u;  // uniform per simdgroup (no collectives in the loop)

    float4 ag[FEW];
    float4 au[FEW];
    for (uint32_t m = 0; m < FEW; ++m) {
      ag[m] = float4(0.0f);
      au[m] = float4(0.0f);
    }
    if (own) moe_few_gate_up_strips<T, S, sbits>(x, tok, rows, wg, sg, bg, wu, su, bu, n0, N, H, K_end, args.group_size, lane, ag, au);
    else moe_few_gate_up_strips<T, S, bits>(x, tok, rows, wg, sg, bg, wu, su, bu, n0, N, H, K_end, args.group_size, lane, ag, au);
    for (uint32_t m = 0; m < FEW; ++m) {  // rows is uniform: every lane makes the same collectives
      if (m >= rows) break;
      const float4 G = simd_sum(ag[m]);
      const float4 U = simd_sum(au[m]);
      if (lane == 0) {
        for (uint32_t r = 0; r < kMoeMvRowsPerSimd; ++r)
          if (n0 + r < N) h[(rb + m) * args.h_stride + n0 + r] = moe_silu(G[r]) * U[r];
      }
    }
  }
}

// The K loop of a few-row down block at `bits` (K = I, or Is for the shared group): the strip's
// codes of feature n0 + r dequantized once (w = s * q + b, fp32), then acc[m][r] += h . w for row m
// of the block (h rows at hb + m * h_stride).
template <typename S, int bits>
inline void moe_few_down_strips(const device float* hb, uint32_t h_stride, uint32_t rows,
                                const device uint32_t* w, const device S* sc, const device S* bi,
                                uint32_t n0, uint32_t H, uint32_t K, uint32_t K_end, uint32_t group_size,
                                uint32_t lane, thread float4* acc) {
  constexpr uint32_t V = strip_codes<bits>(), step = 32 * V;
  const uint32_t wpr = K * bits / 32, gpr = K / group_size;
  for (uint32_t kk = lane * V; kk < K_end; kk += step) {
    const uint32_t grp = kk / group_size;
    for (uint32_t r = 0; r < kMoeMvRowsPerSimd; ++r) {
      const uint32_t n = n0 + r;
      if (n >= H) break;
      float q[V];
      unpack_row<bits, V>(w + n * wpr, kk, q);
      const float s = float(sc[n * gpr + grp]), b = float(bi[n * gpr + grp]);
      for (uint32_t i = 0; i < V; ++i) q[i] = fma(s, q[i], b);  // dequantized once for the rows
      for (uint32_t m = 0; m < kMoeFewBlockRows; ++m) {
        if (m >= rows) break;
        const device float* hm = hb + m * h_stride + kk;
        float dot = 0.0f;
        for (uint32_t i = 0; i < V; ++i) dot = fma(hm[i], q[i], dot);
        acc[m][r] += dot;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// moe_down_few: tiled route, the few-row tiles of the down projection. y[row, n] =
// row_weight[row] * (h[row] . down_g[n]) for the tile's rows (<= 16, in blocks of <= 8),
// matvec-style as above.
//   grid:       (ceil(H / 8), max_few) threadgroups of 64 threads (2 simdgroups x 4 features)
//   buffers:    as moe_down_mm
//   widths:     as moe_gate_up_few
template <typename S, int bits, int sbits>
[[kernel]] void moe_down_few(constant MoeArgs& args [[buffer(0)]],
                             const device uint32_t* plan [[buffer(1)]],
                             const device float* row_weight [[buffer(2)]],
                             const device float* h [[buffer(3)]],
                             const device uint32_t* down_w [[buffer(4)]],
                             const device S* down_s [[buffer(5)]],
                             const device S* down_b [[buffer(6)]],
                             const device uint32_t* sh_down_w [[buffer(7)]],
                             const device S* sh_down_s [[buffer(8)]],
                             const device S* sh_down_b [[buffer(9)]],
                             device float* y [[buffer(10)]],
                             LILY_KERNEL_TAIL) {
  constexpr uint32_t FEW = kMoeFewBlockRows;
  const uint32_t tile = group_pos.y;
  const uint32_t list = moe_plan_list_few(args.max_tiles, args.max_few);
  const bool active = tile < plan[2];
  const uint32_t g = active ? plan[list + 3 * tile] : 0u;
  const uint32_t r0 = active ? plan[list + 3 * tile + 1] : 0u;
  const uint32_t rows_all = active ? plan[list + 3 * tile + 2] - r0 : 0u;  // <= args.few_rows
  const bool shared = g == args.experts;
  const uint32_t H = args.hidden;
  const uint32_t K = shared ? args.shared_inter : args.inter;
  const bool own = sbits != bits && shared;  // the shared expert at its own width
  const uint32_t wpr = K * bits / 32, gpr = K / args.group_size;
  const device uint32_t* w = shared ? sh_down_w : down_w + g * H * wpr;
  const device S* sc = shared ? sh_down_s : down_s + g * H * gpr;
  const device S* bi = shared ? sh_down_b : down_b + g * H * gpr;
  const uint32_t n0 = (group_pos.x * kMoeMvSimdsPerGroup + simd_id) * kMoeMvRowsPerSimd;
  for (uint32_t b0 = 0; b0 < rows_all; b0 += FEW) {  // blocks of <= FEW rows (registers); uniform
    const uint32_t rows = min(FEW, rows_all - b0), rb = r0 + b0;
    const uint32_t K_end = rows > 0 && n0 < H ? K : 0u;

    float4 acc[FEW];
    for (uint32_t m = 0; m < FEW; ++m) acc[m] = float4(0.0f);
    const device float* hb = h + rb * args.h_stride;
    if (own) moe_few_down_strips<S, sbits>(hb, args.h_stride, rows, w, sc, bi, n0, H, K, K_end, args.group_size, lane, acc);
    else moe_few_down_strips<S, bits>(hb, args.h_stride, rows, w, sc, bi, n0, H, K, K_end, args.group_size, lane, acc);
    for (uint32_t m = 0; m < FEW; ++m) {  // rows is uniform
      if (m >= rows) break;
      const float4 total = simd_sum(acc[m]);
      if (lane == 0) {
        const float wr = row_weight[rb + m];
        for (uint32_t r = 0; r < kMoeMvRowsPerSimd; ++r)
          if (n0 + r < H) y[(rb + m) * H + n0 + r] = wr * total[r];
      }
    }
  }
}

// Instantiations: the fp32-tile and few-row rows of csrc/gpu/kernel_ids.h (2 to 8-bit experts,
// fp32 and bf16 activations; the down kernels read the fp32 h).
LILY_INSTANTIATE("moe_gate_up_mm32_b4_xf32_sbf16", moe_gate_up_mm<float, bfloat, 4, 4, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b4_xf32_sbf16", moe_gate_up_mm<float, bfloat, 4, 4, 64>)
LILY_INSTANTIATE("moe_down_mm32_b4_sbf16", moe_down_mm<bfloat, 4, 4, 32>)
LILY_INSTANTIATE("moe_down_mm64_b4_sbf16", moe_down_mm<bfloat, 4, 4, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b4_xf32_sbf16", moe_gate_up_few<float, bfloat, 4, 4>)
LILY_INSTANTIATE("moe_down_few_b4_sbf16", moe_down_few<bfloat, 4, 4>)
LILY_INSTANTIATE("moe_gate_up_mm32_b4_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 4, 4, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b4_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 4, 4, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b4_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 4, 4>)
LILY_INSTANTIATE("moe_gate_up_mm32_b2_xf32_sbf16", moe_gate_up_mm<float, bfloat, 2, 2, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b2_xf32_sbf16", moe_gate_up_mm<float, bfloat, 2, 2, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b2_xf32_sbf16", moe_gate_up_few<float, bfloat, 2, 2>)
LILY_INSTANTIATE("moe_gate_up_mm32_b2_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 2, 2, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b2_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 2, 2, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b2_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 2, 2>)
LILY_INSTANTIATE("moe_down_mm32_b2_sbf16", moe_down_mm<bfloat, 2, 2, 32>)
LILY_INSTANTIATE("moe_down_mm64_b2_sbf16", moe_down_mm<bfloat, 2, 2, 64>)
LILY_INSTANTIATE("moe_down_few_b2_sbf16", moe_down_few<bfloat, 2, 2>)
LILY_INSTANTIATE("moe_gate_up_mm32_b3_xf32_sbf16", moe_gate_up_mm<float, bfloat, 3, 3, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b3_xf32_sbf16", moe_gate_up_mm<float, bfloat, 3, 3, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b3_xf32_sbf16", moe_gate_up_few<float, bfloat, 3, 3>)
LILY_INSTANTIATE("moe_gate_up_mm32_b3_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 3, 3, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b3_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 3, 3, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b3_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 3, 3>)
LILY_INSTANTIATE("moe_down_mm32_b3_sbf16", moe_down_mm<bfloat, 3, 3, 32>)
LILY_INSTANTIATE("moe_down_mm64_b3_sbf16", moe_down_mm<bfloat, 3, 3, 64>)
LILY_INSTANTIATE("moe_down_few_b3_sbf16", moe_down_few<bfloat, 3, 3>)
LILY_INSTANTIATE("moe_gate_up_mm32_b5_xf32_sbf16", moe_gate_up_mm<float, bfloat, 5, 5, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b5_xf32_sbf16", moe_gate_up_mm<float, bfloat, 5, 5, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b5_xf32_sbf16", moe_gate_up_few<float, bfloat, 5, 5>)
LILY_INSTANTIATE("moe_gate_up_mm32_b5_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 5, 5, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b5_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 5, 5, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b5_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 5, 5>)
LILY_INSTANTIATE("moe_down_mm32_b5_sbf16", moe_down_mm<bfloat, 5, 5, 32>)
LILY_INSTANTIATE("moe_down_mm64_b5_sbf16", moe_down_mm<bfloat, 5, 5, 64>)
LILY_INSTANTIATE("moe_down_few_b5_sbf16", moe_down_few<bfloat, 5, 5>)
LILY_INSTANTIATE("moe_gate_up_mm32_b6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 6, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 6, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b6_xf32_sbf16", moe_gate_up_few<float, bfloat, 6, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 6, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 6, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b6_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 6, 6>)
LILY_INSTANTIATE("moe_down_mm32_b6_sbf16", moe_down_mm<bfloat, 6, 6, 32>)
LILY_INSTANTIATE("moe_down_mm64_b6_sbf16", moe_down_mm<bfloat, 6, 6, 64>)
LILY_INSTANTIATE("moe_down_few_b6_sbf16", moe_down_few<bfloat, 6, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b8_xf32_sbf16", moe_gate_up_mm<float, bfloat, 8, 8, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b8_xf32_sbf16", moe_gate_up_mm<float, bfloat, 8, 8, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b8_xf32_sbf16", moe_gate_up_few<float, bfloat, 8, 8>)
LILY_INSTANTIATE("moe_gate_up_mm32_b8_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 8, 8, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b8_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 8, 8, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b8_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 8, 8>)
LILY_INSTANTIATE("moe_down_mm32_b8_sbf16", moe_down_mm<bfloat, 8, 8, 32>)
LILY_INSTANTIATE("moe_down_mm64_b8_sbf16", moe_down_mm<bfloat, 8, 8, 64>)
LILY_INSTANTIATE("moe_down_few_b8_sbf16", moe_down_few<bfloat, 8, 8>)


// Mixed checkpoints: routed experts at b, the shared expert at s (csrc/gpu/kernel_ids.h,
// kMoeSharedWidths: the pairs built).
LILY_INSTANTIATE("moe_gate_up_mm32_b2s6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 2, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b2s6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 2, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b2s6_xf32_sbf16", moe_gate_up_few<float, bfloat, 2, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b2s6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 2, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b2s6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 2, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b2s6_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 2, 6>)
LILY_INSTANTIATE("moe_down_mm32_b2s6_sbf16", moe_down_mm<bfloat, 2, 6, 32>)
LILY_INSTANTIATE("moe_down_mm64_b2s6_sbf16", moe_down_mm<bfloat, 2, 6, 64>)
LILY_INSTANTIATE("moe_down_few_b2s6_sbf16", moe_down_few<bfloat, 2, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b3s6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 3, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b3s6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 3, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b3s6_xf32_sbf16", moe_gate_up_few<float, bfloat, 3, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b3s6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 3, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b3s6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 3, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b3s6_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 3, 6>)
LILY_INSTANTIATE("moe_down_mm32_b3s6_sbf16", moe_down_mm<bfloat, 3, 6, 32>)
LILY_INSTANTIATE("moe_down_mm64_b3s6_sbf16", moe_down_mm<bfloat, 3, 6, 64>)
LILY_INSTANTIATE("moe_down_few_b3s6_sbf16", moe_down_few<bfloat, 3, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b4s6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 4, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b4s6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 4, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b4s6_xf32_sbf16", moe_gate_up_few<float, bfloat, 4, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b4s6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 4, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b4s6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 4, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b4s6_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 4, 6>)
LILY_INSTANTIATE("moe_down_mm32_b4s6_sbf16", moe_down_mm<bfloat, 4, 6, 32>)
LILY_INSTANTIATE("moe_down_mm64_b4s6_sbf16", moe_down_mm<bfloat, 4, 6, 64>)
LILY_INSTANTIATE("moe_down_few_b4s6_sbf16", moe_down_few<bfloat, 4, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b4s8_xf32_sbf16", moe_gate_up_mm<float, bfloat, 4, 8, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b4s8_xf32_sbf16", moe_gate_up_mm<float, bfloat, 4, 8, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b4s8_xf32_sbf16", moe_gate_up_few<float, bfloat, 4, 8>)
LILY_INSTANTIATE("moe_gate_up_mm32_b4s8_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 4, 8, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b4s8_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 4, 8, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b4s8_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 4, 8>)
LILY_INSTANTIATE("moe_down_mm32_b4s8_sbf16", moe_down_mm<bfloat, 4, 8, 32>)
LILY_INSTANTIATE("moe_down_mm64_b4s8_sbf16", moe_down_mm<bfloat, 4, 8, 64>)
LILY_INSTANTIATE("moe_down_few_b4s8_sbf16", moe_down_few<bfloat, 4, 8>)

}  // namespace lily
