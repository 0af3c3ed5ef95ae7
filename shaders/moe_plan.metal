// Mixture of experts, the routing: router top-k (moe_route: the tiled route, and the matvec route
// from kMoeMvRouteMinTokens tokens on), the tiled route's plan
// (moe_plan) and the combine of the expert outputs (moe_combine). The expert kernels: the decode
// matvecs in moe_decode.metal, the prefill tiles in moe_prefill.metal and moe_prefill_bf16.metal
// (M5: m5/moe_m5.metal); shared selection code in common/moe.h. Host: csrc/gpu/ops/moe.cpp
// (routes, grids, the dispatch sequence).
// Reference: lily_py.reference.kernels.moe_route / moe (which match lily_py.reference.moe).
//
// The block, per route (T tokens, k of E experts, args MoeArgs in common/args_moe.h):
//   matvec (T <= kMoeMvMaxTokens):  router logits (qmv1 / qmv, qmm.metal) -> moe_gate_up_mv ->
//                                   moe_down_mv (3 dispatches; gate/up selects the experts from
//                                   the logits itself, moe_select, and writes the routing down
//                                   reads), or from kMoeMvRouteMinTokens tokens on router logits
//                                   -> moe_route -> moe_gate_up_mv -> moe_down_mv (4 dispatches;
//                                   moe_decode.metal)
//   tiled (T > kMoeMvMaxTokens):     router logits (qmm) -> moe_route -> moe_plan ->
//                                   moe_gate_up_{mm64, mm32, few} -> moe_down_{mm64, mm32, few}
//                                   -> moe_combine (10 dispatches, 5 barriers: the three tile
//                                   kinds of one stage write disjoint rows, no barrier between)
//                                   Tiles are sized per group by its load (moe_plan; the
//                                   tiles: moe_prefill.metal, moe_prefill_bf16.metal)
// The router weight is [E + 1, H]: rows 0..E-1 the router, row E the shared-expert gate, so one
// matmul yields every logit. The shared expert is one more "group" (index E) that every token
// uses with weight sigmoid(logit E): no separate shared-expert dispatches.
//
// Buffers of quantized matrices follow MLX's affine layout (common/quant.h): routed experts are
// stacked [E, N, K * bits / 32] with scales/biases [E, N, K / group_size] (mlx-lm's switch_mlp),
// the shared expert's matrices are [N, K * bits / 32].
//
// Precision (every kernel): codes, scales, biases and activations widened to fp32; dot products,
// softmax, SwiGLU, routing weights and sums in fp32 (no fast math); nothing dequantized reaches
// device memory; the intermediate h and the per-row expert outputs y are fp32; out is rounded to
// T once.
#include "common/lily_metal.h"
#include "common/moe.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// moe_route: softmax over the E router logits (fp32), top-k, renormalise; shared-expert gate.
//   grid:     T threadgroups of 32 threads (one simdgroup per token)
//   lane:     logits e = lane, lane + 32, ... (E <= kMoeMaxExperts)
//   top-k:    k rounds of (simd_max of the probabilities, simd_min of the indices holding it):
//             ties go to the lowest expert index, as in lily_py.reference.moe.route (stable sort)
//   outputs:  ids[t, j] (descending probability), weights[t, j] = p_j / sum_j p_j (sum in slot
//             order), weights[t, k] = sigmoid(logit E) (the shared expert's weight)
//   logits:   [T, E + 1] in the activation dtype (row E of the router matrix is the shared-expert gate)

template <typename L>
[[kernel]] void moe_route(constant MoeArgs& args [[buffer(0)]],
                          const device L* logits [[buffer(1)]],
                          device uint32_t* ids [[buffer(2)]],
                          device float* weights [[buffer(3)]],
                          LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, sel_s, [kMoeMaxTopK]);
  LILY_TG_ARRAY(float, w_s, [kMoeMaxTopK + 1]);
  const uint32_t k = args.top_k, t = group_pos.x;
  moe_select<L>(args, logits + t * (args.experts + 1), lane, sel_s, w_s);
  if (lane == 0) {  // lane 0 reads back what it wrote
    for (uint32_t j = 0; j < k; ++j) {
      ids[t * k + j] = sel_s[j];
      weights[t * (k + 1) + j] = w_s[j];
    }
    weights[t * (k + 1) + k] = w_s[k];
  }
}

// ---------------------------------------------------------------------------------------------
// moe_plan: the routing plan of the tiled routes, all on the device, deterministic.
//   grid:     one threadgroup of kMoePlanThreads threads; thread i owns experts i, i + 256, ...
//   steps:    (1) count rows per expert: the routed ids stream through threadgroup memory in
//             chunks of kMoePlanThreads * 4 and every thread counts its experts' entries;
//             (2) exclusive prefix sum over the E + 1 groups (the shared group E holds all T
//             tokens) -> offsets; each group's rows cut by its load into 64-row tiles and one
//             remainder tile (few-row up to args.few_rows rows, 32-row or 64-row:
//             common/args_moe.h) -> three block maps;
//             (3) the same stream again: each thread gives its experts' entries consecutive rows
//             in token order (a stable permutation, no atomics), writes row -> token, the
//             per-row routing weight and slot -> row; the shared group's rows are offset[E] + t.
//   outputs:  the plan buffer (layout in common/args_moe.h), row_weight [R] fp32, and tile_stats
//             uint32 [kMoeTileStats] = tiles in the 64-row, 32-row and few-row lists, the rows in
//             few-row tiles and the 32-row list's tiles of <= kMoeTile16MaxRows rows (the host
//             reads it after the step to count the FLOPs the tiles executed).
//   cost:     every thread reads all T * k ids twice from threadgroup memory (T = 4096, k = 8:
//             64K reads per thread); a one-pass atomic version would be faster on the GPU but
//             gives a run-dependent row order.
template <typename W>
[[kernel]] void moe_plan(constant MoeArgs& args [[buffer(0)]],
                         const device uint32_t* ids [[buffer(1)]],
                         const device W* weights [[buffer(2)]],
                         device uint32_t* plan [[buffer(3)]],
                         device float* row_weight [[buffer(4)]],
                         device uint32_t* tile_stats [[buffer(5)]],
                         LILY_KERNEL_TAIL) {
  constexpr uint32_t CHUNK = kMoePlanThreads * 4;
  constexpr uint32_t OWN = (kMoeMaxExperts + kMoePlanThreads - 1) / kMoePlanThreads;
  LILY_TG_ARRAY(uint32_t, chunk, [CHUNK]);
  LILY_TG_ARRAY(uint32_t, offsets, [kMoeMaxExperts + 2]);
  LILY_TG_ARRAY(uint32_t, base64, [kMoeMaxExperts + 2]);   // first entry of group g in each list
  LILY_TG_ARRAY(uint32_t, base32, [kMoeMaxExperts + 2]);
  LILY_TG_ARRAY(uint32_t, base_few, [kMoeMaxExperts + 2]);
  const uint32_t E = args.experts, k = args.top_k, T = args.tokens;
  const uint32_t few = args.few_rows;  // <= kMoeFewMaxRows (host-checked)
  const uint32_t groups = E + 1;
  const uint32_t tid = thread_pos.x, nt = group_size.x;  // nt == kMoePlanThreads
  const uint32_t row_token = moe_plan_row_token(args.max_tiles);
  const uint32_t pos = moe_plan_pos(args.max_tiles, T, k);
  const uint32_t routed = T * k;

  uint32_t count[OWN];
  for (uint32_t o = 0; o < OWN; ++o) count[o] = 0;
  for (uint32_t c0 = 0; c0 < routed; c0 += CHUNK) {  // (1) count
    for (uint32_t i = tid; i < CHUNK; i += nt) chunk[i] = c0 + i < routed ? ids[c0 + i] : 0xFFFFFFFFu;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t o = 0; o < OWN; ++o) {
      const uint32_t e = tid + o * nt;
      for (uint32_t i = 0; i < min(CHUNK, routed - c0); ++i) count[o] += chunk[i] == e ? 1u : 0u;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint32_t o = 0; o < OWN; ++o)
    if (tid + o * nt < E) offsets[tid + o * nt] = count[o];  // counts, until the scan below
  threadgroup_barrier(mem_flags::mem_threadgroup);

  if (tid == 0) {  // (2) E + 1 <= 513 additions: cheaper serial than a scan's extra barriers
    uint32_t off = 0, n64 = 0, n32 = 0, nfew = 0, few_rows = 0, n16 = 0;
    for (uint32_t g = 0; g < groups; ++g) {
      const uint32_t c = g < E ? offsets[g] : T;
      const uint32_t rem = c % 64;
      offsets[g] = off;
      base64[g] = n64;
      base32[g] = n32;
      base_few[g] = nfew;
      off += c;
      n64 += c / 64 + (rem > kMoeTile32MaxRows ? 1u : 0u);
      n32 += rem > few && rem <= kMoeTile32MaxRows ? 1u : 0u;
      n16 += rem > few && rem <= kMoeTile16MaxRows ? 1u : 0u;
      nfew += rem > 0 && rem <= few ? 1u : 0u;
      few_rows += rem <= few ? rem : 0u;
    }
    offsets[groups] = off;
    plan[0] = n64;
    plan[1] = n32;
    plan[2] = nfew;
    tile_stats[0] = n64;  // read by the host after the step (exact executed FLOPs)
    tile_stats[1] = n32;
    tile_stats[2] = nfew;
    tile_stats[3] = few_rows;
    tile_stats[4] = n16;  // of the 32-row list: tiles of <= kMoeTile16MaxRows rows (16-row on M5)
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint32_t list32 = moe_plan_list32(args.max_tiles, args.max_tiles32, args.max_few);
  const uint32_t list_few = moe_plan_list_few(args.max_tiles, args.max_few);
  for (uint32_t g = tid; g < groups; g += nt) {  // block map: tiles of group g, sized by its load
    const uint32_t lo = offsets[g], hi = offsets[g + 1];
    const uint32_t full = (hi - lo) / 64, rem = (hi - lo) % 64;
    for (uint32_t m = 0; m < full + (rem > kMoeTile32MaxRows ? 1u : 0u); ++m) {
      const uint32_t ti = moe_plan_list64() + 3 * (base64[g] + m);
      plan[ti] = g;
      plan[ti + 1] = lo + m * 64;
      plan[ti + 2] = min(lo + (m + 1) * 64, hi);
    }
    if (rem > 0 && rem <= kMoeTile32MaxRows) {
      const uint32_t ti = rem <= few ? list_few + 3 * base_few[g] : list32 + 3 * base32[g];
      plan[ti] = g;
      plan[ti + 1] = lo + full * 64;
      plan[ti + 2] = hi;
    }
  }
  for (uint32_t t = tid; t < T; t += nt) {  // the shared group: row offsets[E] + t
    const uint32_t r = offsets[E] + t, s = t * (k + 1) + k;
    plan[pos + s] = r;
    plan[row_token + r] = t;
    row_weight[r] = float(weights[s]);
  }

  uint32_t next[OWN];  // (3) stable permutation of the routed slots
  for (uint32_t o = 0; o < OWN; ++o) next[o] = tid + o * nt < E ? offsets[tid + o * nt] : 0u;
  for (uint32_t c0 = 0; c0 < routed; c0 += CHUNK) {
    for (uint32_t i = tid; i < CHUNK; i += nt) chunk[i] = c0 + i < routed ? ids[c0 + i] : 0xFFFFFFFFu;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t o = 0; o < OWN; ++o) {
      const uint32_t e = tid + o * nt;
      if (e >= E) continue;
      for (uint32_t i = 0; i < min(CHUNK, routed - c0); ++i) {
        if (chunk[i] != e) continue;
        const uint32_t flat = c0 + i, t = flat / k, s = t * (k + 1) + flat % k, r = next[o]++;
        plan[pos + s] = r;
        plan[row_token + r] = t;
        row_weight[r] = float(weights[s]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// ---------------------------------------------------------------------------------------------
// moe_combine: tiled routes. out[t, n] = sum_j y[pos(t, j), n] (routed slots in order, then the
// shared slot; already weighted) (+ residual[t, n]), rounded to T once.
//   grid:    (ceil(H / 256), T) threadgroups of 256 threads, one output element per thread
template <typename T>
[[kernel]] void moe_combine(constant MoeArgs& args [[buffer(0)]],
                            const device uint32_t* plan [[buffer(1)]],
                            const device float* y [[buffer(2)]],
                            const device T* residual [[buffer(3)]],
                            device T* out [[buffer(4)]],
                            LILY_KERNEL_TAIL) {
  const uint32_t k = args.top_k, H = args.hidden, t = group_pos.y;
  const uint32_t n = group_pos.x * kMoeCombineThreads + thread_pos.x;
  const uint32_t pos = moe_plan_pos(args.max_tiles, args.tokens, k);
  if (n < H) {
    float acc = 0.0f;
    for (uint32_t j = 0; j <= k; ++j) acc += y[plan[pos + t * (k + 1) + j] * H + n];
    if (args.has_residual) acc += float(residual[t * H + n]);
    out[t * H + n] = T(acc);
  }
}

// Instantiations: the MoE routing rows of csrc/gpu/kernel_ids.h (fp32 and bf16 router logits).
LILY_INSTANTIATE("moe_route", moe_route<float>)
LILY_INSTANTIATE("moe_plan", moe_plan<float>)
LILY_INSTANTIATE("moe_combine_xf32", moe_combine<float>)
LILY_INSTANTIATE("moe_route_xbf16", moe_route<bfloat>)
LILY_INSTANTIATE("moe_combine_xbf16", moe_combine<bfloat>)

}  // namespace lily
