// Args struct and records of the argmax / sampling kernels (shaders/sampling*.metal, host:
// csrc/gpu/ops/sampling.cpp). Included from common/args.h. Only 32-bit fields: 64-bit masses are
// stored as (lo, hi) pairs, so host, emulator and Metal agree on every layout.
#pragma once

namespace lily {

enum : uint32_t {
  kSampleThreads = 64,                             // threads per threadgroup, every partial kernel
  kSampleStrip = 32,                               // consecutive entries per thread (partials)
  kSampleChunk = kSampleThreads * kSampleStrip,    // entries per threadgroup (partials) = 2048
  kSampleFinalThreads = 32,                        // the per-row final kernels
  kSampleRecordWords = 8,                          // a SamplePartial in threadgroup memory
  kSampleSmallK = 64,                              // top_k <= this: the small-k route (candidates)
  kSampleMergeThreads = 256,                       // the small-k merge kernel (one per row)
  // The bucket route (any other filter): a histogram of the scaled logits over kSampleHistBins
  // monotone buckets, the cutoff buckets found from it, their entries collected, the cutoff
  // resolved exactly among them (shaders/sampling_buckets.metal, "The bucket route").
  kSampleHistBins = 1024,                          // buckets (bin 0: the largest s)
  kSampleTailBin = 1022,                           // finite s beyond the last tier
  kSampleInfBin = 1023,                            // s = -inf
  kSampleMaxVocab = 1u << 18,                      // bucket masses: 14-bit pieces summed in uint32
  kSampleCandidates = 4096,                        // collected entries per row (more: fallback)
  kSampleSelectThreads = 256,                      // sample_select (4 bins per thread)
  kSampleResolveThreads = 256,                     // sample_resolve
  kSampleBinWords = 4,                             // global bucket: count, mass pieces w2, w1, w0
  kSampleCumWords = 4,                             // cumulative bucket: count, mass lo, hi, pad
  // Per-row words of the hist scratch (bucket route): buckets, cumulative buckets, candidates.
  kSampleRowWords = kSampleHistBins * (kSampleBinWords + kSampleCumWords) + 2 * kSampleCandidates,
  kSampleMaxLogprobs = 20,                         // top_logprobs <= this
  // Logprob record per (slot + row): word 0 the chosen token's logprob (float), word 1 the number
  // n of top entries found (<= top_logprobs), then n (id, logprob) pairs, most likely first.
  kSampleLogprobWords = 2 + 2 * kSampleMaxLogprobs,
  kSampleNoId = 0xFFFFFFFFu,                       // "no token" / the error sentinel id
  kSampleStatusNaN = 1,                            // a NaN logit below valid_vocab
  kSampleStatusPosInf = 2,                         // a +inf logit below valid_vocab
  kSampleStatusNoFinite = 4,                       // every logit below valid_vocab is -inf
};

// One struct for the family (fields a kernel does not use are ignored).
struct SampleArgs {
  uint32_t rows;             // R rows of logits (grid.y)
  uint32_t stride;           // elements between rows of logits
  uint32_t valid_vocab;      // ids >= valid_vocab are never read nor chosen
  uint32_t groups;           // G = ceil(valid_vocab / kSampleChunk) partial threadgroups per row
  float inv_temperature;     // float32(1 / temperature): s = (l - max l) * inv_temperature
  float min_p_log;           // float32(log(min_p)); -inf = off
  uint32_t top_k;            // 0 = off (the host also sends 0 when top_k >= valid_vocab)
  uint32_t top_p;            // floor(top_p * 2^32); 0 = off
  uint32_t seed_lo, seed_hi; // the 64-bit seed
  uint32_t step;             // generation step
  uint32_t slot;             // row r writes ids[slot + r] (and chosen_logit[slot + r])
  float bin_scale;           // bucket route: bucket of s from x = -s * bin_scale (any > 0 is exact)
  uint32_t cap;              // bucket route: candidates collected at most (<= kSampleCandidates)
  uint32_t greedy;           // max_final: 1 = write the argmax as the chosen token
  uint32_t buckets;          // max_final: 1 = zero the bucket histogram of the row (bucket route)
  uint32_t masked;           // max_partial: 1 = apply the allowed-token bitset (disallowed -> -inf in place)
  uint32_t mask_stride;      // words between rows of the bitset
};

// Per-(row, threadgroup) result of a partial kernel (max, gumbel).
struct SamplePartial {
  float value;      // max logit / best perturbed score
  float logit;      // the raw logit of `id`
  uint32_t id;      // its token id (kSampleNoId: none)
  uint32_t status;  // kSampleStatus* bits
  uint32_t bad_id;  // lowest id with a NaN / +inf logit (kSampleNoId: none)
  uint32_t count;   // unused
  uint32_t mass_lo, mass_hi;  // unused
};

// Per-row state the kernels of one sampling call hand to each other (device memory).
struct SampleState {
  float max_logit;
  uint32_t max_id;
  uint32_t status;
  uint32_t bad_id;
  uint32_t min_p_count;           // bucket route (atomic): entries with s >= min_p_log
  uint32_t cand_count;            // bucket route (atomic): entries offered to the candidate list
  uint32_t k_eff;                 // select: c = max(1, min(top_k or V, min_p_count))
  uint32_t lo, hi;                // select: collected buckets lo..hi (every bucket < lo is kept)
  uint32_t extra;                 // select: one more collected bucket (top-k's, for Z), or none
  uint32_t bin_k;                 // select: bucket of the top_k-th entry when Z needs it, else none
  uint32_t z_lo, z_hi;            // select: Z (top-k set's mass) when known exactly
  uint32_t fallback;              // select: 1 = too many candidates, resolve scans the row
  uint32_t collected;             // select: entries in the collected buckets
  uint32_t use_p;                 // select: 1 = top-p can end the kept set before k_eff
  uint32_t pad;
};

}  // namespace lily
