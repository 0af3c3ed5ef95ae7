// Args struct and records of the argmax / sampling kernels (shaders/sampling.metal, host:
// csrc/gpu/ops/sampling.cpp). Included from common/args.h. Only 32-bit fields: 64-bit masses are
// stored as (lo, hi) pairs, so host, emulator and Metal agree on every layout.
#pragma once

namespace lily {

enum : uint32_t {
  kSampleThreads = 64,                             // threads per threadgroup, every kernel
  kSampleStrip = 32,                               // consecutive entries per thread (partials)
  kSampleChunk = kSampleThreads * kSampleStrip,    // entries per threadgroup (partials) = 2048
  kSampleFinalThreads = 32,                        // the per-row final / select kernels
  kSampleDigitBits = 4,                            // radix of the cutoff search
  kSampleBins = 16,                                // 2^kSampleDigitBits
  kSampleRounds = 8,                               // 32-bit keys / 4-bit digits
  kSampleRecordWords = 8,                          // a SamplePartial in threadgroup memory
  kSampleSmallK = 64,                              // top_k <= this: the small-k route (candidates)
  kSampleMergeThreads = 256,                       // the small-k merge kernel (one per row)
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
  uint32_t shift;            // hist / select: digit position 28, 24, ..., 0
  uint32_t search;           // hist / select: 0 = the top-k set (its mass Z), 1 = the kept set
  uint32_t greedy;           // max_final: 1 = write the argmax as the chosen token
  uint32_t pad;
};

// Per-(row, threadgroup) result of a partial kernel (max, stats, gumbel).
struct SamplePartial {
  float value;      // max logit / best perturbed score
  float logit;      // the raw logit of `id`
  uint32_t id;      // its token id (kSampleNoId: none)
  uint32_t status;  // kSampleStatus* bits
  uint32_t bad_id;  // lowest id with a NaN / +inf logit (kSampleNoId: none)
  uint32_t count;   // stats: entries with s >= min_p_log
  uint32_t mass_lo, mass_hi;  // stats: sum of the fixed-point masses
};

// Per-(row, threadgroup, digit) histogram of the cutoff search.
struct SampleBin {
  uint32_t count;
  uint32_t mass_lo, mass_hi;
  uint32_t pad;
};

// Per-row state the kernels of one sampling call hand to each other (device memory).
struct SampleState {
  float max_logit;
  uint32_t max_id;
  uint32_t status;
  uint32_t bad_id;
  uint32_t k_eff;                 // count bound: min(top_k, #entries with s >= min_p_log)
  uint32_t limit_lo, limit_hi;    // top-p mass limit P (all ones: off)
  uint32_t total_lo, total_hi;    // Z over all valid entries (stats)
  uint32_t prefix;                // search: key digits fixed so far
  uint32_t above_count;           // search: entries above the current key bucket
  uint32_t above_lo, above_hi;    // search: their mass
  uint32_t cut_key;               // result: key of the last kept entry
  uint32_t keep_ties;             // result: entries with key == cut_key kept (lowest ids first)
  uint32_t tie_digit;             // result: the last digit (its histogram counts the ties)
  uint32_t filtered;              // 0: every valid entry is kept
  uint32_t pad[2];
};

}  // namespace lily
