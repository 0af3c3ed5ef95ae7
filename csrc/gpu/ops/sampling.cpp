#include "gpu/ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>

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

void validate(const SampleOperands& op) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("sample: " + m); };
  if (op.rows == 0 || op.valid_vocab == 0) fail("empty shape");
  if (op.stride < op.valid_vocab) fail("stride " + std::to_string(op.stride) + " < valid_vocab " + std::to_string(op.valid_vocab));
  const SampleParams& s = op.params;
  if (!s.greedy && !(s.temperature > 0)) fail("temperature must be > 0 when sampling");
  if (!(s.top_p > 0 && s.top_p <= 1)) fail("top_p must be in (0, 1]");
  if (!(s.min_p >= 0 && s.min_p <= 1)) fail("min_p must be in [0, 1]");
  if (s.logprobs < -1 || s.logprobs > int32_t(kSampleMaxLogprobs))
    fail("logprobs must be -1 (off) or a top count in [0, " + std::to_string(kSampleMaxLogprobs) + "]");
  if (op.candidate_cap > kSampleCandidates) fail("candidate_cap must be <= " + std::to_string(kSampleCandidates));
  if (sample_plan(op).buckets && op.valid_vocab > kSampleMaxVocab)
    fail("valid_vocab " + std::to_string(op.valid_vocab) + " > " + std::to_string(kSampleMaxVocab) + " (bucket masses)");
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

void encode_sample(Encoder& enc, const SampleOperands& op) {
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
  bool first = true;
  // Every pass reads what the previous one wrote: a barrier before each but the first. The
  // buffers bind at indices 1, 2, ... in the order given (index 0 is the args).
  auto begin = [&](KernelId k, std::initializer_list<Binding> buffers) {
    if (!first) enc.barrier();
    first = false;
    enc.set_kernel(k);
    enc.set_args(a);
    uint32_t index = 1;
    for (const Binding& b : buffers) enc.set_buffer(index++, b);
  };

  auto route = [&] {
    // Unmasked: the state binding stands in for the mask (never read).
    begin(KernelId::sample_max_partial_f32,
          {logits, parts, a.masked ? range(op.mask, uint64_t(op.rows) * a.mask_stride * 4) : state});
    if (!a.masked) enc.set_touched(3, 0);
    enc.dispatch(partial_grid, partial_threads);
    if (plan.buckets) {
      begin(KernelId::sample_max_final_buckets, {parts, state, hist});
      enc.set_touched(3, bins_bytes);
      enc.dispatch(final_grid, final_threads);
    } else {
      begin(KernelId::sample_max_final, {parts, state, ids, chosen});
      enc.dispatch(final_grid, final_threads);
    }
    if (plan.greedy) return;

    if (plan.small_k) {
      const uint64_t cand = uint64_t(op.rows) * G * a.top_k * 8;  // (s, id) per candidate
      begin(KernelId::sample_topk_partial_f32, {logits, state, hist});
      enc.set_touched(3, cand);
      enc.dispatch(partial_grid, partial_threads);
      begin(KernelId::sample_topk_merge_f32, {logits, state, hist, ids, chosen});
      enc.set_touched(1, uint64_t(op.rows) * 4);  // reads the chosen entry's logit only
      enc.set_touched(3, cand);
      enc.dispatch(final_grid, Size3{kSampleMergeThreads, 1, 1});
      return;
    }

    if (plan.plain) {
      begin(KernelId::sample_gumbel_partial_f32, {logits, state, parts});
      enc.dispatch(partial_grid, partial_threads);
      begin(KernelId::sample_gumbel_final, {parts, state, ids, chosen});
      enc.dispatch(final_grid, final_threads);
      return;
    }

    // The bucket route. Touched bytes: the buckets, the cumulative buckets, and at most cap
    // candidates (the fallback re-reads the row instead; not counted).
    const uint64_t cum_bytes = uint64_t(op.rows) * kSampleHistBins * kSampleCumWords * 4;
    const uint64_t cand_bytes = uint64_t(op.rows) * a.cap * 8;
    begin(KernelId::sample_hist_partial_f32, {logits, state, hist});
    enc.set_touched(3, bins_bytes);
    enc.dispatch(partial_grid, partial_threads);
    begin(KernelId::sample_select, {state, hist});
    enc.set_touched(2, bins_bytes + cum_bytes);
    enc.dispatch(final_grid, Size3{kSampleSelectThreads, 1, 1});
    begin(KernelId::sample_collect_f32, {logits, state, hist, parts});
    enc.set_touched(3, cand_bytes);
    enc.dispatch(partial_grid, partial_threads);
    begin(KernelId::sample_resolve_f32, {logits, state, hist, parts, ids, chosen});
    enc.set_touched(1, cand_bytes / 2);  // the candidates' logits
    enc.set_touched(3, cum_bytes + cand_bytes);
    enc.dispatch(final_grid, Size3{kSampleResolveThreads, 1, 1});
  };
  route();
  if (plan.logprobs < 0) return;

  // Logprobs: the top candidates of s = l - max (the small-k partial at temperature 1) and the
  // groups' sums of exp(s), one level; then the record. Both overwrite scratch the route is done
  // with (hist, partials).
  SampleArgs lp = a;
  lp.inv_temperature = 1.0f;
  lp.top_k = uint32_t(plan.logprobs);
  const Binding sums = range(op.partials, uint64_t(op.rows) * G * 4);
  const Binding records = range(op.logprobs, (uint64_t(op.slot) + op.rows) * kSampleLogprobWords * 4);
  const uint64_t lp_cand = uint64_t(op.rows) * G * lp.top_k * 8;
  enc.barrier();
  if (lp.top_k > 0) {
    enc.set_kernel(KernelId::sample_topk_partial_f32);
    enc.set_args(lp);
    enc.set_buffer(1, logits);
    enc.set_buffer(2, state);
    enc.set_buffer(3, range(op.hist, sample_hist_bytes(op.rows, op.valid_vocab)));
    enc.set_touched(3, lp_cand);
    enc.dispatch(partial_grid, partial_threads);
  }
  enc.set_kernel(KernelId::sample_lse_partial_f32);  // same level: reads what the route left
  enc.set_args(lp);
  enc.set_buffer(1, logits);
  enc.set_buffer(2, state);
  enc.set_buffer(3, sums);
  enc.dispatch(partial_grid, partial_threads);
  enc.barrier();
  enc.set_kernel(KernelId::sample_logprobs);
  enc.set_args(lp);
  enc.set_buffer(1, state);
  enc.set_buffer(2, lp.top_k > 0 ? range(op.hist, sample_hist_bytes(op.rows, op.valid_vocab)) : sums);
  if (lp.top_k > 0) enc.set_touched(2, lp_cand);
  enc.set_buffer(3, sums);
  enc.set_buffer(4, chosen);
  enc.set_buffer(5, records);
  enc.dispatch(final_grid, Size3{kSampleMergeThreads, 1, 1});
}

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
