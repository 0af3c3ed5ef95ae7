// Quantized matmul y[M, N] = x[M, K] @ dequant(w)[N, K]^T, MLX affine layout (common/quant.h).
// Host: csrc/gpu/ops/qmm.cpp (route, grid, bindings). Reference: lily_py.reference.kernels.
//
// Buffers (both kernels): 1 x [M, x_stride] T, 2 w uint32 [N, K*bits/32], 3 scales [N, K/gs] S,
// 4 biases [N, K/gs] S, 5 y [M, y_stride] T.  T = activation dtype (float or bfloat),
// S = scale/bias dtype (float or bfloat); bits 4 or 8; group size 32, 64 or 128 (runtime).
//
// Precision: codes, scales, biases and x are widened to fp32; dequantisation, products and
// accumulation are fp32; y is rounded to T once at the end. Nothing dequantized reaches device
// memory.
#include "common/lily_metal.h"
#include "common/mma.h"
#include "common/qmm_bf16.h"
#include "common/quant.h"
#include "common/reduce.h"
#include "common/gated_norm.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// qmv: the small-M route (2 <= M <= kQmvMaxRows: a batched decode step, tiny chunks). Every weight
// byte is loaded once and every code unpacked once for all M rows of x.
//   grid:      ceil(N / kQmvRows) threadgroups of 32 * splits threads (qmv_splits: min(kQmv1MaxSplits,
//              ceil(K / B)), 1 for lm_head-sized N)
//   block:     B = 32 lanes x kQmvLaneCodes (8) codes; simdgroup s walks K blocks s, s + splits, ...
//   per block: the lane unpacks its 8 codes of each of the kQmvRows rows once (unpack_row: every
//              width 2..8, exact values) and dequantizes them once, w = s * q + b in fp32; then for
//              each row m of x its 8 values (one 16-byte load8 at bf16: x 16-byte aligned, the host
//              checks) and 8 fma per row of w into acc[m][r]. Per code: the unpack and one fma shared
//              by the M rows of x, then one fma per row of x: no sum of x and no scale or bias
//              arithmetic per row of x (M = 8, 4 bits, sm_90: about 580 instructions per lane and
//              block instead of 750; instruction-bound there, docs/kernels-matmul.md).
//   rows:      rows past N load row N - 1; only the store is guarded. Rows of x past M are skipped
//              by a uniform branch (acc[m][r] stays compile-time indexed: registers).
//   reduction: the 32 acc[m][r] reduce-scattered over the lanes (simd_sum_scatter: 31 shuffles
//              where 32 simd_sums take 160; each total simd_sum's), lane l storing value
//              simd_scatter_index(l), then over the splits through threadgroup memory in order.
template <typename T, typename S, int bits, typename Y = T>
[[kernel]] void qmv(constant QmmArgs& args [[buffer(0)]],
                    const device T* x [[buffer(1)]],
                    const device uint32_t* w [[buffer(2)]],
                    const device S* scales [[buffer(3)]],
                    const device S* biases [[buffer(4)]],
                    device Y* y [[buffer(5)]],
                    LILY_KERNEL_TAIL) {
  constexpr uint32_t V = kQmvLaneCodes;
  constexpr uint32_t B = 32 * V;
  constexpr uint32_t R = kQmvRows;
  constexpr uint32_t MR = kQmvMaxRows;
  LILY_TG_ARRAY(float, red, [kQmv1MaxSplits * kQmvMaxRows * kQmvRows]);
  const uint32_t K = args.K, M = args.M;
  const uint32_t splits = group_size.x / 32;
  const uint32_t words_per_row = K * bits / 32;
  const uint32_t gshift = group_shift_of(args.group_size);
  const uint32_t groups_per_row = K >> gshift;
  const uint32_t n0 = group_pos.x * R;

  uint32_t row[R];
  LILY_UNROLL
  for (uint32_t r = 0; r < R; ++r) row[r] = min(n0 + r, args.N - 1);
  float acc[MR][R];
  LILY_UNROLL
  for (uint32_t m = 0; m < MR; ++m) {
    LILY_UNROLL
    for (uint32_t r = 0; r < R; ++r) acc[m][r] = 0.0f;
  }
  for (uint32_t k0 = simd_id * B; k0 < K; k0 += splits * B) {
    const uint32_t k = k0 + lane * V;
    if (k < K) {  // only a last, partial block diverges (K is a multiple of 32, k of 8)
      const uint32_t g = k >> gshift;  // the 8 codes lie in one group
      float wq[R][V];  // the dequantized weights, s * q + b
      LILY_UNROLL
      for (uint32_t r = 0; r < R; ++r) {
        unpack_row<bits, V>(w + row[r] * words_per_row, k, wq[r]);
        const float sc = float(scales[row[r] * groups_per_row + g]);
        const float bi = float(biases[row[r] * groups_per_row + g]);
        for (uint32_t i = 0; i < V; ++i) wq[r][i] = fma(sc, wq[r][i], bi);
      }
      LILY_UNROLL
      for (uint32_t m = 0; m < MR; ++m) {
        if (m < M) {
          float xv[V];
          load8(x + m * args.x_stride + k, xv);
          LILY_UNROLL
          for (uint32_t r = 0; r < R; ++r) {
            for (uint32_t i = 0; i < V; ++i) acc[m][r] = fma(xv[i], wq[r][i], acc[m][r]);
          }
        }
      }
    }
  }

  // value m * R + r of the flat acc; rows of x past M are zeros (summed, never stored)
  const float t = simd_sum_scatter<MR * R>(&acc[0][0], lane);
  if (lane < MR * R) red[simd_id * MR * R + simd_scatter_index<MR * R>(lane)] = t;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t i = thread_pos.x; i < M * R; i += group_size.x) {
    const uint32_t m = i / R, r = i % R;
    if (n0 + r >= args.N) continue;
    float total = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) total += red[(s * MR + m) * R + r];
    y[m * args.y_stride + n0 + r] = Y(total);
  }
}

// ---------------------------------------------------------------------------------------------
// qmv1's pieces, shared with qmv1_gated (inlined: acc and row stay compile-time indexed).
// One batch of RB rows of a lane's block: every row's codes, scale and bias loaded
// (qmv1_batch_load) before any dot product (qmv1_batch_accumulate: acc[r] += s * (codes . xs) +
// b * xsum), so RB independent 16-byte loads per lane are in flight (compilers keep a load next
// to its use otherwise: the H200's qmv1_*_r16 had one in flight, docs/gpu.md). wk: w at the
// lane's first code; g: its group.
template <int bits, uint32_t RB>
struct Qmv1RowBatch {
  typename Qmv1Codes<bits>::Words wv[RB];
  float sc[RB], bi[RB];
};

template <int bits, uint32_t RB, typename S>
inline void qmv1_batch_load(thread Qmv1RowBatch<bits, RB>& b, thread const uint32_t* row,
                            const device uint32_t* wk, const device S* scales, const device S* biases,
                            uint32_t words_per_row, uint32_t groups_per_row, uint32_t g) {
  LILY_UNROLL
  for (uint32_t r = 0; r < RB; ++r) {
    b.wv[r] = Qmv1Codes<bits>::load(wk + row[r] * words_per_row);
    b.sc[r] = float(scales[row[r] * groups_per_row + g]);
    b.bi[r] = float(biases[row[r] * groups_per_row + g]);
  }
}

template <int bits, uint32_t RB>
inline void qmv1_batch_accumulate(thread const Qmv1RowBatch<bits, RB>& b, thread const float* xs, float xsum,
                                  thread float* acc) {
  float dr[RB];
  Qmv1Codes<bits>::template dot_rows<RB>(b.wv, xs, dr);
  LILY_UNROLL
  for (uint32_t r = 0; r < RB; ++r) acc[r] = fma(b.sc[r], dr[r], fma(b.bi[r], xsum, acc[r]));
}

// The R rows' share of a lane's block, in batches of kQmv1LoadBatch rows (Qmv1RowBatch).
template <int bits, uint32_t R, typename S>
inline void qmv1_block_rows(thread const float* xs, float xsum, thread const uint32_t* row, const device uint32_t* wk,
                            const device S* scales, const device S* biases, uint32_t words_per_row,
                            uint32_t groups_per_row, uint32_t g, thread float* acc) {
  constexpr uint32_t RB = R < kQmv1LoadBatch ? R : kQmv1LoadBatch;
  LILY_UNROLL
  for (uint32_t r0 = 0; r0 < R; r0 += RB) {
    Qmv1RowBatch<bits, RB> b;
    qmv1_batch_load(b, row + r0, wk, scales, biases, words_per_row, groups_per_row, g);
    qmv1_batch_accumulate(b, xs, xsum, acc + r0);
  }
}

// The reduction: acc[R] reduce-scattered over the lanes (simd_sum_scatter: acc is overwritten) and
// simd_sum of ss (norm_count > 0 only), then over the splits through `red` (splits x (R + 1)
// floats) in order; thread r < R stores y[n0 + r] = total * inv_rms (rows < N), inv_rms =
// rsqrt(sum(ss) / norm_count + eps) when norm_count > 0 (the fused RMSNorm), else 1. Returns inv_rms.
template <uint32_t R, typename Y>
inline float qmv1_reduce_store(thread float* acc, float ss, uint32_t N, uint32_t n0, threadgroup float* red,
                               device Y* y, uint32_t lane, uint32_t simd_id, uint32_t splits, uint32_t tid,
                               float norm_count, float eps) {
  const bool norm = norm_count > 0.0f;  // uniform
  const float t = simd_sum_scatter<R>(acc, lane);
  if (norm) ss = simd_sum(ss);
  if (lane < R) red[simd_id * (R + 1) + simd_scatter_index<R>(lane)] = t;
  if (norm && lane == 0) red[simd_id * (R + 1) + R] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float inv_rms = 1.0f;
  if (norm) {
    float total_ss = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) total_ss += red[s * (R + 1) + R];
    inv_rms = rsqrt(total_ss / norm_count + eps);
  }
  if (tid < R && n0 + tid < N) {
    float total = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) total += red[s * (R + 1) + tid];
    y[n0 + tid] = Y(total * inv_rms);
  }
  return inv_rms;
}

// ---------------------------------------------------------------------------------------------
// qmv1: the single-token route (M = 1: every decode projection), after MLX's qmv_fast.
//   grid:      ceil(N / R) threadgroups of 32 * splits threads, splits = min(4, ceil(K / B));
//              R = kQmv1Rows = 8 rows per threadgroup, or R = 1 (the *_r1 kernels) where 8 would
//              give fewer than kQmv1MinSimdgroups = 1024 simdgroups (the router: 257 rows), or
//              R = kQmv1WideRows = 16 (the *_r16 kernels, 4 and 8 bits) where K is not split
//              (lm_head: 15,520 threadgroups of one simdgroup; x loaded once per 16 rows)
//   block:     B = 32 lanes x V codes (V = 128 / bits: one 16-byte load of w per lane and row at
//              4 and 8 bits; V = 32, `bits` words, at 2, 3, 5 and 6: Qmv1Codes);
//              simdgroup s walks K blocks s, s + splits, ...
//   per block: the lane's V values of x are loaded once, 8 per 16-byte load (load8; x, residual
//              and norm_w 16-byte aligned: the host checks), with the residual added and the norm
//              weight applied when fused, pre-scaled for 4-bit codes (x * 16^-(i % 4): a nibble
//              is then masked in place, never shifted; exact: a power-of-two scale), summed once
//              for the bias term, and reused by the R rows: R independent 16-byte loads per
//              lane in flight. The group index is a shift (group_shift), no division.
//   rows:      rows past N load row N - 1 (loads never wait on a branch); only the store is guarded
//   reduction: per lane acc[R] (compile-time indexed: registers), reduce-scattered over the
//              lanes (simd_sum_scatter), and with the norm the sum of squares of h (simd_sum);
//              then over the splits through threadgroup memory in order.
//   norm:      y = rsqrt(sum(h^2) / K + eps) * (w . (h * norm_w)), sum(h^2) recomputed by every
//              threadgroup (x, residual, norm_w re-read per threadgroup); threadgroup 0 writes the side
//              outputs h_out and xn_out = T(h * rsqrt(...) * norm_w) when asked (kQmv1Side).
//   buffers:   1 x [K] T, 2 w, 3 scales, 4 biases, 5 y [N] T, 6 residual [K] T, 7 norm_w [K] float,
//              8 h_out [K] T, 9 xn_out [K] T (6..9 read or written only when their flag is set).
// Qmv1Codes (the 16-byte code dot products): common/quant.h, shared with the MoE matvecs.
template <typename T, typename S, int bits, typename Y = T, uint32_t R = kQmv1Rows>
[[kernel]] void qmv1(constant Qmv1Args& args [[buffer(0)]],
                     const device T* x [[buffer(1)]],
                     const device uint32_t* w [[buffer(2)]],
                     const device S* scales [[buffer(3)]],
                     const device S* biases [[buffer(4)]],
                     device Y* y [[buffer(5)]],
                     const device T* residual [[buffer(6)]],
                     const device float* norm_w [[buffer(7)]],
                     device T* h_out [[buffer(8)]],
                     device T* xn_out [[buffer(9)]],
                     LILY_KERNEL_TAIL) {
  static_assert(R == kQmv1Rows || R == 1 || R == kQmv1WideRows, "qmv1 is instantiated for 8, 1 or 16 rows");
  constexpr uint32_t V = Qmv1Codes<bits>::V;
  constexpr uint32_t B = 32 * V;
  LILY_TG_ARRAY(float, red, [kQmv1MaxSplits * (R + 1)]);
  const uint32_t K = args.K;
  const uint32_t splits = group_size.x / 32;
  const uint32_t words_per_row = K * bits / 32;
  const uint32_t groups_per_row = K >> args.group_shift;
  const bool has_norm = (args.flags & kQmv1Norm) != 0;
  const bool has_res = (args.flags & kQmv1Residual) != 0;
  const uint32_t n0 = group_pos.x * R;

  uint32_t row[R];  // row r loads row min(n0 + r, N - 1): the loads never wait on a branch
  LILY_UNROLL
  for (uint32_t r = 0; r < R; ++r) row[r] = min(n0 + r, args.N - 1);

  float acc[R];
  LILY_UNROLL
  for (uint32_t r = 0; r < R; ++r) acc[r] = 0.0f;
  float ss = 0.0f;
  for (uint32_t k0 = simd_id * B; k0 < K; k0 += splits * B) {
    const uint32_t k = k0 + lane * V;
    if (k < K) {  // only a last, partial block diverges (K is a multiple of 32 >= V)
      float xs[V];
      float xsum = 0.0f;
      for (uint32_t c = 0; c < V; c += 8) {  // 16-byte loads of x, residual and norm_w (load8)
        float hv[8], rv[8], nv[8];
        load8(x + k + c, hv);
        if (has_res) load8(residual + k + c, rv);
        if (has_norm) load8(norm_w + k + c, nv);
        for (uint32_t i = 0; i < 8; ++i) {
          float h = hv[i];
          if (has_res) h = float(T(h + rv[i]));
          ss += h * h;
          const float xv = has_norm ? h * nv[i] : h;
          xsum += xv;
          xs[c + i] = xv * Qmv1Codes<bits>::scale_of(c + i);
        }
      }
      qmv1_block_rows<bits, R>(xs, xsum, row, w + k * bits / 32, scales, biases, words_per_row, groups_per_row,
                               k >> args.group_shift, acc);
    }
  }

  const float inv_rms = qmv1_reduce_store<R>(acc, ss, args.N, n0, red, y, lane, simd_id, splits, thread_pos.x,
                                             has_norm ? float(K) : 0.0f, args.eps);
  if ((args.flags & kQmv1Side) != 0 && group_pos.x == 0) {
    for (uint32_t c = thread_pos.x; c < K; c += group_size.x) {
      float h = float(x[c]);
      if (has_res) h = float(T(h + float(residual[c])));
      h_out[c] = T(h);
      xn_out[c] = T(h * inv_rms * norm_w[c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// qmv1_gated: a DeltaNet layer's out_proj at one token with the gated RMSNorm folded in front, so
// the norm needs no level of its own (30 fewer per token on the real config). x is the delta rule's
// raw output o [K = Hv * Dv] (float, gated_delta_decode's o_raw); the product is taken with
//   x_j = round_Y(gated_norm_value(o_j, rsqrt(|o_h|^2 / Dv + eps), norm_w[j % Dv], z_j))
// (common/gated_norm.h), the expression gd_chunk_norm writes for out_proj to read; only the
// order of the |o_h|^2 sum differs (fp32: a few ulp of inv_rms).
//   grid, block, rows, reduction: as qmv1 (R = 8 or 1; K split over `splits` simdgroups).
//   per block: a lane's V values lie in one head (Dv = head_lanes * V, head_lanes a power of two
//              <= 32; a block starts on a head boundary, 32 V being a multiple of Dv), so |o_h|^2 is
//              the lane's sum of squares reduced over the head's head_lanes lanes: log2(head_lanes)
//              xor shuffles, in uniform control flow (lanes past K add 0; a head's lanes are all
//              inside K or all past it). The R rows' codes, scales and biases are loaded first
//              (one Qmv1RowBatch), then o and z, before the shuffles, norm_w after (16-byte loads);
//              the gated value is rounded to Y and pre-scaled as qmv1's x.
//   buffers:   1 o [K] float, 2 w, 3 scales, 4 biases, 5 y [N] Y, 6 z [K] Y, 7 norm_w [Dv] float
//              (o, z and norm_w 16-byte aligned: the host checks).
template <typename S, int bits, typename Y, uint32_t R>
[[kernel]] void qmv1_gated(constant Qmv1GatedArgs& args [[buffer(0)]],
                           const device float* o [[buffer(1)]],
                           const device uint32_t* w [[buffer(2)]],
                           const device S* scales [[buffer(3)]],
                           const device S* biases [[buffer(4)]],
                           device Y* y [[buffer(5)]],
                           const device Y* z [[buffer(6)]],
                           const device float* norm_w [[buffer(7)]],
                           LILY_KERNEL_TAIL) {
  static_assert(R == kQmv1Rows || R == 1, "qmv1_gated is instantiated for 8 or 1 rows");
  static_assert(R <= kQmv1LoadBatch, "qmv1_gated loads its rows in one batch");
  constexpr uint32_t V = Qmv1Codes<bits>::V;
  constexpr uint32_t B = 32 * V;
  LILY_TG_ARRAY(float, red, [kQmv1MaxSplits * (R + 1)]);
  const uint32_t K = args.K;
  const uint32_t splits = group_size.x / 32;
  const uint32_t words_per_row = K * bits / 32;
  const uint32_t groups_per_row = K >> args.group_shift;
  const uint32_t n0 = group_pos.x * R;

  uint32_t row[R];
  LILY_UNROLL
  for (uint32_t r = 0; r < R; ++r) row[r] = min(n0 + r, args.N - 1);
  float acc[R];
  LILY_UNROLL
  for (uint32_t r = 0; r < R; ++r) acc[r] = 0.0f;
  for (uint32_t k0 = simd_id * B; k0 < K; k0 += splits * B) {  // uniform in the simdgroup
    const uint32_t k = k0 + lane * V;
    const bool live = k < K;
    float xs[V], zs[V];  // o, then x; z (loaded with o: one round trip before the shuffles)
    float ss = 0.0f;
    // The R rows' weights first: their loads go out before the norm's loads, shuffles and
    // sigmoids, not after them (all R rows in one batch: R <= kQmv1LoadBatch)
    Qmv1RowBatch<bits, R> rows;
    if (live) {
      qmv1_batch_load(rows, row, w + k * bits / 32, scales, biases, words_per_row, groups_per_row,
                      k >> args.group_shift);
      for (uint32_t c = 0; c < V; c += 8) {
        load8(o + k + c, xs + c);
        load8(z + k + c, zs + c);
      }
      for (uint32_t i = 0; i < V; ++i) ss += xs[i] * xs[i];
    }
    for (uint32_t m = 1; m < args.head_lanes; m <<= 1) ss += simd_shuffle_xor(ss, ushort(m));
    if (live) {
      const float inv_rms = rsqrt(ss / float(args.Dv) + args.eps);
      const uint32_t d = k & (args.Dv - 1);  // the lane's first column within its head
      float xsum = 0.0f;
      for (uint32_t c = 0; c < V; c += 8) {
        float nv[8];
        load8(norm_w + d + c, nv);
        for (uint32_t i = 0; i < 8; ++i) {
          const float xv = float(Y(gated_norm_value(xs[c + i], inv_rms, nv[i], zs[c + i])));
          xsum += xv;
          xs[c + i] = xv * Qmv1Codes<bits>::scale_of(c + i);
        }
      }
      qmv1_batch_accumulate(rows, xs, xsum, acc);
    }
  }
  qmv1_reduce_store<R>(acc, 0.0f, args.N, n0, red, y, lane, simd_id, splits, thread_pos.x, 0.0f, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// qmm: the tiled route (M > kQmvMaxRows; prefill).
//   grid:        (ceil(N / 32), ceil(M / 32)) threadgroups of 128 threads (4 simdgroups)
//   tile:        32 rows of x by 32 output features; K walked in steps of kQmmTileK = 32
//   per step:    thread t loads x[m0 + t/4, k0 + 8*(t%4) .. +8] and dequantizes the same
//                coordinates of w into threadgroup memory (fp32; zeros past M / N); barrier;
//                simdgroup s multiplies its 16x16 quarter (rows 16*(s/2), cols 16*(s%2)) as
//                2x2 8x8 simdgroup matrices; barrier.
//   epilogue:    accumulators go through threadgroup memory; thread t writes row t/4,
//                columns 8*(t%4) .. +8 of the tile, masked to M x N.
// A 32-wide K step lies inside one quantization group (group sizes are multiples of 32).
template <typename T, typename S, int bits, typename Y = T>
[[kernel]] void qmm(constant QmmArgs& args [[buffer(0)]],
                    const device T* x [[buffer(1)]],
                    const device uint32_t* w [[buffer(2)]],
                    const device S* scales [[buffer(3)]],
                    const device S* biases [[buffer(4)]],
                    device Y* y [[buffer(5)]],
                    LILY_KERNEL_TAIL) {
  constexpr uint32_t BM = kQmmTileM, BN = kQmmTileN, BK = kQmmTileK;
  constexpr uint32_t LD = BK + 4;   // padded rows of the x and w tiles
  constexpr uint32_t LDY = BN + 4;  // padded rows of the output tile
  static_assert(BM == 32 && BN == 32 && BK == 32 && kQmmSimdsPerGroup == 4,
                "the thread-to-tile mapping below assumes 32x32x32 tiles and 128 threads");
  LILY_TG_ARRAY(float, xs, [BM * LD]);
  LILY_TG_ARRAY(float, ws, [BN * LD]);
  LILY_TG_ARRAY(float, ys, [BM * LDY]);

  const uint32_t t = thread_pos.x;
  const uint32_t row = t / 4;        // tile row this thread loads / writes
  const uint32_t col = (t % 4) * 8;  // first of its 8 columns
  const uint32_t m0 = group_pos.y * BM;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t words_per_row = args.K * bits / 32;
  const uint32_t groups_per_row = args.K / args.group_size;
  const uint32_t sm = (simd_id / 2) * 16;  // this simdgroup's quarter of the tile
  const uint32_t sn = (simd_id % 2) * 16;

  MmaTile<2, 2> acc;
  mma_zero(acc);

  for (uint32_t k0 = 0; k0 < args.K; k0 += BK) {
    const uint32_t m = m0 + row;
    for (uint32_t i = 0; i < 8; ++i)
      xs[row * LD + col + i] = m < args.M ? float(x[m * args.x_stride + k0 + col + i]) : 0.0f;

    const uint32_t n = n0 + row;
    if (n < args.N) {
      float q[8];
      unpack_row<bits, 8>(w + n * words_per_row, k0 + col, q);
      const uint32_t g = n * groups_per_row + (k0 + col) / args.group_size;
      const float s = float(scales[g]);
      const float b = float(biases[g]);
      for (uint32_t i = 0; i < 8; ++i) ws[row * LD + col + i] = s * q[i] + b;
    } else {
      for (uint32_t i = 0; i < 8; ++i) ws[row * LD + col + i] = 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint32_t kk = 0; kk < BK; kk += 8)
      mma_step(acc, xs + sm * LD + kk, LD, ws + sn * LD + kk, LD);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  mma_store(acc, ys + sm * LDY + sn, LDY);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint32_t m = m0 + row;
  if (m < args.M) {
    for (uint32_t i = 0; i < 8; ++i) {
      const uint32_t n = n0 + col + i;
      if (n < args.N) y[m * args.y_stride + n] = Y(ys[row * LDY + col + i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// qmm_bf16: the M1-M4 prefill route (M >= kQmmBf16MinRows; learned from MLX's steel GEMM and
// llama.cpp's kernel_mul_mm, written for this layout).
//   grid:        (ceil(N / 64), ceil(M / 64)) threadgroups of 128 threads (4 simdgroups)
//   tile:        64 rows of x by 64 output features, fp32 accumulators: simdgroup s owns the 32 x 32
//                quarter (rows 32*(s/2), cols 32*(s%2)) as 4 x 4 simdgroup_float8x8; K walked in
//                steps of kQmmBf16TileK = 16 (inside one quantization group)
//   staging:     simdgroups 0-1 stage w, 2-3 stage x (uniform per simdgroup): thread t owns tile row
//                t % 64 and its 16 columns of the step. w: one 16-byte load (128 / bits codes) per
//                row every 128 / bits / 16 steps (4-bit: every other step, the second half stays in
//                registers), dequantized s * q + b in fp32 and rounded to bf16. x: two 16-byte loads
//                (bf16, copied as is) or four (fp32, rounded to bf16). Both land in threadgroup memory
//                as two 16-byte stores per thread. Rows past M / N load row M - 1 / N - 1 (loads never
//                wait on a branch); their outputs are not stored.
//   K loop:      two stages; step s: global loads for step s + 1 into registers, the 2 x (4 + 4)
//                simdgroup loads and 2 x 16 multiply-accumulates of step s (bf16 x bf16 -> fp32),
//                then the registers into the other stage, one threadgroup barrier. The stage written
//                in step s was last read in step s - 1, before that step's barrier.
//   epilogue:    per 8 x 8 accumulator: simdgroup_store into the simdgroup's own 8 x 8 fp32 slot of
//                threadgroup memory, simdgroup barrier, each lane writes 2 outputs (masked to M x N,
//                rounded to T), simdgroup barrier.
//   threadgroup memory: 2 stages x (64 + 64) rows x 24 bf16 (16 + 8 padding: 48-byte rows, 16-byte
//                aligned) = 12288 bytes, plus 4 x 64 fp32 = 1024: 13312 bytes.
// Precision: x and the dequantized weights are rounded to bf16 once (relative error <= 2^-9 each);
// their products are exact in fp32 and summed in fp32; y is rounded to T once at the end.
// Alignment (checked by the host, which otherwise takes qmm): x rows and the w binding start on
// 16-byte boundaries.

// Staging helpers (QmmXRegs, qmm_bf16_load / qmm_bf16_store): common/qmm_bf16.h, shared with
// the MoE grouped bf16 tiles (moe_prefill_bf16.metal).

template <typename T, typename S, int bits>
[[kernel]] void qmm_bf16(constant QmmArgs& args [[buffer(0)]],
                         const device T* x [[buffer(1)]],
                         const device uint32_t* w [[buffer(2)]],
                         const device S* scales [[buffer(3)]],
                         const device S* biases [[buffer(4)]],
                         device T* y [[buffer(5)]],
                         LILY_KERNEL_TAIL) {
  constexpr uint32_t BM = kQmmBf16TileM, BN = kQmmBf16TileN, BK = kQmmBf16TileK;
  constexpr uint32_t LD = BK + 8;         // padded rows of the stages (48 bytes)
  constexpr uint32_t STAGE = BM * LD;     // elements of one stage of one operand
  static_assert(BM == 64 && BN == 64 && BK == 16 && kQmmBf16SimdsPerGroup == 4,
                "the staging map below assumes 64x64x16 tiles and 128 threads");
  // Stages declared as uint4 (16-byte aligned, for the 16-byte stores), used as bfloat.
  LILY_TG_ARRAY(uint4, xs16, [2 * BM * LD / 8]);
  LILY_TG_ARRAY(uint4, ws16, [2 * BN * LD / 8]);
  LILY_TG_ARRAY(float, cs, [kQmmBf16SimdsPerGroup * 64]);
  threadgroup bfloat* xs = reinterpret_cast<threadgroup bfloat*>(xs16);
  threadgroup bfloat* ws = reinterpret_cast<threadgroup bfloat*>(ws16);

  const uint32_t t = thread_pos.x;
  const bool stages_w = simd_id < 2;  // uniform per simdgroup
  const uint32_t row = t % 64;        // the tile row this thread stages
  const uint32_t m0 = group_pos.y * BM;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t groups_per_row = args.K / args.group_size;
  const uint32_t n = min(n0 + row, args.N - 1);
  const device T* xrow = x + min(m0 + row, args.M - 1) * args.x_stride;
  const device uint32_t* wrow = w + n * (args.K * bits / 32);
  const device S* srow = scales + n * groups_per_row;
  const device S* brow = biases + n * groups_per_row;
  const uint32_t sm = (simd_id / 2) * 32;  // this simdgroup's quarter of the tile
  const uint32_t sn = (simd_id % 2) * 32;

  const uint32_t gshift = group_shift_of(args.group_size);
  QmmXRegs<T> xr;
  uint4 wq = uint4(0u);
  float sc = 0.0f, bi = 0.0f;
  MmaTile<4, 4> acc;
  mma_zero(acc);
  const uint32_t steps = args.K / BK;
  qmm_bf16_load<bits>(stages_w, 0, gshift, xrow, wrow, srow, brow, xr, wq, sc, bi);
  qmm_bf16_store<bits>(stages_w, 0, xr, wq, sc, bi, xs + row * LD, ws + row * LD);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t cur = (s % 2) * STAGE, next = STAGE - cur;
    const uint32_t k1 = (s + 1) * BK;
    const bool more = s + 1 < steps;
    if (more) qmm_bf16_load<bits>(stages_w, k1, gshift, xrow, wrow, srow, brow, xr, wq, sc, bi);
    for (uint32_t kk = 0; kk < BK; kk += 8)
      mma_step(acc, xs + cur + sm * LD + kk, LD, ws + cur + sn * LD + kk, LD);
    if (more) qmm_bf16_store<bits>(stages_w, k1, xr, wq, sc, bi, xs + next + row * LD, ws + next + row * LD);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const uint32_t r = lane / 4, c = 2 * (lane % 4);  // the 2 outputs this lane writes per 8 x 8
  for (uint32_t i = 0; i < 4; ++i) {
    for (uint32_t j = 0; j < 4; ++j) {
      simdgroup_store(acc.c[i][j], cs + simd_id * 64, ulong(8), ulong2(0), false);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      const uint32_t m = m0 + sm + 8 * i + r;
      const uint32_t nc = n0 + sn + 8 * j + c;
      if (m < args.M) {
        if (nc < args.N) y[m * args.y_stride + nc] = T(cs[simd_id * 64 + r * 8 + c]);
        if (nc + 1 < args.N) y[m * args.y_stride + nc + 1] = T(cs[simd_id * 64 + r * 8 + c + 1]);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

// Instantiations: exactly the rows of csrc/gpu/kernel_ids.h (x dtype, scale dtype, bits).
LILY_INSTANTIATE("qmv_b4_xf32_sf32", qmv<float, float, 4>)
LILY_INSTANTIATE("qmv_b4_xf32_sbf16", qmv<float, bfloat, 4>)
LILY_INSTANTIATE("qmv_b4_xbf16_sf32", qmv<bfloat, float, 4>)
LILY_INSTANTIATE("qmv_b4_xbf16_sbf16", qmv<bfloat, bfloat, 4>)
LILY_INSTANTIATE("qmv_b8_xf32_sf32", qmv<float, float, 8>)
LILY_INSTANTIATE("qmv_b8_xf32_sbf16", qmv<float, bfloat, 8>)
LILY_INSTANTIATE("qmv_b8_xbf16_sf32", qmv<bfloat, float, 8>)
LILY_INSTANTIATE("qmv_b8_xbf16_sbf16", qmv<bfloat, bfloat, 8>)
LILY_INSTANTIATE("qmv1_b4_xf32_sf32", qmv1<float, float, 4>)
LILY_INSTANTIATE("qmv1_b4_xf32_sbf16", qmv1<float, bfloat, 4>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sf32", qmv1<bfloat, float, 4>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sbf16", qmv1<bfloat, bfloat, 4>)
LILY_INSTANTIATE("qmv1_b8_xf32_sf32", qmv1<float, float, 8>)
LILY_INSTANTIATE("qmv1_b8_xf32_sbf16", qmv1<float, bfloat, 8>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sf32", qmv1<bfloat, float, 8>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sbf16", qmv1<bfloat, bfloat, 8>)
LILY_INSTANTIATE("qmm_b4_xf32_sf32", qmm<float, float, 4>)
LILY_INSTANTIATE("qmm_b4_xf32_sbf16", qmm<float, bfloat, 4>)
LILY_INSTANTIATE("qmm_b4_xbf16_sf32", qmm<bfloat, float, 4>)
LILY_INSTANTIATE("qmm_b4_xbf16_sbf16", qmm<bfloat, bfloat, 4>)
LILY_INSTANTIATE("qmm_b8_xf32_sf32", qmm<float, float, 8>)
LILY_INSTANTIATE("qmm_b8_xf32_sbf16", qmm<float, bfloat, 8>)
LILY_INSTANTIATE("qmm_b8_xbf16_sf32", qmm<bfloat, float, 8>)
LILY_INSTANTIATE("qmm_b8_xbf16_sbf16", qmm<bfloat, bfloat, 8>)

LILY_INSTANTIATE("qmm_bf16_b4_xf32_sf32", qmm_bf16<float, float, 4>)
LILY_INSTANTIATE("qmm_bf16_b4_xf32_sbf16", qmm_bf16<float, bfloat, 4>)
LILY_INSTANTIATE("qmm_bf16_b4_xbf16_sf32", qmm_bf16<bfloat, float, 4>)
LILY_INSTANTIATE("qmm_bf16_b4_xbf16_sbf16", qmm_bf16<bfloat, bfloat, 4>)
LILY_INSTANTIATE("qmm_bf16_b8_xf32_sf32", qmm_bf16<float, float, 8>)
LILY_INSTANTIATE("qmm_bf16_b8_xf32_sbf16", qmm_bf16<float, bfloat, 8>)
LILY_INSTANTIATE("qmm_bf16_b8_xbf16_sf32", qmm_bf16<bfloat, float, 8>)
LILY_INSTANTIATE("qmm_bf16_b8_xbf16_sbf16", qmm_bf16<bfloat, bfloat, 8>)
// bfloat16 activations, float32 outputs (lm_head: fp32 logits from a bf16 residual stream).
LILY_INSTANTIATE("qmv_b4_xbf16_sf32_yf32", qmv<bfloat, float, 4, float>)
LILY_INSTANTIATE("qmv_b4_xbf16_sbf16_yf32", qmv<bfloat, bfloat, 4, float>)
LILY_INSTANTIATE("qmv_b8_xbf16_sf32_yf32", qmv<bfloat, float, 8, float>)
LILY_INSTANTIATE("qmv_b8_xbf16_sbf16_yf32", qmv<bfloat, bfloat, 8, float>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sf32_yf32", qmv1<bfloat, float, 4, float>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sbf16_yf32", qmv1<bfloat, bfloat, 4, float>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sf32_yf32", qmv1<bfloat, float, 8, float>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sbf16_yf32", qmv1<bfloat, bfloat, 8, float>)
LILY_INSTANTIATE("qmm_b4_xbf16_sf32_yf32", qmm<bfloat, float, 4, float>)
LILY_INSTANTIATE("qmm_b4_xbf16_sbf16_yf32", qmm<bfloat, bfloat, 4, float>)
LILY_INSTANTIATE("qmm_b8_xbf16_sf32_yf32", qmm<bfloat, float, 8, float>)
LILY_INSTANTIATE("qmm_b8_xbf16_sbf16_yf32", qmm<bfloat, bfloat, 8, float>)

// One row per threadgroup (qmv1_rows: dispatches that would have < kQmv1MinSimdgroups simdgroups).
LILY_INSTANTIATE("qmv1_b4_xf32_sf32_r1", qmv1<float, float, 4, float, 1>)
LILY_INSTANTIATE("qmv1_b4_xf32_sbf16_r1", qmv1<float, bfloat, 4, float, 1>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sf32_r1", qmv1<bfloat, float, 4, bfloat, 1>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sbf16_r1", qmv1<bfloat, bfloat, 4, bfloat, 1>)
LILY_INSTANTIATE("qmv1_b8_xf32_sf32_r1", qmv1<float, float, 8, float, 1>)
LILY_INSTANTIATE("qmv1_b8_xf32_sbf16_r1", qmv1<float, bfloat, 8, float, 1>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sf32_r1", qmv1<bfloat, float, 8, bfloat, 1>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sbf16_r1", qmv1<bfloat, bfloat, 8, bfloat, 1>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sf32_yf32_r1", qmv1<bfloat, float, 4, float, 1>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sbf16_yf32_r1", qmv1<bfloat, bfloat, 4, float, 1>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sf32_yf32_r1", qmv1<bfloat, float, 8, float, 1>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sbf16_yf32_r1", qmv1<bfloat, bfloat, 8, float, 1>)

// Sixteen rows per threadgroup (qmv1_rows: K not split, 4 and 8 bits: lm_head).
LILY_INSTANTIATE("qmv1_b4_xf32_sf32_r16", qmv1<float, float, 4, float, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b4_xf32_sbf16_r16", qmv1<float, bfloat, 4, float, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sf32_r16", qmv1<bfloat, float, 4, bfloat, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sbf16_r16", qmv1<bfloat, bfloat, 4, bfloat, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b8_xf32_sf32_r16", qmv1<float, float, 8, float, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b8_xf32_sbf16_r16", qmv1<float, bfloat, 8, float, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sf32_r16", qmv1<bfloat, float, 8, bfloat, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sbf16_r16", qmv1<bfloat, bfloat, 8, bfloat, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sf32_yf32_r16", qmv1<bfloat, float, 4, float, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b4_xbf16_sbf16_yf32_r16", qmv1<bfloat, bfloat, 4, float, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sf32_yf32_r16", qmv1<bfloat, float, 8, float, kQmv1WideRows>)
LILY_INSTANTIATE("qmv1_b8_xbf16_sbf16_yf32_r16", qmv1<bfloat, bfloat, 8, float, kQmv1WideRows>)

// 2, 3, 5 and 6 bits (bfloat16 scales; unpack_row / the generic Qmv1Codes in common/quant.h).
LILY_INSTANTIATE("qmv_b2_xf32_sbf16", qmv<float, bfloat, 2>)
LILY_INSTANTIATE("qmv1_b2_xf32_sbf16", qmv1<float, bfloat, 2>)
LILY_INSTANTIATE("qmv1_b2_xf32_sbf16_r1", qmv1<float, bfloat, 2, float, 1>)
LILY_INSTANTIATE("qmm_b2_xf32_sbf16", qmm<float, bfloat, 2>)
LILY_INSTANTIATE("qmv_b2_xbf16_sbf16", qmv<bfloat, bfloat, 2>)
LILY_INSTANTIATE("qmv1_b2_xbf16_sbf16", qmv1<bfloat, bfloat, 2>)
LILY_INSTANTIATE("qmv1_b2_xbf16_sbf16_r1", qmv1<bfloat, bfloat, 2, bfloat, 1>)
LILY_INSTANTIATE("qmm_b2_xbf16_sbf16", qmm<bfloat, bfloat, 2>)
LILY_INSTANTIATE("qmv_b2_xbf16_sbf16_yf32", qmv<bfloat, bfloat, 2, float>)
LILY_INSTANTIATE("qmv1_b2_xbf16_sbf16_yf32", qmv1<bfloat, bfloat, 2, float>)
LILY_INSTANTIATE("qmv1_b2_xbf16_sbf16_yf32_r1", qmv1<bfloat, bfloat, 2, float, 1>)
LILY_INSTANTIATE("qmm_b2_xbf16_sbf16_yf32", qmm<bfloat, bfloat, 2, float>)
LILY_INSTANTIATE("qmv_b3_xf32_sbf16", qmv<float, bfloat, 3>)
LILY_INSTANTIATE("qmv1_b3_xf32_sbf16", qmv1<float, bfloat, 3>)
LILY_INSTANTIATE("qmv1_b3_xf32_sbf16_r1", qmv1<float, bfloat, 3, float, 1>)
LILY_INSTANTIATE("qmm_b3_xf32_sbf16", qmm<float, bfloat, 3>)
LILY_INSTANTIATE("qmv_b3_xbf16_sbf16", qmv<bfloat, bfloat, 3>)
LILY_INSTANTIATE("qmv1_b3_xbf16_sbf16", qmv1<bfloat, bfloat, 3>)
LILY_INSTANTIATE("qmv1_b3_xbf16_sbf16_r1", qmv1<bfloat, bfloat, 3, bfloat, 1>)
LILY_INSTANTIATE("qmm_b3_xbf16_sbf16", qmm<bfloat, bfloat, 3>)
LILY_INSTANTIATE("qmv_b3_xbf16_sbf16_yf32", qmv<bfloat, bfloat, 3, float>)
LILY_INSTANTIATE("qmv1_b3_xbf16_sbf16_yf32", qmv1<bfloat, bfloat, 3, float>)
LILY_INSTANTIATE("qmv1_b3_xbf16_sbf16_yf32_r1", qmv1<bfloat, bfloat, 3, float, 1>)
LILY_INSTANTIATE("qmm_b3_xbf16_sbf16_yf32", qmm<bfloat, bfloat, 3, float>)
LILY_INSTANTIATE("qmv_b5_xf32_sbf16", qmv<float, bfloat, 5>)
LILY_INSTANTIATE("qmv1_b5_xf32_sbf16", qmv1<float, bfloat, 5>)
LILY_INSTANTIATE("qmv1_b5_xf32_sbf16_r1", qmv1<float, bfloat, 5, float, 1>)
LILY_INSTANTIATE("qmm_b5_xf32_sbf16", qmm<float, bfloat, 5>)
LILY_INSTANTIATE("qmv_b5_xbf16_sbf16", qmv<bfloat, bfloat, 5>)
LILY_INSTANTIATE("qmv1_b5_xbf16_sbf16", qmv1<bfloat, bfloat, 5>)
LILY_INSTANTIATE("qmv1_b5_xbf16_sbf16_r1", qmv1<bfloat, bfloat, 5, bfloat, 1>)
LILY_INSTANTIATE("qmm_b5_xbf16_sbf16", qmm<bfloat, bfloat, 5>)
LILY_INSTANTIATE("qmv_b5_xbf16_sbf16_yf32", qmv<bfloat, bfloat, 5, float>)
LILY_INSTANTIATE("qmv1_b5_xbf16_sbf16_yf32", qmv1<bfloat, bfloat, 5, float>)
LILY_INSTANTIATE("qmv1_b5_xbf16_sbf16_yf32_r1", qmv1<bfloat, bfloat, 5, float, 1>)
LILY_INSTANTIATE("qmm_b5_xbf16_sbf16_yf32", qmm<bfloat, bfloat, 5, float>)
LILY_INSTANTIATE("qmv_b6_xf32_sbf16", qmv<float, bfloat, 6>)
LILY_INSTANTIATE("qmv1_b6_xf32_sbf16", qmv1<float, bfloat, 6>)
LILY_INSTANTIATE("qmv1_b6_xf32_sbf16_r1", qmv1<float, bfloat, 6, float, 1>)
LILY_INSTANTIATE("qmm_b6_xf32_sbf16", qmm<float, bfloat, 6>)
LILY_INSTANTIATE("qmv_b6_xbf16_sbf16", qmv<bfloat, bfloat, 6>)
LILY_INSTANTIATE("qmv1_b6_xbf16_sbf16", qmv1<bfloat, bfloat, 6>)
LILY_INSTANTIATE("qmv1_b6_xbf16_sbf16_r1", qmv1<bfloat, bfloat, 6, bfloat, 1>)
LILY_INSTANTIATE("qmm_b6_xbf16_sbf16", qmm<bfloat, bfloat, 6>)
LILY_INSTANTIATE("qmv_b6_xbf16_sbf16_yf32", qmv<bfloat, bfloat, 6, float>)
LILY_INSTANTIATE("qmv1_b6_xbf16_sbf16_yf32", qmv1<bfloat, bfloat, 6, float>)
LILY_INSTANTIATE("qmv1_b6_xbf16_sbf16_yf32_r1", qmv1<bfloat, bfloat, 6, float, 1>)
LILY_INSTANTIATE("qmm_b6_xbf16_sbf16_yf32", qmm<bfloat, bfloat, 6, float>)

// qmv1_gated (out_proj of a DeltaNet layer at one token): 4 and 8 bits, float / bfloat16 scales and
// activations (y and z), 8 or 1 rows per threadgroup.
LILY_INSTANTIATE("qmv1_gated_b4_sf32_yf32", qmv1_gated<float, 4, float, kQmv1Rows>)
LILY_INSTANTIATE("qmv1_gated_b4_sbf16_yf32", qmv1_gated<bfloat, 4, float, kQmv1Rows>)
LILY_INSTANTIATE("qmv1_gated_b4_sf32_ybf16", qmv1_gated<float, 4, bfloat, kQmv1Rows>)
LILY_INSTANTIATE("qmv1_gated_b4_sbf16_ybf16", qmv1_gated<bfloat, 4, bfloat, kQmv1Rows>)
LILY_INSTANTIATE("qmv1_gated_b8_sf32_yf32", qmv1_gated<float, 8, float, kQmv1Rows>)
LILY_INSTANTIATE("qmv1_gated_b8_sbf16_yf32", qmv1_gated<bfloat, 8, float, kQmv1Rows>)
LILY_INSTANTIATE("qmv1_gated_b8_sf32_ybf16", qmv1_gated<float, 8, bfloat, kQmv1Rows>)
LILY_INSTANTIATE("qmv1_gated_b8_sbf16_ybf16", qmv1_gated<bfloat, 8, bfloat, kQmv1Rows>)
LILY_INSTANTIATE("qmv1_gated_b4_sf32_yf32_r1", qmv1_gated<float, 4, float, 1>)
LILY_INSTANTIATE("qmv1_gated_b4_sbf16_yf32_r1", qmv1_gated<bfloat, 4, float, 1>)
LILY_INSTANTIATE("qmv1_gated_b4_sf32_ybf16_r1", qmv1_gated<float, 4, bfloat, 1>)
LILY_INSTANTIATE("qmv1_gated_b4_sbf16_ybf16_r1", qmv1_gated<bfloat, 4, bfloat, 1>)
LILY_INSTANTIATE("qmv1_gated_b8_sf32_yf32_r1", qmv1_gated<float, 8, float, 1>)
LILY_INSTANTIATE("qmv1_gated_b8_sbf16_yf32_r1", qmv1_gated<bfloat, 8, float, 1>)
LILY_INSTANTIATE("qmv1_gated_b8_sf32_ybf16_r1", qmv1_gated<float, 8, bfloat, 1>)
LILY_INSTANTIATE("qmv1_gated_b8_sbf16_ybf16_r1", qmv1_gated<bfloat, 8, bfloat, 1>)

}  // namespace lily
