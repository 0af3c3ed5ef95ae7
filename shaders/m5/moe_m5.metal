// MoE grouped expert matmuls on Metal 4 tensor ops (M5 path): the 64- and 32-row tiles of the
// tiled route (shaders/moe_prefill.metal, moe_gate_up_mm / moe_down_mm) with matmul2d instead of 8x8
// simdgroup matrices. Same buffers, args (MoeArgs), grid, plan lists and outputs as those kernels;
// host: csrc/gpu/ops/moe.cpp (taken for the 64- and 32-row kinds when the device reports tensor
// ops; the few-row kind keeps its matvec kernels). Compiled with -std=metal4.0 into
// lily_m5.metallib (CMakeLists.txt), by the emulator, and by the strict pass against
// csrc/emu/tensor_ops_strict.h. Reference: lily_py.reference.kernels.moe.
//
//   grid:      (ceil(max(I, Is) / 32) | ceil(H / 32), list bound) threadgroups of 128 threads
//              (4 simdgroups); tiles >= the plan's count for the list do no work (uniformly: no
//              thread calls run, no thread waits at a barrier)
//   tile:      BM (64 or 32) rows of the group x 32 output features, K walked in steps of 32; a tile
//              of the 32-row list with <= kMoeTile16MaxRows (16) rows runs with BM = 16 (the plan
//              gives such tiles from 3 rows on M5: MoeArgs::few_rows = kMoeFewMaxRowsM5)
//   staging:   thread t rounds x (gathered through the plan's row -> token map; h for down) of row
//              t / (128 / BM), BM / 4 consecutive columns, to half, and dequantizes 8 consecutive
//              weights of feature t / 4 (gate and up, or down: in half arithmetic, fma(s, q, b)
//              rounded once; moe_m5_stage_w) into threadgroup memory; zeros past the tile's rows and features. Two stages: step
//              s+1 is staged while matmul2d multiplies step s, one threadgroup barrier per step.
//   multiply:  one simdgroup per op (execution_simdgroup), 16-row sub-tiles: the tile's BM / 16
//              row blocks times its matrices (gate and up, or down) are the jobs, simdgroup g
//              takes job g (and g + 4 while jobs remain); job j = row block j % (BM / 16) of
//              matrix j / (BM / 16). So a 64-row gate/up tile: each simdgroup both matrices of
//              its 16 rows; 32 rows: four jobs, one each; 16 rows: gate on simdgroup 0, up on 1;
//              down: 4, 2 or 1 simdgroups multiply (the rest only stage). Each job:
//              matmul2d_descriptor(16, 32, 32, transpose_left = false, transpose_right = true,
//              relaxed_precision = false, multiply_accumulate), its 16 x rows [row][k] as left
//              (extents (32, 16)), the weight tile [n][k] as right transposed (extents (32, 32)),
//              an fp32 cooperative accumulator per job. Why: docs/tensor-ops.md, "Execution scope and
//              tile shape" (one simdgroup per op ran best in the only public measurement; 16 x 32
//              x 32 at ~96% of the 32 x 32 x 32 rate there).
//   epilogue:  gate/up: h[row, n] = silu(gate) * up (fp32): where gate and up of a row block are
//              on two simdgroups (16- and 32-row tiles) the up job writes its accumulator to
//              threadgroup memory (the gate stages, free after the K loop's last barrier), one
//              barrier, the gate job reads it by the same (row, n); down: y[row, n] =
//              row_weight[row] * acc (fp32); each thread writes its cooperative-tensor elements,
//              masked to the tile's rows and the group's features.
// Precision: operands half (the half x half -> float row of Apple's matmul2d types): x, h and the
// dequantized weights are rounded to half once (the weights as half fma(s, q, b) of the group's
// scale and bias in half); products and accumulation fp32; SwiGLU and the routing weight in fp32 as
// in moe_prefill.metal.
#include "common/lily_metal.h"
#include "common/quant.h"
#include "common/tensor_ops.h"

namespace lily {

inline float moe_m5_silu(float v) { return v / (1.0f + exp(-v)); }

// One tile of the plan's 64- or 32-row list (uniform over the threadgroup): its group g (an expert,
// or args.experts for the shared group) and rows [r0, r1); inactive (g = r0 = r1 = 0) past the
// list's count.
struct MoeM5Tile {
  bool active;
  uint32_t g, r0, r1;
};
template <int LIST>
inline MoeM5Tile moe_m5_tile(constant MoeArgs& args, const device uint32_t* plan, uint32_t tile) {
  const uint32_t list = LIST == 64 ? moe_plan_list64() : moe_plan_list32(args.max_tiles, args.max_tiles32, args.max_few);
  MoeM5Tile r;
  r.active = tile < plan[LIST == 64 ? 0 : 1];
  r.g = r.active ? plan[list + 3 * tile] : 0u;
  r.r0 = r.active ? plan[list + 3 * tile + 1] : 0u;
  r.r1 = r.active ? plan[list + 3 * tile + 2] : 0u;
  return r;
}

// Group g's matrix of one kind (gate, up or down; `rows` output rows, wpr code words and gpr scale
// groups per row): the expert's slice of the stacked buffers, or the shared expert's own buffers.
template <typename S>
struct MoeM5Matrix {
  const device uint32_t* w;
  const device S* s;
  const device S* b;
};
template <typename S>
inline MoeM5Matrix<S> moe_m5_matrix(bool shared, uint32_t g, uint32_t rows, uint32_t wpr, uint32_t gpr,
                                    const device uint32_t* w, const device S* sc, const device S* bi,
                                    const device uint32_t* sh_w, const device S* sh_sc, const device S* sh_bi) {
  MoeM5Matrix<S> m;
  m.w = shared ? sh_w : w + g * rows * wpr;
  m.s = shared ? sh_sc : sc + g * rows * gpr;
  m.b = shared ? sh_bi : bi + g * rows * gpr;
  return m;
}

// Rounds BM / 4 values of one row of the left operand to half (zeros for an absent row).
template <typename T, uint32_t BM>
inline void moe_m5_stage_rows(const device T* src, bool valid, uint32_t t, threadgroup half* xs) {
  constexpr uint32_t BK = kMoeTileK, PER = BM / 4, CPR = BK / PER;
  const uint32_t row = t / CPR, col = (t % CPR) * PER;
  for (uint32_t c = 0; c < PER; ++c) xs[row * BK + col + c] = valid ? half(float(src[c])) : half(0.0f);
}

// Dequantizes 8 weights (columns k0 + col .. + 8) of feature n of one matrix into ws[t / 4][col..]
// (half; zeros for n >= N). 4-bit codes in half arithmetic: the 8 codes are one word, code j in bits
// 4j .. 4j + 3; masking codes j and j + 4 into the low mantissa bits of two halves of exponent 1024
// (0x6400) gives 1024 + q exactly, so q = that - 1024 (exact), and w = fma(s, q, b) in half, rounded
// once, with s and b converted to half: exact for bf16 values of magnitude 2^-17 .. 65,280 (8
// significant bits fit half's subnormals down to 2^-17); smaller ones lose bits (an absolute error
// <= 2^-25 in s, times q <= 15); 65,536 and more overflow to inf and poison the word's 8 weights
// (NaN), as the half weights of the fp32 path overflowed before: MLX 4-bit scales and biases are
// orders of magnitude below that. Per word: 3 shifts,
// 4 masks, 4 ors and 8 half2 operations instead of 8 integer-to-float conversions, 8 fp32 FMAs and
// 8 conversions to half (docs/kernels-moe.md: the M5 MoE tile kinds; FP16 issues at up to twice the
// FP32 rate on M5 / A19: docs/tensor-ops.md). 8-bit codes: fp32 s * q + b, rounded to half.
template <typename S, int bits>
inline void moe_m5_stage_w(const device uint32_t* w, const device S* sc, const device S* bi, uint32_t n,
                           uint32_t N, uint32_t k0, uint32_t wpr, uint32_t gpr, uint32_t group_size, uint32_t t,
                           threadgroup half* ws) {
  constexpr uint32_t BK = kMoeTileK;
  const uint32_t col = (t % 4) * 8;
  threadgroup half* dst = ws + (t / 4) * BK + col;
  if (n < N) {
    const uint32_t gi = n * gpr + (k0 + col) / group_size;
    if (bits == 4) {
      const uint32_t word = w[n * wpr + (k0 + col) / 8];
      const half2 s2 = half2(half(float(sc[gi])));
      const half2 b2 = half2(half(float(bi[gi])));
      const half2 m = half2(half(1024.0f));
      for (uint32_t j = 0; j < 4; ++j) {
        const half2 q = as_type<half2>(((word >> (4 * j)) & 0x000F000Fu) | 0x64006400u) - m;  // codes j, j + 4
        const half2 d = fma(s2, q, b2);
        dst[j] = d.x;
        dst[j + 4] = d.y;
      }
    } else {
      float q[8];
      unpack_codes<bits, 8>(w + n * wpr + (k0 + col) * bits / 32, q);
      const float s = float(sc[gi]), b = float(bi[gi]);
      for (uint32_t c = 0; c < 8; ++c) dst[c] = half(s * q[c] + b);
    }
  } else {
    for (uint32_t c = 0; c < 8; ++c) dst[c] = half(0.0f);
  }
}

// gate + up + SwiGLU of one tile of BM = 64, 32 or 16 rows: rows [r0, r1) of group g (r1 - r0 <=
// BM), features n0 .. n0 + 32, `steps` K steps (0: no work, no run, no barrier; uniform over the
// threadgroup). xs, gs, us: the kernel's threadgroup stages (xs holds at least 2 BM x 32 halves).
template <typename T, typename S, int bits, int BM>
inline void moe_gate_up_m5_tile(constant MoeArgs& args, const device T* x, const device uint32_t* plan,
                                const device uint32_t* wg, const device S* sg, const device S* bg,
                                const device uint32_t* wu, const device S* su, const device S* bu,
                                device float* h, uint32_t N, uint32_t r0, uint32_t r1, uint32_t n0,
                                uint32_t steps, uint32_t t, uint32_t simd, threadgroup half* xs,
                                threadgroup half* gs, threadgroup half* us) {
  constexpr uint32_t BN = kMoeTileN, BK = kMoeTileK, SR = kMoeM5SubRows;
  static_assert(BN == 32 && BK == 32 && kMoeTileSimds == 4 && SR == 16 && (BM == 16 || BM == 32 || BM == 64),
                "the staging map and jobs below assume 32-wide tiles, 128 threads, 16-row jobs, BM 16, 32 or 64");
  constexpr uint32_t RB = BM / SR;         // row blocks
  constexpr bool kBoth = 2 * RB > 4;       // 64 rows: each simdgroup runs gate and up of its block
  static_assert(kBoth || BM * BN * 4 <= 2 * BN * BK * 2, "the up exchange must fit in the gate stages");
  const uint32_t H = args.hidden;
  const uint32_t wpr = H * bits / 32, gpr = H / args.group_size;
  constexpr uint32_t PER = BM / 4, CPR = BK / PER;
  const uint32_t my_row = r0 + t / CPR;  // the row this thread stages
  const bool my_valid = my_row < r1;
  const uint32_t my_tok = my_valid ? plan[moe_plan_row_token(args.max_tiles) + my_row] : 0u;
  const device T* xr = x + my_tok * H + (t % CPR) * PER;
  const uint32_t n_st = n0 + t / 4;  // the feature whose weights this thread stages

  // This simdgroup's job (uniform over the simdgroup): row block rb of matrix mat (0 gate, 1 up).
  const bool job = simd < 2 * RB;
  const uint32_t rb = simd % RB;
  const uint32_t mat = kBoth ? 0u : simd / RB;
  constexpr auto desc = matmul2d_descriptor(int(SR), int(BN), int(BK), false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> op;
  threadgroup half* wa = mat == 0u ? gs : us;  // the first job's weight stages
  auto x0 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(xs + rb * SR * BK, dextents<int32_t, 2>(int(BK), int(SR)));
  auto x1 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(xs + BM * BK + rb * SR * BK, dextents<int32_t, 2>(int(BK), int(SR)));
  auto a0 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(wa, dextents<int32_t, 2>(int(BK), int(BN)));
  auto a1 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(wa + BN * BK, dextents<int32_t, 2>(int(BK), int(BN)));
  auto u0 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(us, dextents<int32_t, 2>(int(BK), int(BN)));
  auto u1 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(us + BN * BK, dextents<int32_t, 2>(int(BK), int(BN)));
  auto acc_a = op.template get_destination_cooperative_tensor<decltype(x0), decltype(a0), float>();
  auto acc_u = op.template get_destination_cooperative_tensor<decltype(x0), decltype(u0), float>();
  for (uint16_t i = 0; i < acc_a.get_capacity(); ++i) {
    if (!acc_a.is_valid_element(i)) continue;
    acc_a[i] = 0.0f;
    acc_u[i] = 0.0f;
  }

  if (steps != 0u) {
    moe_m5_stage_rows<T, BM>(xr, my_valid, t, xs);
    moe_m5_stage_w<S, bits>(wg, sg, bg, n_st, N, 0, wpr, gpr, args.group_size, t, gs);
    moe_m5_stage_w<S, bits>(wu, su, bu, n_st, N, 0, wpr, gpr, args.group_size, t, us);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t nx = (s + 1) & 1;
    if (s + 1 < steps) {  // stage s+1 into the buffers the previous step's runs read (barrier between)
      const uint32_t k1 = (s + 1) * BK;
      moe_m5_stage_rows<T, BM>(xr + k1, my_valid, t, xs + nx * BM * BK);
      moe_m5_stage_w<S, bits>(wg, sg, bg, n_st, N, k1, wpr, gpr, args.group_size, t, gs + nx * BN * BK);
      moe_m5_stage_w<S, bits>(wu, su, bu, n_st, N, k1, wpr, gpr, args.group_size, t, us + nx * BN * BK);
    }
    if (job) {
      if ((s & 1) == 0) {
        op.run(x0, a0, acc_a);
        if (kBoth) op.run(x0, u0, acc_u);
      } else {
        op.run(x1, a1, acc_a);
        if (kBoth) op.run(x1, u1, acc_u);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (steps != 0u) {
    threadgroup float* ex = reinterpret_cast<threadgroup float*>(gs);  // [BM][32] up values (!kBoth)
    if (!kBoth) {
      if (job && mat == 1u) {
        for (uint16_t i = 0; i < acc_a.get_capacity(); ++i) {
          if (!acc_a.is_valid_element(i)) continue;
          const auto idx = acc_a.get_multidimensional_index(i);
          ex[(rb * SR + uint32_t(idx[1])) * BN + uint32_t(idx[0])] = acc_a[i];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (job && mat == 0u) {
      for (uint16_t i = 0; i < acc_a.get_capacity(); ++i) {
        if (!acc_a.is_valid_element(i)) continue;
        const auto idx = acc_a.get_multidimensional_index(i);
        const uint32_t c = uint32_t(idx[0]);
        const uint32_t lr = rb * SR + uint32_t(idx[1]);
        const uint32_t n = n0 + c;
        const uint32_t r = r0 + lr;
        const float up = kBoth ? float(acc_u[i]) : ex[lr * BN + c];
        if (r < r1 && n < N) h[r * args.h_stride + n] = moe_m5_silu(acc_a[i]) * up;
      }
    }
  }
}

// gate + up + SwiGLU of one tile of the 64-row (LIST = 64) or 32-row (LIST = 32) list: rows
// [r0, r1) of group g, features n0 .. n0 + 32. A 32-row-list tile of <= kMoeTile16MaxRows rows
// runs as a 16-row tile (uniform over the threadgroup: the tile's rows come from the plan).
template <typename T, typename S, int bits, int LIST>
[[kernel]] void moe_gate_up_m5(constant MoeArgs& args [[buffer(0)]],
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
  constexpr uint32_t BN = kMoeTileN, BK = kMoeTileK;
  static_assert(LIST == 32 || LIST == 64, "the 64- and 32-row lists");
  LILY_TG_ARRAY(half, xs, [2 * LIST * BK]);  // two stages of the x tile [BM][32], BM <= LIST
  LILY_TG_ARRAY(half, gs, [2 * BN * BK]);    // two stages of the gate tile [32][32]
  LILY_TG_ARRAY(half, us, [2 * BN * BK]);    // two stages of the up tile [32][32]

  const MoeM5Tile tl = moe_m5_tile<LIST>(args, plan, group_pos.y);  // uniform over the threadgroup
  const uint32_t r0 = tl.r0, r1 = tl.r1;
  const bool shared = tl.g == args.experts;
  const uint32_t N = shared ? args.shared_inter : args.inter;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t H = args.hidden;
  const uint32_t steps = (tl.active && n0 < N) ? H / BK : 0u;  // uniform: no work, no run, no barrier
  const uint32_t wpr = H * bits / 32, gpr = H / args.group_size;
  const MoeM5Matrix<S> G = moe_m5_matrix<S>(shared, tl.g, N, wpr, gpr, gate_w, gate_s, gate_b, sh_gate_w, sh_gate_s, sh_gate_b);
  const MoeM5Matrix<S> U = moe_m5_matrix<S>(shared, tl.g, N, wpr, gpr, up_w, up_s, up_b, sh_up_w, sh_up_s, sh_up_b);
  const uint32_t t = thread_pos.x;
  if (LIST == 32 && r1 - r0 <= kMoeTile16MaxRows)
    moe_gate_up_m5_tile<T, S, bits, 16>(args, x, plan, G.w, G.s, G.b, U.w, U.s, U.b, h, N, r0, r1, n0, steps, t,
                                        simd_id, xs, gs, us);
  else
    moe_gate_up_m5_tile<T, S, bits, LIST>(args, x, plan, G.w, G.s, G.b, U.w, U.s, U.b, h, N, r0, r1, n0, steps, t,
                                          simd_id, xs, gs, us);
}

// down projection x routing weight of one tile of BM = 64, 32 or 16 rows (rows [r0, r1) of group
// g, features n0 .. n0 + 32, `steps` K steps; xs, ws: the kernel's threadgroup stages).
template <typename S, int bits, int BM>
inline void moe_down_m5_tile(constant MoeArgs& args, const device float* row_weight, const device float* h,
                             const device uint32_t* w, const device S* sc, const device S* bi, device float* y,
                             uint32_t K, uint32_t r0, uint32_t r1, uint32_t n0, uint32_t steps, uint32_t t,
                             uint32_t simd, threadgroup half* xs, threadgroup half* ws) {
  constexpr uint32_t BN = kMoeTileN, BK = kMoeTileK, SR = kMoeM5SubRows;
  static_assert(BN == 32 && BK == 32 && kMoeTileSimds == 4 && SR == 16 && (BM == 16 || BM == 32 || BM == 64),
                "the staging map and jobs below assume 32-wide tiles, 128 threads, 16-row jobs, BM 16, 32 or 64");
  constexpr uint32_t RB = BM / SR;  // row blocks: simdgroup g < RB multiplies block g
  const uint32_t H = args.hidden;
  const uint32_t wpr = K * bits / 32, gpr = K / args.group_size;
  constexpr uint32_t PER = BM / 4, CPR = BK / PER;
  const uint32_t my_row = r0 + t / CPR;
  const bool my_valid = my_row < r1;
  const device float* hr = h + (my_valid ? my_row : 0u) * args.h_stride + (t % CPR) * PER;
  const uint32_t n_st = n0 + t / 4;

  const bool job = simd < RB;  // uniform over the simdgroup
  const uint32_t rb = simd % RB;
  constexpr auto desc = matmul2d_descriptor(int(SR), int(BN), int(BK), false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> op;
  auto x0 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(xs + rb * SR * BK, dextents<int32_t, 2>(int(BK), int(SR)));
  auto x1 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(xs + BM * BK + rb * SR * BK, dextents<int32_t, 2>(int(BK), int(SR)));
  auto w0 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(ws, dextents<int32_t, 2>(int(BK), int(BN)));
  auto w1 = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(ws + BN * BK, dextents<int32_t, 2>(int(BK), int(BN)));
  auto acc = op.template get_destination_cooperative_tensor<decltype(x0), decltype(w0), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) acc[i] = 0.0f;

  if (steps != 0u) {
    moe_m5_stage_rows<float, BM>(hr, my_valid, t, xs);
    moe_m5_stage_w<S, bits>(w, sc, bi, n_st, H, 0, wpr, gpr, args.group_size, t, ws);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t nx = (s + 1) & 1;
    if (s + 1 < steps) {
      const uint32_t k1 = (s + 1) * BK;
      moe_m5_stage_rows<float, BM>(hr + k1, my_valid, t, xs + nx * BM * BK);
      moe_m5_stage_w<S, bits>(w, sc, bi, n_st, H, k1, wpr, gpr, args.group_size, t, ws + nx * BN * BK);
    }
    if (job) {
      if ((s & 1) == 0) op.run(x0, w0, acc);
      else op.run(x1, w1, acc);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (steps != 0u && job) {
    for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
      if (!acc.is_valid_element(i)) continue;
      const auto idx = acc.get_multidimensional_index(i);
      const uint32_t n = n0 + uint32_t(idx[0]);
      const uint32_t r = r0 + rb * SR + uint32_t(idx[1]);
      if (r < r1 && n < H) y[r * H + n] = row_weight[r] * i8_acc_get(acc, i);
    }
  }
}

// down projection x routing weight of one tile of the 64- or 32-row list (rows [r0, r1) of group
// g, features n0 .. n0 + 32); a 32-row-list tile of <= kMoeTile16MaxRows rows runs as 16 rows.
template <typename S, int bits, int LIST>
[[kernel]] void moe_down_m5(constant MoeArgs& args [[buffer(0)]],
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
  constexpr uint32_t BN = kMoeTileN, BK = kMoeTileK;
  static_assert(LIST == 32 || LIST == 64, "the 64- and 32-row lists");
  LILY_TG_ARRAY(half, xs, [2 * LIST * BK]);  // two stages of the h tile [BM][32], BM <= LIST
  LILY_TG_ARRAY(half, ws, [2 * BN * BK]);    // two stages of the down tile [32][32]

  const MoeM5Tile tl = moe_m5_tile<LIST>(args, plan, group_pos.y);  // uniform over the threadgroup
  const uint32_t r0 = tl.r0, r1 = tl.r1;
  const bool shared = tl.g == args.experts;
  const uint32_t H = args.hidden;
  const uint32_t K = shared ? args.shared_inter : args.inter;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t steps = tl.active ? K / BK : 0u;  // uniform
  const uint32_t wpr = K * bits / 32, gpr = K / args.group_size;
  const MoeM5Matrix<S> D = moe_m5_matrix<S>(shared, tl.g, H, wpr, gpr, down_w, down_s, down_b, sh_down_w, sh_down_s, sh_down_b);
  const uint32_t t = thread_pos.x;
  if (LIST == 32 && r1 - r0 <= kMoeTile16MaxRows)
    moe_down_m5_tile<S, bits, 16>(args, row_weight, h, D.w, D.s, D.b, y, K, r0, r1, n0, steps, t, simd_id, xs, ws);
  else
    moe_down_m5_tile<S, bits, LIST>(args, row_weight, h, D.w, D.s, D.b, y, K, r0, r1, n0, steps, t, simd_id, xs, ws);
}

// ---------------------------------------------------------------------------------------------
// moe_gate_up_m5i8 / moe_down_m5i8: the 64-row list's tiles with int8 activations on the int8 rows
// of matmul2d (int8_t x uint8_t -> int32_t), as qmm_m5i8 (shaders/m5/qmm_m5.metal) does for the
// projections. Taken for the 64-row kind when the device allows int8 (Encoder::tensor_int8) and
// moe_int8_allowed holds (host: csrc/gpu/ops/moe.cpp: bf16 activations, 4-bit experts with groups
// of 64 or 128, H and I = Is multiples of 64, the int8 scratches bound); the 32-row and few-row kinds
// keep their kernels. Same args, grid and plan list as moe_gate_up_m5 / moe_down_m5 with LIST = 64;
// buffer 1 of gate/up is x's int8 scratch (quantize_i8 of x [T, H] in encode_moe, beside the
// router) instead of x, buffer 3 of down h's (quantize_i8 of h [T (k + 1), h_stride] after the
// gate/up kinds) instead of h.
//   staging:   per K step of 64 (kI8StepK: one weight group), thread t copies the 32 codes of row
//              t / 2 of the tile at columns 32 (t % 2) (x: the code row of the row's token, through
//              the plan's row -> token map; down: the row's own h codes), its scales and step code
//              sum (i8_stage_row); and spreads 16 weight codes of feature t / 4, half (t % 4) / 2,
//              columns 16 (t % 2) of it, to bytes with two masks a word (i8_stage_w16: gate and up,
//              or down), with the feature's group scale and bias. Each half (32 columns) is its own
//              tile. Two stages, one barrier per step.
//   multiply:  simdgroup g owns row block g (16 rows): per step matmul2d_descriptor(16, 32, 32, false,
//              true, false, multiply) on each half into int32 cooperative tensors (gate and up, or
//              down; exact: |sum| <= 32 x 127 x 15), then i8_rescale into fp32 accumulators of the
//              same op: acc += s_w (s_xa D_a + s_xb D_b) + b_w (s_xa C_a + s_xb C_b).
//   epilogue:  as moe_gate_up_m5 (h = silu(gate) * up, fp32) and moe_down_m5 (y = row weight * acc).
// Precision: x and h are rounded to int8 per row and 32 columns (error <= s / 2 per element); the
// weight codes, integer products and sums are exact; the rescale, SwiGLU and the routing weight are
// fp32. Reference: lily_py.reference.kernels.int8_rows; model-level error: docs/int8.md.
constant constexpr uint32_t kMoeI8XHalf = 64 * kI8Group / 16;         // uint4 in a [64][32]-byte x half
constant constexpr uint32_t kMoeI8WHalf = uint32_t(kMoeTileN) * uint32_t(kI8Group) / 16;  // uint4 in a [32][32]-byte w half

// Stages 16 codes of feature n of one matrix for thread t (feature t / 4 of the tile, half
// (t % 4) / 2, 16 columns (t % 2)), the scale and bias from thread t % 4 == 0.
template <typename S>
inline void moe_m5i8_stage_w(const device uint32_t* w, const device S* sc, const device S* bi, uint32_t n,
                             uint32_t N, uint32_t k0, uint32_t wpr, uint32_t gpr, uint32_t group_size, uint32_t t,
                             threadgroup uint4* wt, threadgroup float* ws, threadgroup float* wb) {
  i8_stage_w16(w, sc, bi, n, N, k0, wpr, gpr, group_size, t / 4, (t % 4) / 2, t % 2, t % 4 == 0, wt, kMoeI8WHalf,
               ws, wb);
}

template <typename S>
[[kernel]] void moe_gate_up_m5i8(constant MoeArgs& args [[buffer(0)]],
                                 const device uint8_t* xq [[buffer(1)]],
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
  constexpr uint32_t BM = 64, BN = kMoeTileN, SR = kMoeM5SubRows, XH = kMoeI8XHalf, WH = kMoeI8WHalf;
  static_assert(BN == 32 && kI8Group == 32 && kI8StepK == 64 && SR == 16 && BM / SR == kMoeTileSimds,
                "the staging map assumes 32 features, 64-wide steps of two 32-column halves, 128 threads; one "
                "16-row block per simdgroup");
  LILY_TG_ARRAY(uint4, xt, [2 * 2 * XH]);  // x codes: [stage][half][64][32] bytes
  LILY_TG_ARRAY(uint4, gt, [2 * 2 * WH]);  // gate codes as bytes: [stage][half][32][32]
  LILY_TG_ARRAY(uint4, ut, [2 * 2 * WH]);  // up codes, the same
  LILY_TG_ARRAY(float, xsa, [2 * BM]);     // per stage: s_x of the row's first 32 columns
  LILY_TG_ARRAY(float, xsb, [2 * BM]);     // ... of its second 32
  LILY_TG_ARRAY(float, xsum, [2 * BM]);    // ... its step code sum s_xa C_a + s_xb C_b
  LILY_TG_ARRAY(float, wsb, [2 * 4 * BN]); // per stage: gate scale, gate bias, up scale, up bias [32]

  const MoeM5Tile tl = moe_m5_tile<64>(args, plan, group_pos.y);  // uniform over the threadgroup
  const uint32_t r0 = tl.r0, r1 = tl.r1;
  const bool shared = tl.g == args.experts;
  const uint32_t N = shared ? args.shared_inter : args.inter;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t H = args.hidden;
  const uint32_t steps = (tl.active && n0 < N) ? H / kI8StepK : 0u;  // uniform: no work, no run, no barrier
  const uint32_t wpr = H * 4 / 32, gpr = H / args.group_size;
  const MoeM5Matrix<S> G = moe_m5_matrix<S>(shared, tl.g, N, wpr, gpr, gate_w, gate_s, gate_b, sh_gate_w, sh_gate_s, sh_gate_b);
  const MoeM5Matrix<S> U = moe_m5_matrix<S>(shared, tl.g, N, wpr, gpr, up_w, up_s, up_b, sh_up_w, sh_up_s, sh_up_b);
  const uint32_t t = thread_pos.x;
  const uint32_t row = t / 2, part = t % 2;  // the row (and half) of x this thread stages
  const bool my_valid = r0 + row < r1;
  const uint32_t my_tok = my_valid ? plan[moe_plan_row_token(args.max_tiles) + r0 + row] : 0u;
  const uint32_t G32 = H / kI8Group;
  const device float* sx = i8_scales(xq, args.tokens, H) + my_tok * G32;
  const device float* su = i8_sums(xq, args.tokens, H) + my_tok * G32;
  const device uint8_t* xr = xq + my_tok * H;
  const uint32_t n_st = n0 + t / 4;  // the feature whose weights this thread stages
  const uint32_t rb = simd_id;       // this simdgroup's row block

  constexpr auto desc = matmul2d_descriptor(int(SR), int(BN), int(kI8Group), false, true, false,
                                            matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroup> op;
  using XT = tensor<threadgroup int8_t, dextents<int32_t, 2>, tensor_inline>;
  using WT = tensor<threadgroup uint8_t, dextents<int32_t, 2>, tensor_inline>;
  auto acc_g = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();  // fp32 bits (i8_acc_get)
  auto acc_u = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
  for (uint16_t i = 0; i < acc_g.get_capacity(); ++i) {
    if (!acc_g.is_valid_element(i)) continue;
    i8_acc_set(acc_g, i, 0.0f);
    i8_acc_set(acc_u, i, 0.0f);
  }

  for (uint32_t s = 0; s <= steps; ++s) {
    // iteration s stages step s (if any) into stage s & 1 and multiplies step s - 1 (if any): the
    // barrier at its end orders the staging before the next iteration's runs, the runs before the
    // staging that overwrites their stage two iterations later.
    if (s < steps) {
      const uint32_t b = s & 1, k0 = s * kI8StepK;
      threadgroup float* wn = wsb + b * 4 * BN;
      i8_stage_row(xr + k0, sx + k0 / kI8Group, su + k0 / kI8Group, my_valid, row, part, xt + 2 * b * XH, XH,
                   xsa + b * BM, xsb + b * BM, xsum + b * BM);
      moe_m5i8_stage_w<S>(G.w, G.s, G.b, n_st, N, k0, wpr, gpr, args.group_size, t, gt + 2 * b * WH, wn, wn + BN);
      moe_m5i8_stage_w<S>(U.w, U.s, U.b, n_st, N, k0, wpr, gpr, args.group_size, t, ut + 2 * b * WH, wn + 2 * BN,
                          wn + 3 * BN);
    }
    if (s > 0) {
      const uint32_t c = (s - 1) & 1;
      auto xa = i8_half_tile<int8_t, SR>(xt + 2 * c * XH, rb * SR);  // (run takes its operands by reference)
      auto xb = i8_half_tile<int8_t, SR>(xt + (2 * c + 1) * XH, rb * SR);
      auto ga = i8_half_tile<uint8_t, BN>(gt + 2 * c * WH, 0);
      auto gb = i8_half_tile<uint8_t, BN>(gt + (2 * c + 1) * WH, 0);
      auto ua = i8_half_tile<uint8_t, BN>(ut + 2 * c * WH, 0);
      auto ub = i8_half_tile<uint8_t, BN>(ut + (2 * c + 1) * WH, 0);
      auto dga = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
      auto dgb = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
      auto dua = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
      auto dub = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
      op.run(xa, ga, dga);
      op.run(xb, gb, dgb);
      op.run(xa, ua, dua);
      op.run(xb, ub, dub);
      const threadgroup float* wc = wsb + c * 4 * BN;
      i8_rescale(dga, dgb, acc_g, xsa + c * BM, xsb + c * BM, xsum + c * BM, wc, wc + BN, rb * SR, 0);
      i8_rescale(dua, dub, acc_u, xsa + c * BM, xsb + c * BM, xsum + c * BM, wc + 2 * BN, wc + 3 * BN, rb * SR, 0);
    }
    if (steps != 0u) threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (steps != 0u) {
    for (uint16_t i = 0; i < acc_g.get_capacity(); ++i) {
      if (!acc_g.is_valid_element(i)) continue;
      const auto idx = acc_g.get_multidimensional_index(i);
      const uint32_t n = n0 + uint32_t(idx[0]);
      const uint32_t r = r0 + rb * SR + uint32_t(idx[1]);
      if (r < r1 && n < N) h[r * args.h_stride + n] = moe_m5_silu(i8_acc_get(acc_g, i)) * i8_acc_get(acc_u, i);
    }
  }
}

template <typename S>
[[kernel]] void moe_down_m5i8(constant MoeArgs& args [[buffer(0)]],
                              const device uint32_t* plan [[buffer(1)]],
                              const device float* row_weight [[buffer(2)]],
                              const device uint8_t* hq [[buffer(3)]],
                              const device uint32_t* down_w [[buffer(4)]],
                              const device S* down_s [[buffer(5)]],
                              const device S* down_b [[buffer(6)]],
                              const device uint32_t* sh_down_w [[buffer(7)]],
                              const device S* sh_down_s [[buffer(8)]],
                              const device S* sh_down_b [[buffer(9)]],
                              device float* y [[buffer(10)]],
                              LILY_KERNEL_TAIL) {
  constexpr uint32_t BM = 64, BN = kMoeTileN, SR = kMoeM5SubRows, XH = kMoeI8XHalf, WH = kMoeI8WHalf;
  static_assert(BN == 32 && kI8Group == 32 && kI8StepK == 64 && SR == 16 && BM / SR == kMoeTileSimds,
                "the staging map assumes 32 features, 64-wide steps of two 32-column halves, 128 threads; one "
                "16-row block per simdgroup");
  LILY_TG_ARRAY(uint4, xt, [2 * 2 * XH]);  // h codes: [stage][half][64][32] bytes
  LILY_TG_ARRAY(uint4, wt, [2 * 2 * WH]);  // down codes as bytes: [stage][half][32][32]
  LILY_TG_ARRAY(float, xsa, [2 * BM]);
  LILY_TG_ARRAY(float, xsb, [2 * BM]);
  LILY_TG_ARRAY(float, xsum, [2 * BM]);
  LILY_TG_ARRAY(float, wsb, [2 * 2 * BN]); // per stage: scale, bias [32]

  const MoeM5Tile tl = moe_m5_tile<64>(args, plan, group_pos.y);  // uniform over the threadgroup
  const uint32_t r0 = tl.r0, r1 = tl.r1;
  const bool shared = tl.g == args.experts;
  const uint32_t H = args.hidden;
  const uint32_t K = shared ? args.shared_inter : args.inter;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t steps = tl.active ? K / kI8StepK : 0u;  // uniform
  const uint32_t wpr = K * 4 / 32, gpr = K / args.group_size;
  const MoeM5Matrix<S> D = moe_m5_matrix<S>(shared, tl.g, H, wpr, gpr, down_w, down_s, down_b, sh_down_w, sh_down_s, sh_down_b);
  const uint32_t t = thread_pos.x;
  const uint32_t row = t / 2, part = t % 2;
  const bool my_valid = r0 + row < r1;
  const uint32_t my_row = my_valid ? r0 + row : 0u;  // the row of h (quantized as [R, h_stride])
  const uint32_t R = args.tokens * (args.top_k + 1), KH = args.h_stride, G32 = KH / kI8Group;
  const device float* sx = i8_scales(hq, R, KH) + my_row * G32;
  const device float* su = i8_sums(hq, R, KH) + my_row * G32;
  const device uint8_t* xr = hq + my_row * KH;
  const uint32_t n_st = n0 + t / 4;
  const uint32_t rb = simd_id;

  constexpr auto desc = matmul2d_descriptor(int(SR), int(BN), int(kI8Group), false, true, false,
                                            matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroup> op;
  using XT = tensor<threadgroup int8_t, dextents<int32_t, 2>, tensor_inline>;
  using WT = tensor<threadgroup uint8_t, dextents<int32_t, 2>, tensor_inline>;
  auto acc = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();  // fp32 bits (i8_acc_get)
  for (uint16_t i = 0; i < acc.get_capacity(); ++i)
    if (acc.is_valid_element(i)) i8_acc_set(acc, i, 0.0f);

  for (uint32_t s = 0; s <= steps; ++s) {  // as in moe_gate_up_m5i8: stage step s, multiply step s - 1
    if (s < steps) {
      const uint32_t b = s & 1, k0 = s * kI8StepK;
      threadgroup float* wn = wsb + b * 2 * BN;
      i8_stage_row(xr + k0, sx + k0 / kI8Group, su + k0 / kI8Group, my_valid, row, part, xt + 2 * b * XH, XH,
                   xsa + b * BM, xsb + b * BM, xsum + b * BM);
      moe_m5i8_stage_w<S>(D.w, D.s, D.b, n_st, H, k0, wpr, gpr, args.group_size, t, wt + 2 * b * WH, wn, wn + BN);
    }
    if (s > 0) {
      const uint32_t c = (s - 1) & 1;
      auto xa = i8_half_tile<int8_t, SR>(xt + 2 * c * XH, rb * SR);
      auto xb = i8_half_tile<int8_t, SR>(xt + (2 * c + 1) * XH, rb * SR);
      auto wa = i8_half_tile<uint8_t, BN>(wt + 2 * c * WH, 0);
      auto wbt = i8_half_tile<uint8_t, BN>(wt + (2 * c + 1) * WH, 0);
      auto da = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
      auto db = op.template get_destination_cooperative_tensor<XT, WT, int32_t>();
      op.run(xa, wa, da);
      op.run(xb, wbt, db);
      const threadgroup float* wc = wsb + c * 2 * BN;
      i8_rescale(da, db, acc, xsa + c * BM, xsb + c * BM, xsum + c * BM, wc, wc + BN, rb * SR, 0);
    }
    if (steps != 0u) threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (steps != 0u) {
    for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
      if (!acc.is_valid_element(i)) continue;
      const auto idx = acc.get_multidimensional_index(i);
      const uint32_t n = n0 + uint32_t(idx[0]);
      const uint32_t r = r0 + rb * SR + uint32_t(idx[1]);
      if (r < r1 && n < H) y[r * H + n] = row_weight[r] * i8_acc_get(acc, i);
    }
  }
}

// Instantiations: exactly the moe *_m5 rows of csrc/gpu/kernel_ids.h (activations fp32, scales
// bf16, 4-bit experts, as the simdgroup kernels of moe_prefill_bf16.metal).
LILY_INSTANTIATE("moe_gate_up_m5_64_b4_xf32_sbf16", moe_gate_up_m5<float, bfloat, 4, 64>)
LILY_INSTANTIATE("moe_gate_up_m5_32_b4_xf32_sbf16", moe_gate_up_m5<float, bfloat, 4, 32>)
LILY_INSTANTIATE("moe_gate_up_m5_64_b4_xbf16_sbf16", moe_gate_up_m5<bfloat, bfloat, 4, 64>)
LILY_INSTANTIATE("moe_gate_up_m5_32_b4_xbf16_sbf16", moe_gate_up_m5<bfloat, bfloat, 4, 32>)
LILY_INSTANTIATE("moe_down_m5_64_b4_sbf16", moe_down_m5<bfloat, 4, 64>)
LILY_INSTANTIATE("moe_down_m5_32_b4_sbf16", moe_down_m5<bfloat, 4, 32>)
LILY_INSTANTIATE("moe_gate_up_m5i8_64_b4_xbf16_sbf16", moe_gate_up_m5i8<bfloat>)
LILY_INSTANTIATE("moe_down_m5i8_64_b4_sbf16", moe_down_m5i8<bfloat>)

}  // namespace lily
