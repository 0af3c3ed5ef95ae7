// Sequences and batched decode: several conversations over one set of weights. The active
// sequence's state lives in the engine's own members (state_, position_, conv_parity_, the KV pool
// size in spec_), so every single-stream path is unchanged; the others are parked (Parked) and
// swap in without a copy. decode_batch() feeds one token to each of B sequences in one step:
// the projections, router, experts and lm_head over B rows (each weight byte read once), the
// DeltaNet rule and attention per sequence on its own buffers (gpu::SeqState, StepParams::batch).
// submit_batch() / complete_batch() run the same step with a sampler per row, two in flight.
#include <algorithm>
#include <set>
#include <string>

#include "core/engine.h"
#include "core/engine_internal.h"
#include "gpu/ops/attention.h"
#include "gpu/ops/sampling.h"

namespace lily::core {

using detail::fail;
using detail::num;

void Engine::rebind_state() {
  // build_buffers allocates the state in layer order: attention layers K then V pool, DeltaNet
  // layers conv window 0, conv window 1, recurrent state (engine_buffers.cpp).
  size_t i = 0;
  auto next = [&](const gpu::Binding& old) {
    if (i >= state_.size()) fail("state buffers do not match the layers");
    gpu::Buffer* b = state_[i++].get();
    return gpu::Binding{b, 0, is_kv(i - 1) ? b->size() : old.bytes};
  };
  for (gpu::Layer& L : m_.layers) {
    if (L.attention) {
      L.at.k_cache = next(L.at.k_cache);
      L.at.v_cache = next(L.at.v_cache);
    } else {
      L.dn.conv_state[0] = next(L.dn.conv_state[0]);
      L.dn.conv_state[1] = next(L.dn.conv_state[1]);
      L.dn.state = next(L.dn.state);
    }
  }
  if (i != state_.size()) fail("state buffers do not match the layers");
}

void Engine::swap_state(Parked& p) {
  std::swap(state_, p.state);
  std::swap(position_, p.position);
  std::swap(conv_parity_, p.conv_parity);
  std::swap(valid_, p.valid);
  const uint32_t blocks = spec_.kv_pool();
  spec_.kv_pool_blocks = p.pool_blocks;
  p.pool_blocks = blocks;
  rebind_state();
}

void Engine::swap_active(Parked& p) {
  swap_state(p);
  failed_ = false;
  have_token_ = false;  // the device slot and the logits rows hold the other sequence's
  last_rows_ = 0;
}

void Engine::ensure_kv_of(uint32_t id, uint64_t rows) {
  if (id == active_) return ensure_kv(rows);
  Parked& p = parked_.at(id);
  const uint64_t B = spec_.kv_block_tokens;
  if ((rows + B - 1) / B <= p.pool_blocks || kv_cache_.empty()) return;
  // The parked sequence's buffers become the engine's for the resize (ensure_kv waits for the
  // steps in flight first), then go back; the active sequence's slots are not touched.
  swap_state(p);
  try {
    ensure_kv(rows);
  } catch (...) {
    swap_state(p);
    throw;
  }
  swap_state(p);
}

uint64_t Engine::sequence_state_bytes(uint32_t pool_blocks) const {
  uint64_t n = 0;
  for (size_t i = 0; i < state_.size(); ++i)
    if (!is_kv(i)) n += state_[i]->size();
  return n + uint64_t(pool_blocks) * kv_block_bytes();
}

// The batched sampler's buffers (gpu::StepScratch::batch_tokens ...), one per binding so that each
// starts at offset 0 (Metal binds a buffer at a multiple of its element's size): token ids, chosen
// logits and SampleStates of 2 slots x kBatchSlots rows, then the sampler scratch of kBatchSlots
// rows of V.
std::vector<uint64_t> Engine::batch_sampler_sizes() const {
  const uint32_t R = gpu::kBatchSlots, V = spec_.vocab;
  return {2 * R * 4, 2 * R * 4, 2 * R * gpu::ops::sample_state_bytes(1), R * gpu::ops::sample_partials_bytes(1, V),
          R * gpu::ops::sample_hist_bytes(1, V)};
}

uint64_t Engine::batch_sampler_bytes() const {
  uint64_t n = 0;
  for (uint64_t b : batch_sampler_sizes()) n += b;
  return n;
}

void Engine::bind_batch_sampler() {
  const std::vector<uint64_t> sizes = batch_sampler_sizes();
  batch_sampler_.clear();
  for (uint64_t n : sizes) batch_sampler_.push_back(device_->new_buffer(n));
  gpu::Binding* out[] = {&m_.s.batch_tokens, &m_.s.batch_chosen, &m_.s.batch_sample_state, &m_.s.batch_sample_partials,
                         &m_.s.batch_sample_hist};
  for (size_t i = 0; i < sizes.size(); ++i) *out[i] = gpu::Binding{batch_sampler_[i].get(), 0, sizes[i]};
}

uint32_t Engine::add_sequence() {
  require_idle("add_sequence");
  const ModelSpec& s = spec_;
  const bool scratch = !batch_o_raw_;
  uint64_t bytes = sequence_state_bytes(1);
  const uint64_t VD = uint64_t(s.lin_v_heads) * s.lin_v_dim;
  // The batch scratch (once, with the first extra sequence): each of kMaxBatch sequences' decode
  // raw outputs and attention partials for the whole context.
  const uint64_t partials =
      kv_cache_.empty() ? 0
                        : gpu::ops::attention_scratch_bytes(s.q_heads, s.head_dim, s.context_length, s.kv_block_tokens);
  const uint64_t per_sequence = std::max<uint64_t>(VD * 4, 4) + std::max<uint64_t>(partials, 4);
  const uint64_t scratch_bytes = scratch ? kMaxBatch * per_sequence + batch_sampler_bytes() : 0;
  if (memory_.working_set_bytes && memory_.total() + bytes + scratch_bytes > memory_.working_set_bytes)
    throw DeviceMemoryError("engine: a new sequence needs " + num(bytes + scratch_bytes) + " bytes of state, but " +
                            num(memory_.total()) + " of the device's " + num(memory_.working_set_bytes) +
                            " bytes are taken (drop a sequence, or reset one to free its KV blocks)");
  Parked p;
  try {
    for (size_t i = 0; i < state_.size(); ++i) {
      const uint64_t n = is_kv(i) ? uint64_t(spec_.kv_heads) * s.kv_block_tokens * s.kv_row_bytes() : state_[i]->size();
      p.state.push_back(device_->new_buffer(n));
      if (p.state.back()->has_storage()) p.state.back()->fill(0, 0, n);
    }
    if (scratch) {
      batch_o_raw_ = device_->new_buffer(kMaxBatch * std::max<uint64_t>(VD * 4, 4));
      batch_partials_ = device_->new_buffer(kMaxBatch * std::max<uint64_t>(partials, 4));
      batch_partials_bytes_ = partials;
      bind_batch_sampler();
      memory_.scratch_bytes += scratch_bytes;
    }
  } catch (const DeviceMemoryError&) {
    throw;
  } catch (const std::exception& e) {
    throw DeviceMemoryError("engine: cannot allocate a new sequence's state (" + num(bytes) + " bytes): " + e.what());
  }
  memory_.state_bytes += bytes;
  const uint32_t id = next_sequence_++;
  parked_.emplace(id, std::move(p));
  return id;
}

void Engine::select_sequence(uint32_t id) {
  if (id == active_) return;
  require_idle("select_sequence");
  auto it = parked_.find(id);
  if (it == parked_.end()) fail("select_sequence: no sequence " + num(id));
  Parked p = std::move(it->second);
  parked_.erase(it);
  swap_active(p);  // p now holds the old active sequence
  parked_.emplace(active_, std::move(p));
  active_ = id;
}

void Engine::drop_sequence(uint32_t id) {
  require_idle("drop_sequence");
  if (id == active_) fail("drop_sequence: sequence " + num(id) + " is the active one; select another first");
  auto it = parked_.find(id);
  if (it == parked_.end()) fail("drop_sequence: no sequence " + num(id));
  memory_.state_bytes -= sequence_state_bytes(it->second.pool_blocks);
  parked_.erase(it);
}

std::vector<uint32_t> Engine::sequences() const {
  std::vector<uint32_t> out{active_};
  for (const auto& [id, p] : parked_) out.push_back(id);
  std::sort(out.begin(), out.end());
  return out;
}

uint32_t Engine::sequence_position(uint32_t id) const {
  if (id == active_) return position_;
  auto it = parked_.find(id);
  if (it == parked_.end()) fail("no sequence " + num(id));
  return it->second.position;
}

bool Engine::sequence_valid(uint32_t id) const {
  if (id == active_) return valid_;
  auto it = parked_.find(id);
  if (it == parked_.end()) fail("no sequence " + num(id));
  return it->second.valid;
}

uint32_t Engine::max_batch() const { return std::min({kMaxBatch, spec_.prefill_chunk, spec_.logit_rows}); }

gpu::SeqState Engine::seq_state(uint32_t id, uint32_t index, uint32_t position) const {
  gpu::SeqState q;
  const std::vector<std::unique_ptr<gpu::Buffer>>* st = &state_;
  q.conv_parity = conv_parity_;
  q.pool_blocks = spec_.kv_pool();
  if (id != active_) {
    const Parked& p = parked_.at(id);
    st = &p.state;
    q.conv_parity = p.conv_parity;
    q.pool_blocks = p.pool_blocks;
  }
  q.position = position;
  size_t i = 0;
  auto next = [&](const gpu::Binding& like) {
    gpu::Buffer* b = (*st)[i].get();
    return gpu::Binding{b, 0, is_kv(i++) ? b->size() : like.bytes};
  };
  for (const gpu::Layer& L : m_.layers) {
    gpu::SeqLayerState ls;
    if (L.attention) {
      ls.k_cache = next(L.at.k_cache);
      ls.v_cache = next(L.at.v_cache);
    } else {
      ls.conv_state[0] = next(L.dn.conv_state[0]);
      ls.conv_state[1] = next(L.dn.conv_state[1]);
      ls.state = next(L.dn.state);
    }
    q.layers.push_back(ls);
  }
  const ModelSpec& s = spec_;
  const uint64_t VD = uint64_t(s.lin_v_heads) * s.lin_v_dim * 4;
  if (batch_o_raw_) q.gd_o_raw = gpu::Binding{batch_o_raw_.get(), index * std::max<uint64_t>(VD, 4), VD};
  if (batch_partials_)
    q.attn_partials = gpu::Binding{batch_partials_.get(), index * std::max<uint64_t>(batch_partials_bytes_, 4),
                                   batch_partials_bytes_};
  return q;
}

void Engine::check_batch_rows(const char* what, const uint32_t* seqs, const uint32_t* ids, uint32_t B,
                              bool check_valid) const {
  const std::string w(what);
  std::set<uint32_t> seen;
  for (uint32_t t = 0; t < B; ++t) {
    const uint32_t id = seqs[t];
    if (!seen.insert(id).second) fail(w + ": sequence " + num(id) + " appears twice");
    if (id != active_ && !parked_.count(id)) fail(w + ": no sequence " + num(id) + " (index " + num(t) + ")");
    if (check_valid && !sequence_valid(id))
      fail(w + ": sequence " + num(id) + " is invalid after a failed step: reset or restore it first");
    if (uint64_t(sequence_position(id)) + 1 > spec_.context_length)
      fail(w + ": sequence " + num(id) + " at position " + num(sequence_position(id)) +
           " has no room left in context_length " + num(spec_.context_length));
    if (ids && ids[t] >= spec_.vocab)
      fail(w + ": token id " + num(ids[t]) + " at index " + num(t) + " outside [0, " + num(spec_.vocab) + ")");
  }
}

StepStats Engine::decode_batch(const uint32_t* seqs, const uint32_t* ids, uint32_t B, float* logits) {
  require_idle("decode_batch");
  if (B == 0 || B > max_batch())
    fail("decode_batch: " + num(B) + " sequences outside [1, max_batch=" + num(max_batch()) + "]");
  check_batch_rows("decode_batch", seqs, ids, B, true);
  if (B == 1) {  // today's single-stream step: the same levels and bytes
    select_sequence(seqs[0]);
    return forward(ids, 1, false, logits);
  }
  for (uint32_t t = 0; t < B; ++t) {  // every sequence's KV blocks first: throws before any state changes
    select_sequence(seqs[t]);
    ensure_kv(uint64_t(position_) + 1);
  }
  std::vector<gpu::SeqState> states;
  for (uint32_t t = 0; t < B; ++t) states.push_back(seq_state(seqs[t], t, sequence_position(seqs[t])));
  if (m_.s.ids.buffer->has_storage()) m_.s.ids.buffer->write(m_.s.ids.offset, ids, size_t(B) * 4);
  for (uint32_t t = 0; t < B; ++t) set_sequence_valid(seqs[t], false);  // until the step finished
  last_rows_ = 0;
  have_batch_token_ = false;  // the sequences move on without sampling into the batch slot
  StepStats st;
  try {
    InFlight f = encode(B, 0, true, StepSampling{}, true, nullptr, &states);
    counters_.commits += 1;
    counters_.idle_commits += 1;
    counters_.host_waits += 1;
    f.enc->wait();
    st = f.st;
  } catch (...) {
    failed_ = false;
    throw;  // every sequence of the batch stays invalid until reset / restore
  }
  for (uint32_t t = 0; t < B; ++t) {
    set_sequence_valid(seqs[t], true);
    advance_sequence(seqs[t]);
  }
  st.host_waits = st.waits_in_step + 1;
  const size_t V = spec_.vocab;
  gpu::Buffer& lb = *m_.s.logits.buffer;
  if (logits && lb.has_storage()) {
    lb.read(m_.s.logits.offset, logits, size_t(B) * V * 4);
    logit_bytes_copied_ += uint64_t(B) * V * 4;
  }
  last_ = st;
  return st;
}

void Engine::set_sequence_valid(uint32_t id, bool v) {
  if (id == active_) valid_ = v;
  else parked_.at(id).valid = v;
}

void Engine::advance_sequence(uint32_t id) {
  if (id == active_) {
    position_ += 1;
    conv_parity_ = 1 - conv_parity_;
  } else {
    Parked& p = parked_.at(id);
    p.position += 1;
    p.conv_parity = 1 - p.conv_parity;
  }
}

// The step-level sampling of a sampled batched step (rows' parameters into `params`).
static StepSampling batch_sampling(const std::vector<StepSampling>& rows, bool from_slot,
                                   std::vector<gpu::ops::SampleParams>& params) {
  for (const StepSampling& s : rows) params.push_back(s.params);
  StepSampling step;
  step.enabled = true;
  step.valid_vocab = rows[0].valid_vocab;
  step.ids_from_slot = from_slot;
  return step;
}

static_assert(Engine::kMaxBatch <= gpu::kBatchSlots, "a batched step samples at most kBatchSlots rows");

StepStats Engine::submit_batch(const uint32_t* seqs, const uint32_t* ids, uint32_t B,
                               const std::vector<StepSampling>& sampling, bool from_slot) {
  if (B == 0 || B > max_batch())
    fail("submit_batch: " + num(B) + " sequences outside [1, max_batch=" + num(max_batch()) + "]");
  if (sampling.size() != B) fail("submit_batch: " + num(uint32_t(sampling.size())) + " samplings for " + num(B) + " sequences");
  if (inflight_.size() >= 2) fail("submit_batch: two steps are in flight already; complete one first");
  const bool idle = inflight_.empty();
  if (!idle && !from_slot)
    fail("submit_batch: only a step fed from the device slot may be submitted while another is in flight");
  const std::vector<uint32_t> order(seqs, seqs + B);
  if (from_slot && (!have_batch_token_ || batch_seqs_ != order))
    fail("submit_batch: feeding the device slot needs the step before to be a sampling submit_batch() of the same "
         "sequences in the same order");
  // sequences in flight are invalid until their step completes; a slot feed has no host ids
  check_batch_rows("submit_batch", seqs, from_slot ? nullptr : ids, B, idle);
  for (uint32_t t = 0; t < B; ++t) {
    const StepSampling& s = sampling[t];
    if (!s.enabled || s.mask || s.ids_from_slot || s.params.logprobs >= 0)
      fail("submit_batch: sampling " + num(t) + " must sample, with no mask, slot feed or logprobs");
    if (s.valid_vocab > spec_.vocab || s.valid_vocab != sampling[0].valid_vocab)
      fail("submit_batch: valid_vocab must be the same for every row and <= vocab " + num(spec_.vocab));
    try {
      gpu::ops::validate_params(s.params, s.valid_vocab ? s.valid_vocab : spec_.vocab);
    } catch (const std::invalid_argument& e) {
      fail("submit_batch: sampling " + num(t) + ": " + e.what());
    }
  }
  if (B == 1) {  // the single-stream step of that sequence (its own slot feed)
    if (idle) select_sequence(seqs[0]);
    StepSampling s = sampling[0];
    s.ids_from_slot = from_slot;
    const uint32_t placeholder = 0;
    const StepStats st = submit(from_slot ? &placeholder : ids, 1, false, s, true);
    inflight_.back().seqs = order;
    have_batch_token_ = true;
    batch_seqs_ = order;
    return st;
  }
  if (!batch_o_raw_) fail("submit_batch: the batch scratch is allocated with the first extra sequence");
  for (uint32_t t = 0; t < B; ++t)  // every sequence's KV blocks first (waits for the steps in flight to grow one)
    ensure_kv_of(seqs[t], uint64_t(sequence_position(seqs[t])) + 1);
  std::vector<gpu::SeqState> states;
  for (uint32_t t = 0; t < B; ++t) states.push_back(seq_state(seqs[t], t, sequence_position(seqs[t])));
  if (!from_slot && m_.s.ids.buffer->has_storage()) m_.s.ids.buffer->write(m_.s.ids.offset, ids, size_t(B) * 4);
  std::vector<gpu::ops::SampleParams> params;
  const StepSampling step = batch_sampling(sampling, from_slot, params);
  for (uint32_t id : order) set_sequence_valid(id, false);  // until the step finished
  have_token_ = false;
  have_batch_token_ = false;
  last_rows_ = 0;
  InFlight f;
  try {
    f = encode(B, 0, true, step, true, nullptr, &states, &params);
  } catch (...) {
    discard_inflight();  // the sequences of the batch stay invalid until reset / restore
    throw;
  }
  counters_.commits += 1;
  counters_.idle_commits += idle ? 1 : 0;
  for (uint32_t id : order) advance_sequence(id);
  next_slot_ = 1 - next_slot_;
  have_batch_token_ = true;
  batch_seqs_ = order;
  f.seqs = order;
  const StepStats st = f.st;
  inflight_.push_back(std::move(f));
  return st;
}

StepStats Engine::complete_batch(std::vector<uint32_t>& tokens) {
  if (inflight_.empty()) fail("complete_batch: no step in flight");
  if (inflight_.front().seqs.empty()) fail("complete_batch: the oldest step in flight is not a submit_batch(); complete() it");
  if (inflight_.front().seqs.size() == 1) {
    const StepStats st = complete(nullptr);
    tokens.assign(1, st.token);
    return st;
  }
  InFlight f = std::move(inflight_.front());
  inflight_.pop_front();
  counters_.host_waits += 1;
  try {
    f.enc->wait();
  } catch (...) {
    discard_inflight();  // every sequence of the step stays invalid until reset / restore
    throw;
  }
  StepStats st = f.st;
  st.host_waits = st.waits_in_step + 1;
  correct_moe_flops(st, f.slot);
  if (inflight_.empty())
    for (uint32_t id : f.seqs) set_sequence_valid(id, true);
  last_ = st;
  const uint32_t B = uint32_t(f.seqs.size());
  tokens.assign(B, 0u);
  gpu::Buffer& tb = *m_.s.batch_tokens.buffer;
  if (!tb.has_storage()) return st;  // the counting device
  const uint64_t first = uint64_t(gpu::kBatchSlots) * f.slot;
  tb.read(m_.s.batch_tokens.offset + first * 4, tokens.data(), size_t(B) * 4);
  std::vector<::lily::SampleState> states(B);
  m_.s.batch_sample_state.buffer->read(m_.s.batch_sample_state.offset + first * sizeof(::lily::SampleState),
                                       states.data(), size_t(B) * sizeof(::lily::SampleState));
  for (uint32_t t = 0; t < B; ++t) {
    if (states[t].status == 0) continue;
    if (inflight_.empty()) have_batch_token_ = false;
    throw detail::sample_error(states[t], " in row " + num(t) + " (sequence " + num(f.seqs[t]) +
                                          ") of a batched step (numerical failure in the model)");
  }
  return st;
}

template <class Fn>
auto Engine::with_temporary_batch(uint32_t B, uint32_t position, Fn fn) {
  require_idle("a batched step");
  if (B < 2 || B > max_batch())
    fail("batched step: " + num(B) + " sequences outside [2, max_batch=" + num(max_batch()) + "]");
  if (uint64_t(position) + 1 > spec_.context_length)
    fail("batched step: position " + num(position) + " + 1 exceeds context_length " + num(spec_.context_length));
  const uint32_t home = active_;
  std::vector<uint32_t> ids{home}, temp;
  struct Cleanup {  // the temporary sequences go, the original is active again, whatever happens
    Engine& e;
    uint32_t home;
    std::vector<uint32_t>& temp;
    ~Cleanup() {
      try {
        e.select_sequence(home);
        for (uint32_t id : temp) e.drop_sequence(id);
      } catch (...) {
      }
    }
  } cleanup{*this, home, temp};
  for (uint32_t i = 1; i < B; ++i) {
    temp.push_back(add_sequence());
    ids.push_back(temp.back());
  }
  for (uint32_t id : ids) {
    select_sequence(id);
    ensure_kv(uint64_t(position) + 1);
  }
  select_sequence(home);
  std::vector<gpu::SeqState> states;
  for (uint32_t t = 0; t < B; ++t) states.push_back(seq_state(ids[t], t, position));
  return fn(states, ids);
}

StepStats Engine::count_batch(uint32_t B, uint32_t position) {
  if (!std::string_view(device_->name()).starts_with("count"))
    fail("count_batch() runs on the counting device only (device 'count' or 'count_host')");
  return with_temporary_batch(B, position, [&](const std::vector<gpu::SeqState>& states, const std::vector<uint32_t>&) {
    return record_counted([&] { return encode(B, 0, true, StepSampling{}, true, nullptr, &states); });
  });
}

StepStats Engine::check_batch(uint32_t B, uint32_t position, int64_t skip, const std::vector<StepSampling>& sampling) {
  if (!sampling.empty() && sampling.size() != B)
    fail("check_batch: " + num(uint32_t(sampling.size())) + " samplings for " + num(B) + " sequences");
  return with_temporary_batch(B, position, [&](const std::vector<gpu::SeqState>& states, const std::vector<uint32_t>&) {
    auto enc = device_->new_checking_encoder(skip, false);
    if (!enc) fail("check_batch() needs a device that checks plans (the emulator, device 'emu')");
    if (sampling.empty()) return encode(B, 0, true, StepSampling{}, true, std::move(enc), &states).st;
    std::vector<gpu::ops::SampleParams> params;
    const StepSampling step = batch_sampling(sampling, false, params);
    return encode(B, 0, true, step, true, std::move(enc), &states, &params).st;
  });
}

gpu::StepTiming Engine::time_batch(uint32_t B, uint32_t position, const gpu::TimingOptions& options) {
  gpu::StepTiming out;
  auto enc = device_->new_timing_encoder(options, &out);
  if (!enc) fail("time_batch needs a device that times dispatches (the cuda device)");
  with_temporary_batch(B, position, [&](const std::vector<gpu::SeqState>& states, const std::vector<uint32_t>&) {
    // Every sequence reads KV rows [0, position]: zeros, not a fresh pool's poison (see time_step).
    for (const gpu::SeqState& q : states)
      for (const gpu::SeqLayerState& ls : q.layers)
        for (const gpu::Binding* b : {&ls.k_cache, &ls.v_cache})
          if (b->buffer && b->buffer->has_storage()) b->buffer->fill(0, 0, b->buffer->size());
    std::vector<uint32_t> tok(B);
    for (uint32_t i = 0; i < B; ++i) tok[i] = 1 + i % (spec_.vocab - 1);
    if (m_.s.ids.buffer->has_storage()) m_.s.ids.buffer->write(m_.s.ids.offset, tok.data(), size_t(B) * 4);
    try {
      InFlight f = encode(B, 0, true, StepSampling{}, true, std::move(enc), &states);
      f.enc->wait();
    } catch (...) {
      reset();
      throw;
    }
    return 0;
  });
  reset();  // the step ran many times over the state: start again
  return out;
}

}  // namespace lily::core
