// Argmax (greedy) and sampling (temperature, top-k, top-p, min-p, Gumbel-max) over a vocabulary of
// up to 248,320 logits per row, writing the chosen token id into a uint32 device slot. This file:
// the max pass every route starts with, the plain route (Gumbel) and the small-k route, and the
// noise itself; the bucket route: sampling_buckets.metal; logprobs: sampling_logprobs.metal;
// shared records and helpers: common/sample_records.h.
// Host: csrc/gpu/ops/sampling.cpp (the pass sequence). Reference: lily_py.sampling (must match
// bit for bit; see docs/kernels-sampling.md "Sampling" for the exact-reproduction argument).
//
// Shapes: logits float32 [R, stride], entries 0 .. valid_vocab-1 of each row are read; ids uint32
// and chosen_logit float32 [>= slot + R]. Partial kernels: grid (G, R), G = ceil(valid_vocab /
// 2048), 64 threads (two simdgroups); simdgroup q owns the 1024 entries g*2048 + 1024q .. +1024
// and reads them in 32 rounds, lane l taking entry 32r + l of round r (sample_entry): every load
// instruction of a simdgroup covers 128 consecutive bytes. Final kernels: grid (1, R), 32
// threads; the small-k merge, select and resolve: one threadgroup per row of 256 threads.
//
// Routes (chosen by the host from the parameters only): greedy (max partial + final), plain
// (temperature only: + Gumbel partial + final), small-k (0 < top_k <= 64: + per-group top-k
// candidates + one merge), buckets (every other filter: 6 levels, see "The bucket route").
//
// Precision: no reassociated float math. Maxima and argmaxes are exact (ties to the lowest id);
// s = (l - max) * inv_temperature is one float32 subtract and one multiply; masses are integers
// (lily_mass), so their sums are exact in any order; noise and z = s + gumbel are float32 with
// the exactly specified lily_log (common/sampling.h).
//
// Errors: a NaN or +inf logit, or no finite logit, below valid_vocab sets SampleState.status;
// the final kernel then writes kSampleNoId (0xFFFFFFFF) and a NaN logit, and later kernels of the
// call skip all work (no floating-point exception from a NaN reaches the arithmetic).
#include "common/lily_metal.h"
#include "common/sampling.h"
#include "common/sample_records.h"

namespace lily {

// ---------------------------------------------------------------------------------------------
// sample_max_partial: per (row, group) the largest finite-or--inf logit and its lowest id, and
// NaN / +inf detection. grid (G, R) x 64. With args.masked, the allowed-token bitset (bit i % 32
// of word i / 32 of the row's mask; a constraint's mask) is applied first, in place: a disallowed
// entry's logit becomes -inf, so every later pass of every route (and the logprob pass) sees
// the masked row: disallowed tokens have probability zero.
template <typename T>
[[kernel]] void sample_max_partial(constant SampleArgs& args [[buffer(0)]],
                                   device T* logits [[buffer(1)]],
                                   device SamplePartial* part [[buffer(2)]],
                                   const device uint32_t* mask [[buffer(3)]],
                                   LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y, g = group_pos.x;
  device T* lr = logits + ulong(row) * args.stride;
  const device uint32_t* mr = mask + ulong(row) * args.mask_stride;
  SamplePartial p = sample_empty();
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    if (i >= args.valid_vocab) break;
    if (args.masked != 0 && ((mr[i >> 5] >> (i & 31u)) & 1u) == 0) {
      lr[i] = T(-as_type<float>(0x7F800000u));
      continue;
    }
    const float l = float(lr[i]);
    if (isnan(l) || (isinf(l) && l > 0.0f)) {
      p.status |= isnan(l) ? uint32_t(kSampleStatusNaN) : uint32_t(kSampleStatusPosInf);
      p.bad_id = min(p.bad_id, i);
    } else if (sample_better(l, i, p.value, p.id)) {
      p.value = l;
      p.logit = l;
      p.id = i;
    }
  }
  sample_tg_store(recs + thread_pos.x * kSampleRecordWords, p);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_pos.x == 0) sample_store(part + row * args.groups + g, sample_combine(recs, group_size.x));
}

// sample_max_final: the row's max logit and argmax into SampleState (and, greedy, the token into
// ids[slot + row]); initialises the state of a sampling call. grid (1, R) x 32.
// sample_max_final_buckets (the bucket route) also zeroes the row's bucket histogram.
template <bool kBuckets>
inline void sample_max_final_body(constant SampleArgs& args, const device SamplePartial* part,
                                  device SampleState* state, device uint32_t* ids, device float* chosen_logit,
                                  device uint32_t* hist, threadgroup uint32_t* recs, uint32_t row, uint32_t t,
                                  uint32_t threads) {
  if (kBuckets) {
    device uint32_t* h = hist + ulong(row) * kSampleRowWords;
    for (uint32_t i = t; i < kSampleHistBins * kSampleBinWords; i += threads) h[i] = 0;
  }
  const SamplePartial p = sample_reduce_row(part + row * args.groups, recs, args.groups, t, threads);
  if (t == 0) {
    uint32_t status = p.status;
    if (p.id == kSampleNoId || (isinf(p.value) && p.value < 0.0f)) status |= kSampleStatusNoFinite;
    device SampleState& st = state[row];
    st.max_logit = p.value;
    st.max_id = p.id;
    st.status = status;
    st.bad_id = p.bad_id;
    st.min_p_count = 0;
    st.cand_count = 0;
    if (args.greedy) sample_write_error_or(ids, chosen_logit, args.slot + row, status, p.id, p.logit);
  }
}

template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_max_final(constant SampleArgs& args [[buffer(0)]],
                                 const device SamplePartial* part [[buffer(1)]],
                                 device SampleState* state [[buffer(2)]],
                                 device uint32_t* ids [[buffer(3)]],
                                 device float* chosen_logit [[buffer(4)]],
                                 LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleFinalThreads * kSampleRecordWords]);
  sample_max_final_body<false>(args, part, state, ids, chosen_logit, ids, recs, group_pos.y, thread_pos.x,
                               group_size.x);
}

template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_max_final_buckets(constant SampleArgs& args [[buffer(0)]],
                                         const device SamplePartial* part [[buffer(1)]],
                                         device SampleState* state [[buffer(2)]],
                                         device uint32_t* hist [[buffer(3)]],
                                         LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleFinalThreads * kSampleRecordWords]);
  sample_max_final_body<true>(args, part, state, hist, (device float*)hist, hist, recs, group_pos.y, thread_pos.x,
                              group_size.x);
}

// ---------------------------------------------------------------------------------------------
// The plain route (temperature only, no filter): every valid entry is kept.
// sample_gumbel_partial: per (row, group) the entry with the largest z = s + gumbel(seed, step, id)
// (ties to the lowest id). grid (G, R) x 64.
template <typename T>
[[kernel]] void sample_gumbel_partial(constant SampleArgs& args [[buffer(0)]],
                                      const device T* logits [[buffer(1)]],
                                      const device SampleState* state [[buffer(2)]],
                                      device SamplePartial* part [[buffer(3)]],
                                      LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y, g = group_pos.x;
  const device SampleState& st = state[row];
  const uint32_t end = sample_valid_end(args, st);
  const device T* lr = logits + ulong(row) * args.stride;
  const uint32_t key = lily_sample_key(args.seed_lo, args.seed_hi, args.step);
  SamplePartial p = sample_empty();
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    if (i >= end) break;
    const float l = float(lr[i]);
    // z = (l - max) * inv_t + gumbel with ONE rounding, written as the fma it is: a compiler
    // that contracts s + g (s a product) into an fma cannot change it (sampling.py: fma32).
    const float z = fma(l - st.max_logit, args.inv_temperature, lily_gumbel(key, i));
    if (sample_better(z, i, p.value, p.id)) {
      p.value = z;
      p.logit = l;
      p.id = i;
    }
  }
  sample_tg_store(recs + thread_pos.x * kSampleRecordWords, p);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_pos.x == 0) sample_store(part + row * args.groups + g, sample_combine(recs, group_size.x));
}

// sample_gumbel_final: the row's choice into ids[slot + row] and its raw logit into
// chosen_logit[slot + row] (kSampleNoId and NaN when the row is in error). grid (1, R) x 32.
template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_gumbel_final(constant SampleArgs& args [[buffer(0)]],
                                    const device SamplePartial* part [[buffer(1)]],
                                    const device SampleState* state [[buffer(2)]],
                                    device uint32_t* ids [[buffer(3)]],
                                    device float* chosen_logit [[buffer(4)]],
                                    LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleFinalThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y;
  const SamplePartial p = sample_reduce_row(part + row * args.groups, recs, args.groups, thread_pos.x, group_size.x);
  if (thread_pos.x == 0)
    sample_write_error_or(ids, chosen_logit, args.slot + row, state[row].status, p.id, p.logit);
}


// ---------------------------------------------------------------------------------------------
// The small-k route (0 < top_k <= kSampleSmallK): every filter keeps a prefix of the top-k set in
// the sorted order (value descending, id ascending), so the whole choice is made from each
// threadgroup's own top-k candidates, merged once:
//   sample_max_partial -> sample_max_final -> sample_topk_partial -> sample_topk_merge.
// Candidates are (s, id) pairs, s = (l - max) * inv_temperature, as two uint32 words.

// sample_topk_partial: per (row, group) the top_k entries of the group's 2048 in the sorted
// order, best first (kSampleNoId past the group's valid entries). grid (G, R) x 64. Simdgroup q
// reads entries [g*2048 + q*1024, +1024) with lane l at offset 32 r + l (coalesced: 128 bytes per
// simdgroup load); each thread keeps its 32 scaled values in registers. top_k rounds: every
// thread offers its best entry after the last one chosen, the threadgroup takes the best offer.
template <typename T>
[[kernel]] void sample_topk_partial(constant SampleArgs& args [[buffer(0)]],
                                    const device T* logits [[buffer(1)]],
                                    const device SampleState* state [[buffer(2)]],
                                    device uint32_t* cand [[buffer(3)]],
                                    LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, offer_s, [2][kSampleThreads / 32]);
  LILY_TG_ARRAY(uint32_t, offer_id, [2][kSampleThreads / 32]);
  const uint32_t row = group_pos.y, g = group_pos.x;
  const device SampleState& st = state[row];
  const uint32_t end = sample_valid_end(args, st);
  const uint32_t base = g * kSampleChunk + simd_id * (kSampleChunk / 2) + lane;
  const device T* lr = logits + ulong(row) * args.stride;
  float v[kSampleStrip];
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = base + 32 * r;
    v[r] = i < end ? sample_scaled(float(lr[i]), st.max_logit, args.inv_temperature) : 0.0f;
  }
  device uint32_t* out = cand + (ulong(row) * args.groups + g) * (2 * kSampleSmallK);
  float last_s = as_type<float>(0x7F800000u);  // +inf: nothing chosen yet
  uint32_t last_id = 0;
  for (uint32_t j = 0; j < args.top_k; ++j) {
    float s = 0.0f;
    uint32_t id = kSampleNoId;
    for (uint32_t r = 0; r < kSampleStrip; ++r) {
      const uint32_t i = base + 32 * r;
      if (i < end && sample_after(v[r], i, last_s, last_id) && sample_better(v[r], i, s, id)) {
        s = v[r];
        id = i;
      }
    }
    sample_simd_best(s, id);
    if (lane == 0) {
      offer_s[j & 1][simd_id] = s;
      offer_id[j & 1][simd_id] = id;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t q = 0; q < kSampleThreads / 32; ++q) {  // the same order in every thread
      const float os = offer_s[j & 1][q];
      const uint32_t oid = offer_id[j & 1][q];
      if (q == 0 || sample_better(os, oid, s, id)) {
        s = os;
        id = oid;
      }
    }
    if (thread_pos.x == 0) {
      out[2 * j] = as_type<uint32_t>(s);
      out[2 * j + 1] = id;
    }
    if (id == kSampleNoId) {  // the group is exhausted (the same in every thread)
      for (uint32_t k = j + 1 + thread_pos.x; k < args.top_k; k += group_size.x) out[2 * k + 1] = kSampleNoId;
      break;
    }
    last_s = s;
    last_id = id;
  }
}

// sample_topk_merge: the row's top_k entries from the G x top_k candidates (top_k rounds of the
// same offer-and-take, kSampleMergeThreads threads), then on thread 0, in the sorted order:
// k_eff = min(top_k, max(1, #(s >= min_p_log))), the top-k set's mass Z, P = top_p_limit(Z), entry
// j kept iff j < k_eff and the mass before it < P (entry 0 always), and the kept entry with the
// largest z = s + gumbel (ties to the lowest id) into ids[slot + row] and its raw logit into
// chosen_logit[slot + row]. grid (1, R) x kSampleMergeThreads.
template <typename T>
[[kernel]] void sample_topk_merge(constant SampleArgs& args [[buffer(0)]],
                                  const device T* logits [[buffer(1)]],
                                  const device SampleState* state [[buffer(2)]],
                                  const device uint32_t* cand [[buffer(3)]],
                                  device uint32_t* ids [[buffer(4)]],
                                  device float* chosen_logit [[buffer(5)]],
                                  LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, offer_s, [2][kSampleMergeThreads / 32]);
  LILY_TG_ARRAY(uint32_t, offer_id, [2][kSampleMergeThreads / 32]);
  LILY_TG_ARRAY(float, top_s, [kSampleSmallK]);
  LILY_TG_ARRAY(uint32_t, top_id, [kSampleSmallK]);
  const uint32_t row = group_pos.y;
  const device SampleState& st = state[row];
  const uint32_t n = st.status ? 0u : args.groups * args.top_k;  // candidates (error: none)
  const device uint32_t* c = cand + ulong(row) * args.groups * (2 * kSampleSmallK);
  const uint32_t simds = group_size.x / 32;
  float last_s = as_type<float>(0x7F800000u);
  uint32_t last_id = 0;
  uint32_t found = 0;
  for (uint32_t j = 0; j < args.top_k; ++j) {
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
  if (st.status != 0 || found == 0) {
    sample_write_error_or(ids, chosen_logit, args.slot + row, st.status | kSampleStatusNoFinite, 0, 0.0f);
    return;
  }
  uint32_t k_eff = found;
  if (!isinf(args.min_p_log)) {
    uint32_t count = 0;
    for (uint32_t j = 0; j < found; ++j) count += top_s[j] >= args.min_p_log ? 1u : 0u;
    k_eff = min(k_eff, max(count, 1u));
  }
  ulong limit = ~ulong(0);
  if (args.top_p != 0) {
    ulong Z = 0;
    for (uint32_t j = 0; j < found; ++j) Z += lily_mass(top_s[j]);
    limit = lily_top_p_limit(Z, args.top_p);
  }
  const uint32_t key = lily_sample_key(args.seed_lo, args.seed_hi, args.step);
  float best = 0.0f;
  uint32_t best_id = kSampleNoId;
  ulong before = 0;
  for (uint32_t j = 0; j < k_eff; ++j) {
    if (j > 0 && !(before < limit)) break;
    const float z = top_s[j] + lily_gumbel(key, top_id[j]);
    if (sample_better(z, top_id[j], best, best_id)) {
      best = z;
      best_id = top_id[j];
    }
    before += lily_mass(top_s[j]);
  }
  const device T* lr = logits + ulong(row) * args.stride;
  sample_write_error_or(ids, chosen_logit, args.slot + row, 0u, best_id, float(lr[best_id]));
}

// sample_noise: the Gumbel noise itself, out[i] = gumbel(seed, step, i) for i < valid_vocab (tests
// compare it bit for bit with lily_py.sampling.gumbel). grid (ceil(valid_vocab / 2048), 1) x 64.
template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_noise(constant SampleArgs& args [[buffer(0)]],
                             device float* out [[buffer(1)]],
                             LILY_KERNEL_TAIL) {
  const uint32_t key = lily_sample_key(args.seed_lo, args.seed_hi, args.step);
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(group_pos.x, simd_id, lane, r);
    if (i < args.valid_vocab) out[i] = lily_gumbel(key, i);
  }
}

// Instantiations: the max pass, plain, small-k and noise rows of csrc/gpu/kernel_ids.h.
LILY_INSTANTIATE("sample_max_partial_f32", sample_max_partial<float>)
LILY_INSTANTIATE("sample_max_final", sample_max_final<float>)
LILY_INSTANTIATE("sample_max_final_buckets", sample_max_final_buckets<float>)
LILY_INSTANTIATE("sample_gumbel_partial_f32", sample_gumbel_partial<float>)
LILY_INSTANTIATE("sample_gumbel_final", sample_gumbel_final<float>)
LILY_INSTANTIATE("sample_topk_partial_f32", sample_topk_partial<float>)
LILY_INSTANTIATE("sample_topk_merge_f32", sample_topk_merge<float>)
LILY_INSTANTIATE("sample_noise", sample_noise<float>)

}  // namespace lily
