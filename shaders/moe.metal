// Mixture of experts: router top-k, routing plan, expert matmuls with fused dequantization,
// combine. Host: csrc/gpu/ops/moe.cpp (routes, grids, the dispatch sequence).
// Reference: lily_py.reference.kernels.moe_route / moe (which match lily_py.reference.moe).
//
// The block, per route (T tokens, k of E experts, args MoeArgs in common/args_moe.h):
//   matvec (T <= kMoeMvMaxTokens):  router logits (qmv1 / qmv, qmm.metal) -> moe_gate_up_mv ->
//                                   moe_down_mv (3 dispatches; both select the experts from the
//                                   logits themselves, moe_select, no moe_route level)
//   tiled (T > kMoeMvMaxTokens):     router logits (qmm) -> moe_route -> moe_plan ->
//                                   moe_gate_up_{mm64, mm32, few} -> moe_down_{mm64, mm32, few}
//                                   -> moe_combine (10 dispatches, 5 barriers: the three tile
//                                   kinds of one stage write disjoint rows, no barrier between)
//                                   Tiles are sized per group by its load (moe_plan).
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
#include "common/mma.h"
#include "common/qmm_bf16.h"
#include "common/quant.h"

namespace lily {

inline float moe_silu(float v) { return v / (1.0f + exp(-v)); }

// ---------------------------------------------------------------------------------------------
// moe_route: softmax over the E router logits (fp32), top-k, renormalise; shared-expert gate.
//   grid:     T threadgroups of 32 threads (one simdgroup per token)
//   lane:     logits e = lane, lane + 32, ... (E <= kMoeMaxExperts)
//   top-k:    k rounds of (simd_max of the probabilities, simd_min of the indices holding it):
//             ties go to the lowest expert index, as in lily_py.reference.moe.route (stable sort)
//   outputs:  ids[t, j] (descending probability), weights[t, j] = p_j / sum_j p_j (sum in slot
//             order), weights[t, k] = sigmoid(logit E) (the shared expert's weight)
//   logits:   [T, E + 1] in the activation dtype (row E of the router matrix is the shared-expert gate)
// The selection of one token, by one whole simdgroup (every lane calls; k uniform): softmax of
// row[0 .. E) in fp32 (moe_probs), then rounds of (simd_max, simd_min of the index) (moe_take).
// Every caller runs this same code on the same logits, so every kernel that selects for itself
// gets the same experts (ties go to the lowest expert index, as in lily_py.reference.moe.route).
constant constexpr float kMoeTaken = -1.0f;  // below every probability

// p[i]: the probability of expert lane + 32 i (kMoeTaken past E). A NaN probability (a NaN or
// infinite logit: the activations went bad upstream) ranks below every number and above a taken
// expert, so k distinct experts below E are always chosen (an id past E would read outside the
// expert stacks). Returns whether the row had one (uniform over the simdgroup).
template <typename L>
inline bool moe_probs(constant MoeArgs& args, const device L* row, uint32_t lane, thread float* p) {
  constexpr uint32_t PER_LANE = kMoeMaxExperts / 32;
  const uint32_t E = args.experts;
  float m = -3.0e38f;
  for (uint32_t i = 0; i < PER_LANE; ++i) {
    const uint32_t e = lane + 32 * i;
    p[i] = e < E ? float(row[e]) : kMoeTaken;
    if (e < E) m = max(m, p[i]);
  }
  m = simd_max(m);
  float sum = 0.0f;
  for (uint32_t i = 0; i < PER_LANE; ++i) {
    if (lane + 32 * i < E) {
      p[i] = exp(p[i] - m);
      sum += p[i];
    }
  }
  sum = simd_sum(sum);
  for (uint32_t i = 0; i < PER_LANE; ++i)
    if (lane + 32 * i < E) p[i] = p[i] / sum;
  bool bad = false;
  for (uint32_t i = 0; i < PER_LANE; ++i) {
    if (lane + 32 * i < E && !(p[i] >= 0.0f)) {
      p[i] = 0.5f * kMoeTaken;
      bad = true;
    }
  }
  return simd_any(bad);
}

// One round: the largest untaken probability (the lowest index among equals), marked taken.
// Returns its expert and sets top to its probability, the same on every lane.
inline uint32_t moe_take(thread float* p, uint32_t lane, uint32_t E, thread float& top) {
  constexpr uint32_t PER_LANE = kMoeMaxExperts / 32;
  float best = kMoeTaken;
  uint32_t best_e = 0xFFFFFFFFu;
  for (uint32_t i = 0; i < PER_LANE; ++i) {  // ascending e: the lane keeps its lowest index
    const uint32_t e = lane + 32 * i;
    if (e < E && p[i] > best) {
      best = p[i];
      best_e = e;
    }
  }
  top = simd_max(best);
  const uint32_t top_e = simd_min(best == top ? best_e : 0xFFFFFFFFu);
  for (uint32_t i = 0; i < PER_LANE; ++i)
    if (lane + 32 * i == top_e) p[i] = kMoeTaken;
  return top_e;
}

// moe_select: k rounds, renormalised in slot order. Lane 0 writes sel[j] (expert of slot j),
// w[j] = p_j / sum p (j < k) and w[k] = sigmoid(row[E]) to threadgroup memory (a row with a NaN
// or infinite logit: experts still distinct and below E, w[j < k] NaN). moe_route and
// moe_down_mv select with it.
template <typename L>
inline void moe_select(constant MoeArgs& args, const device L* row, uint32_t lane, threadgroup uint32_t* sel,
                       threadgroup float* w) {
  const uint32_t E = args.experts, k = args.top_k;
  float p[kMoeMaxExperts / 32];
  const bool bad = moe_probs<L>(args, row, lane, p);
  float wsum = 0.0f;
  for (uint32_t j = 0; j < k; ++j) {  // k is uniform: every lane makes the same collectives
    float top;
    const uint32_t top_e = moe_take(p, lane, E, top);
    if (lane == 0) {
      sel[j] = top_e;
      w[j] = top;
    }
    wsum += top;
  }
  if (lane == 0) {
    for (uint32_t j = 0; j < k; ++j) w[j] = bad ? as_type<float>(0x7FC00000u) : w[j] / wsum;
    w[k] = 1.0f / (1.0f + exp(-float(row[E])));
  }
}

// moe_select_slot: the expert of slot j < k alone (j + 1 rounds), in registers on every lane: no
// threadgroup memory, no barrier (moe_gate_up_mv, which needs no weights).
template <typename L>
inline uint32_t moe_select_slot(constant MoeArgs& args, const device L* row, uint32_t lane, uint32_t j) {
  float p[kMoeMaxExperts / 32];
  moe_probs<L>(args, row, lane, p);
  uint32_t id = 0;
  for (uint32_t r = 0; r <= j; ++r) {  // j is uniform over the simdgroup
    float top;
    id = moe_take(p, lane, args.experts, top);
  }
  return id;
}

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
// Matvec route helpers. Activations enter the 16-byte-load dot product of Qmv1Codes
// (common/quant.h) pre-scaled, so 4-bit codes are masked in place (MLX qmv_fast's trick).
// V values of x at p (16-byte aligned: p is a row start plus a multiple of 32 elements).
// 16-byte loads (load8): bf16 8 per load, float 4 per load.
template <uint32_t V, typename T>
inline void moe_load_act(const device T* p, thread float* o) {
  for (uint32_t i = 0; i < V; i += 8) load8(p + i, o + i);
}

// ---------------------------------------------------------------------------------------------
// moe_gate_up_mv: decode / matvec route. h[slot, n] = silu(gate_g[n] . x_t) * (up_g[n] . x_t)
// for the k selected experts and the shared expert of every token; reads only those experts.
// Design: MLX gather_qmv_fast / llama.cpp kernel_mul_mv_id (a dense single-row matvec per
// (token, slot) whose matrix is looked up from the routing), on qmv1's qmv_fast layout.
//   grid:       (ceil(max(I, Is) / kMoeMvRows), T * (k + 1)) threadgroups of 32 * splits threads,
//               splits = min(kMoeGateUpMaxSplits, ceil(H / B)) (host: moe_mv_splits)
//   routing:    every simdgroup selects its slot's expert from the router logits [T, E + 1]
//               (moe_select_slot: j + 1 rounds of the code moe_route runs, in registers; the
//               shared slot selects nothing): no barrier before the loads
//   block:      B = 32 lanes x V codes (Qmv1Codes: V = 128 / bits, one 16-byte load per lane and
//               row, at 4 and 8 bits; V = 32, `bits` words, at 2, 3, 5, 6);
//               simdgroup s walks the K = H blocks s, s + splits, ...; per block the lane's V
//               values of x are loaded once (16-byte loads), summed once for the bias term,
//               pre-scaled (Qmv1Codes::scale_of) and reused by the kMoeMvRows gate rows and
//               kMoeMvRows up rows: 8 independent 16-byte weight loads per lane in flight
//   rows:       rows past N load row N - 1 (no branch before a load); only the store is
//               guarded. Threadgroups wholly past N (the narrower of I and Is) load nothing.
//   reduction:  ag[R], au[R] (compile-time indexed: registers), simd_sum, then over the splits
//               through threadgroup memory in order; thread r < R applies SwiGLU, writes h
template <typename T, typename S, int bits>
[[kernel]] void moe_gate_up_mv(constant MoeArgs& args [[buffer(0)]],
                               const device T* x [[buffer(1)]],
                               const device T* logits [[buffer(2)]],
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
  constexpr uint32_t R = kMoeMvRows;
  constexpr uint32_t V = Qmv1Codes<bits>::V;
  constexpr uint32_t B = 32 * V;
  LILY_TG_ARRAY(float, red, [kMoeGateUpMaxSplits * 2 * kMoeMvRows]);
  const uint32_t k = args.top_k, H = args.hidden;
  const uint32_t splits = group_size.x / 32;
  const uint32_t slot = group_pos.y, t = slot / (k + 1), j = slot - t * (k + 1);
  const bool shared = j == k;  // uniform over the threadgroup
  // Every simdgroup selects its slot's expert itself: no simdgroup waits at a barrier for another.
  const uint32_t g = shared ? 0u : moe_select_slot<T>(args, logits + t * (args.experts + 1), lane, j);
  const uint32_t N = shared ? args.shared_inter : args.inter;
  const uint32_t wpr = H * bits / 32, gpr = H >> args.group_shift;
  const device uint32_t* wg = shared ? sh_gate_w : gate_w + g * N * wpr;
  const device S* sg = shared ? sh_gate_s : gate_s + g * N * gpr;
  const device S* bg = shared ? sh_gate_b : gate_b + g * N * gpr;
  const device uint32_t* wu = shared ? sh_up_w : up_w + g * N * wpr;
  const device S* su = shared ? sh_up_s : up_s + g * N * gpr;
  const device S* bu = shared ? sh_up_b : up_b + g * N * gpr;
  const device T* xt = x + t * H;
  const uint32_t n0 = group_pos.x * R;
  const uint32_t K_end = n0 < N ? H : 0u;  // uniform over the threadgroup

  uint32_t row[R];
  for (uint32_t r = 0; r < R; ++r) row[r] = min(n0 + r, N - 1);
  float ag[R], au[R];
  for (uint32_t r = 0; r < R; ++r) {
    ag[r] = 0.0f;
    au[r] = 0.0f;
  }
  for (uint32_t k0 = simd_id * B; k0 < K_end; k0 += splits * B) {
    const uint32_t kk = k0 + lane * V;
    if (kk < H) {  // only a last, partial block diverges (H is a multiple of 32)
      float xv[V];
      moe_load_act<V>(xt + kk, xv);
      float xs[V];
      float xsum = 0.0f;
      for (uint32_t i = 0; i < V; ++i) {
        xsum += xv[i];
        xs[i] = xv[i] * Qmv1Codes<bits>::scale_of(i);
      }
      const uint32_t gi = kk >> args.group_shift;
      const uint32_t wo = kk * bits / 32;
      for (uint32_t r = 0; r < R; ++r) {
        const float dg = Qmv1Codes<bits>::dot_at(wg + row[r] * wpr + wo, xs);
        const float du = Qmv1Codes<bits>::dot_at(wu + row[r] * wpr + wo, xs);
        ag[r] = fma(float(sg[row[r] * gpr + gi]), dg, fma(float(bg[row[r] * gpr + gi]), xsum, ag[r]));
        au[r] = fma(float(su[row[r] * gpr + gi]), du, fma(float(bu[row[r] * gpr + gi]), xsum, au[r]));
      }
    }
  }
  for (uint32_t r = 0; r < R; ++r) {
    ag[r] = simd_sum(ag[r]);
    au[r] = simd_sum(au[r]);
  }
  if (lane == 0) {
    for (uint32_t r = 0; r < R; ++r) {
      red[simd_id * 2 * R + r] = ag[r];
      red[simd_id * 2 * R + R + r] = au[r];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_pos.x < R && n0 + thread_pos.x < N) {
    float G = 0.0f, U = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) {
      G += red[s * 2 * R + thread_pos.x];
      U += red[s * 2 * R + R + thread_pos.x];
    }
    h[slot * args.h_stride + n0 + thread_pos.x] = moe_silu(G) * U;
  }
}

// ---------------------------------------------------------------------------------------------
// moe_down_mv: decode / matvec route. out[t, n] = (residual[t, n]) + sum_j w_j (down_g[n] . h_slot)
// over the k routed slots then the shared slot (w_k = sigmoid gate): down projection, routing
// weights, shared expert and residual add in one dispatch.
// Design: as moe_gate_up_mv; the k + 1 products of a row are one dot product over the
// concatenated K' = k I + Is (every slot's h pre-multiplied by its routing weight), split over
// the threadgroup's simdgroups.
//   grid:       (ceil(H / kMoeMvRows), T) threadgroups of 32 * splits threads,
//               splits = min(kMoeDownMaxSplits, ceil(C / 32)), C = K' / V chunks (host)
//   routing:    simdgroup 0 selects all k (moe_select into threadgroup memory; barrier; the same experts and
//               weights); threadgroup (0, t) also writes ids [T, k] and weights [T, k + 1]
//   chunk:      V codes (one 16-byte load per row) of one slot: chunk c < k I / V is slot
//               c / (I / V) (one division per chunk, outside the row loop), the rest the shared
//               slot. Lane l of simdgroup s takes chunks s * 32 + l, + 32 splits, ...: every lane
//               of the threadgroup busy while chunks last (real config: 144 chunks, 160 lanes)
//   per chunk:  the V values of h (float4 loads) times w_j, summed once, pre-scaled; kMoeMvRows
//               rows of that slot's expert: 4 independent 16-byte weight loads in flight
//   rows:       rows past H load row H - 1; only the store is guarded
//   reduction:  acc[R] in registers, simd_sum, over the splits through threadgroup memory in
//               order, + residual, rounded to T once
template <typename T, typename S, int bits>
[[kernel]] void moe_down_mv(constant MoeArgs& args [[buffer(0)]],
                            const device T* logits [[buffer(1)]],
                            device uint32_t* ids [[buffer(2)]],
                            device float* weights [[buffer(3)]],
                            const device float* h [[buffer(4)]],
                            const device uint32_t* down_w [[buffer(5)]],
                            const device S* down_s [[buffer(6)]],
                            const device S* down_b [[buffer(7)]],
                            const device uint32_t* sh_down_w [[buffer(8)]],
                            const device S* sh_down_s [[buffer(9)]],
                            const device S* sh_down_b [[buffer(10)]],
                            const device T* residual [[buffer(11)]],
                            device T* out [[buffer(12)]],
                            LILY_KERNEL_TAIL) {
  constexpr uint32_t R = kMoeMvRows;
  constexpr uint32_t V = Qmv1Codes<bits>::V;
  LILY_TG_ARRAY(uint32_t, sel_s, [kMoeMaxTopK]);
  LILY_TG_ARRAY(float, w_s, [kMoeMaxTopK + 1]);
  LILY_TG_ARRAY(float, red, [kMoeDownMaxSplits * kMoeMvRows]);
  const uint32_t k = args.top_k, H = args.hidden, t = group_pos.y;
  const uint32_t splits = group_size.x / 32;
  if (simd_id == 0) moe_select<T>(args, logits + t * (args.experts + 1), lane, sel_s, w_s);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (group_pos.x == 0 && thread_pos.x == 0) {  // the routing, for callers and tests
    for (uint32_t j = 0; j < k; ++j) {
      ids[t * k + j] = sel_s[j];
      weights[t * (k + 1) + j] = w_s[j];
    }
    weights[t * (k + 1) + k] = w_s[k];
  }
  const uint32_t cI = args.inter / V, routed = k * cI, C = routed + args.shared_inter / V;
  const uint32_t wpI = args.inter * bits / 32, gpI = args.inter >> args.group_shift;
  const uint32_t wpS = args.shared_inter * bits / 32, gpS = args.shared_inter >> args.group_shift;
  const uint32_t n0 = group_pos.x * R;

  uint32_t row[R];
  for (uint32_t r = 0; r < R; ++r) row[r] = min(n0 + r, H - 1);
  float acc[R];
  for (uint32_t r = 0; r < R; ++r) acc[r] = 0.0f;
  for (uint32_t c = simd_id * 32 + lane; c < C; c += splits * 32) {
    const bool shared = c >= routed;
    const uint32_t j = shared ? k : c / cI;
    const uint32_t kk = (shared ? c - routed : c - j * cI) * V;  // first code in the slot's K
    const uint32_t g = shared ? 0u : sel_s[j];
    const float wj = w_s[j];
    const uint32_t wpr = shared ? wpS : wpI, gpr = shared ? gpS : gpI;
    const device uint32_t* w = shared ? sh_down_w : down_w + g * H * wpI;
    const device S* sc = shared ? sh_down_s : down_s + g * H * gpI;
    const device S* bi = shared ? sh_down_b : down_b + g * H * gpI;
    float hv[V];
    moe_load_act<V>(h + (t * (k + 1) + j) * args.h_stride + kk, hv);
    float xs[V];
    float hsum = 0.0f;
    for (uint32_t i = 0; i < V; ++i) {
      const float v = wj * hv[i];
      hsum += v;
      xs[i] = v * Qmv1Codes<bits>::scale_of(i);
    }
    const uint32_t gi = kk >> args.group_shift;
    const uint32_t wo = kk * bits / 32;
    for (uint32_t r = 0; r < R; ++r) {
      const float d = Qmv1Codes<bits>::dot_at(w + row[r] * wpr + wo, xs);
      acc[r] = fma(float(sc[row[r] * gpr + gi]), d, fma(float(bi[row[r] * gpr + gi]), hsum, acc[r]));
    }
  }
  for (uint32_t r = 0; r < R; ++r) acc[r] = simd_sum(acc[r]);
  if (lane == 0)
    for (uint32_t r = 0; r < R; ++r) red[simd_id * R + r] = acc[r];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint32_t n = n0 + thread_pos.x;
  if (thread_pos.x < R && n < H) {
    float total = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) total += red[s * R + thread_pos.x];
    const float v = args.has_residual ? total + float(residual[t * H + n]) : total;
    out[t * H + n] = T(v);
  }
}

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
template <typename T, typename S, int bits, int BM>
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
  const uint32_t wpr = H * bits / 32, gpr = H / args.group_size;
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
      unpack_row<bits, 8>(wg + n * wpr, k0 + col, q);
      const float s1 = float(sg[gi]), b1 = float(bg[gi]);
      for (uint32_t c = 0; c < 8; ++c) wgt[(tp / 4) * LD + col + c] = s1 * q[c] + b1;
      unpack_row<bits, 8>(wu + n * wpr, k0 + col, q);
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
template <typename S, int bits, int BM>
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
  const uint32_t wpr = K * bits / 32, gpr = K / args.group_size;
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
      unpack_row<bits, 8>(w + n * wpr, k0 + col, q);
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
  const uint32_t gshift = args.group_size == 32 ? 5u : args.group_size == 64 ? 6u : 7u;

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
  const uint32_t gshift = args.group_size == 32 ? 5u : args.group_size == 64 ? 6u : 7u;

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

// ---------------------------------------------------------------------------------------------
// moe_gate_up_few: tiled route, the few-row tiles (a group's remainder of <= args.few_rows <= 16
// rows, e.g. an expert that received few tokens): matvec-style, like qmv (qmm.metal), every
// weight row read once per block of <= kMoeFewBlockRows = 8 of the tile's rows (a 16-row tile
// reads its 8 features' weights twice, the second time from cache) and nothing computed for
// absent rows.
//   grid:       (ceil(max(I, Is) / 8), max_few) threadgroups of 64 threads (2 simdgroups);
//               tiles >= the plan's few-row count do no work (uniformly)
//   simdgroup:  4 consecutive features n0..n0+3 of gate and up for the tile's rows (<= 8)
//   lane:       strips of strip_codes<bits>() codes per step; per (feature, row): s * dot(x, q) + b * sum(x);
//               one simd_sum(float4) per row and matrix; lane 0 writes h = silu(gate) * up
//   buffers:    as moe_gate_up_mm (x rows gathered through the plan's row -> token map)
template <typename T, typename S, int bits>
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
  constexpr uint32_t V = strip_codes<bits>(), step = 32 * V, FEW = kMoeFewBlockRows;
  const uint32_t tile = group_pos.y;
  const uint32_t list = moe_plan_list_few(args.max_tiles, args.max_few);
  const bool active = tile < plan[2];  // uniform over the threadgroup
  const uint32_t g = active ? plan[list + 3 * tile] : 0u;
  const uint32_t r0 = active ? plan[list + 3 * tile + 1] : 0u;
  const uint32_t rows_all = active ? plan[list + 3 * tile + 2] - r0 : 0u;  // <= args.few_rows
  const bool shared = g == args.experts;
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
    for (uint32_t kk = lane * V; kk < K_end; kk += step) {
      const uint32_t grp = kk / args.group_size;  // the strip lies inside one group
      for (uint32_t r = 0; r < kMoeMvRowsPerSimd; ++r) {
        const uint32_t n = n0 + r;
        if (n >= N) break;
        float qg[V];
        float qu[V];
        unpack_row<bits, V>(wg + n * wpr, kk, qg);
        unpack_row<bits, V>(wu + n * wpr, kk, qu);
        const float s1 = float(sg[n * gpr + grp]), b1 = float(bg[n * gpr + grp]);
        const float s2 = float(su[n * gpr + grp]), b2 = float(bu[n * gpr + grp]);
        for (uint32_t m = 0; m < FEW; ++m) {
          if (m >= rows) break;
          const device T* xm = x + tok[m] * H + kk;
          float dg = 0.0f, du = 0.0f, xsum = 0.0f;
          for (uint32_t i = 0; i < V; ++i) {
            const float xv = float(xm[i]);
            dg += xv * qg[i];
            du += xv * qu[i];
            xsum += xv;
          }
          ag[m][r] += s1 * dg + b1 * xsum;
          au[m][r] += s2 * du + b2 * xsum;
        }
      }
    }
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

// ---------------------------------------------------------------------------------------------
// moe_down_few: tiled route, the few-row tiles of the down projection. y[row, n] =
// row_weight[row] * (h[row] . down_g[n]) for the tile's rows (<= 16, in blocks of <= 8),
// matvec-style as above.
//   grid:       (ceil(H / 8), max_few) threadgroups of 64 threads (2 simdgroups x 4 features)
//   buffers:    as moe_down_mm
template <typename S, int bits>
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
  constexpr uint32_t V = strip_codes<bits>(), step = 32 * V, FEW = kMoeFewBlockRows;
  const uint32_t tile = group_pos.y;
  const uint32_t list = moe_plan_list_few(args.max_tiles, args.max_few);
  const bool active = tile < plan[2];
  const uint32_t g = active ? plan[list + 3 * tile] : 0u;
  const uint32_t r0 = active ? plan[list + 3 * tile + 1] : 0u;
  const uint32_t rows_all = active ? plan[list + 3 * tile + 2] - r0 : 0u;  // <= args.few_rows
  const bool shared = g == args.experts;
  const uint32_t H = args.hidden;
  const uint32_t K = shared ? args.shared_inter : args.inter;
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
    for (uint32_t kk = lane * V; kk < K_end; kk += step) {
      const uint32_t grp = kk / args.group_size;
      for (uint32_t r = 0; r < kMoeMvRowsPerSimd; ++r) {
        const uint32_t n = n0 + r;
        if (n >= H) break;
        float q[V];
        unpack_row<bits, V>(w + n * wpr, kk, q);
        const float s = float(sc[n * gpr + grp]), b = float(bi[n * gpr + grp]);
        for (uint32_t m = 0; m < FEW; ++m) {
          if (m >= rows) break;
          const device float* hm = h + (rb + m) * args.h_stride + kk;
          float dot = 0.0f, hsum = 0.0f;
          for (uint32_t i = 0; i < V; ++i) {
            dot += hm[i] * q[i];
            hsum += hm[i];
          }
          acc[m][r] += s * dot + b * hsum;
        }
      }
    }
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

// Instantiations: exactly the MoE rows of csrc/gpu/kernel_ids.h (activations fp32, scales bf16,
// 4-bit experts; the router goes through qmm.metal's 8-bit kernels).
LILY_INSTANTIATE("moe_route", moe_route<float>)
LILY_INSTANTIATE("moe_plan", moe_plan<float>)
LILY_INSTANTIATE("moe_gate_up_mv_b4_xf32_sbf16", moe_gate_up_mv<float, bfloat, 4>)
LILY_INSTANTIATE("moe_down_mv_b4_xf32_sbf16", moe_down_mv<float, bfloat, 4>)
LILY_INSTANTIATE("moe_gate_up_mm32_b4_xf32_sbf16", moe_gate_up_mm<float, bfloat, 4, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b4_xf32_sbf16", moe_gate_up_mm<float, bfloat, 4, 64>)
LILY_INSTANTIATE("moe_down_mm32_b4_sbf16", moe_down_mm<bfloat, 4, 32>)
LILY_INSTANTIATE("moe_down_mm64_b4_sbf16", moe_down_mm<bfloat, 4, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b4_xf32_sbf16", moe_gate_up_few<float, bfloat, 4>)
LILY_INSTANTIATE("moe_down_few_b4_sbf16", moe_down_few<bfloat, 4>)
LILY_INSTANTIATE("moe_combine_xf32", moe_combine<float>)
// bfloat16 activations (x, router logits, residual and out; h and y stay fp32 scratch).
LILY_INSTANTIATE("moe_route_xbf16", moe_route<bfloat>)
LILY_INSTANTIATE("moe_gate_up_mv_b4_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 4>)
LILY_INSTANTIATE("moe_down_mv_b4_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 4>)
LILY_INSTANTIATE("moe_gate_up_mm32_b4_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 4, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b4_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 4, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b4_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 4>)
LILY_INSTANTIATE("moe_combine_xbf16", moe_combine<bfloat>)
// M1-M4 bf16 tiles (bf16 activations, no tensor ops): the 64- and 32-row kinds.
LILY_INSTANTIATE("moe_gate_up_bf16_64_b4_xbf16_sbf16", moe_gate_up_bf16<bfloat, 4, 64>)
LILY_INSTANTIATE("moe_gate_up_bf16_32_b4_xbf16_sbf16", moe_gate_up_bf16<bfloat, 4, 32>)
LILY_INSTANTIATE("moe_down_bf16_64_b4_sbf16", moe_down_bf16<bfloat, 4, 64>)
LILY_INSTANTIATE("moe_down_bf16_32_b4_sbf16", moe_down_bf16<bfloat, 4, 32>)

// 2, 3, 5, 6 and 8-bit experts (bfloat16 scales): the matvec, fp32-tile and few-row kernels.
LILY_INSTANTIATE("moe_gate_up_mv_b2_xf32_sbf16", moe_gate_up_mv<float, bfloat, 2>)
LILY_INSTANTIATE("moe_down_mv_b2_xf32_sbf16", moe_down_mv<float, bfloat, 2>)
LILY_INSTANTIATE("moe_gate_up_mm32_b2_xf32_sbf16", moe_gate_up_mm<float, bfloat, 2, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b2_xf32_sbf16", moe_gate_up_mm<float, bfloat, 2, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b2_xf32_sbf16", moe_gate_up_few<float, bfloat, 2>)
LILY_INSTANTIATE("moe_gate_up_mv_b2_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 2>)
LILY_INSTANTIATE("moe_down_mv_b2_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 2>)
LILY_INSTANTIATE("moe_gate_up_mm32_b2_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 2, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b2_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 2, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b2_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 2>)
LILY_INSTANTIATE("moe_down_mm32_b2_sbf16", moe_down_mm<bfloat, 2, 32>)
LILY_INSTANTIATE("moe_down_mm64_b2_sbf16", moe_down_mm<bfloat, 2, 64>)
LILY_INSTANTIATE("moe_down_few_b2_sbf16", moe_down_few<bfloat, 2>)
LILY_INSTANTIATE("moe_gate_up_mv_b3_xf32_sbf16", moe_gate_up_mv<float, bfloat, 3>)
LILY_INSTANTIATE("moe_down_mv_b3_xf32_sbf16", moe_down_mv<float, bfloat, 3>)
LILY_INSTANTIATE("moe_gate_up_mm32_b3_xf32_sbf16", moe_gate_up_mm<float, bfloat, 3, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b3_xf32_sbf16", moe_gate_up_mm<float, bfloat, 3, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b3_xf32_sbf16", moe_gate_up_few<float, bfloat, 3>)
LILY_INSTANTIATE("moe_gate_up_mv_b3_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 3>)
LILY_INSTANTIATE("moe_down_mv_b3_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 3>)
LILY_INSTANTIATE("moe_gate_up_mm32_b3_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 3, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b3_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 3, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b3_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 3>)
LILY_INSTANTIATE("moe_down_mm32_b3_sbf16", moe_down_mm<bfloat, 3, 32>)
LILY_INSTANTIATE("moe_down_mm64_b3_sbf16", moe_down_mm<bfloat, 3, 64>)
LILY_INSTANTIATE("moe_down_few_b3_sbf16", moe_down_few<bfloat, 3>)
LILY_INSTANTIATE("moe_gate_up_mv_b5_xf32_sbf16", moe_gate_up_mv<float, bfloat, 5>)
LILY_INSTANTIATE("moe_down_mv_b5_xf32_sbf16", moe_down_mv<float, bfloat, 5>)
LILY_INSTANTIATE("moe_gate_up_mm32_b5_xf32_sbf16", moe_gate_up_mm<float, bfloat, 5, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b5_xf32_sbf16", moe_gate_up_mm<float, bfloat, 5, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b5_xf32_sbf16", moe_gate_up_few<float, bfloat, 5>)
LILY_INSTANTIATE("moe_gate_up_mv_b5_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 5>)
LILY_INSTANTIATE("moe_down_mv_b5_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 5>)
LILY_INSTANTIATE("moe_gate_up_mm32_b5_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 5, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b5_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 5, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b5_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 5>)
LILY_INSTANTIATE("moe_down_mm32_b5_sbf16", moe_down_mm<bfloat, 5, 32>)
LILY_INSTANTIATE("moe_down_mm64_b5_sbf16", moe_down_mm<bfloat, 5, 64>)
LILY_INSTANTIATE("moe_down_few_b5_sbf16", moe_down_few<bfloat, 5>)
LILY_INSTANTIATE("moe_gate_up_mv_b6_xf32_sbf16", moe_gate_up_mv<float, bfloat, 6>)
LILY_INSTANTIATE("moe_down_mv_b6_xf32_sbf16", moe_down_mv<float, bfloat, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b6_xf32_sbf16", moe_gate_up_mm<float, bfloat, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b6_xf32_sbf16", moe_gate_up_few<float, bfloat, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b6_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 6>)
LILY_INSTANTIATE("moe_down_mv_b6_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 6>)
LILY_INSTANTIATE("moe_gate_up_mm32_b6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 6, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b6_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 6, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b6_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 6>)
LILY_INSTANTIATE("moe_down_mm32_b6_sbf16", moe_down_mm<bfloat, 6, 32>)
LILY_INSTANTIATE("moe_down_mm64_b6_sbf16", moe_down_mm<bfloat, 6, 64>)
LILY_INSTANTIATE("moe_down_few_b6_sbf16", moe_down_few<bfloat, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b8_xf32_sbf16", moe_gate_up_mv<float, bfloat, 8>)
LILY_INSTANTIATE("moe_down_mv_b8_xf32_sbf16", moe_down_mv<float, bfloat, 8>)
LILY_INSTANTIATE("moe_gate_up_mm32_b8_xf32_sbf16", moe_gate_up_mm<float, bfloat, 8, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b8_xf32_sbf16", moe_gate_up_mm<float, bfloat, 8, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b8_xf32_sbf16", moe_gate_up_few<float, bfloat, 8>)
LILY_INSTANTIATE("moe_gate_up_mv_b8_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 8>)
LILY_INSTANTIATE("moe_down_mv_b8_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 8>)
LILY_INSTANTIATE("moe_gate_up_mm32_b8_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 8, 32>)
LILY_INSTANTIATE("moe_gate_up_mm64_b8_xbf16_sbf16", moe_gate_up_mm<bfloat, bfloat, 8, 64>)
LILY_INSTANTIATE("moe_gate_up_few_b8_xbf16_sbf16", moe_gate_up_few<bfloat, bfloat, 8>)
LILY_INSTANTIATE("moe_down_mm32_b8_sbf16", moe_down_mm<bfloat, 8, 32>)
LILY_INSTANTIATE("moe_down_mm64_b8_sbf16", moe_down_mm<bfloat, 8, 64>)
LILY_INSTANTIATE("moe_down_few_b8_sbf16", moe_down_few<bfloat, 8>)

}  // namespace lily
