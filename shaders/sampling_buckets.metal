// The sampler's bucket route (any filter the small-k route does not take: top-p or min-p without
// top-k, top_k > kSampleSmallK): sample_hist_partial -> sample_select -> sample_collect ->
// sample_resolve, after sampling.metal's sample_max_partial and sample_max_final_buckets.
// Host: csrc/gpu/ops/sampling.cpp (the pass sequence). Reference: lily_py.sampling (must match
// bit for bit; docs/kernels-sampling.md). Shapes, grids, routes, precision and errors: the header
// of sampling.metal; shared records and helpers: common/sample_records.h.
#include "common/lily_metal.h"
#include "common/sampling.h"
#include "common/sample_records.h"

namespace lily {

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

// Instantiations: the bucket route rows of csrc/gpu/kernel_ids.h.
LILY_INSTANTIATE("sample_hist_partial_f32", sample_hist_partial<float>)
LILY_INSTANTIATE("sample_select", sample_select<float>)
LILY_INSTANTIATE("sample_collect_f32", sample_collect<float>)
LILY_INSTANTIATE("sample_resolve_f32", sample_resolve<float>)

}  // namespace lily
