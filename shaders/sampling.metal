// Argmax (greedy) and sampling (temperature, top-k, top-p, min-p, Gumbel-max) over a vocabulary of
// up to 248,320 logits per row, writing the chosen token id into a uint32 device slot.
// Host: csrc/gpu/ops/sampling.cpp (the pass sequence). Reference: lily_py.sampling (must match
// bit for bit; see docs/kernels.md "Sampling" for the exact-reproduction argument).
//
// Shapes: logits float32 [R, stride], entries 0 .. valid_vocab-1 of each row are read; ids uint32
// and chosen_logit float32 [>= slot + R]. Partial kernels: grid (G, R), G = ceil(valid_vocab /
// 2048), 64 threads (two simdgroups); simdgroup q owns the 1024 entries g*2048 + 1024q .. +1024
// and reads them in 32 rounds, lane l taking entry 32r + l of round r (sample_entry): every load
// instruction of a simdgroup covers 128 consecutive bytes. Id order is (simdgroup, round, lane)
// order, which the Gumbel pass's tie ranking relies on. Final / select kernels: grid (1, R), 32
// threads.
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
// NaN / +inf detection. grid (G, R) x 64.
template <typename T>
[[kernel]] void sample_max_partial(constant SampleArgs& args [[buffer(0)]],
                                   const device T* logits [[buffer(1)]],
                                   device SamplePartial* part [[buffer(2)]],
                                   LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y, g = group_pos.x;
  const device T* lr = logits + ulong(row) * args.stride;
  SamplePartial p = sample_empty();
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    if (i >= args.valid_vocab) break;
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
// ids[slot + row]); initialises the filter state of a sampling call. grid (1, R) x 32.
template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_max_final(constant SampleArgs& args [[buffer(0)]],
                                 const device SamplePartial* part [[buffer(1)]],
                                 device SampleState* state [[buffer(2)]],
                                 device uint32_t* ids [[buffer(3)]],
                                 device float* chosen_logit [[buffer(4)]],
                                 LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleFinalThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y;
  const SamplePartial p = sample_reduce_row(part + row * args.groups, recs, args.groups, thread_pos.x, group_size.x);
  if (thread_pos.x == 0) {
    uint32_t status = p.status;
    if (p.id == kSampleNoId || (isinf(p.value) && p.value < 0.0f)) status |= kSampleStatusNoFinite;
    device SampleState& st = state[row];
    st.max_logit = p.value;
    st.max_id = p.id;
    st.status = status;
    st.bad_id = p.bad_id;
    st.k_eff = args.top_k ? args.top_k : args.valid_vocab;
    st.limit_lo = 0xFFFFFFFFu;
    st.limit_hi = 0xFFFFFFFFu;
    st.total_lo = 0;
    st.total_hi = 0;
    st.prefix = 0;
    st.above_count = 0;
    st.above_lo = 0;
    st.above_hi = 0;
    st.cut_key = 0;
    st.keep_ties = 0;
    st.tie_digit = 0;
    st.filtered = 0;
    if (args.greedy) sample_write_error_or(ids, chosen_logit, args.slot + row, status, p.id, p.logit);
  }
}

// Valid entries of a row for the kernels after max_final: none when the row is in error.
inline uint32_t sample_valid_end(constant SampleArgs& args, const device SampleState& st) {
  return st.status ? 0u : args.valid_vocab;
}

inline float sample_scaled(float l, float max_logit, float inv_temperature) {
  return (l - max_logit) * inv_temperature;  // -inf stays -inf; the max entry gives exactly 0
}

// ---------------------------------------------------------------------------------------------
// sample_stats_partial: per (row, group) the number of entries with s >= min_p_log and the sum
// of their fixed-point masses over all entries (Z without top-k). grid (G, R) x 64.
template <typename T>
[[kernel]] void sample_stats_partial(constant SampleArgs& args [[buffer(0)]],
                                     const device T* logits [[buffer(1)]],
                                     const device SampleState* state [[buffer(2)]],
                                     device SamplePartial* part [[buffer(3)]],
                                     LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y, g = group_pos.x;
  const device SampleState& st = state[row];
  const uint32_t end = sample_valid_end(args, st);
  const device T* lr = logits + ulong(row) * args.stride;
  SamplePartial p = sample_empty();
  ulong mass = 0;
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    if (i >= end) break;
    const float s = sample_scaled(float(lr[i]), st.max_logit, args.inv_temperature);
    p.count += s >= args.min_p_log ? 1u : 0u;
    mass += lily_mass(s);
  }
  p.mass_lo = uint32_t(mass);
  p.mass_hi = uint32_t(mass >> 32);
  sample_tg_store(recs + thread_pos.x * kSampleRecordWords, p);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_pos.x == 0) sample_store(part + row * args.groups + g, sample_combine(recs, group_size.x));
}

// sample_stats_final: k_eff = min(top_k, count) and, top-p without top-k, P from Z. grid (1, R) x 32.
template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_stats_final(constant SampleArgs& args [[buffer(0)]],
                                   const device SamplePartial* part [[buffer(1)]],
                                   device SampleState* state [[buffer(2)]],
                                   LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleFinalThreads * kSampleRecordWords]);
  const uint32_t row = group_pos.y;
  const SamplePartial p = sample_reduce_row(part + row * args.groups, recs, args.groups, thread_pos.x, group_size.x);
  if (thread_pos.x == 0) {
    device SampleState& st = state[row];
    st.total_lo = p.mass_lo;
    st.total_hi = p.mass_hi;
    if (!isinf(args.min_p_log)) st.k_eff = min(st.k_eff, max(p.count, 1u));
    if (args.top_p != 0 && args.top_k == 0) {
      const ulong P = lily_top_p_limit(lily_u64(p.mass_lo, p.mass_hi), args.top_p);
      st.limit_lo = uint32_t(P);
      st.limit_hi = uint32_t(P >> 32);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The cutoff search: the kept set is a prefix of the sorted order (value descending, id
// ascending), so it is {key > cut_key} plus the keep_ties lowest ids with key == cut_key, where
// cut_key is the order key of the last kept entry. Found digit by digit (4 bits, from the top):
// sample_hist_partial histograms the entries inside the current key bucket; sample_select walks
// the 16 bins from the top with the running count/mass above them and keeps the lowest non-empty
// bin whose top entry is still kept (count above < bound and mass above < P).

// sample_hist_partial: grid (G, R) x 64. Each thread counts into its own row of 16 bins in
// threadgroup memory (rows padded to 17 words against bank conflicts): the count and the mass's
// two 20-bit halves (integer sums, exact in any order); then thread d < 16 sums bin d over rows.
constant constexpr uint32_t kSampleBinRow = kSampleBins + 1;

template <typename T>
[[kernel]] void sample_hist_partial(constant SampleArgs& args [[buffer(0)]],
                                    const device T* logits [[buffer(1)]],
                                    const device SampleState* state [[buffer(2)]],
                                    device SampleBin* hist [[buffer(3)]],
                                    LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, counts, [kSampleThreads * kSampleBinRow]);
  LILY_TG_ARRAY(uint32_t, mass_hi, [kSampleThreads * kSampleBinRow]);  // sum of mass >> 20
  LILY_TG_ARRAY(uint32_t, mass_lo, [kSampleThreads * kSampleBinRow]);  // sum of mass & (2^20 - 1)
  const uint32_t row = group_pos.y, g = group_pos.x;
  const device SampleState& st = state[row];
  const uint32_t end = sample_valid_end(args, st);
  const device T* lr = logits + ulong(row) * args.stride;
  const uint32_t shift = args.shift;
  const bool first = shift + kSampleDigitBits >= 32;
  const uint32_t mine = thread_pos.x * kSampleBinRow;
  for (uint32_t d = 0; d < kSampleBins; ++d) {
    counts[mine + d] = 0;
    mass_hi[mine + d] = 0;
    mass_lo[mine + d] = 0;
  }
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    if (i >= end) break;
    const float s = sample_scaled(float(lr[i]), st.max_logit, args.inv_temperature);
    const uint32_t key = lily_order_key(s);
    if (first || (key >> (shift + kSampleDigitBits)) == (st.prefix >> (shift + kSampleDigitBits))) {
      const uint32_t d = (key >> shift) & (kSampleBins - 1);
      const ulong m = lily_mass(s);  // <= 2^40: halves <= 2^20, their sums over 2048 entries < 2^32
      counts[mine + d] += 1;
      mass_hi[mine + d] += uint32_t(m >> 20);
      mass_lo[mine + d] += uint32_t(m & 0xFFFFFu);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_pos.x < kSampleBins) {
    const uint32_t d = thread_pos.x;
    uint32_t count = 0;
    ulong hi = 0, lo = 0;
    for (uint32_t t = 0; t < group_size.x; ++t) {
      count += counts[t * kSampleBinRow + d];
      hi += mass_hi[t * kSampleBinRow + d];
      lo += mass_lo[t * kSampleBinRow + d];
    }
    const ulong mass = (hi << 20) + lo;
    device SampleBin& b = hist[(row * args.groups + g) * kSampleBins + d];
    b.count = count;
    b.mass_lo = uint32_t(mass);
    b.mass_hi = uint32_t(mass >> 32);
    b.pad = 0;
  }
}

// sample_select: one digit of the cutoff. grid (1, R) x 32. search 0 bounds the count by top_k
// only (its result is the top-k set, whose mass Z gives P); search 1 by k_eff and P.
template <typename T>  // T: logits type of the call (unused here)
[[kernel]] void sample_select(constant SampleArgs& args [[buffer(0)]],
                              const device SampleBin* hist [[buffer(1)]],
                              device SampleState* state [[buffer(2)]],
                              LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, counts, [kSampleBins]);
  LILY_TG_ARRAY(ulong, masses, [kSampleBins]);
  const uint32_t row = group_pos.y;
  if (thread_pos.x < kSampleBins) {
    uint32_t count = 0;
    ulong mass = 0;
    for (uint32_t g = 0; g < args.groups; ++g) {
      const device SampleBin& b = hist[(row * args.groups + g) * kSampleBins + thread_pos.x];
      count += b.count;
      mass += lily_u64(b.mass_lo, b.mass_hi);
    }
    counts[thread_pos.x] = count;
    masses[thread_pos.x] = mass;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (thread_pos.x == 0) {
    device SampleState& st = state[row];
    const bool first = args.shift + kSampleDigitBits >= 32;
    const uint32_t bound = args.search == 0 ? args.top_k : st.k_eff;
    const ulong limit = args.search == 0 ? ~ulong(0) : lily_u64(st.limit_lo, st.limit_hi);
    uint32_t above_c = first ? 0u : st.above_count;
    ulong above_m = first ? ulong(0) : lily_u64(st.above_lo, st.above_hi);
    int chosen = -1;
    uint32_t chosen_c = 0;
    ulong chosen_m = 0;
    for (int d = int(kSampleBins) - 1; d >= 0; --d) {
      if (counts[d] == 0) continue;
      if (!(above_c < bound && above_m < limit)) break;
      chosen = d;
      chosen_c = above_c;
      chosen_m = above_m;
      above_c += counts[d];
      above_m += masses[d];
    }
    if (chosen >= 0) {  // always, unless the row is in error (no entries)
      const uint32_t prefix = (first ? 0u : st.prefix) | (uint32_t(chosen) << args.shift);
      st.prefix = prefix;
      st.above_count = chosen_c;
      st.above_lo = uint32_t(chosen_m);
      st.above_hi = uint32_t(chosen_m >> 32);
      if (args.shift == 0) {  // prefix is the cut key; counts[chosen] entries tie on it
        const uint32_t ties = counts[chosen];
        const ulong q = masses[chosen] / ulong(ties);  // every tie has the same mass
        uint32_t keep = min(ties, bound - chosen_c);
        if (args.search == 0) {
          const ulong Z = chosen_m + ulong(keep) * q;
          const ulong P = lily_top_p_limit(Z, args.top_p);
          st.limit_lo = uint32_t(P);
          st.limit_hi = uint32_t(P >> 32);
        } else {
          if (q > 0 && limit != ~ulong(0)) {
            const ulong by_mass = (limit - chosen_m + q - 1) / q;  // r < (P - mass above) / q
            if (by_mass < ulong(keep)) keep = uint32_t(by_mass);
          }
          st.cut_key = prefix;
          st.keep_ties = keep;
          st.tie_digit = uint32_t(chosen);
          st.filtered = 1;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// sample_gumbel_partial: per (row, group) the kept entry with the largest z = s + gumbel(seed,
// step, id) (ties to the lowest id). A tie on the cut key is kept when its rank among the ties
// (ties in earlier groups, from the last search round's histogram, + the earlier simdgroup's,
// + earlier rounds', + earlier lanes' of this round) is < keep_ties. grid (G, R) x 64.
template <typename T>
[[kernel]] void sample_gumbel_partial(constant SampleArgs& args [[buffer(0)]],
                                      const device T* logits [[buffer(1)]],
                                      const device SampleState* state [[buffer(2)]],
                                      const device SampleBin* hist [[buffer(3)]],
                                      device SamplePartial* part [[buffer(4)]],
                                      LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, recs, [kSampleThreads * kSampleRecordWords]);
  LILY_TG_ARRAY(uint32_t, simd_ties, [kSampleThreads / 32]);
  const uint32_t row = group_pos.y, g = group_pos.x;
  const device SampleState& st = state[row];
  const uint32_t end = sample_valid_end(args, st);
  const device T* lr = logits + ulong(row) * args.stride;
  const bool filtered = st.filtered != 0;

  // Ties on the cut key before this thread's next entry, in id order: earlier groups (the last
  // search round's histogram), the earlier simdgroup of this group, earlier rounds, earlier lanes.
  uint32_t rank = 0;
  if (filtered) {
    for (uint32_t h = 0; h < g; ++h) rank += hist[(row * args.groups + h) * kSampleBins + st.tie_digit].count;
    uint32_t mine = 0;
    for (uint32_t r = 0; r < kSampleStrip; ++r) {
      const uint32_t i = sample_entry(g, simd_id, lane, r);
      if (i >= end) break;
      mine += lily_order_key(sample_scaled(float(lr[i]), st.max_logit, args.inv_temperature)) == st.cut_key ? 1u : 0u;
    }
    const uint32_t total = simd_sum(mine);
    if (lane == 0) simd_ties[simd_id] = total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (filtered)
    for (uint32_t q = 0; q < simd_id; ++q) rank += simd_ties[q];

  const uint32_t key = lily_sample_key(args.seed_lo, args.seed_hi, args.step);
  SamplePartial p = sample_empty();
  for (uint32_t r = 0; r < kSampleStrip; ++r) {
    const uint32_t i = sample_entry(g, simd_id, lane, r);
    const bool valid = i < end;
    const float l = valid ? float(lr[i]) : 0.0f;
    const float s = valid ? sample_scaled(l, st.max_logit, args.inv_temperature) : 0.0f;
    const uint32_t k = lily_order_key(s);
    const uint32_t tie = (valid && filtered && k == st.cut_key) ? 1u : 0u;
    const uint32_t before = simd_prefix_exclusive_sum(tie);  // every lane takes part
    const uint32_t round_ties = simd_sum(tie);
    bool kept = valid;
    if (valid && filtered) kept = tie ? (rank + before < st.keep_ties) : k > st.cut_key;
    rank += round_ties;
    if (!kept) continue;
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
LILY_INSTANTIATE("sample_stats_partial_f32", sample_stats_partial<float>)
LILY_INSTANTIATE("sample_stats_final", sample_stats_final<float>)
LILY_INSTANTIATE("sample_hist_partial_f32", sample_hist_partial<float>)
LILY_INSTANTIATE("sample_select", sample_select<float>)
LILY_INSTANTIATE("sample_gumbel_partial_f32", sample_gumbel_partial<float>)
LILY_INSTANTIATE("sample_gumbel_final", sample_gumbel_final<float>)
LILY_INSTANTIATE("sample_topk_partial_f32", sample_topk_partial<float>)
LILY_INSTANTIATE("sample_topk_merge_f32", sample_topk_merge<float>)
LILY_INSTANTIATE("sample_noise", sample_noise<float>)

}  // namespace lily
