// What the sampler's shader files share (shaders/sampling.metal, sampling_buckets.metal,
// sampling_logprobs.metal): the (value, id) order, the per-thread entry map of the partial
// kernels, the SamplePartial records (threadgroup and device copies, merge, combine), the
// row reduction, the error-or-token write, the valid range and scaled logits of a row, and the
// simdgroup's best (s, id). Records and constants: common/args_sampling.h; the exact functions
// (mass, log, Gumbel noise): common/sampling.h.
#pragma once

#include "common/lily_metal.h"
#include "common/sampling.h"

namespace lily {

// (value, id) order: larger value first, then lower id; id kSampleNoId is "nothing".
inline bool sample_better(float v, uint32_t id, float best, uint32_t best_id) {
  if (id == kSampleNoId) return false;
  if (best_id == kSampleNoId) return true;
  return v > best || (v == best && id < best_id);
}

inline float sample_nan() { return as_type<float>(0x7FC00000u); }

// Entry of round r for this thread in group g (kSampleThreads = 2 simdgroups of 32 lanes).
inline uint32_t sample_entry(uint32_t g, uint32_t simd_id, uint32_t lane, uint32_t r) {
  return g * kSampleChunk + simd_id * (kSampleChunk / 2) + 32 * r + lane;
}

// Records cross address spaces field by field (the strict pass has no struct copy between address
// spaces); a threadgroup record is kSampleRecordWords uint32 words.

inline void sample_tg_store(threadgroup uint32_t* r, SamplePartial p) {
  r[0] = as_type<uint32_t>(p.value);
  r[1] = as_type<uint32_t>(p.logit);
  r[2] = p.id;
  r[3] = p.status;
  r[4] = p.bad_id;
  r[5] = p.count;
  r[6] = p.mass_lo;
  r[7] = p.mass_hi;
}

inline SamplePartial sample_tg_load(const threadgroup uint32_t* r) {
  SamplePartial p;
  p.value = as_type<float>(r[0]);
  p.logit = as_type<float>(r[1]);
  p.id = r[2];
  p.status = r[3];
  p.bad_id = r[4];
  p.count = r[5];
  p.mass_lo = r[6];
  p.mass_hi = r[7];
  return p;
}

inline SamplePartial sample_load(const device SamplePartial* r) {
  SamplePartial p;
  p.value = r->value;
  p.logit = r->logit;
  p.id = r->id;
  p.status = r->status;
  p.bad_id = r->bad_id;
  p.count = r->count;
  p.mass_lo = r->mass_lo;
  p.mass_hi = r->mass_hi;
  return p;
}

inline void sample_store(device SamplePartial* r, SamplePartial p) {
  r->value = p.value;
  r->logit = p.logit;
  r->id = p.id;
  r->status = p.status;
  r->bad_id = p.bad_id;
  r->count = p.count;
  r->mass_lo = p.mass_lo;
  r->mass_hi = p.mass_hi;
}

// Merge record r into out: best (value, id), OR of status, min bad id, sums of count and mass.
inline SamplePartial sample_merge(SamplePartial out, SamplePartial r) {
  if (sample_better(r.value, r.id, out.value, out.id)) {
    out.value = r.value;
    out.logit = r.logit;
    out.id = r.id;
  }
  out.status |= r.status;
  out.bad_id = min(out.bad_id, r.bad_id);
  out.count += r.count;
  const ulong m = lily_u64(out.mass_lo, out.mass_hi) + lily_u64(r.mass_lo, r.mass_hi);
  out.mass_lo = uint32_t(m);
  out.mass_hi = uint32_t(m >> 32);
  return out;
}

// Combine the n per-thread records of a threadgroup in thread order (thread 0 calls it).
inline SamplePartial sample_combine(const threadgroup uint32_t* recs, uint32_t n) {
  SamplePartial out = sample_tg_load(recs);
  for (uint32_t t = 1; t < n; ++t) out = sample_merge(out, sample_tg_load(recs + t * kSampleRecordWords));
  return out;
}

inline SamplePartial sample_empty() {
  SamplePartial p;
  p.value = 0.0f;
  p.logit = 0.0f;
  p.id = kSampleNoId;
  p.status = 0;
  p.bad_id = kSampleNoId;
  p.count = 0;
  p.mass_lo = 0;
  p.mass_hi = 0;
  return p;
}

// Reduce a row's G partial records (32 threads, then thread 0 in thread order).
inline SamplePartial sample_reduce_row(const device SamplePartial* part, threadgroup uint32_t* recs,
                                       uint32_t groups, uint32_t t, uint32_t threads) {
  SamplePartial p = sample_empty();
  for (uint32_t g = t; g < groups; g += threads) p = sample_merge(p, sample_load(part + g));
  sample_tg_store(recs + t * kSampleRecordWords, p);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return sample_combine(recs, threads);
}

inline void sample_write_error_or(device uint32_t* ids, device float* chosen, uint32_t at, uint32_t status,
                                  uint32_t id, float logit) {
  ids[at] = status ? uint32_t(kSampleNoId) : id;
  chosen[at] = status ? sample_nan() : logit;
}

// Valid entries of a row for the kernels after max_final: none when the row is in error.
inline uint32_t sample_valid_end(constant SampleArgs& args, const device SampleState& st) {
  return st.status ? 0u : args.valid_vocab;
}

inline float sample_scaled(float l, float max_logit, float inv_temperature) {
  return (l - max_logit) * inv_temperature;  // -inf stays -inf; the max entry gives exactly 0
}

// (s, id) is after (b, bid) in the sorted order: smaller s, or equal s and a larger id.
inline bool sample_after(float s, uint32_t id, float b, uint32_t bid) {
  return s < b || (s == b && id > bid);
}

// The best (s, id) of a simdgroup (sample_better order), by an xor butterfly.
inline void sample_simd_best(thread float& s, thread uint32_t& id) {
  for (uint32_t d = 16; d >= 1; d >>= 1) {
    const float os = simd_shuffle_xor(s, ushort(d));
    const uint32_t oid = simd_shuffle_xor(id, ushort(d));
    if (sample_better(os, oid, s, id)) {
      s = os;
      id = oid;
    }
  }
}

}  // namespace lily
