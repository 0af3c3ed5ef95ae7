// The device sampler outside a step: sample_row() (one row of host logits through the sampling
// kernels), the allowed-token mask, submit_sampler() (the sampler on the last step's logits) and
// the logprobs record.
#include "core/engine.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/engine_internal.h"
#include "gpu/ops/sampling.h"

namespace lily::core {

using detail::fail;
using detail::num;

uint32_t Engine::sample_row(const float* row, const StepSampling& sampling) {
  require_idle("sample_row");
  if (!sampling.enabled || sampling.ids_from_slot) fail("sample_row: needs sampling parameters (and no slot feed)");
  if (!sampling.params.greedy && !(sampling.params.temperature > 0))
    fail("sample_row: temperature must be > 0");
  if (sampling.valid_vocab > spec_.vocab) fail("sample_row: valid_vocab " + num(sampling.valid_vocab) + " > vocab " + num(spec_.vocab));
  const size_t V = spec_.vocab;
  if (!m_.s.logits.buffer->has_storage()) fail("sample_row: device '" + std::string(device_->name()) + "' keeps no logits");
  m_.s.logits.buffer->write(m_.s.logits.offset, row, V * 4);
  last_rows_ = 0;  // row 0 now holds the host's row, not the last step's
  have_token_ = false;
  write_mask(sampling, 0);
  gpu::ops::SampleOperands so;
  so.logits = gpu::Binding{m_.s.logits.buffer, m_.s.logits.offset, uint64_t(V) * 4};
  so.ids = m_.s.token_slot;
  so.chosen_logit = m_.s.chosen_logit;
  const uint64_t state_bytes = gpu::ops::sample_state_bytes(1);
  so.state = gpu::Binding{m_.s.sample_state.buffer, m_.s.sample_state.offset, state_bytes};
  so.partials = m_.s.sample_partials;
  so.hist = m_.s.sample_hist;
  so.logprobs = m_.s.logprobs;
  so.rows = 1;
  so.stride = uint32_t(V);
  so.valid_vocab = sampling.valid_vocab ? sampling.valid_vocab : uint32_t(V);
  so.slot = 0;
  so.params = sampling.params;
  if (sampling.mask)
    so.mask = gpu::Binding{m_.s.token_mask.buffer, m_.s.token_mask.offset, uint64_t(gpu::ops::mask_words(so.valid_vocab)) * 4};
  gpu::ops::validate(so);
  auto enc = device_->new_encoder();
  gpu::ops::encode_sample(*enc, so);
  enc->commit();
  counters_.commits += 1;
  counters_.idle_commits += 1;
  counters_.host_waits += 1;
  enc->wait();
  const auto state = m_.s.sample_state.buffer->read_value<::lily::SampleState>(m_.s.sample_state.offset);
  if (state.status != 0)
    throw detail::sample_error(state, " in the row given to sample_row");
  lp_slot_ = 0;
  return m_.s.token_slot.buffer->read_value<uint32_t>(m_.s.token_slot.offset);
}

void Engine::write_mask(const StepSampling& sampling, uint32_t slot) {
  if (!sampling.mask) return;
  gpu::Buffer& b = *m_.s.token_mask.buffer;
  if (!b.has_storage()) return;  // the counting device
  const uint32_t valid = sampling.valid_vocab ? sampling.valid_vocab : spec_.vocab;
  const uint64_t stride = uint64_t(gpu::ops::mask_words(spec_.vocab)) * 4;
  // No sampler in flight reads this slot: the one that did (two steps back) completed before the
  // host could know the token this mask depends on.
  b.write(m_.s.token_mask.offset + slot * stride, sampling.mask, size_t(gpu::ops::mask_words(valid)) * 4);
  counters_.masks_written += 1;
}

void Engine::submit_sampler(const StepSampling& sampling) {
  if (!sampling.enabled || sampling.ids_from_slot) fail("submit_sampler: needs sampling parameters (and no slot feed)");
  if (!sampling.params.greedy && !(sampling.params.temperature > 0))
    fail("submit_sampler: temperature must be > 0 when not greedy");
  if (sampling.valid_vocab > spec_.vocab)
    fail("submit_sampler: valid_vocab " + num(sampling.valid_vocab) + " > vocab " + num(spec_.vocab));
  InFlight* target = nullptr;
  InFlight fresh;
  const bool idle = inflight_.empty();
  if (!idle) {
    target = &inflight_.back();
    if (target->sampled || target->rows != 1)
      fail("submit_sampler: the newest step in flight already samples (or computed no single logits row)");
  } else {
    // The last completed step's row, still on the device (nothing submitted since).
    if (last_rows_ != 1) fail("submit_sampler: no step in flight and no single logits row left on the device");
    if (!valid_) fail("the engine state is invalid after a failed step: call Model.reset() (or restore a snapshot)");
    fresh.slot = last_slot_;
    fresh.rows = 1;
    target = &fresh;
  }
  if (!idle && target->slot != 1 - next_slot_) fail("submit_sampler: internal slot mismatch");
  gpu::StepParams p;
  p.sample = true;
  p.sample_params = sampling.params;
  p.valid_vocab = sampling.valid_vocab;
  p.masked = sampling.mask != nullptr;
  p.slot = target->slot;
  write_mask(sampling, p.slot);
  auto enc = device_->new_encoder();
  gpu::encode_step_sampler(*enc, spec_, m_, p, /*logits_row=*/p.slot);
  enc->commit();
  counters_.commits += 1;
  counters_.idle_commits += idle ? 1 : 0;
  const gpu::Counters& c = enc->counters();
  target->st.dispatches += c.dispatches;
  target->st.barriers += c.barriers;
  target->st.bytes_bound += c.bytes_bound;
  target->st.bytes_touched += c.bytes_touched;
  target->st.threads += c.threads;
  target->st.commits += 1;
  target->sampler = std::move(enc);
  target->sampled = true;
  target->masked = p.masked;
  if (idle) {
    fresh.st.in_flight = 0;
    last_rows_ = 0;  // the row now belongs to the entry (complete() sets it back)
    inflight_.push_back(std::move(fresh));
  }
  next_slot_ = 1 - p.slot;
  have_token_ = true;  // the next step may read token_slot[p.slot]
}

std::vector<uint32_t> Engine::logprob_record() const {
  gpu::Buffer& b = *m_.s.logprobs.buffer;
  if (!b.has_storage()) fail("last_logprobs: device '" + std::string(device_->name()) + "' keeps no records");
  std::vector<uint32_t> r(kSampleLogprobWords);
  b.read(m_.s.logprobs.offset + size_t(lp_slot_) * kSampleLogprobWords * 4, r.data(), r.size() * 4);
  return r;
}

}  // namespace lily::core
