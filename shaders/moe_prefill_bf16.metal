// Mixture of experts, the M1-M4 bf16 tiles of the tiled routes (bf16 activations, no tensor ops):
// moe_gate_up_bf16 / moe_down_bf16, 64- and 32-row tiles with bf16 8x8 operands and fp32
// accumulators (common/qmm_bf16.h stages the weights). Tiles come from moe_plan (moe_plan.metal);
// the fp32 tiles and the few-row tiles: moe_prefill.metal.
//
// Precision (every kernel): codes, scales, biases and activations widened to fp32; dot products,
// softmax, SwiGLU, routing weights and sums in fp32 (no fast math); nothing dequantized reaches
// device memory; the intermediate h and the per-row expert outputs y are fp32; out is rounded to
// T once. The block's routes: shaders/moe_plan.metal. Reference: lily_py.reference.kernels.moe_route
// / moe (which match lily_py.reference.moe). Host: csrc/gpu/ops/moe.cpp.
#include "common/lily_metal.h"
#include "common/mma.h"
#include "common/moe.h"
#include "common/qmm_bf16.h"
#include "common/quant.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// moe_gate_up_bf16 / moe_down_bf16: the 64- and 32-row tile kinds of the M1-M4 path when the
// activations are bf16 (no tensor ops): qmm_bf16's design (qmm.metal; staging helpers in
// common/qmm_bf16.h) on the plan, grid, tiles and FLOPs of moe_gate_up_mm / moe_down_mm.
//   operands:  bf16 in threadgroup memory: gathered x rows (bf16, copied as is) or h rows (fp32,
//              rounded to bf16), the dequantized expert weights rounded to bf16; products
//              bf16 x bf16 -> fp32 (simdgroup_bfloat8x8 into simdgroup_float8x8 accumulators)
//   K loop:    steps of kQmmBf16TileK = 16 (inside one quantization group), two stages: step s
//              issues the global (16-byte) loads of step s + 1, multiplies stage s, writes the
//              registers into the other stage, then one threadgroup barrier
//   staging:   uniform per simdgroup; a thread owns one stage row. gate_up: simdgroups 0-1 the 32
//              gate rows then the 32 up rows of the tile's features, simdgroups 2-3 the BM rows of
//              x (gathered through row -> token; BM = 32: simdgroup 3 stages nothing). down:
//              simdgroup 0 the 32 down rows, simdgroups 1.. the BM rows of h. Rows past the tile
//              (r >= r1) load row r1 - 1 and features past N load row N - 1: loads never wait on a
//              branch, only the stores are masked.
//   mma:       simdgroup s owns rows [BM/4 s, BM/4 (s + 1)) and all 32 features: gate_up two
//              MmaTile<BM/32, 4> (gate, up), down one. Epilogue per 8 x 8 block through the
//              simdgroup's own fp32 slots (gate and up side by side), simdgroup barrier, each lane
//              writes 2 outputs (SwiGLU into h / times the row's routing weight into y).
//   threadgroup memory: 2 stages x (BM + 64 | BM + 32) rows x 24 bf16 + 4 x 128 fp32: gate_up
//              14336 bytes at BM 64 (11264 at 32), down 11264 (8192).
// Precision: the operands are rounded to bf16 once each, their products are exact in fp32 and
// summed in fp32; SwiGLU, the routing weight and h / y stay fp32.
template <typename S, int bits, int BM>
[[kernel]] void moe_gate_up_bf16(constant MoeArgs& args [[buffer(0)]],
                                 const device bfloat* x [[buffer(1)]],
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
  constexpr uint32_t BN = kMoeTileN, BK = kQmmBf16TileK, LD = BK + 8, RS = BM / 4;
  constexpr uint32_t XSTAGE = BM * LD, WSTAGE = 2 * BN * LD;
  static_assert(BN == 32 && kMoeTileSimds == 4 && (BM == 32 || BM == 64) && BK == 16,
                "the staging map below assumes 32 features (gate + up = 64 rows), 128 threads, BM 32 or 64");
  LILY_TG_ARRAY(uint4, xs16, [2 * XSTAGE / 8]);
  LILY_TG_ARRAY(uint4, ws16, [2 * WSTAGE / 8]);
  LILY_TG_ARRAY(float, cs, [kMoeTileSimds * 128]);
  threadgroup bfloat* xs = reinterpret_cast<threadgroup bfloat*>(xs16);
  threadgroup bfloat* ws = reinterpret_cast<threadgroup bfloat*>(ws16);

  const uint32_t tile = group_pos.y;
  const uint32_t list = BM == 64 ? moe_plan_list64() : moe_plan_list32(args.max_tiles, args.max_tiles32, args.max_few);
  const bool active = tile < plan[BM == 64 ? 0 : 1];  // uniform over the threadgroup
  const uint32_t g = active ? plan[list + 3 * tile] : 0u;
  const uint32_t r0 = active ? plan[list + 3 * tile + 1] : 0u;
  const uint32_t r1 = active ? plan[list + 3 * tile + 2] : 1u;
  const bool shared = g == args.experts;
  const uint32_t N = shared ? args.shared_inter : args.inter;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t H = args.hidden;
  const uint32_t steps = (active && n0 < N) ? H / BK : 0u;  // uniform: no work, no barrier mismatch
  const uint32_t wpr = H * bits / 32, gpr = H / args.group_size;

  const uint32_t tp = thread_pos.x;
  const bool stages_w = simd_id < 2;                  // uniform per simdgroup
  const uint32_t srow = stages_w ? tp : tp - 2 * BN;  // this thread's row in its stage
  const bool stages = stages_w || srow < BM;          // BM = 32: simdgroup 3 stages nothing
  const bool up_row = srow >= BN;
  const uint32_t n = min(n0 + srow % BN, N - 1);
  const device uint32_t* wrow = (shared ? (up_row ? sh_up_w : sh_gate_w) : (up_row ? up_w : gate_w) + g * N * wpr) + n * wpr;
  const device S* sp = (shared ? (up_row ? sh_up_s : sh_gate_s) : (up_row ? up_s : gate_s) + g * N * gpr) + n * gpr;
  const device S* bp = (shared ? (up_row ? sh_up_b : sh_gate_b) : (up_row ? up_b : gate_b) + g * N * gpr) + n * gpr;
  const uint32_t row_token = moe_plan_row_token(args.max_tiles);
  const uint32_t tok = (active && !stages_w) ? plan[row_token + min(r0 + srow, r1 - 1)] : 0u;
  const device bfloat* xrow = x + tok * H;
  const uint32_t gshift = args.group_shift;  // MoeArgs: log2(group_size), set by the host

  QmmXRegs<bfloat> xr;
  uint4 wq = uint4(0u);
  float sc = 0.0f, bi = 0.0f;
  MmaTile<RS / 8, 4> acc_g;
  MmaTile<RS / 8, 4> acc_u;
  mma_zero(acc_g);
  mma_zero(acc_u);
  const uint32_t sm = simd_id * RS;  // this simdgroup's rows of the tile
  if (stages && steps != 0) {
    qmm_bf16_load<bits>(stages_w, 0, gshift, xrow, wrow, sp, bp, xr, wq, sc, bi);
    qmm_bf16_store<bits>(stages_w, 0, xr, wq, sc, bi, xs + srow * LD, ws + srow * LD);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t xc = (s % 2) * XSTAGE, xn = XSTAGE - xc;
    const uint32_t wc = (s % 2) * WSTAGE, wn = WSTAGE - wc;
    const uint32_t k1 = (s + 1) * BK;
    const bool more = stages && s + 1 < steps;
    if (more) qmm_bf16_load<bits>(stages_w, k1, gshift, xrow, wrow, sp, bp, xr, wq, sc, bi);
    for (uint32_t kk = 0; kk < BK; kk += 8) {
      mma_step(acc_g, xs + xc + sm * LD + kk, LD, ws + wc + kk, LD);
      mma_step(acc_u, xs + xc + sm * LD + kk, LD, ws + wc + BN * LD + kk, LD);
    }
    if (more) qmm_bf16_store<bits>(stages_w, k1, xr, wq, sc, bi, xs + xn + srow * LD, ws + wn + srow * LD);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const uint32_t r = lane / 4, c = 2 * (lane % 4);  // the 2 outputs this lane writes per 8 x 8
  threadgroup float* slot = cs + simd_id * 128;     // gate [8][8] then up [8][8]
  for (uint32_t i = 0; i < RS / 8; ++i) {
    for (uint32_t j = 0; j < 4; ++j) {
      simdgroup_store(acc_g.c[i][j], slot, ulong(8), ulong2(0), false);
      simdgroup_store(acc_u.c[i][j], slot + 64, ulong(8), ulong2(0), false);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      const uint32_t row = r0 + sm + 8 * i + r;
      const uint32_t nc = n0 + 8 * j + c;
      if (steps != 0 && row < r1) {
        if (nc < N) h[row * args.h_stride + nc] = moe_silu(slot[r * 8 + c]) * slot[64 + r * 8 + c];
        if (nc + 1 < N) h[row * args.h_stride + nc + 1] = moe_silu(slot[r * 8 + c + 1]) * slot[64 + r * 8 + c + 1];
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

template <typename S, int bits, int BM>
[[kernel]] void moe_down_bf16(constant MoeArgs& args [[buffer(0)]],
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
  constexpr uint32_t BN = kMoeTileN, BK = kQmmBf16TileK, LD = BK + 8, RS = BM / 4;
  constexpr uint32_t XSTAGE = BM * LD, WSTAGE = BN * LD;
  static_assert(BN == 32 && kMoeTileSimds == 4 && (BM == 32 || BM == 64) && BK == 16,
                "the staging map below assumes 32 features, 128 threads, BM 32 or 64");
  LILY_TG_ARRAY(uint4, xs16, [2 * XSTAGE / 8]);
  LILY_TG_ARRAY(uint4, ws16, [2 * WSTAGE / 8]);
  LILY_TG_ARRAY(float, cs, [kMoeTileSimds * 64]);
  threadgroup bfloat* xs = reinterpret_cast<threadgroup bfloat*>(xs16);
  threadgroup bfloat* ws = reinterpret_cast<threadgroup bfloat*>(ws16);

  const uint32_t tile = group_pos.y;
  const uint32_t list = BM == 64 ? moe_plan_list64() : moe_plan_list32(args.max_tiles, args.max_tiles32, args.max_few);
  const bool active = tile < plan[BM == 64 ? 0 : 1];  // uniform over the threadgroup
  const uint32_t g = active ? plan[list + 3 * tile] : 0u;
  const uint32_t r0 = active ? plan[list + 3 * tile + 1] : 0u;
  const uint32_t r1 = active ? plan[list + 3 * tile + 2] : 1u;
  const bool shared = g == args.experts;
  const uint32_t H = args.hidden;
  const uint32_t K = shared ? args.shared_inter : args.inter;
  const uint32_t n0 = group_pos.x * BN;
  const uint32_t steps = active ? K / BK : 0u;
  const uint32_t wpr = K * bits / 32, gpr = K / args.group_size;

  const uint32_t tp = thread_pos.x;
  const bool stages_w = simd_id == 0;            // uniform per simdgroup
  const uint32_t srow = stages_w ? tp : tp - BN;  // this thread's row in its stage
  const bool stages = stages_w || srow < BM;     // BM = 32: simdgroups 2-3 stage nothing
  const uint32_t n = min(n0 + srow % BN, H - 1);
  const device uint32_t* wrow = (shared ? sh_down_w : down_w + g * H * wpr) + n * wpr;
  const device S* sp = (shared ? sh_down_s : down_s + g * H * gpr) + n * gpr;
  const device S* bp = (shared ? sh_down_b : down_b + g * H * gpr) + n * gpr;
  const device float* xrow = h + min(r0 + srow, r1 - 1) * args.h_stride;
  const uint32_t gshift = args.group_shift;  // MoeArgs: log2(group_size), set by the host

  QmmXRegs<float> xr;
  uint4 wq = uint4(0u);
  float sc = 0.0f, bi = 0.0f;
  MmaTile<RS / 8, 4> acc;
  mma_zero(acc);
  const uint32_t sm = simd_id * RS;
  if (stages && steps != 0) {
    qmm_bf16_load<bits>(stages_w, 0, gshift, xrow, wrow, sp, bp, xr, wq, sc, bi);
    qmm_bf16_store<bits>(stages_w, 0, xr, wq, sc, bi, xs + srow * LD, ws + srow * LD);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t s = 0; s < steps; ++s) {
    const uint32_t xc = (s % 2) * XSTAGE, xn = XSTAGE - xc;
    const uint32_t wc = (s % 2) * WSTAGE, wn = WSTAGE - wc;
    const uint32_t k1 = (s + 1) * BK;
    const bool more = stages && s + 1 < steps;
    if (more) qmm_bf16_load<bits>(stages_w, k1, gshift, xrow, wrow, sp, bp, xr, wq, sc, bi);
    for (uint32_t kk = 0; kk < BK; kk += 8) mma_step(acc, xs + xc + sm * LD + kk, LD, ws + wc + kk, LD);
    if (more) qmm_bf16_store<bits>(stages_w, k1, xr, wq, sc, bi, xs + xn + srow * LD, ws + wn + srow * LD);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const uint32_t r = lane / 4, c = 2 * (lane % 4);
  threadgroup float* slot = cs + simd_id * 64;
  for (uint32_t i = 0; i < RS / 8; ++i) {
    for (uint32_t j = 0; j < 4; ++j) {
      simdgroup_store(acc.c[i][j], slot, ulong(8), ulong2(0), false);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      const uint32_t row = r0 + sm + 8 * i + r;
      const uint32_t nc = n0 + 8 * j + c;
      if (steps != 0 && row < r1) {
        const float wr = row_weight[row];
        if (nc < H) y[row * H + nc] = wr * slot[r * 8 + c];
        if (nc + 1 < H) y[row * H + nc + 1] = wr * slot[r * 8 + c + 1];
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

// Instantiations: the M1-M4 bf16 tile rows of csrc/gpu/kernel_ids.h (4-bit experts).
LILY_INSTANTIATE("moe_gate_up_bf16_64_b4_xbf16_sbf16", moe_gate_up_bf16<bfloat, 4, 64>)
LILY_INSTANTIATE("moe_gate_up_bf16_32_b4_xbf16_sbf16", moe_gate_up_bf16<bfloat, 4, 32>)
LILY_INSTANTIATE("moe_down_bf16_64_b4_sbf16", moe_down_bf16<bfloat, 4, 64>)
LILY_INSTANTIATE("moe_down_bf16_32_b4_sbf16", moe_down_bf16<bfloat, 4, 32>)

}  // namespace lily
