// Mixture of experts, the matvec route (decode, T <= kMoeMvMaxTokens). Below kMoeMvRouteMinTokens
// tokens moe_gate_up_mv selects its token's experts from the router logits itself, once per
// threadgroup (common/moe.h), and writes the token's routing (ids, weights) once: router logits
// (qmv1 / qmv, qmm.metal) -> moe_gate_up_mv -> moe_down_mv. From there on a moe_route level
// (moe_plan.metal) writes the routing first and gate/up reads it (MoeArgs::mv_routed). moe_down_mv
// reads the routing either way.
// Buffers of quantized matrices follow MLX's affine layout (common/quant.h): routed experts
// stacked [E, N, K * bits / 32] with scales/biases [E, N, K / group_size], the shared expert's
// [N, K * bits / 32]; the shared expert is one more slot (index E) with weight sigmoid(logit E).
//
// Precision (every kernel): codes, scales, biases and activations widened to fp32; dot products,
// softmax, SwiGLU, routing weights and sums in fp32 (no fast math); nothing dequantized reaches
// device memory; the intermediate h and the per-row expert outputs y are fp32; out is rounded to
// T once. The block's routes: shaders/moe_plan.metal. Reference: lily_py.reference.kernels.moe_route
// / moe (which match lily_py.reference.moe). Host: csrc/gpu/ops/moe.cpp.
#include "common/lily_metal.h"
#include "common/moe.h"
#include "common/quant.h"
#include "common/reduce.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// Matvec route helpers. Activations enter the 16-byte-load dot product of Qmv1Codes
// (common/quant.h) pre-scaled, so 4-bit codes are masked in place (MLX qmv_fast's trick).
// V values of x at p (16-byte aligned: p is a row start plus a multiple of 32 elements).
// 16-byte loads (load8): bf16 8 per load, float 4 per load.
template <uint32_t V, typename T>
inline void moe_load_act(const device T* p, thread float* o) {
  for (uint32_t i = 0; i < V; i += 8) load8(p + i, o + i);
}

// The K loop of moe_gate_up_mv at `bits`: split s of a slot walks the blocks s, s + splits, ... of
// B = 32 x V codes; ag[r] / au[r] collect the lane's part of gate and up row row[r], r < rows.
template <typename T, typename S, int bits>
inline void moe_gate_up_mv_blocks(const device T* xt, const device uint32_t* wg, const device S* sg,
                                  const device S* bg, const device uint32_t* wu, const device S* su,
                                  const device S* bu, const thread uint32_t* row, uint32_t H, uint32_t group_shift,
                                  uint32_t K_end, uint32_t splits, uint32_t split, uint32_t rows,
                                  uint32_t lane, thread float* ag, thread float* au) {
  constexpr uint32_t R = kMoeGateUpRows;
  constexpr uint32_t V = Qmv1Codes<bits>::V;
  constexpr uint32_t B = 32 * V;
  const uint32_t wpr = H * bits / 32, gpr = H >> group_shift;
  for (uint32_t k0 = split * B; k0 < K_end; k0 += splits * B) {
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
      const uint32_t gi = kk >> group_shift;
      const uint32_t wo = kk * bits / 32;
      LILY_UNROLL
      for (uint32_t r = 0; r < R; ++r) {  // unrolled: ag, au and row stay registers
        if (r >= rows) break;  // uniform: the threadgroup's rows (args.mv_rows)
        const float dg = Qmv1Codes<bits>::dot_at(wg + row[r] * wpr + wo, xs);
        const float du = Qmv1Codes<bits>::dot_at(wu + row[r] * wpr + wo, xs);
        ag[r] = fma(float(sg[row[r] * gpr + gi]), dg, fma(float(bg[row[r] * gpr + gi]), xsum, ag[r]));
        au[r] = fma(float(su[row[r] * gpr + gi]), du, fma(float(bu[row[r] * gpr + gi]), xsum, au[r]));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// moe_gate_up_mv: decode / matvec route. h[slot, n] = silu(gate_g[n] . x_t) * (up_g[n] . x_t)
// for the k selected experts and the shared expert of every token; reads only those experts.
// Design: MLX gather_qmv_fast / llama.cpp kernel_mul_mv_id (a dense single-row matvec per
// (token, slot) whose matrix is looked up from the routing), on qmv1's qmv_fast layout; one
// threadgroup covers the same rows = args.mv_rows (<= kMoeGateUpRows) rows of every slot of its
// token, so the token's experts are selected once per threadgroup, not once per simdgroup.
//   grid:       (ceil(max(I, Is) / rows), T) threadgroups of 32 * (k + 1) * splits threads:
//               simdgroup j * splits + s is slot j (j == k: the shared expert), K split s;
//               splits = max(1, min(kMoeGateUpMaxSplits, ceil(H / B), kMoeGateUpMaxSimds / (k + 1)))
//               (host: moe_mv_shape); rows = 2 at one token, else 4 (host: moe_gate_up_rows)
//   routing:    simdgroup 0 selects the token's k experts (moe_select: softmax, k rounds of
//               simd_max / simd_min) into threadgroup memory; meanwhile the shared slot's
//               simdgroups, which need no selection, run their loads; one barrier, then the
//               routed slots read their expert. Threadgroup 0 of each token also writes ids [T, k]
//               and weights [T, k + 1] (moe_down_mv's routing). args.mv_routed (uniform): moe_route
//               wrote them already; routed simdgroup j reads ids[t k + j], nothing selects, no
//               barrier before the loads
//   block:      B = 32 lanes x V codes (Qmv1Codes: V = 128 / bits, one 16-byte load per lane and
//               row, at 4 and 8 bits; V = 32, `bits` words, at 2, 3, 5, 6);
//               simdgroup s of a slot walks the K = H blocks s, s + splits, ...; per block the
//               lane's V values of x are loaded once (16-byte loads), summed once for the bias
//               term, pre-scaled (Qmv1Codes::scale_of) and reused by the rows' gate and up rows:
//               2 x rows independent 16-byte weight loads per lane in flight
//   rows:       rows past a slot's N (I routed, Is shared) load row N - 1 (no branch before a
//               load); only the store is guarded. A slot's simdgroups wholly past its N load nothing.
//   reduction:  acc[2 R] = ag[R], au[R] (compile-time indexed: registers), reduce-scattered over
//               the lanes (simd_sum_scatter: 2 R totals in 9 shuffles where 2 R simd_sums take 40), then
//               over a slot's splits through threadgroup memory in order; thread j * R + r applies
//               SwiGLU, writes h
//   widths:     the routed experts at `bits`, the shared slot at `sbits` (a mixed checkpoint; its
//               simdgroups run their own blocks, B = 32 x Qmv1Codes<sbits>::V), before the
//               barrier; the routed slots' after it
template <typename T, typename S, int bits, int sbits>
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
                               device uint32_t* ids [[buffer(16)]],
                               device float* weights [[buffer(17)]],
                               LILY_KERNEL_TAIL) {
  constexpr uint32_t R = kMoeGateUpRows;
  LILY_TG_ARRAY(float, red, [kMoeGateUpMaxSimds * 2 * kMoeGateUpRows]);
  LILY_TG_ARRAY(uint32_t, sel_s, [kMoeMaxTopK]);
  LILY_TG_ARRAY(float, w_s, [kMoeMaxTopK + 1]);
  const uint32_t k = args.top_k, H = args.hidden, t = group_pos.y;
  const uint32_t splits = group_size.x / (32 * (k + 1));
  const uint32_t j = simd_id / splits, split = simd_id - j * splits;
  const bool shared = j == k;  // uniform over the simdgroup
  const uint32_t rows = args.mv_rows;  // <= R
  const uint32_t n0 = group_pos.x * rows;
  const device T* xt = x + t * H;
  float acc[2 * R];  // ag = acc[0, R): gate rows; au = acc[R, 2 R): up rows
  LILY_UNROLL
  for (uint32_t i = 0; i < 2 * R; ++i) acc[i] = 0.0f;
  thread float* ag = acc;
  thread float* au = acc + R;
  const bool routed = args.mv_routed != 0;  // uniform: a moe_route level wrote ids already
  if (!routed && simd_id == 0) {  // slot 0's first simdgroup selects for the threadgroup
    moe_select<T>(args, logits + t * (args.experts + 1), lane, sel_s, w_s);
    if (group_pos.x == 0 && lane == 0) {  // lane 0 reads back only what it wrote itself
      for (uint32_t i = 0; i < k; ++i) {
        ids[t * k + i] = sel_s[i];
        weights[t * (k + 1) + i] = w_s[i];
      }
      weights[t * (k + 1) + k] = w_s[k];
    }
  }
  const uint32_t N = shared ? args.shared_inter : args.inter;  // the slot's rows
  const uint32_t K_end = n0 < N ? H : 0u;                        // uniform over the simdgroup
  uint32_t row[R];
  LILY_UNROLL
  for (uint32_t r = 0; r < R; ++r) row[r] = min(n0 + r, N - 1);
  if (shared)  // needs no selection: its loads go out while simdgroup 0 selects
    moe_gate_up_mv_blocks<T, S, sbits>(xt, sh_gate_w, sh_gate_s, sh_gate_b, sh_up_w, sh_up_s, sh_up_b, row, H,
                                       args.group_shift, K_end, splits, split, rows, lane, ag, au);
  if (!routed) threadgroup_barrier(mem_flags::mem_threadgroup);  // sel_s (uniform branch)
  if (!shared) {
    const uint32_t g = routed ? ids[t * k + j] : sel_s[j], wpr = H * bits / 32, gpr = H >> args.group_shift;
    moe_gate_up_mv_blocks<T, S, bits>(xt, gate_w + g * N * wpr, gate_s + g * N * gpr, gate_b + g * N * gpr,
                                      up_w + g * N * wpr, up_s + g * N * gpr, up_b + g * N * gpr, row, H,
                                      args.group_shift, K_end, splits, split, rows, lane, ag, au);
  }
  const float tot = simd_sum_scatter<2 * R>(acc, lane);  // value r: gate row r; R + r: up row r
  if (lane < 2 * R) red[simd_id * 2 * R + simd_scatter_index<2 * R>(lane)] = tot;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint32_t oj = thread_pos.x / R, r = thread_pos.x - oj * R;  // thread oj * R + r: slot oj, row r
  if (oj <= k && r < rows && n0 + r < (oj == k ? args.shared_inter : args.inter)) {
    float G = 0.0f, U = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) {
      G += red[(oj * splits + s) * 2 * R + r];
      U += red[(oj * splits + s) * 2 * R + R + r];
    }
    h[(t * (k + 1) + oj) * args.h_stride + n0 + r] = moe_silu(G) * U;
  }
}

// One chunk of moe_down_mv at `bits`: the V values of h at hp times the slot's routing weight wj,
// summed once, pre-scaled; acc[r] += the dot product with row row[r] of the slot's expert w.
template <typename S, int bits>
inline void moe_down_mv_chunk(const device float* hp, float wj, const device uint32_t* w, const device S* sc,
                              const device S* bi, uint32_t wpr, uint32_t gpr, uint32_t kk, uint32_t group_shift,
                              const thread uint32_t* row, thread float* acc) {
  constexpr uint32_t V = Qmv1Codes<bits>::V;
  float hv[V];
  moe_load_act<V>(hp, hv);
  float xs[V];
  float hsum = 0.0f;
  for (uint32_t i = 0; i < V; ++i) {
    const float v = wj * hv[i];
    hsum += v;
    xs[i] = v * Qmv1Codes<bits>::scale_of(i);
  }
  const uint32_t gi = kk >> group_shift;
  const uint32_t wo = kk * bits / 32;
  for (uint32_t r = 0; r < kMoeMvRows; ++r) {
    const float d = Qmv1Codes<bits>::dot_at(w + row[r] * wpr + wo, xs);
    acc[r] = fma(float(sc[row[r] * gpr + gi]), d, fma(float(bi[row[r] * gpr + gi]), hsum, acc[r]));
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
//   routing:    read from ids [T, k] and weights [T, k + 1], which moe_gate_up_mv (or, from
//               kMoeMvRouteMinTokens tokens on, moe_route) wrote before the barrier that h needs:
//               no selection and no barrier before the loads
//   chunk:      V codes (one 16-byte load per row) of one slot: chunk c < k I / V is slot
//               c / (I / V) (one division per chunk, outside the row loop), the rest the shared
//               slot. Lane l of simdgroup s takes chunks s * 32 + l, + 32 splits, ...: every lane
//               of the threadgroup busy while chunks last (real config: 144 chunks, 160 lanes)
//   per chunk:  the V values of h (float4 loads) times w_j, summed once, pre-scaled; kMoeMvRows
//               rows of that slot's expert: 4 independent 16-byte weight loads in flight
//   rows:       rows past H load row H - 1; only the store is guarded
//   reduction:  acc[R] in registers, reduce-scattered over the lanes (simd_sum_scatter), over the
//               splits through threadgroup memory in order, + residual, rounded to T once
//   widths:     the routed chunks at `bits`, then the shared slot's at `sbits` (V_s codes each:
//               C = k I / V + Is / V_s); a lane walks its routed chunks, then its shared ones
template <typename T, typename S, int bits, int sbits>
[[kernel]] void moe_down_mv(constant MoeArgs& args [[buffer(0)]],
                            const device uint32_t* ids [[buffer(1)]],
                            const device float* weights [[buffer(2)]],
                            const device float* h [[buffer(3)]],
                            const device uint32_t* down_w [[buffer(4)]],
                            const device S* down_s [[buffer(5)]],
                            const device S* down_b [[buffer(6)]],
                            const device uint32_t* sh_down_w [[buffer(7)]],
                            const device S* sh_down_s [[buffer(8)]],
                            const device S* sh_down_b [[buffer(9)]],
                            const device T* residual [[buffer(10)]],
                            device T* out [[buffer(11)]],
                            LILY_KERNEL_TAIL) {
  constexpr uint32_t R = kMoeMvRows;
  constexpr uint32_t V = Qmv1Codes<bits>::V, Vs = Qmv1Codes<sbits>::V;
  LILY_TG_ARRAY(float, red, [kMoeDownMaxSplits * kMoeMvRows]);
  const uint32_t k = args.top_k, H = args.hidden, t = group_pos.y;
  const uint32_t splits = group_size.x / 32;
  const uint32_t cI = args.inter / V, routed = k * cI, C = routed + args.shared_inter / Vs;
  const uint32_t wpI = args.inter * bits / 32, gpI = args.inter >> args.group_shift;
  const uint32_t wpS = args.shared_inter * sbits / 32, gpS = args.shared_inter >> args.group_shift;
  const uint32_t n0 = group_pos.x * R;

  uint32_t row[R];
  for (uint32_t r = 0; r < R; ++r) row[r] = min(n0 + r, H - 1);
  float acc[R];
  for (uint32_t r = 0; r < R; ++r) acc[r] = 0.0f;
  uint32_t c = simd_id * 32 + lane;
  for (; c < routed; c += splits * 32) {
    const uint32_t j = c / cI;
    const uint32_t kk = (c - j * cI) * V;  // first code in the slot's K
    const uint32_t g = ids[t * k + j];
    moe_down_mv_chunk<S, bits>(h + (t * (k + 1) + j) * args.h_stride + kk, weights[t * (k + 1) + j],
                               down_w + g * H * wpI, down_s + g * H * gpI, down_b + g * H * gpI, wpI, gpI, kk,
                               args.group_shift, row, acc);
  }
  for (; c < C; c += splits * 32) {  // the shared slot
    const uint32_t kk = (c - routed) * Vs;
    moe_down_mv_chunk<S, sbits>(h + (t * (k + 1) + k) * args.h_stride + kk, weights[t * (k + 1) + k], sh_down_w,
                                sh_down_s, sh_down_b, wpS, gpS, kk, args.group_shift, row, acc);
  }
  const float tot = simd_sum_scatter<R>(acc, lane);
  if (lane < R) red[simd_id * R + simd_scatter_index<R>(lane)] = tot;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint32_t n = n0 + thread_pos.x;
  if (thread_pos.x < R && n < H) {
    float total = 0.0f;
    for (uint32_t s = 0; s < splits; ++s) total += red[s * R + thread_pos.x];
    const float v = args.has_residual ? total + float(residual[t * H + n]) : total;
    out[t * H + n] = T(v);
  }
}

// Instantiations: the matvec rows of csrc/gpu/kernel_ids.h (2 to 8-bit experts, fp32 and bf16
// activations, bf16 scales).
LILY_INSTANTIATE("moe_gate_up_mv_b4_xf32_sbf16", moe_gate_up_mv<float, bfloat, 4, 4>)
LILY_INSTANTIATE("moe_down_mv_b4_xf32_sbf16", moe_down_mv<float, bfloat, 4, 4>)
LILY_INSTANTIATE("moe_gate_up_mv_b4_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 4, 4>)
LILY_INSTANTIATE("moe_down_mv_b4_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 4, 4>)
LILY_INSTANTIATE("moe_gate_up_mv_b2_xf32_sbf16", moe_gate_up_mv<float, bfloat, 2, 2>)
LILY_INSTANTIATE("moe_down_mv_b2_xf32_sbf16", moe_down_mv<float, bfloat, 2, 2>)
LILY_INSTANTIATE("moe_gate_up_mv_b2_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 2, 2>)
LILY_INSTANTIATE("moe_down_mv_b2_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 2, 2>)
LILY_INSTANTIATE("moe_gate_up_mv_b3_xf32_sbf16", moe_gate_up_mv<float, bfloat, 3, 3>)
LILY_INSTANTIATE("moe_down_mv_b3_xf32_sbf16", moe_down_mv<float, bfloat, 3, 3>)
LILY_INSTANTIATE("moe_gate_up_mv_b3_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 3, 3>)
LILY_INSTANTIATE("moe_down_mv_b3_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 3, 3>)
LILY_INSTANTIATE("moe_gate_up_mv_b5_xf32_sbf16", moe_gate_up_mv<float, bfloat, 5, 5>)
LILY_INSTANTIATE("moe_down_mv_b5_xf32_sbf16", moe_down_mv<float, bfloat, 5, 5>)
LILY_INSTANTIATE("moe_gate_up_mv_b5_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 5, 5>)
LILY_INSTANTIATE("moe_down_mv_b5_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 5, 5>)
LILY_INSTANTIATE("moe_gate_up_mv_b6_xf32_sbf16", moe_gate_up_mv<float, bfloat, 6, 6>)
LILY_INSTANTIATE("moe_down_mv_b6_xf32_sbf16", moe_down_mv<float, bfloat, 6, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b6_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 6, 6>)
LILY_INSTANTIATE("moe_down_mv_b6_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 6, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b8_xf32_sbf16", moe_gate_up_mv<float, bfloat, 8, 8>)
LILY_INSTANTIATE("moe_down_mv_b8_xf32_sbf16", moe_down_mv<float, bfloat, 8, 8>)
LILY_INSTANTIATE("moe_gate_up_mv_b8_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 8, 8>)
LILY_INSTANTIATE("moe_down_mv_b8_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 8, 8>)


// Mixed checkpoints: routed experts at b, the shared expert at s (csrc/gpu/kernel_ids.h,
// kMoeSharedWidths: the pairs built).
LILY_INSTANTIATE("moe_gate_up_mv_b2s6_xf32_sbf16", moe_gate_up_mv<float, bfloat, 2, 6>)
LILY_INSTANTIATE("moe_down_mv_b2s6_xf32_sbf16", moe_down_mv<float, bfloat, 2, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b2s6_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 2, 6>)
LILY_INSTANTIATE("moe_down_mv_b2s6_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 2, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b3s6_xf32_sbf16", moe_gate_up_mv<float, bfloat, 3, 6>)
LILY_INSTANTIATE("moe_down_mv_b3s6_xf32_sbf16", moe_down_mv<float, bfloat, 3, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b3s6_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 3, 6>)
LILY_INSTANTIATE("moe_down_mv_b3s6_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 3, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b4s6_xf32_sbf16", moe_gate_up_mv<float, bfloat, 4, 6>)
LILY_INSTANTIATE("moe_down_mv_b4s6_xf32_sbf16", moe_down_mv<float, bfloat, 4, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b4s6_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 4, 6>)
LILY_INSTANTIATE("moe_down_mv_b4s6_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 4, 6>)
LILY_INSTANTIATE("moe_gate_up_mv_b4s8_xf32_sbf16", moe_gate_up_mv<float, bfloat, 4, 8>)
LILY_INSTANTIATE("moe_down_mv_b4s8_xf32_sbf16", moe_down_mv<float, bfloat, 4, 8>)
LILY_INSTANTIATE("moe_gate_up_mv_b4s8_xbf16_sbf16", moe_gate_up_mv<bfloat, bfloat, 4, 8>)
LILY_INSTANTIATE("moe_down_mv_b4s8_xbf16_sbf16", moe_down_mv<bfloat, bfloat, 4, 8>)

}  // namespace lily
