// What the MoE shader files share (shaders/moe_plan.metal, moe_decode.metal, moe_prefill.metal,
// moe_prefill_bf16.metal): SiLU, and the expert selection every kernel that routes runs on the
// router logits (softmax in fp32, top-k by rounds of simd_max / simd_min, renormalised), so every
// kernel that selects for itself gets the same experts. Args: common/args_moe.h.
#pragma once

#include "common/lily_metal.h"

namespace lily {

inline float moe_silu(float v) { return v / (1.0f + exp(-v)); }

// The selection of one token, by one whole simdgroup (every lane calls; k uniform): softmax of
// row[0 .. E) in fp32 (moe_probs), then rounds of (simd_max, simd_min of the index) (moe_take).
// Every caller runs this same code on the same logits, so every kernel that selects for itself
// gets the same experts (ties go to the lowest expert index, as in lily_py.reference.moe.route).
// P: probabilities per lane, kMoeSelectLane (8) when E <= 256 (this model), else
// kMoeMaxExperts / 32: the same experts and weights either way, half the scan a round for E <= 256.
constant constexpr float kMoeTaken = -1.0f;  // below every probability

// p[i]: the probability of expert lane + 32 i (kMoeTaken past E). A NaN probability (a NaN or
// infinite logit: the activations went bad upstream) ranks below every number and above a taken
// expert, so k distinct experts below E are always chosen (an id past E would read outside the
// expert stacks). Returns whether the row had one (uniform over the simdgroup).
template <uint32_t P, typename L>
inline bool moe_probs(constant MoeArgs& args, const device L* row, uint32_t lane, thread float* p) {
  const uint32_t E = args.experts;
  float m = -3.0e38f;
  for (uint32_t i = 0; i < P; ++i) {
    const uint32_t e = lane + 32 * i;
    p[i] = e < E ? float(row[e]) : kMoeTaken;
    if (e < E) m = max(m, p[i]);
  }
  m = simd_max(m);
  float sum = 0.0f;
  for (uint32_t i = 0; i < P; ++i) {
    if (lane + 32 * i < E) {
      p[i] = exp(p[i] - m);
      sum += p[i];
    }
  }
  sum = simd_sum(sum);
  for (uint32_t i = 0; i < P; ++i)
    if (lane + 32 * i < E) p[i] = p[i] / sum;
  bool bad = false;
  for (uint32_t i = 0; i < P; ++i) {
    if (lane + 32 * i < E && !(p[i] >= 0.0f)) {
      p[i] = 0.5f * kMoeTaken;
      bad = true;
    }
  }
  return simd_any(bad);
}

// One round: the largest untaken probability (the lowest index among equals), marked taken.
// Returns its expert and sets top to its probability, the same on every lane.
template <uint32_t P>
inline uint32_t moe_take(thread float* p, uint32_t lane, uint32_t E, thread float& top) {
  float best = kMoeTaken;
  uint32_t best_e = 0xFFFFFFFFu;
  for (uint32_t i = 0; i < P; ++i) {  // ascending e: the lane keeps its lowest index
    const uint32_t e = lane + 32 * i;
    if (e < E && p[i] > best) {
      best = p[i];
      best_e = e;
    }
  }
  top = simd_max(best);
  const uint32_t top_e = simd_min(best == top ? best_e : 0xFFFFFFFFu);
  for (uint32_t i = 0; i < P; ++i)
    if (lane + 32 * i == top_e) p[i] = kMoeTaken;
  return top_e;
}

template <uint32_t P, typename L>
inline void moe_select_lanes(constant MoeArgs& args, const device L* row, uint32_t lane, threadgroup uint32_t* sel,
                             threadgroup float* w) {
  const uint32_t E = args.experts, k = args.top_k;
  float p[P];
  const bool bad = moe_probs<P, L>(args, row, lane, p);
  float wsum = 0.0f;
  for (uint32_t j = 0; j < k; ++j) {  // k is uniform: every lane makes the same collectives
    float top;
    const uint32_t top_e = moe_take<P>(p, lane, E, top);
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

// moe_select: k rounds, renormalised in slot order. Lane 0 writes sel[j] (expert of slot j),
// w[j] = p_j / sum p (j < k) and w[k] = sigmoid(row[E]) to threadgroup memory (a row with a NaN
// or infinite logit: experts still distinct and below E, w[j < k] NaN). moe_route and
// moe_gate_up_mv select with it.
template <typename L>
inline void moe_select(constant MoeArgs& args, const device L* row, uint32_t lane, threadgroup uint32_t* sel,
                       threadgroup float* w) {
  if (args.experts <= 32 * kMoeSelectLane)  // uniform
    moe_select_lanes<kMoeSelectLane, L>(args, row, lane, sel, w);
  else
    moe_select_lanes<kMoeMaxExperts / 32, L>(args, row, lane, sel, w);
}

}  // namespace lily
