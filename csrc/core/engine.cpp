// The engine's steps: encode() (one prefill chunk or decode step on one encoder), submit() and
// complete() (two steps in flight, one host wait each), forward(), the last step's logits, the
// MoE FLOP correction from the tiles the plans made, and the counting, checking and timing runs.
// Elsewhere: the spec (engine_spec.cpp), buffers and the memory plan (engine_buffers.cpp), weights
// (engine_weights.cpp), the state, KV pool and snapshots (engine_kv.cpp), the sampler outside a
// step (engine_sampler.cpp).
#include "core/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "core/engine_internal.h"
#include "gpu/ops/attention.h"
#include "gpu/ops/gated_delta.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/sampling.h"

namespace lily::core {

using detail::fail;
using detail::num;

void Engine::require_idle(const char* what) const {
  if (!inflight_.empty()) fail(std::string(what) + ": steps are in flight; complete() them first");
}

void Engine::discard_inflight() {
  // reset()/restore() overwrite the state, so steps still in flight (e.g. after a KeyboardInterrupt
  // in the host loop) are waited out and dropped rather than refused.
  while (!inflight_.empty()) {
    try {
      if (inflight_.front().enc) inflight_.front().enc->wait();
      if (inflight_.front().sampler) inflight_.front().sampler->wait();
    } catch (...) {
    }
    inflight_.pop_front();
  }
  have_token_ = false;
  have_batch_token_ = false;
}

Engine::InFlight Engine::encode(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling,
                                bool want_logits, std::unique_ptr<gpu::Encoder> enc,
                                const std::vector<gpu::SeqState>* batch,
                                const std::vector<gpu::ops::SampleParams>* batch_sample) {
  gpu::StepParams p;
  p.batch = batch;
  p.batch_sample = batch_sample;
  p.logits = want_logits;
  p.sample = sampling.enabled;
  p.sample_params = sampling.params;
  p.valid_vocab = sampling.valid_vocab;
  p.ids_from_slot = sampling.ids_from_slot;
  p.masked = sampling.enabled && sampling.mask != nullptr;
  p.slot = next_slot_;
  p.tokens = T;
  p.position = position;
  p.all_logits = all_logits;
  p.conv_parity = conv_parity_;
  p.serialize = serialize;
  InFlight f;
  const auto t0 = std::chrono::steady_clock::now();
  if (!enc && skip_barrier >= 0) {
    enc = device_->new_checking_encoder(skip_barrier, true);
    if (!enc) fail("skip_barrier needs a device that checks plans (the emulator, device 'emu')");
  }
  f.enc = enc ? std::move(enc) : device_->new_encoder();
  if (recording_) {
    counted_dispatches_.clear();
    f.enc->record = &counted_dispatches_;
  }
  gpu::ops::RecordingEncoder rec(*f.enc);  // counts commit()/wait() asked for while encoding
  gpu::encode_prefill_chunk(rec, spec_, m_, p);
  f.st.encode_ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - t0).count());
  f.st.tokens = T;
  f.st.ids_from_slot = sampling.ids_from_slot;
  f.st.waits_in_step = rec.waits;
  f.st.commits = rec.commits + 1;
  f.st.in_flight = uint32_t(inflight_.size());
  f.enc->commit();
  const gpu::Counters& c = f.enc->counters();
  f.st.dispatches = c.dispatches;
  f.st.barriers = c.barriers;
  f.st.bytes_bound = c.bytes_bound;
  f.st.bytes_touched = c.bytes_touched;
  f.st.threads = c.threads;
  f.st.flops_executed = c.flops_executed;
  f.st.flops_useful = c.flops_useful;
  f.slot = p.slot;
  f.rows = !want_logits ? 0 : all_logits ? T : 1;
  f.sampled = sampling.enabled;
  return f;
}

StepStats Engine::submit(const uint32_t* ids, uint32_t T, bool all_logits, const StepSampling& sampling,
                         bool want_logits) {
  if (!want_logits && (all_logits || sampling.enabled)) fail("forward: all_logits / sampling need want_logits");
  if (!valid_ && inflight_.empty()) fail("the engine state is invalid after a failed step: call Model.reset() (or restore a snapshot)");
  if (inflight_.size() >= 2) fail("submit: two steps are in flight already; complete() one first");
  if (!inflight_.empty() && !sampling.ids_from_slot)
    fail("submit: only a step fed from the device slot may be submitted while another is in flight");
  if (T == 0 || T > spec_.prefill_chunk) fail("forward: " + num(T) + " tokens outside [1, prefill_chunk=" + num(spec_.prefill_chunk) + "]");
  if (all_logits && T > spec_.logit_rows) fail("forward: all_logits for " + num(T) + " tokens exceeds logit_rows=" + num(spec_.logit_rows));
  if (uint64_t(position_) + T > spec_.context_length)
    fail("forward: position " + num(position_) + " + " + num(T) + " tokens exceeds context_length " + num(spec_.context_length));
  if (sampling.valid_vocab > spec_.vocab) fail("forward: valid_vocab " + num(sampling.valid_vocab) + " > vocab " + num(spec_.vocab));
  if (sampling.ids_from_slot && (T != 1 || !have_token_))
    fail("forward: feeding the device slot needs one token and a previous sampling step");
  if (sampling.enabled && !sampling.params.greedy && !(sampling.params.temperature > 0))
    fail("forward: temperature must be > 0 when not greedy");
  if (sampling.mask && !sampling.enabled) fail("forward: a token mask needs sampling");
  for (uint32_t i = 0; i < T && !sampling.ids_from_slot; ++i)
    if (ids[i] >= spec_.vocab) fail("forward: token id " + num(ids[i]) + " at index " + num(i) + " outside [0, " + num(spec_.vocab) + ")");
  ensure_kv(uint64_t(position_) + T);  // throws before the state changes when the blocks do not fit
  if (m_.s.ids.buffer->has_storage() && !sampling.ids_from_slot) m_.s.ids.buffer->write(m_.s.ids.offset, ids, size_t(T) * 4);
  write_mask(sampling, next_slot_);
  valid_ = false;  // until every step in flight finished: a device error leaves a half-updated state
  have_token_ = false;
  have_batch_token_ = false;  // the sequence moves on without the batch (submit_batch sets it back for B == 1)
  last_rows_ = 0;  // the new step will overwrite the logits rows
  InFlight f;
  const bool idle = inflight_.empty();
  try {
    f = encode(T, position_, all_logits, sampling, want_logits);
  } catch (...) {
    failed_ = true;  // the devices may have half-run it (the emulator runs at commit)
    throw;
  }
  counters_.commits += 1;
  counters_.idle_commits += idle ? 1 : 0;
  f.masked = sampling.enabled && sampling.mask != nullptr;
  position_ += T;
  conv_parity_ = 1 - conv_parity_;
  next_slot_ = 1 - next_slot_;
  have_token_ = sampling.enabled;
  const StepStats st = f.st;
  inflight_.push_back(std::move(f));
  return st;
}

StepStats Engine::complete(float* logits) {
  if (inflight_.empty()) fail("complete: no step in flight");
  if (inflight_.front().seqs.size() > 1) fail("complete: the oldest step in flight is a batched one; complete_batch() it");
  InFlight f = std::move(inflight_.front());
  inflight_.pop_front();
  counters_.host_waits += 1;
  try {
    if (f.enc) f.enc->wait();
    if (f.sampler) f.sampler->wait();
  } catch (...) {
    inflight_.clear();  // the state is invalid (valid_ stays false) until reset / restore
    failed_ = true;
    have_token_ = false;
    throw;
  }
  StepStats st = f.st;
  st.host_waits = st.waits_in_step + 1;
  if (f.enc) correct_moe_flops(st, f.slot);
  const size_t V = spec_.vocab;
  gpu::Buffer& lb = *m_.s.logits.buffer;
  if (logits && lb.has_storage() && f.rows) {
    lb.read(m_.s.logits.offset + (f.rows == 1 ? f.slot : 0) * V * 4, logits, f.rows * V * 4);
    logit_bytes_copied_ += f.rows * V * 4;
  }
  // A masked sampler set the disallowed logits of its row to -inf in place: the row no longer
  // holds the model's logits (last_logits() refuses it).
  last_rows_ = f.masked ? 0 : f.rows;
  last_slot_ = f.slot;
  if (inflight_.empty() && !failed_) valid_ = true;
  last_ = st;
  if (f.sampled) {
    // The step itself is complete (state advanced, logits returned); a sampler error only means
    // there is no token to feed.
    gpu::Buffer& sb = *m_.s.sample_state.buffer;
    if (sb.has_storage()) {
      const auto state = sb.read_value<::lily::SampleState>(m_.s.sample_state.offset + f.slot * gpu::ops::sample_state_bytes(1));
      if (state.status != 0) {
        if (inflight_.empty()) have_token_ = false;
        throw detail::sample_error(state, " (numerical failure in the model)");
      }
    }
    lp_slot_ = f.slot;
    if (m_.s.token_slot.buffer->has_storage())
      st.token = m_.s.token_slot.buffer->read_value<uint32_t>(m_.s.token_slot.offset + f.slot * 4);
    if (m_.s.chosen_logit.buffer->has_storage())
      st.token_logit = m_.s.chosen_logit.buffer->read_value<float>(m_.s.chosen_logit.offset + f.slot * 4);
    last_ = st;
  }
  return st;
}

void Engine::last_logits(float* out) const {
  require_idle("last_logits");
  if (last_rows_ == 0) fail("last_logits: the last step computed no logits (or the state was reset / restored)");
  const size_t V = spec_.vocab;
  gpu::Buffer& lb = *m_.s.logits.buffer;
  if (!lb.has_storage()) fail("last_logits: device '" + std::string(device_->name()) + "' keeps no logits");
  const size_t row = last_rows_ == 1 ? last_slot_ : last_rows_ - 1;
  lb.read(m_.s.logits.offset + row * V * 4, out, V * 4);
  logit_bytes_copied_ += V * 4;
}

void Engine::correct_moe_flops(StepStats& st, uint32_t slot) const {
  // The encoder counted the MoE tiled route's bound over every routing; each layer's plan wrote
  // the tiles it made (device memory, complete after the wait): count what ran instead.
  const ModelSpec& s = spec_;
  const uint32_t T = uint32_t(st.tokens);
  if (gpu::ops::moe_route(T, s.top_k) != gpu::ops::MoeRoute::tiled) return;
  gpu::Buffer& tb = *m_.s.moe_tile_stats.buffer;
  if (!tb.has_storage()) return;  // the counting device has no memory: the bound stays
  const bool m5 = device_->info().tensor_ops;  // the plan and tile kernels encode_moe chose
  const auto bound = gpu::ops::moe_expert_flops(T, s.top_k, s.experts, s.hidden, s.moe_inter, s.shared_inter, m5);
  std::vector<uint32_t> tile_stats(size_t(s.layers) * kMoeTileStats);
  tb.read(m_.s.moe_tile_stats.offset + uint64_t(slot) * s.layers * kMoeTileStats * 4, tile_stats.data(),
          tile_stats.size() * 4);
  const uint32_t* stats = tile_stats.data();
  for (uint32_t li = 0; li < s.layers; ++li)
    st.flops_executed = st.flops_executed - bound.executed +
                        gpu::ops::moe_expert_flops_from_tiles(T, s.top_k, s.hidden, s.moe_inter, s.shared_inter,
                                                              stats + kMoeTileStats * li, m5);
}

StepStats Engine::forward(const uint32_t* ids, uint32_t T, bool all_logits, float* logits,
                          const StepSampling& sampling, bool want_logits) {
  if (!inflight_.empty()) fail("forward: steps are in flight; complete() them first");
  submit(ids, T, all_logits, sampling, want_logits);
  return complete(logits);
}

StepStats Engine::count(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling,
                        bool want_logits) {
  if (!std::string_view(device_->name()).starts_with("count"))
    fail("count() runs on the counting device only (device 'count' or 'count_host')");
  ensure_kv(uint64_t(position) + T);
  return record_counted([&] { return encode(T, position, all_logits, sampling, want_logits); });
}

StepStats Engine::record_counted(const std::function<InFlight()>& encode_step) {
  recording_ = true;
  InFlight f;
  try {
    f = encode_step();
  } catch (...) {
    recording_ = false;
    throw;
  }
  recording_ = false;
  f.enc->record = nullptr;
  const gpu::Counters& c = f.enc->counters();
  counted_kernels_.assign(std::begin(c.kernels), std::end(c.kernels));
  last_ = f.st;
  return f.st;
}

StepStats Engine::check(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling,
                        bool want_logits, int64_t skip_barrier) {
  auto enc = device_->new_checking_encoder(skip_barrier, false);
  if (!enc) fail("check() needs a device that checks plans (the emulator, device 'emu')");
  ensure_kv(uint64_t(position) + T);
  return encode(T, position, all_logits, sampling, want_logits, std::move(enc)).st;
}

gpu::StepTiming Engine::time_step(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling,
                                  const gpu::TimingOptions& options) {
  require_idle("time_step");
  if (T == 0 || T > spec_.prefill_chunk) fail("time_step: " + num(T) + " tokens outside [1, prefill_chunk=" + num(spec_.prefill_chunk) + "]");
  if (uint64_t(position) + T > spec_.context_length)
    fail("time_step: position " + num(position) + " + " + num(T) + " tokens exceeds context_length " + num(spec_.context_length));
  if (all_logits && T > spec_.logit_rows) fail("time_step: all_logits for " + num(T) + " tokens exceeds logit_rows=" + num(spec_.logit_rows));
  gpu::StepTiming out;
  auto enc = device_->new_timing_encoder(options, &out);
  if (!enc) fail("time_step needs a device that times dispatches (the cuda device)");
  ensure_kv(uint64_t(position) + T);
  // The step reads KV rows [0, position] whatever the engine's own position: zeros, not the
  // fresh pool's poison (NaN on cuda), which would make every router logit NaN.
  for (size_t n : kv_cache_)
    if (state_[n]->has_storage()) state_[n]->fill(0, 0, state_[n]->size());
  // Token ids 1, 2, ... (any valid ids: the time does not depend on them).
  std::vector<uint32_t> ids(T);
  for (uint32_t i = 0; i < T; ++i) ids[i] = 1 + i % (spec_.vocab - 1);
  if (m_.s.ids.buffer->has_storage()) m_.s.ids.buffer->write(m_.s.ids.offset, ids.data(), size_t(T) * 4);
  try {
    InFlight f = encode(T, position, all_logits, sampling, true, std::move(enc));
    f.enc->wait();
  } catch (...) {
    reset();
    throw;
  }
  reset();  // the step ran many times over the state: start again
  return out;
}

}  // namespace lily::core
