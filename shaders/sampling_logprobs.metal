// The sampler's logprobs (optional, after the sampler): sample_lse_partial -> sample_logprobs, the
// model's log_softmax over the valid entries, the chosen token's logprob and the top entries.
// Host: csrc/gpu/ops/sampling.cpp (the pass sequence). Reference: lily_py.sampling (must match
// bit for bit; docs/kernels-sampling.md). Shapes, grids, routes, precision and errors: the header
// of sampling.metal; shared records and helpers: common/sample_records.h.
#include "common/lily_metal.h"
#include "common/sampling.h"
#include "common/sample_records.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// Logprobs (optional, after the sampler): the model's distribution log_softmax(l) over the valid
// entries (raw logits: no temperature, no filters), the chosen token's logprob and the top
// top_logprobs entries. No row leaves the device; the host reads one kSampleLogprobWords record.
//   sample_topk_partial (inv_temperature 1, top_k = top_logprobs; skipped for 0) and
//   sample_lse_partial (one level) -> sample_logprobs.

// sample_lse_partial: per (row, group) the sum of lily_exp(l - max) over the group's valid
// entries (each thread its 32 in order, then thread 0 the 64 in thread order) into
// sums[row * groups + g]. grid (G, R) x 64.
template <typename T>
[[kernel]] void sample_lse_partial(constant SampleArgs& args [[buffer(0)]],
                                   const device T* logits [[buffer(1)]],
                                   const device SampleState* state [[buffer(2)]],
                                   device float* sums [[buffer(3)]],
                                   LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, acc, [kSampleThreads]);
  const uint32_t row = group_pos.y, g = group_pos.x;
  const device SampleState& st = state[row];
  const uint32_t end = sample_valid_end(args, st);
  const device T* lr = logits + ulong(row) * args.stride;
  float sum = 0.0f;
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    if (i >= end) break;
    sum += lily_exp(float(lr[i]) - st.max_logit);  // 0 below -32 (and for -inf)
  }
  acc[thread_pos.x] = sum;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_pos.x == 0) {
    float total = 0.0f;
    for (uint32_t t = 0; t < group_size.x; ++t) total += acc[t];
    sums[row * args.groups + g] = total;
  }
}

// sample_logprobs: the row's top args.top_k (= top_logprobs, may be 0) entries from the groups'
// candidates (s = l - max), the log normaliser lz = lily_log(sum of the groups' sums, in group
// order) (>= 1: the max entry adds exactly 1), and the record logprobs[slot + row]: the chosen
// token's (chosen_logit[slot + row] - max) - lz, the count found, then (id, s - lz) pairs. A row
// in error gets a NaN logprob and count 0. grid (1, R) x kSampleMergeThreads.
template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_logprobs(constant SampleArgs& args [[buffer(0)]],
                                const device SampleState* state [[buffer(1)]],
                                const device uint32_t* cand [[buffer(2)]],
                                const device float* sums [[buffer(3)]],
                                const device float* chosen_logit [[buffer(4)]],
                                device uint32_t* out [[buffer(5)]],
                                LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, offer_s, [2][kSampleMergeThreads / 32]);
  LILY_TG_ARRAY(uint32_t, offer_id, [2][kSampleMergeThreads / 32]);
  LILY_TG_ARRAY(float, top_s, [kSampleMaxLogprobs]);
  LILY_TG_ARRAY(uint32_t, top_id, [kSampleMaxLogprobs]);
  const uint32_t row = group_pos.y;
  const device SampleState& st = state[row];
  const uint32_t n = st.status ? 0u : args.groups * args.top_k;
  const device uint32_t* c = cand + ulong(row) * args.groups * (2 * kSampleSmallK);
  const uint32_t simds = group_size.x / 32;
  float last_s = as_type<float>(0x7F800000u);
  uint32_t last_id = 0;
  uint32_t found = 0;
  for (uint32_t j = 0; j < args.top_k && n != 0; ++j) {
    float s = 0.0f;
    uint32_t id = kSampleNoId;
    for (uint32_t e = thread_pos.x; e < n; e += group_size.x) {
      const uint32_t at = (e / args.top_k) * (2 * kSampleSmallK) + 2 * (e % args.top_k);
      const float cs = as_type<float>(c[at]);
      const uint32_t cid = c[at + 1];
      if (cid != kSampleNoId && sample_after(cs, cid, last_s, last_id) && sample_better(cs, cid, s, id)) {
        s = cs;
        id = cid;
      }
    }
    sample_simd_best(s, id);
    if (lane == 0) {
      offer_s[j & 1][simd_id] = s;
      offer_id[j & 1][simd_id] = id;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t q = 0; q < simds; ++q) {
      const float os = offer_s[j & 1][q];
      const uint32_t oid = offer_id[j & 1][q];
      if (q == 0 || sample_better(os, oid, s, id)) {
        s = os;
        id = oid;
      }
    }
    if (id == kSampleNoId) break;  // fewer valid entries than top_k (the same in every thread)
    if (thread_pos.x == 0) {
      top_s[j] = s;
      top_id[j] = id;
    }
    found = j + 1;
    last_s = s;
    last_id = id;
  }
  if (thread_pos.x != 0) return;
  device uint32_t* rec = out + ulong(args.slot + row) * kSampleLogprobWords;
  const uint32_t at = args.slot + row;
  if (st.status != 0) {
    rec[0] = as_type<uint32_t>(sample_nan());
    rec[1] = 0;
    return;
  }
  float total = 0.0f;
  for (uint32_t g = 0; g < args.groups; ++g) total += sums[row * args.groups + g];
  const float lz = lily_log(total);
  rec[0] = as_type<uint32_t>((chosen_logit[at] - st.max_logit) - lz);
  rec[1] = found;
  for (uint32_t j = 0; j < found; ++j) {
    rec[2 + 2 * j] = top_id[j];
    rec[3 + 2 * j] = as_type<uint32_t>(top_s[j] - lz);
  }
}

// Instantiations: the logprobs rows of csrc/gpu/kernel_ids.h.
LILY_INSTANTIATE("sample_lse_partial_f32", sample_lse_partial<float>)
LILY_INSTANTIATE("sample_logprobs", sample_logprobs<float>)

}  // namespace lily
