// Argmax (greedy) and sampling (temperature, top-k, top-p, min-p, Gumbel-max) over a vocabulary of
// up to 248,320 logits per row, writing the chosen token id into a uint32 device slot.
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


// Valid entries of a row for the kernels after max_final: none when the row is in error.
inline uint32_t sample_valid_end(constant SampleArgs& args, const device SampleState& st) {
  return st.status ? 0u : args.valid_vocab;
}

inline float sample_scaled(float l, float max_logit, float inv_temperature) {
  return (l - max_logit) * inv_temperature;  // -inf stays -inf; the max entry gives exactly 0
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

// ---------------------------------------------------------------------------------------------
// The bucket route (any filter the small-k route does not take: top-p or min-p without top-k,
// top_k > kSampleSmallK), six levels in all:
//   sample_max_partial -> sample_max_final_buckets -> sample_hist_partial -> sample_select ->
//   sample_collect -> sample_resolve.
// Every filter keeps a prefix of the sorted order (s descending, id ascending): the first n
// entries, n = max(1, min(top_k, #(s >= log min_p), n_p)), n_p the top-p length. Buckets are a
// monotone function of s (bucket 0 holds the largest s), so the prefix is every bucket below the
// cutoff bucket plus a prefix of the cutoff bucket:
//  * hist_partial: per bucket the count and the exact integer mass (threadgroup atomics, then
//    device atomics into one histogram per row), and #(s >= log min_p);
//  * select (one threadgroup): cumulative counts / masses; the buckets the cutoff can lie in
//    (lo..hi; with top-k and top-p also the top-k entry's bucket when Z is not known exactly from
//    whole buckets); fallback when they hold more than args.cap entries;
//  * collect: per group the best z = s + gumbel over the buckets below lo (all kept), and the
//    entries of the collected buckets appended to a candidate list (one atomic per simdgroup round);
//  * resolve (one threadgroup): the exact cutoff among the candidates by searches over the 64-bit
//    rank key (order key of s, ~id) - the same counts and integer masses as the reference - then
//    the Gumbel-max over the kept candidates merged with the groups' best. In the fallback the
//    same searches scan the whole row (entries of the collected buckets) in this one threadgroup:
//    slower, one level, exact.
// Which buckets exist decides only how many candidates there are, never the result.

// Bucket of a scaled logit s <= 0 from x = -s * scale (monotone non-decreasing in -s): 384 unit
// buckets, 384 of width 4, 254 of width 32, then the tail bucket; s = -inf has its own.
inline uint32_t sample_bin(float s, float scale) {
  if (isinf(s)) return kSampleInfBin;
  const float x = (-s) * scale;
  if (!(x < 16384.0f)) return kSampleTailBin;
  const uint32_t xi = uint32_t(x);
  if (xi < 384u) return xi;
  if (xi < 1920u) return 384u + ((xi - 384u) >> 2);
  return min(768u + ((xi - 1920u) >> 5), uint32_t(kSampleTailBin));
}

// Larger key = earlier in the sorted order (larger s, then lower id); distinct for distinct ids.
inline ulong sample_rank_key(float s, uint32_t id) {
  return (ulong(lily_order_key(s)) << 32) | ulong(~id);
}

// Mass pieces: m <= 2^40 as (m >> 27, 14 bits, 13 bits); sums of 2^18 entries fit in uint32.
inline ulong sample_mass_join(uint32_t w2, uint32_t w1, uint32_t w0) {
  return (ulong(w2) << 27) + (ulong(w1) << 13) + ulong(w0);
}

inline device atomic_uint* sample_atomic(device uint32_t* p) { return (device atomic_uint*)p; }
inline threadgroup atomic_uint* sample_tg_atomic(threadgroup uint32_t* p) { return (threadgroup atomic_uint*)p; }

// Row pointers into the hist scratch: buckets (count, w2, w1, w0), cumulative buckets (count,
// mass lo, mass hi, pad: inclusive, from bucket 0), candidates (s bits, id).
inline ulong sample_row_base(uint32_t row) { return ulong(row) * kSampleRowWords; }
constant constexpr uint32_t kSampleCumOffset = kSampleHistBins * kSampleBinWords;
constant constexpr uint32_t kSampleCandOffset = kSampleHistBins * (kSampleBinWords + kSampleCumWords);

// sample_hist_partial: grid (G, R) x 64. Threadgroup histogram (atomics), flushed into the row's
// histogram (device atomics, non-empty buckets only); min-p count by simd_sum + one atomic.
template <typename T>
[[kernel]] void sample_hist_partial(constant SampleArgs& args [[buffer(0)]],
                                    const device T* logits [[buffer(1)]],
                                    device SampleState* state [[buffer(2)]],
                                    device uint32_t* hist [[buffer(3)]],
                                    LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, bins, [kSampleHistBins * kSampleBinWords]);  // updated through atomics
  const uint32_t row = group_pos.y, g = group_pos.x;
  device SampleState& st = state[row];
  const uint32_t end = sample_valid_end(args, st);
  const float max_logit = st.max_logit;
  const device T* lr = logits + ulong(row) * args.stride;
  for (uint32_t i = thread_pos.x; i < kSampleHistBins * kSampleBinWords; i += group_size.x)
    bins[i] = 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint32_t above_min_p = 0;
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    if (i >= end) break;
    const float s = sample_scaled(float(lr[i]), max_logit, args.inv_temperature);
    const uint32_t b = sample_bin(s, args.bin_scale) * kSampleBinWords;
    const ulong m = lily_mass(s);
    atomic_fetch_add_explicit(sample_tg_atomic(&bins[b]), 1u, memory_order_relaxed);
    if (m != 0) {
      atomic_fetch_add_explicit(sample_tg_atomic(&bins[b + 1]), uint32_t(m >> 27), memory_order_relaxed);
      atomic_fetch_add_explicit(sample_tg_atomic(&bins[b + 2]), uint32_t(m >> 13) & 0x3FFFu, memory_order_relaxed);
      atomic_fetch_add_explicit(sample_tg_atomic(&bins[b + 3]), uint32_t(m) & 0x1FFFu, memory_order_relaxed);
    }
    above_min_p += s >= args.min_p_log ? 1u : 0u;
  }
  const uint32_t n_min_p = simd_sum(above_min_p);
  if (lane == 0 && n_min_p != 0) atomic_fetch_add_explicit(sample_atomic(&st.min_p_count), n_min_p, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  device uint32_t* h = hist + sample_row_base(row);
  for (uint32_t b = thread_pos.x; b < kSampleHistBins; b += group_size.x) {
    for (uint32_t w = 0; w < kSampleBinWords; ++w) {
      const uint32_t v = bins[b * kSampleBinWords + w];  // the barrier above ordered every add
      if (v != 0) atomic_fetch_add_explicit(sample_atomic(h + b * kSampleBinWords + w), v, memory_order_relaxed);
    }
  }
}

// Smallest bucket whose cumulative count (mass) reaches x (exists when x <= the total).
inline uint32_t sample_first_count(const threadgroup uint32_t* cum, uint32_t x) {
  uint32_t lo = 0, hi = kSampleHistBins - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (cum[mid] >= x) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

inline uint32_t sample_first_mass(const threadgroup ulong* cum, ulong x) {
  uint32_t lo = 0, hi = kSampleHistBins - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (cum[mid] >= x) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// sample_select: grid (1, R) x kSampleSelectThreads (4 buckets per thread). Cumulative counts and
// masses (to threadgroup memory and the row's scratch), then on thread 0 the buckets to collect.
template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_select(constant SampleArgs& args [[buffer(0)]],
                              device SampleState* state [[buffer(1)]],
                              device uint32_t* hist [[buffer(2)]],
                              LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, cum_c, [kSampleHistBins]);
  LILY_TG_ARRAY(ulong, cum_m, [kSampleHistBins]);
  LILY_TG_ARRAY(uint32_t, tot_c, [kSampleSelectThreads]);
  LILY_TG_ARRAY(ulong, tot_m, [kSampleSelectThreads]);
  const uint32_t row = group_pos.y, t = thread_pos.x;
  device uint32_t* h = hist + sample_row_base(row);
  constexpr uint32_t per = kSampleHistBins / kSampleSelectThreads;
  uint32_t c = 0;
  ulong m = 0;
  for (uint32_t j = 0; j < per; ++j) {
    const uint32_t b = t * per + j;
    c += h[b * kSampleBinWords];
    m += sample_mass_join(h[b * kSampleBinWords + 1], h[b * kSampleBinWords + 2], h[b * kSampleBinWords + 3]);
    cum_c[b] = c;
    cum_m[b] = m;
  }
  tot_c[t] = c;
  tot_m[t] = m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t == 0) {  // exclusive scan of the per-thread totals
    uint32_t rc = 0;
    ulong rm = 0;
    for (uint32_t u = 0; u < kSampleSelectThreads; ++u) {
      const uint32_t xc = tot_c[u];
      const ulong xm = tot_m[u];
      tot_c[u] = rc;
      tot_m[u] = rm;
      rc += xc;
      rm += xm;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint32_t j = 0; j < per; ++j) {
    const uint32_t b = t * per + j;
    const uint32_t cc = cum_c[b] + tot_c[t];
    const ulong cm = cum_m[b] + tot_m[t];
    cum_c[b] = cc;
    cum_m[b] = cm;
    h[kSampleCumOffset + b * kSampleCumWords] = cc;
    h[kSampleCumOffset + b * kSampleCumWords + 1] = uint32_t(cm);
    h[kSampleCumOffset + b * kSampleCumWords + 2] = uint32_t(cm >> 32);
    h[kSampleCumOffset + b * kSampleCumWords + 3] = 0;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t != 0) return;  // no barrier follows
  device SampleState& st = state[row];
  st.lo = kSampleInfBin;
  st.hi = kSampleInfBin;
  st.extra = kSampleNoId;
  st.bin_k = kSampleNoId;
  st.use_p = 0;
  st.z_lo = 0;
  st.z_hi = 0;
  st.fallback = 0;
  st.collected = 0;
  st.k_eff = 1;
  st.cand_count = 0;
  if (st.status != 0) return;
  const uint32_t V = cum_c[kSampleHistBins - 1];
  const uint32_t kk = args.top_k ? args.top_k : V;
  uint32_t n = kk;
  if (!isinf(args.min_p_log)) n = min(n, st.min_p_count);
  n = max(n, 1u);
  const uint32_t bc = sample_first_count(cum_c, n);
  uint32_t lo = bc, hi = bc, extra = kSampleNoId;
  if (args.top_p != 0) {
    ulong zlo = cum_m[kSampleHistBins - 1], zhi = zlo;
    uint32_t bk = kSampleNoId;
    if (args.top_k != 0) {
      bk = sample_first_count(cum_c, kk);
      zhi = cum_m[bk];
      zlo = cum_c[bk] == kk ? zhi : (bk ? cum_m[bk - 1] : ulong(0));
    }
    const uint32_t bp_lo = sample_first_mass(cum_m, lily_top_p_limit(zlo, args.top_p));
    const uint32_t bp_hi = sample_first_mass(cum_m, lily_top_p_limit(zhi, args.top_p));
    st.z_lo = uint32_t(zlo);
    st.z_hi = uint32_t(zlo >> 32);
    if (bp_lo <= bc) {  // top-p can bind: its bucket is one of bp_lo .. min(bc, bp_hi)
      st.use_p = 1;
      lo = bp_lo;
      hi = min(bc, bp_hi);
      if (zlo != zhi) {  // Z needs the top-k entry's place inside its bucket
        st.bin_k = bk;
        if (bk > hi) extra = bk;
      }
    }
  }
  uint32_t collected = 0;
  for (uint32_t b = lo; b <= hi && b < kSampleInfBin; ++b) collected += cum_c[b] - (b ? cum_c[b - 1] : 0u);
  if (extra < kSampleInfBin) collected += cum_c[extra] - cum_c[extra - 1];
  st.k_eff = n;
  st.lo = lo;
  st.hi = hi;
  st.extra = extra;
  st.collected = collected;
  st.fallback = collected > args.cap ? 1u : 0u;
}

// Entry e is a candidate: its bucket is one of lo..hi (not the -inf bucket) or extra.
inline bool sample_collected(uint32_t b, const device SampleState& st) {
  return b != kSampleInfBin && ((b >= st.lo && b <= st.hi) || b == st.extra);
}

// sample_collect: grid (G, R) x 64. Per group the best z over the buckets below lo (record in
// partials); the entries of the collected buckets appended to the row's candidate list (unless
// the row falls back), in any order (resolve's result does not depend on it).
template <typename T>
[[kernel]] void sample_collect(constant SampleArgs& args [[buffer(0)]],
                               const device T* logits [[buffer(1)]],
                               device SampleState* state [[buffer(2)]],
                               device uint32_t* hist [[buffer(3)]],
                               device SamplePartial* part [[buffer(4)]],
                               LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y, g = group_pos.x;
  device SampleState& st = state[row];
  const uint32_t end = sample_valid_end(args, st);
  const float max_logit = st.max_logit;
  const uint32_t lo = st.lo;
  const bool append = st.fallback == 0;
  const device T* lr = logits + ulong(row) * args.stride;
  device uint32_t* cand = hist + sample_row_base(row) + kSampleCandOffset;
  const uint32_t key = lily_sample_key(args.seed_lo, args.seed_hi, args.step);
  SamplePartial p = sample_empty();
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    const bool valid = i < end;
    const float l = valid ? float(lr[i]) : 0.0f;
    const float s = valid ? sample_scaled(l, max_logit, args.inv_temperature) : 0.0f;
    const uint32_t b = valid ? sample_bin(s, args.bin_scale) : uint32_t(kSampleInfBin);
    if (valid && b < lo) {  // kept for sure
      const float z = fma(l - max_logit, args.inv_temperature, lily_gumbel(key, i));
      if (sample_better(z, i, p.value, p.id)) {
        p.value = z;
        p.logit = l;
        p.id = i;
      }
    }
    const uint32_t take = (append && valid && sample_collected(b, st)) ? 1u : 0u;
    const uint32_t n = simd_sum(take);
    if (n != 0) {  // uniform in the simdgroup
      const uint32_t off = simd_prefix_exclusive_sum(take);
      uint32_t base = 0;
      if (lane == 0) base = atomic_fetch_add_explicit(sample_atomic(&st.cand_count), n, memory_order_relaxed);
      base = simd_broadcast(base, ushort(0));
      const uint32_t at = base + off;
      if (take && at < args.cap) {
        cand[2 * at] = as_type<uint32_t>(s);
        cand[2 * at + 1] = i;
      }
    }
  }
  sample_tg_store(recs + thread_pos.x * kSampleRecordWords, p);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_pos.x == 0) sample_store(part + row * args.groups + g, sample_combine(recs, group_size.x));
}

// ---- sample_resolve helpers (all threads of the threadgroup call them, in uniform control flow)

// Probes per search round (one 4-bit digit of the 64-bit rank key) and the words a simdgroup
// writes to the reduction scratch per round (three pieces per probe).
constant constexpr uint32_t kSampleProbes = 15;
constant constexpr uint32_t kSampleRedWords = kSampleProbes * 3;  // per simdgroup and buffer

// Sum of one 64-bit value per thread over the threadgroup, returned to every thread: three
// 21/21/22-bit pieces by simd_sum (exact), per-simdgroup sums in red[parity] (alternating buffers:
// the barrier of the next call orders this call's reads before the one after it writes).
inline ulong sample_tg_sum(ulong v, threadgroup uint32_t* red, thread uint32_t& parity, uint32_t simd_id,
                           uint32_t lane, uint32_t simds) {
  const uint32_t p0 = simd_sum(uint32_t(v) & 0x1FFFFFu);
  const uint32_t p1 = simd_sum(uint32_t(v >> 21) & 0x1FFFFFu);
  const uint32_t p2 = simd_sum(uint32_t(v >> 42));
  threadgroup uint32_t* buf = red + parity * (kSampleResolveThreads / 32) * kSampleRedWords;
  parity ^= 1u;
  if (lane == 0) {
    buf[simd_id * 3] = p0;
    buf[simd_id * 3 + 1] = p1;
    buf[simd_id * 3 + 2] = p2;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  ulong total = 0;
  for (uint32_t q = 0; q < simds; ++q)
    total += ulong(buf[q * 3]) + (ulong(buf[q * 3 + 1]) << 21) + (ulong(buf[q * 3 + 2]) << 42);
  return total;
}

// The resolve domain: the candidate list, or (fallback) every valid entry of the row whose bucket
// is collected. Entry e's (s, id) and bucket; kSampleNoId when e is not in the domain.
template <typename T>
inline uint32_t sample_domain_entry(constant SampleArgs& args, const device SampleState& st,
                                    const device T* lr, const device uint32_t* cand, bool fallback, uint32_t e,
                                    thread float& s, thread uint32_t& id) {
  if (fallback) {
    s = sample_scaled(float(lr[e]), st.max_logit, args.inv_temperature);
    id = e;
    const uint32_t b = sample_bin(s, args.bin_scale);
    return sample_collected(b, st) ? b : uint32_t(kSampleNoId);
  }
  s = as_type<float>(cand[2 * e]);
  id = cand[2 * e + 1];
  return sample_bin(s, args.bin_scale);
}

// Count (kMass false) or mass (kMass true) of the domain entries of bucket b with rank key >= x.
template <bool kMass, typename T>
inline ulong sample_domain_sum(constant SampleArgs& args, const device SampleState& st, const device T* lr,
                               const device uint32_t* cand, bool fallback, uint32_t n, uint32_t b, ulong x,
                               uint32_t t, uint32_t threads) {
  ulong acc = 0;
  for (uint32_t e = t; e < n; e += threads) {
    float s;
    uint32_t id;
    if (sample_domain_entry(args, st, lr, cand, fallback, e, s, id) == b && sample_rank_key(s, id) >= x)
      acc += kMass ? lily_mass(s) : ulong(1);
  }
  return acc;
}

// Largest rank key x with base + (count or mass of bucket b's entries with rank key >= x) >=
// target: the rank key of the entry where the cumulative count / mass reaches target (b is the
// first bucket whose cumulative value reaches it, so the answer is an entry of b). 16 rounds of
// one 4-bit digit each: every thread sums its entries above the 15 probes x | d << shift
// (d = 1..15; compile-time indexed accumulators), one threadgroup reduction of the 15 sums (three
// 21/21/22-bit pieces each by simd_sum, per-simdgroup pieces in red[parity]; alternating buffers:
// the barrier of the next round orders this round's reads before the round after writes), and
// the largest d whose sum still reaches target is the digit.

template <bool kMass, typename T>
inline ulong sample_search(constant SampleArgs& args, const device SampleState& st, const device T* lr,
                           const device uint32_t* cand, bool fallback, uint32_t n, uint32_t b, ulong base,
                           ulong target, threadgroup uint32_t* red, thread uint32_t& parity, uint32_t t,
                           uint32_t threads, uint32_t simd_id, uint32_t lane) {
  const uint32_t simds = threads / 32;
  ulong x = 0;
  for (int shift = 60; shift >= 0; shift -= 4) {
    ulong acc[kSampleProbes];
    for (uint32_t d = 0; d < kSampleProbes; ++d) acc[d] = 0;
    for (uint32_t e = t; e < n; e += threads) {
      float s;
      uint32_t id;
      if (sample_domain_entry(args, st, lr, cand, fallback, e, s, id) != b) continue;
      const ulong key = sample_rank_key(s, id);
      // Probes d << shift (d = 1..15) above x: the entry is at or above probe d iff its digits
      // above this one exceed x's (every probe), or equal them and its digit is >= d.
      const ulong high = shift == 60 ? ulong(0) : (key >> (shift + 4));
      const ulong xhigh = shift == 60 ? ulong(0) : (x >> (shift + 4));
      const uint32_t digit = uint32_t(key >> shift) & 15u;
      const uint32_t above = high > xhigh ? 15u : (high == xhigh ? digit : 0u);
      const ulong w = kMass ? lily_mass(s) : ulong(1);
      for (uint32_t d = 0; d < kSampleProbes; ++d) acc[d] += d < above ? w : ulong(0);
    }
    threadgroup uint32_t* buf = red + parity * (kSampleResolveThreads / 32) * kSampleRedWords;
    parity ^= 1u;
    for (uint32_t d = 0; d < kSampleProbes; ++d) {
      const uint32_t p0 = simd_sum(uint32_t(acc[d]) & 0x1FFFFFu);
      const uint32_t p1 = simd_sum(uint32_t(acc[d] >> 21) & 0x1FFFFFu);
      const uint32_t p2 = simd_sum(uint32_t(acc[d] >> 42));
      if (lane == 0) {
        buf[simd_id * kSampleRedWords + 3 * d] = p0;
        buf[simd_id * kSampleRedWords + 3 * d + 1] = p1;
        buf[simd_id * kSampleRedWords + 3 * d + 2] = p2;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint32_t digit = 0;
    for (uint32_t d = 0; d < kSampleProbes; ++d) {  // sums fall with d: the last one that reaches target
      ulong total = 0;
      for (uint32_t q = 0; q < simds; ++q) {
        const threadgroup uint32_t* r = buf + q * kSampleRedWords + 3 * d;
        total += ulong(r[0]) + (ulong(r[1]) << 21) + (ulong(r[2]) << 42);
      }
      if (base + total >= target) digit = d + 1;
    }
    x |= ulong(digit) << shift;
  }
  return x;
}

inline uint32_t sample_cum_count(const device uint32_t* cum, uint32_t b) { return cum[b * kSampleCumWords]; }
inline ulong sample_cum_mass(const device uint32_t* cum, uint32_t b) {
  return lily_u64(cum[b * kSampleCumWords + 1], cum[b * kSampleCumWords + 2]);
}

inline uint32_t sample_first_count_dev(const device uint32_t* cum, uint32_t x) {
  uint32_t lo = 0, hi = kSampleHistBins - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (sample_cum_count(cum, mid) >= x) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

inline uint32_t sample_first_mass_dev(const device uint32_t* cum, ulong x) {
  uint32_t lo = 0, hi = kSampleHistBins - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (sample_cum_mass(cum, mid) >= x) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// sample_resolve: grid (1, R) x kSampleResolveThreads. The cutoff n and its rank key, in the
// reference's terms: Z (the top-k set's mass, searched when the top-k entry's bucket is split),
// P = top_p_limit(Z), n_p = the entries up to the one where the cumulative mass reaches P,
// n = min(k_eff, n_p), then the kept domain entries' best z merged with the groups' records of
// the buckets below lo. Writes ids[slot + row] and chosen_logit[slot + row].
template <typename T>
[[kernel]] void sample_resolve(constant SampleArgs& args [[buffer(0)]],
                               const device T* logits [[buffer(1)]],
                               const device SampleState* state [[buffer(2)]],
                               const device uint32_t* hist [[buffer(3)]],
                               const device SamplePartial* part [[buffer(4)]],
                               device uint32_t* ids [[buffer(5)]],
                               device float* chosen_logit [[buffer(6)]],
                               LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, red, [2 * (kSampleResolveThreads / 32) * kSampleRedWords]);
  LILY_TG_ARRAY(uint32_t, recs, [kSampleResolveThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y, t = thread_pos.x, threads = group_size.x;
  const device SampleState& st = state[row];
  const uint32_t status = st.status;
  const device T* lr = logits + ulong(row) * args.stride;
  const device uint32_t* h = hist + sample_row_base(row);
  const device uint32_t* cum = h + kSampleCumOffset;
  const device uint32_t* cand = h + kSampleCandOffset;
  const bool fallback = st.fallback != 0;
  const uint32_t n_dom = status ? 0u : (fallback ? args.valid_vocab : min(st.cand_count, args.cap));
  uint32_t parity = 0;
  ulong cut = 0;  // kept: rank key >= cut (every domain entry when the cutoff is in the -inf bucket)
  if (status == 0) {
    uint32_t n = st.k_eff;
    if (st.use_p != 0) {
      ulong Z = lily_u64(st.z_lo, st.z_hi);
      if (st.bin_k != kSampleNoId) {  // Z = the mass of the first top_k entries
        const uint32_t bk = st.bin_k;
        const uint32_t cb = bk ? sample_cum_count(cum, bk - 1) : 0u;
        const ulong mb = bk ? sample_cum_mass(cum, bk - 1) : ulong(0);
        const ulong xk = sample_search<false>(args, st, lr, cand, fallback, n_dom, bk, ulong(cb), ulong(args.top_k),
                                              red, parity, t, threads, simd_id, lane);
        Z = mb + sample_tg_sum(sample_domain_sum<true>(args, st, lr, cand, fallback, n_dom, bk, xk, t, threads), red,
                               parity, simd_id, lane, threads / 32);
      }
      const ulong P = lily_top_p_limit(Z, args.top_p);
      const uint32_t bp = sample_first_mass_dev(cum, P);
      if (bp <= sample_first_count_dev(cum, n)) {  // else top-p keeps more than k_eff
        const uint32_t cb = bp ? sample_cum_count(cum, bp - 1) : 0u;
        const ulong mb = bp ? sample_cum_mass(cum, bp - 1) : ulong(0);
        const ulong xp = sample_search<true>(args, st, lr, cand, fallback, n_dom, bp, mb, P, red, parity, t, threads,
                                             simd_id, lane);
        const ulong n_p = cb + sample_tg_sum(sample_domain_sum<false>(args, st, lr, cand, fallback, n_dom, bp, xp, t,
                                                                      threads),
                                             red, parity, simd_id, lane, threads / 32);
        n = uint32_t(min(ulong(n), n_p));
      }
    }
    const uint32_t bn = sample_first_count_dev(cum, n);
    if (bn != kSampleInfBin) {
      const uint32_t cb = bn ? sample_cum_count(cum, bn - 1) : 0u;
      cut = sample_search<false>(args, st, lr, cand, fallback, n_dom, bn, ulong(cb), ulong(n), red, parity, t, threads,
                                 simd_id, lane);
    }
  }
  // Gumbel-max over the kept domain entries (this thread's), then the groups' records.
  const uint32_t key = lily_sample_key(args.seed_lo, args.seed_hi, args.step);
  SamplePartial p = sample_empty();
  for (uint32_t e = t; e < n_dom; e += threads) {
    float s;
    uint32_t id;
    if (sample_domain_entry(args, st, lr, cand, fallback, e, s, id) == kSampleNoId) continue;
    if (sample_rank_key(s, id) < cut) continue;
    const float l = float(lr[id]);
    const float z = fma(l - st.max_logit, args.inv_temperature, lily_gumbel(key, id));
    if (sample_better(z, id, p.value, p.id)) {
      p.value = z;
      p.logit = l;
      p.id = id;
    }
  }
  if (status == 0)
    for (uint32_t g = t; g < args.groups; g += threads) p = sample_merge(p, sample_load(part + row * args.groups + g));
  sample_tg_store(recs + t * kSampleRecordWords, p);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t == 0) {
    const SamplePartial best = sample_combine(recs, threads);
    sample_write_error_or(ids, chosen_logit, args.slot + row, status | (best.id == kSampleNoId ? uint32_t(kSampleStatusNoFinite) : 0u),
                          best.id, best.logit);
  }
}


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


LILY_INSTANTIATE("sample_max_partial_f32", sample_max_partial<float>)
LILY_INSTANTIATE("sample_max_final", sample_max_final<float>)
LILY_INSTANTIATE("sample_max_final_buckets", sample_max_final_buckets<float>)
LILY_INSTANTIATE("sample_gumbel_partial_f32", sample_gumbel_partial<float>)
LILY_INSTANTIATE("sample_gumbel_final", sample_gumbel_final<float>)
LILY_INSTANTIATE("sample_topk_partial_f32", sample_topk_partial<float>)
LILY_INSTANTIATE("sample_topk_merge_f32", sample_topk_merge<float>)
LILY_INSTANTIATE("sample_hist_partial_f32", sample_hist_partial<float>)
LILY_INSTANTIATE("sample_select", sample_select<float>)
LILY_INSTANTIATE("sample_collect_f32", sample_collect<float>)
LILY_INSTANTIATE("sample_resolve_f32", sample_resolve<float>)
LILY_INSTANTIATE("sample_lse_partial_f32", sample_lse_partial<float>)
LILY_INSTANTIATE("sample_logprobs", sample_logprobs<float>)
LILY_INSTANTIATE("sample_noise", sample_noise<float>)

}  // namespace lily
