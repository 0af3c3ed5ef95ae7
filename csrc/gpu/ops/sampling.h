// Argmax and sampling over rows of logits, writing the chosen token id into a device slot.
// Kernels: shaders/sampling.metal, sampling_buckets.metal, sampling_logprobs.metal. Constants and
// records: shaders/common/args_sampling.h.
// Reference: lily_py.sampling (sample / keep_mask), reproduced bit for bit.
#pragma once
#include <cstdint>
#include <vector>

#include "gpu/encoder.h"

namespace lily::gpu::ops {

struct SampleParams {
  bool greedy = true;          // argmax, ties to the lowest id
  double temperature = 1.0;    // > 0 when not greedy
  uint32_t top_k = 0;          // 0 = off
  double top_p = 1.0;          // 1 = off
  double min_p = 0.0;          // 0 = off
  uint64_t seed = 0;
  uint32_t step = 0;
  int32_t logprobs = -1;       // -1 = off; else also the logprob record with this many top entries (<= 20)
};

struct SampleOperands {
  Binding logits;        // float32 [rows, stride]
  Binding ids;           // uint32 [>= slot + rows]: row r's token goes to ids[slot + r]
  Binding chosen_logit;  // float32 [>= slot + rows]: its raw logit
  Binding state;         // scratch: SampleState [rows] (status / bad_id readable after the call)
  Binding partials;      // scratch: SamplePartial [rows * groups]
  Binding hist;          // scratch (sampling only): small-k candidates / bucket route words
  Binding logprobs;      // uint32 [>= (slot + rows) * kSampleLogprobWords] (params.logprobs >= 0)
  // Optional allowed-token bitset, uint32 [rows, ceil(valid_vocab / 32)] (bit i % 32 of word
  // i / 32: token i allowed). Bound: disallowed logits become -inf in place before every route.
  Binding mask;
  uint32_t rows = 0, stride = 0, valid_vocab = 0, slot = 0;
  SampleParams params;
  // Bucket route: candidates collected at most before resolve scans the row instead (tests lower
  // it to run the fallback on every input); <= kSampleCandidates.
  uint32_t candidate_cap = kSampleCandidates;
};

// Which passes a call encodes (decided from the parameters alone, never from the data).
struct SamplePlan {
  bool greedy = false;       // max partial + final only (2 levels)
  bool plain = false;        // temperature only: + Gumbel partial + final (4 levels)
  bool small_k = false;      // 0 < top_k <= kSampleSmallK: + per-group candidates + one merge (4 levels)
  bool buckets = false;      // any other filter: + histogram, select, collect, resolve (6 levels)
  int32_t logprobs = -1;     // >= 0: + top-k candidates (when > 0) and sums, then the record (2 levels)
  uint32_t dispatches() const;
};

uint32_t sample_groups(uint32_t valid_vocab);  // partial threadgroups per row
uint32_t mask_words(uint32_t valid_vocab);     // uint32 words of a row's allowed-token bitset
SamplePlan sample_plan(const SampleOperands& op);
// Scratch sizes in bytes for rows x valid_vocab.
size_t sample_state_bytes(uint32_t rows);
size_t sample_partials_bytes(uint32_t rows, uint32_t valid_vocab);
size_t sample_hist_bytes(uint32_t rows, uint32_t valid_vocab);
// Throws std::invalid_argument naming the bad operand or parameter.
void validate(const SampleOperands& op);
// The parameters' part of validate (a call sampling ids < valid_vocab with them).
void validate_params(const SampleParams& params, uint32_t valid_vocab);
// Bucket route: the bucket scale of a temperature (x = -s * scale; any positive value is exact).
float sample_bin_scale(double temperature);
// Encodes the plan's dispatches with a barrier between consecutive ones (each reads what the
// previous wrote); no barrier after the last one.
void encode_sample(Encoder& enc, const SampleOperands& op);
// Several calls (each row of a batched step with its own parameters) in the levels of the deepest:
// level i of every call, then one barrier, then level i + 1. The calls must not share scratch
// (state, partials, hist) or output entries. Each is validated before anything is encoded.
void encode_samples(Encoder& enc, const std::vector<SampleOperands>& ops);

// The Gumbel noise of (seed, step) for ids 0..n-1 into out (float32 [n]); for tests.
void encode_sample_noise(Encoder& enc, const Binding& out, uint32_t n, uint64_t seed, uint32_t step);

}  // namespace lily::gpu::ops
