#include "gpu/ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace lily::gpu::ops {

namespace {

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

Binding range(Binding b, uint64_t bytes) {
  b.bytes = bytes;
  return b;
}

// Host-side parameter encodings; must match lily_py.sampling (inverse_temperature,
// top_p_fixed, min_p_threshold).
float inverse_temperature(double t) { return static_cast<float>(1.0 / t); }
uint32_t top_p_fixed(double p) {
  const double t = std::floor(p * 4294967296.0);
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}
float min_p_threshold(double m) {
  return m > 0 ? static_cast<float>(std::log(m)) : -std::numeric_limits<float>::infinity();
}

}  // namespace

uint32_t sample_groups(uint32_t valid_vocab) { return ceil_div(valid_vocab, kSampleChunk); }
uint32_t mask_words(uint32_t valid_vocab) { return ceil_div(valid_vocab, 32); }

uint32_t SamplePlan::dispatches() const {
  const uint32_t lp = logprobs < 0 ? 0u : logprobs == 0 ? 2u : 3u;
  if (greedy) return 2 + lp;
  if (buckets) return 6 + lp;
  return 4 + lp;  // plain, small_k
}

SamplePlan sample_plan(const SampleOperands& op) {
  SamplePlan p;
  const SampleParams& s = op.params;
  p.logprobs = s.logprobs;
  if (s.greedy || std::isinf(inverse_temperature(s.temperature))) {
    p.greedy = true;
    return p;
  }
  const bool top_k = s.top_k != 0 && s.top_k < op.valid_vocab;
  const bool top_p = s.top_p < 1.0;
  const bool min_p = s.min_p > 0.0;
  if (top_k && s.top_k <= kSampleSmallK) p.small_k = true;
  else if (top_k || top_p || min_p) p.buckets = true;
  else p.plain = true;
  return p;
}

float sample_bin_scale(double temperature) {
  // x = -s * 64 T ~ -64 (l - max l): 1/64-logit buckets near the top whatever the temperature.
  const double c = 64.0 * temperature;
  return static_cast<float>(std::min(std::max(c, 0x1p-60), 0x1p60));
}

size_t sample_state_bytes(uint32_t rows) { return size_t(rows) * sizeof(SampleState); }
size_t sample_partials_bytes(uint32_t rows, uint32_t v) { return size_t(rows) * sample_groups(v) * sizeof(SamplePartial); }
size_t sample_hist_bytes(uint32_t rows, uint32_t v) {
  // The small-k route's candidates (2 words x kSampleSmallK per group), or the bucket route's
  // buckets, cumulative buckets and candidates (kSampleRowWords per row).
  const size_t small_k = size_t(sample_groups(v)) * 2 * kSampleSmallK * 4;
  return size_t(rows) * std::max<size_t>(small_k, size_t(kSampleRowWords) * 4);
}

void validate_params(const SampleParams& s, uint32_t valid_vocab) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("sample: " + m); };
  if (!s.greedy && !(s.temperature > 0)) fail("temperature must be > 0 when sampling");
  if (!(s.top_p > 0 && s.top_p <= 1)) fail("top_p must be in (0, 1]");
  if (!(s.min_p >= 0 && s.min_p <= 1)) fail("min_p must be in [0, 1]");
  if (s.logprobs < -1 || s.logprobs > int32_t(kSampleMaxLogprobs))
    fail("logprobs must be -1 (off) or a top count in [0, " + std::to_string(kSampleMaxLogprobs) + "]");
  SampleOperands op;
  op.params = s;
  op.valid_vocab = valid_vocab;
  if (sample_plan(op).buckets && valid_vocab > kSampleMaxVocab)
    fail("valid_vocab " + std::to_string(valid_vocab) + " > " + std::to_string(kSampleMaxVocab) + " (bucket masses)");
}

void validate(const SampleOperands& op) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("sample: " + m); };
  if (op.rows == 0 || op.valid_vocab == 0) fail("empty shape");
  if (op.stride < op.valid_vocab) fail("stride " + std::to_string(op.stride) + " < valid_vocab " + std::to_string(op.valid_vocab));
  const SampleParams& s = op.params;
  validate_params(s, op.valid_vocab);
  if (op.candidate_cap > kSampleCandidates) fail("candidate_cap must be <= " + std::to_string(kSampleCandidates));
  auto need = [&](const Binding& b, uint64_t bytes, const char* what) {
    if (b.buffer == nullptr) fail(std::string(what) + " not bound");
    if (b.bytes < bytes) fail(std::string(what) + " range has " + std::to_string(b.bytes) + " bytes, needs " + std::to_string(bytes));
  };
  need(op.logits, ((uint64_t(op.rows) - 1) * op.stride + op.valid_vocab) * 4, "logits");
  need(op.ids, (uint64_t(op.slot) + op.rows) * 4, "ids");
  need(op.chosen_logit, (uint64_t(op.slot) + op.rows) * 4, "chosen_logit");
  need(op.state, sample_state_bytes(op.rows), "state");
  need(op.partials, sample_partials_bytes(op.rows, op.valid_vocab), "partials");
  if (op.mask.buffer != nullptr) need(op.mask, uint64_t(op.rows) * mask_words(op.valid_vocab) * 4, "mask");
  if (s.logprobs >= 0) need(op.logprobs, (uint64_t(op.slot) + op.rows) * kSampleLogprobWords * 4, "logprobs");
  if (sample_plan(op).small_k || sample_plan(op).buckets || s.logprobs > 0) need(op.hist, sample_hist_bytes(op.rows, op.valid_vocab), "hist");
}

namespace {

// One call's dispatches by level: every dispatch of level i reads what level i - 1 wrote (a
// barrier between two levels), dispatches of one level are independent. Each closure sets its
// kernel, args and buffers in full, so the levels of several calls can interleave.
using Level = std::vector<std::function<void(Encoder&)>>;

std::vector<Level> sample_levels(const SampleOperands& op) {
  validate(op);
  const SamplePlan plan = sample_plan(op);
  const SampleParams& s = op.params;
  const uint32_t G = sample_groups(op.valid_vocab);
  SampleArgs a{};
  a.rows = op.rows;
  a.stride = op.stride;
  a.valid_vocab = op.valid_vocab;
  a.groups = G;
  a.inv_temperature = plan.greedy ? 1.0f : inverse_temperature(s.temperature);
  a.min_p_log = plan.greedy ? -std::numeric_limits<float>::infinity() : min_p_threshold(s.min_p);
  a.top_k = (s.top_k != 0 && s.top_k < op.valid_vocab) ? s.top_k : 0;
  a.top_p = s.top_p < 1.0 ? top_p_fixed(s.top_p) : 0;
  a.seed_lo = static_cast<uint32_t>(s.seed);
  a.seed_hi = static_cast<uint32_t>(s.seed >> 32);
  a.step = s.step;
  a.slot = op.slot;
  a.greedy = plan.greedy ? 1 : 0;
  a.buckets = plan.buckets ? 1 : 0;
  a.bin_scale = plan.buckets ? sample_bin_scale(s.temperature) : 1.0f;
  a.cap = op.candidate_cap;
  a.masked = op.mask.buffer != nullptr ? 1 : 0;
  a.mask_stride = mask_words(op.valid_vocab);

  const Binding logits = range(op.logits, ((uint64_t(op.rows) - 1) * op.stride + op.valid_vocab) * 4);
  const Binding ids = range(op.ids, (uint64_t(op.slot) + op.rows) * 4);
  const Binding chosen = range(op.chosen_logit, (uint64_t(op.slot) + op.rows) * 4);
  const Binding state = range(op.state, sample_state_bytes(op.rows));
  const Binding parts = range(op.partials, sample_partials_bytes(op.rows, op.valid_vocab));
  const Binding hist = (plan.greedy || plan.plain) && plan.logprobs <= 0 ? Binding{} : range(op.hist, sample_hist_bytes(op.rows, op.valid_vocab));
  const uint64_t bins_bytes = uint64_t(op.rows) * kSampleHistBins * kSampleBinWords * 4;
  const Size3 partial_grid{G, op.rows, 1}, final_grid{1, op.rows, 1};
  const Size3 partial_threads{kSampleThreads, 1, 1}, final_threads{kSampleFinalThreads, 1, 1};
  std::vector<Level> levels;
  // A dispatch of its own level. The buffers bind at indices 1, 2, ... in the order given (index
  // 0 is the args); touched: (index, bytes) overrides.
  auto level = [&](KernelId k, const SampleArgs& args, std::vector<Binding> buffers, Size3 grid, Size3 threads,
                   std::vector<std::pair<uint32_t, uint64_t>> touched = {}, bool same_level = false) {
    auto d = [=](Encoder& enc) {
      enc.set_kernel(k);
      enc.set_args(args);
      uint32_t index = 1;
      for (const Binding& b : buffers) enc.set_buffer(index++, b);
      for (auto [i, n] : touched) enc.set_touched(i, n);
      enc.dispatch(grid, threads);
    };
    if (same_level) levels.back().push_back(d);
    else levels.push_back(Level{d});
  };

  // Unmasked: the state binding stands in for the mask (never read).
  if (a.masked) {
    level(KernelId::sample_max_partial_f32, a, {logits, parts, range(op.mask, uint64_t(op.rows) * a.mask_stride * 4)},
          partial_grid, partial_threads);
  } else {
    level(KernelId::sample_max_partial_f32, a, {logits, parts, state}, partial_grid, partial_threads, {{3, 0}});
  }
  if (plan.buckets) level(KernelId::sample_max_final_buckets, a, {parts, state, hist}, final_grid, final_threads, {{3, bins_bytes}});
  else level(KernelId::sample_max_final, a, {parts, state, ids, chosen}, final_grid, final_threads);
  if (plan.small_k) {
    const uint64_t cand = uint64_t(op.rows) * G * a.top_k * 8;  // (s, id) per candidate
    level(KernelId::sample_topk_partial_f32, a, {logits, state, hist}, partial_grid, partial_threads, {{3, cand}});
    // the merge reads the chosen entry's logit only
    level(KernelId::sample_topk_merge_f32, a, {logits, state, hist, ids, chosen}, final_grid,
          Size3{kSampleMergeThreads, 1, 1}, {{1, uint64_t(op.rows) * 4}, {3, cand}});
  } else if (plan.plain) {
    level(KernelId::sample_gumbel_partial_f32, a, {logits, state, parts}, partial_grid, partial_threads);
    level(KernelId::sample_gumbel_final, a, {parts, state, ids, chosen}, final_grid, final_threads);
  } else if (plan.buckets) {
    // Touched bytes: the buckets, the cumulative buckets, and at most cap candidates (the
    // fallback re-reads the row instead; not counted).
    const uint64_t cum_bytes = uint64_t(op.rows) * kSampleHistBins * kSampleCumWords * 4;
    const uint64_t cand_bytes = uint64_t(op.rows) * a.cap * 8;
    level(KernelId::sample_hist_partial_f32, a, {logits, state, hist}, partial_grid, partial_threads, {{3, bins_bytes}});
    level(KernelId::sample_select, a, {state, hist}, final_grid, Size3{kSampleSelectThreads, 1, 1},
          {{2, bins_bytes + cum_bytes}});
    level(KernelId::sample_collect_f32, a, {logits, state, hist, parts}, partial_grid, partial_threads, {{3, cand_bytes}});
    // the candidates' logits
    level(KernelId::sample_resolve_f32, a, {logits, state, hist, parts, ids, chosen}, final_grid,
          Size3{kSampleResolveThreads, 1, 1}, {{1, cand_bytes / 2}, {3, cum_bytes + cand_bytes}});
  }
  if (plan.logprobs < 0) return levels;

  // Logprobs: the top candidates of s = l - max (the small-k partial at temperature 1) and the
  // groups' sums of exp(s), one level; then the record. Both overwrite scratch the route is done
  // with (hist, partials).
  SampleArgs lp = a;
  lp.inv_temperature = 1.0f;
  lp.top_k = uint32_t(plan.logprobs);
  const Binding sums = range(op.partials, uint64_t(op.rows) * G * 4);
  const Binding records = range(op.logprobs, (uint64_t(op.slot) + op.rows) * kSampleLogprobWords * 4);
  const Binding lp_hist = range(op.hist, sample_hist_bytes(op.rows, op.valid_vocab));
  const uint64_t lp_cand = uint64_t(op.rows) * G * lp.top_k * 8;
  if (lp.top_k > 0) level(KernelId::sample_topk_partial_f32, lp, {logits, state, lp_hist}, partial_grid, partial_threads, {{3, lp_cand}});
  // same level: reads what the route left
  level(KernelId::sample_lse_partial_f32, lp, {logits, state, sums}, partial_grid, partial_threads, {}, lp.top_k > 0);
  if (lp.top_k > 0) {
    level(KernelId::sample_logprobs, lp, {state, lp_hist, sums, chosen, records}, final_grid,
          Size3{kSampleMergeThreads, 1, 1}, {{2, lp_cand}});
  } else {
    level(KernelId::sample_logprobs, lp, {state, sums, sums, chosen, records}, final_grid, Size3{kSampleMergeThreads, 1, 1});
  }
  return levels;
}

}  // namespace

void encode_samples(Encoder& enc, const std::vector<SampleOperands>& ops) {
  std::vector<std::vector<Level>> all;
  size_t depth = 0;
  for (const SampleOperands& op : ops) {  // every call validated before anything is encoded
    all.push_back(sample_levels(op));
    depth = std::max(depth, all.back().size());
  }
  for (size_t i = 0; i < depth; ++i) {
    if (i) enc.barrier();
    for (const std::vector<Level>& levels : all)
      if (i < levels.size())
        for (const auto& d : levels[i]) d(enc);
  }
}

void encode_sample(Encoder& enc, const SampleOperands& op) { encode_samples(enc, {op}); }

void encode_sample_noise(Encoder& enc, const Binding& out, uint32_t n, uint64_t seed, uint32_t step) {
  if (n == 0) throw std::invalid_argument("sample_noise: n must be > 0");
  if (out.buffer == nullptr || out.bytes < uint64_t(n) * 4) throw std::invalid_argument("sample_noise: out too small");
  SampleArgs a{};
  a.rows = 1;
  a.stride = n;
  a.valid_vocab = n;
  a.groups = sample_groups(n);
  a.seed_lo = static_cast<uint32_t>(seed);
  a.seed_hi = static_cast<uint32_t>(seed >> 32);
  a.step = step;
  enc.set_kernel(KernelId::sample_noise);
  enc.set_args(a);
  enc.set_buffer(1, range(out, uint64_t(n) * 4));
  enc.dispatch({a.groups, 1, 1}, {kSampleThreads, 1, 1});
}

}  // namespace lily::gpu::ops
