#include "core/engine.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "emu/emulator.h"
#include "gpu/counting_device.h"
#include "gpu/ops/attention.h"
#include "gpu/ops/gated_delta.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/sampling.h"
#if defined(LILY_HAVE_METAL)
#include "metal/metal_device.h"
#endif

namespace lily::core {

namespace {

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument("engine: " + m); }

std::string num(uint64_t v) { return std::to_string(v); }

void check_quant(const QuantSpec& q, const char* what) {
  if (q.bits != 4 && q.bits != 8) fail(std::string(what) + ": bits=" + num(q.bits) + " unsupported (4 or 8)");
  if (q.group_size != 32 && q.group_size != 64 && q.group_size != 128)
    fail(std::string(what) + ": group_size=" + num(q.group_size) + " unsupported (32, 64 or 128)");
}

// The MoE scratch for T tokens (moe_scratch_bytes reads only the shape fields).
gpu::ops::MoeScratchBytes moe_bytes(const ModelSpec& s, uint32_t T) {
  gpu::ops::MoeOperands op;
  op.tokens = T;
  op.hidden = s.hidden;
  op.experts = s.experts;
  op.top_k = s.top_k;
  op.inter = s.moe_inter;
  op.shared_inter = s.shared_inter;
  op.x_dtype = gpu::DType::f32;
  return gpu::ops::moe_scratch_bytes(op);
}

}  // namespace

void ModelSpec::validate() const {
  if (vocab == 0 || hidden == 0 || layers == 0) fail("empty model (vocab, hidden, layers)");
  if (full_attention.size() != layers) fail("full_attention has " + num(full_attention.size()) + " entries for " + num(layers) + " layers");
  if (lin_k_heads == 0 || lin_v_heads == 0 || lin_k_dim == 0 || lin_v_dim == 0) fail("empty DeltaNet dims");
  if (experts == 0 || top_k == 0 || moe_inter == 0 || shared_inter == 0) fail("empty MoE dims");
  if (context_length == 0) fail("context_length must be >= 1");
  if (prefill_chunk == 0) fail("prefill_chunk must be >= 1");
  if (logit_rows == 0 || logit_rows > prefill_chunk) fail("logit_rows must be in [1, prefill_chunk]");
  check_quant(embed, "embed");
  check_quant(lm_head, "lm_head");
  check_quant(mixer, "mixer projections");
  check_quant(experts_q, "experts");
  check_quant(router, "router");
  if (!(eps > 0)) fail("eps must be > 0");
}

std::string ModelSpec::summary() const {
  std::ostringstream o;
  uint32_t attn = 0;
  for (uint8_t a : full_attention) attn += a;
  o << layers << " layers (" << layers - attn << " DeltaNet, " << attn << " attention), hidden " << hidden << ", vocab "
    << vocab << ", " << experts << " experts top-" << top_k << ", context " << context_length << ", chunk "
    << prefill_chunk;
  return o.str();
}

std::unique_ptr<gpu::Device> make_device(const std::string& name) {
  if (name == "emu") return std::make_unique<emu::EmuDevice>();
  if (name == "count") return std::make_unique<gpu::CountingDevice>();
  if (name == "metal") {
#if defined(LILY_HAVE_METAL)
    return metal::create_device();
#else
    throw std::invalid_argument("device 'metal' is not available in this build (not macOS); use 'emu'");
#endif
  }
  throw std::invalid_argument("unknown device '" + name + "' (expected 'emu', 'metal' or 'count')");
}

gpu::Binding Engine::alloc_weight(const std::string& name, size_t bytes) {
  auto buf = device_->new_buffer(bytes);
  gpu::Binding b{buf.get(), 0, bytes};
  weights_[name] = Weight{std::move(buf), false};
  weight_order_.push_back(name);
  return b;
}

gpu::Binding Engine::alloc(std::vector<std::unique_ptr<gpu::Buffer>>& pool, size_t bytes) {
  pool.push_back(device_->new_buffer(std::max<size_t>(bytes, 4)));
  return gpu::Binding{pool.back().get(), 0, bytes};
}

gpu::QuantWeight Engine::alloc_quant(const std::string& name, uint64_t rows, uint64_t cols, const QuantSpec& q,
                                     uint64_t count) {
  if (cols % q.group_size) fail(name + ": in-features " + num(cols) + " not a multiple of group_size " + num(q.group_size));
  const uint64_t w = count * rows * cols * q.bits / 8;
  const uint64_t s = count * rows * (cols / q.group_size) * gpu::dtype_size(q.scale_dtype);
  return gpu::QuantWeight{alloc_weight(name + ".weight", w), alloc_weight(name + ".scales", s),
                          alloc_weight(name + ".biases", s)};
}

Engine::Engine(ModelSpec spec, std::unique_ptr<gpu::Device> device) : spec_(std::move(spec)), device_(std::move(device)) {
  const ModelSpec& s = spec_;
  s.validate();
  const uint64_t H = s.hidden, V = s.vocab, E = s.experts, I = s.moe_inter, Is = s.shared_inter;
  const uint64_t C = s.conv_dim(), VD = s.value_dim(), Hv = s.lin_v_heads, K = s.conv_kernel;
  const uint64_t P = gpu::ops::gated_delta_mixer_proj_rows(s.lin_k_heads, s.lin_v_heads, s.lin_k_dim, s.lin_v_dim);

  // Weights, in checkpoint order.
  m_.embed = alloc_quant("embed", V, H, s.embed);
  for (uint32_t i = 0; i < s.layers; ++i) {
    const std::string p = "layers." + num(i) + ".";
    gpu::Layer L;
    L.attention = s.full_attention[i] != 0;
    L.input_norm = alloc_weight(p + "input_norm", H * 4);
    L.post_norm = alloc_weight(p + "post_norm", H * 4);
    if (L.attention) {
      const uint64_t D = s.head_dim, kv = uint64_t(s.kv_heads) * s.context_length * D * 2;  // bf16
      L.at.qkv_proj = alloc_quant(p + "qkv_proj", s.attn_qkv_rows(), H, s.mixer);
      L.at.o_proj = alloc_quant(p + "o_proj", H, uint64_t(s.q_heads) * D, s.mixer);
      L.at.q_norm = alloc_weight(p + "q_norm", D * 4);
      L.at.k_norm = alloc_weight(p + "k_norm", D * 4);
      L.at.k_cache = alloc(state_, kv);
      kv_cache_.push_back(state_.size() - 1);
      L.at.v_cache = alloc(state_, kv);
      kv_cache_.push_back(state_.size() - 1);
    } else {
    L.dn.in_proj = alloc_quant(p + "in_proj", P, H, s.mixer);
    L.dn.out_proj = alloc_quant(p + "out_proj", H, VD, s.mixer);
    L.dn.conv = alloc_weight(p + "conv1d", C * K * 4);
    L.dn.A_log = alloc_weight(p + "A_log", Hv * 4);
    L.dn.dt_bias = alloc_weight(p + "dt_bias", Hv * 4);
    L.dn.norm = alloc_weight(p + "gated_norm", uint64_t(s.lin_v_dim) * 4);
    L.dn.conv_state[0] = alloc(state_, (K - 1) * C * 4);
    L.dn.conv_state[1] = alloc(state_, (K - 1) * C * 4);
    L.dn.state = alloc(state_, Hv * s.lin_v_dim * s.lin_k_dim * 4);
    }
    L.moe.router = alloc_quant(p + "router", E + 1, H, s.router);
    L.moe.gate = alloc_quant(p + "experts.gate", I, H, s.experts_q, E);
    L.moe.up = alloc_quant(p + "experts.up", I, H, s.experts_q, E);
    L.moe.down = alloc_quant(p + "experts.down", H, I, s.experts_q, E);
    L.moe.shared_gate = alloc_quant(p + "shared.gate", Is, H, s.experts_q);
    L.moe.shared_up = alloc_quant(p + "shared.up", Is, H, s.experts_q);
    L.moe.shared_down = alloc_quant(p + "shared.down", H, Is, s.experts_q);
    m_.layers.push_back(L);
  }
  m_.norm = alloc_weight("norm", H * 4);
  m_.lm_head = alloc_quant("lm_head", V, H, s.lm_head);

  // Scratch for prefill_chunk tokens.
  const uint64_t T = s.prefill_chunk;
  gpu::StepScratch& t = m_.s;
  t.ids = alloc(scratch_, T * 4);
  t.x = alloc(scratch_, T * H * 4);
  t.h = alloc(scratch_, T * H * 4);
  t.xn = alloc(scratch_, T * H * 4);
  t.mix = alloc(scratch_, T * H * 4);
  t.proj = alloc(scratch_, T * P * 4);
  t.conv_out = alloc(scratch_, T * C * 4);
  t.o = alloc(scratch_, T * VD * 4);
  const bool any_deltanet = std::find(s.full_attention.begin(), s.full_attention.end(), 0) != s.full_attention.end();
  if (any_deltanet && gpu::ops::gated_delta_route(uint32_t(T), s.lin_k_dim, s.lin_v_dim) == gpu::ops::GdRoute::chunked)
    t.gd_chunk = alloc(scratch_, gpu::ops::gated_delta_chunk_scratch_bytes(uint32_t(T), s.lin_k_heads, s.lin_v_heads,
                                                                           s.lin_k_dim, s.lin_v_dim));
  if (std::find(s.full_attention.begin(), s.full_attention.end(), 1) != s.full_attention.end()) {
    const uint64_t qd = uint64_t(s.q_heads) * s.head_dim;
    t.qkv = alloc(scratch_, T * s.attn_qkv_rows() * 4);
    t.q = alloc(scratch_, T * qd * 4);
    t.attn = alloc(scratch_, T * qd * 4);
    uint64_t partials = 0;  // the split-K partials for the longest context
    for (uint32_t len : {s.context_length, std::min<uint32_t>(s.context_length, 257u)})
      partials = std::max(partials, gpu::ops::attention_scratch_bytes(s.q_heads, s.head_dim, len));
    t.attn_partials = alloc(scratch_, partials);
    const std::vector<float> f = gpu::ops::rope_inv_freq(s.rotary_dim, s.rope_theta);
    m_.inv_freq = alloc(scratch_, f.size() * 4);
    if (void* dst = m_.inv_freq.buffer->contents()) std::memcpy(dst, f.data(), f.size() * 4);
  }
  gpu::ops::MoeScratchBytes mb;  // the largest over every chunk size (routes differ)
  for (uint32_t n = 1; n <= s.prefill_chunk; ++n) {
    const auto b = moe_bytes(s, n);
    mb.logits = std::max(mb.logits, b.logits);
    mb.ids = std::max(mb.ids, b.ids);
    mb.weights = std::max(mb.weights, b.weights);
    mb.plan = std::max(mb.plan, b.plan);
    mb.row_weight = std::max(mb.row_weight, b.row_weight);
    mb.h = std::max(mb.h, b.h);
    mb.y = std::max(mb.y, b.y);
  }
  t.moe_logits = alloc(scratch_, mb.logits);
  t.moe_ids = alloc(scratch_, mb.ids);
  t.moe_weights = alloc(scratch_, mb.weights);
  t.moe_plan = alloc(scratch_, mb.plan);
  t.moe_row_weight = alloc(scratch_, mb.row_weight);
  t.moe_h = alloc(scratch_, mb.h);
  t.moe_y = alloc(scratch_, mb.y);
  t.moe_tile_stats = alloc(scratch_, 2ull * s.layers * 4 * 4);
  t.logits = alloc(scratch_, uint64_t(std::max(s.logit_rows, 2u)) * V * 4);
  t.token_slot = alloc(scratch_, 2 * 4);  // two slots: two steps in flight
  t.chosen_logit = alloc(scratch_, 2 * 4);
  t.sample_state = alloc(scratch_, 2 * gpu::ops::sample_state_bytes(1));
  t.sample_partials = alloc(scratch_, gpu::ops::sample_partials_bytes(1, uint32_t(V)));
  t.sample_hist = alloc(scratch_, gpu::ops::sample_hist_bytes(1, uint32_t(V)));
  for (const auto& b : state_)
    if (b->contents()) std::memset(b->contents(), 0, b->size());
  reset();
}

std::vector<std::pair<std::string, size_t>> Engine::weight_list() const {
  std::vector<std::pair<std::string, size_t>> out;
  for (const auto& n : weight_order_) out.emplace_back(n, weights_.at(n).buffer->size());
  return out;
}

void Engine::upload(const std::string& name, const std::vector<std::pair<const void*, size_t>>& parts) {
  auto it = weights_.find(name);
  if (it == weights_.end()) fail("no weight named '" + name + "'");
  gpu::Buffer& b = *it->second.buffer;
  size_t total = 0;
  for (const auto& p : parts) total += p.second;
  if (total != b.size())
    fail("weight '" + name + "': got " + num(total) + " bytes in " + num(parts.size()) + " part(s), expected " + num(b.size()));
  char* dst = static_cast<char*>(b.contents());
  if (dst == nullptr) fail("weight '" + name + "': device '" + std::string(device_->name()) + "' has no storage to upload to");
  for (const auto& p : parts) {
    std::memcpy(dst, p.first, p.second);
    dst += p.second;
  }
  it->second.loaded = true;
}

void Engine::check_loaded() const {
  for (const auto& n : weight_order_)
    if (!weights_.at(n).loaded) fail("weight '" + n + "' was never uploaded");
}

size_t Engine::weight_bytes() const {
  size_t n = 0;
  for (const auto& [k, w] : weights_) n += w.buffer->size();
  return n;
}
size_t Engine::state_bytes() const {
  size_t n = 0;
  for (const auto& b : state_) n += b->size();
  return n;
}
size_t Engine::scratch_bytes() const {
  size_t n = 0;
  for (const auto& b : scratch_) n += b->size();
  return n;
}

std::vector<gpu::Binding> Engine::state_buffers() const {
  std::vector<gpu::Binding> out;
  for (const auto& b : state_) out.push_back({b.get(), 0, b->size()});
  return out;
}

bool Engine::is_kv(size_t i) const { return std::find(kv_cache_.begin(), kv_cache_.end(), i) != kv_cache_.end(); }

void Engine::require_idle(const char* what) const {
  if (!inflight_.empty()) fail(std::string(what) + ": steps are in flight; complete() them first");
}

void Engine::discard_inflight() {
  // reset()/restore() overwrite the state, so steps still in flight (e.g. after a KeyboardInterrupt
  // in the host loop) are waited out and dropped rather than refused.
  while (!inflight_.empty()) {
    try {
      inflight_.front().enc->wait();
    } catch (...) {
    }
    inflight_.pop_front();
  }
  have_token_ = false;
}

void Engine::reset() {
  discard_inflight();
  // The KV caches need no clearing: attention reads rows [0, position) only.
  for (size_t i = 0; i < state_.size(); ++i)
    if (!is_kv(i) && state_[i]->contents()) std::memset(state_[i]->contents(), 0, state_[i]->size());
  position_ = 0;
  conv_parity_ = 0;
  valid_ = true;
  failed_ = false;
  have_token_ = false;
}

Snapshot Engine::snapshot() const {
  require_idle("snapshot");
  if (!valid_) fail("the engine state is invalid after a failed step: call Model.reset() (or restore a snapshot)");
  Snapshot s;
  s.position = position_;
  s.conv_parity = conv_parity_;
  for (size_t i = 0; i < state_.size(); ++i) {
    const char* p = static_cast<const char*>(state_[i]->contents());
    if (p == nullptr) {
      s.buffers.emplace_back();
    } else if (is_kv(i)) {  // rows [0, position) of every KV head
      const size_t row = size_t(spec_.head_dim) * 2, cap = size_t(spec_.context_length) * row;
      std::vector<char> v;
      for (uint32_t h = 0; h < spec_.kv_heads; ++h) v.insert(v.end(), p + h * cap, p + h * cap + position_ * row);
      s.buffers.push_back(std::move(v));
    } else {
      s.buffers.emplace_back(p, p + state_[i]->size());
    }
  }
  return s;
}

void Engine::restore(const Snapshot& s) {
  discard_inflight();
  if (s.buffers.size() != state_.size() || s.position > spec_.context_length || s.conv_parity > 1)
    fail("snapshot is from a different engine");
  const size_t row = size_t(spec_.head_dim) * 2, cap = size_t(spec_.context_length) * row;
  for (size_t i = 0; i < state_.size(); ++i) {
    char* p = static_cast<char*>(state_[i]->contents());
    const size_t want = p == nullptr ? 0 : is_kv(i) ? size_t(spec_.kv_heads) * s.position * row : state_[i]->size();
    if (s.buffers[i].size() != want) fail("snapshot is from a different engine");
    if (p == nullptr) continue;
    if (is_kv(i)) {
      for (uint32_t h = 0; h < spec_.kv_heads; ++h)
        std::memcpy(p + h * cap, s.buffers[i].data() + h * size_t(s.position) * row, size_t(s.position) * row);
    } else {
      std::memcpy(p, s.buffers[i].data(), want);
    }
  }
  position_ = s.position;
  conv_parity_ = s.conv_parity;
  valid_ = true;
  failed_ = false;
  have_token_ = false;
}

Engine::InFlight Engine::encode(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling,
                                bool want_logits) {
  gpu::StepParams p;
  p.logits = want_logits;
  p.sample = sampling.enabled;
  p.sample_params = sampling.params;
  p.valid_vocab = sampling.valid_vocab;
  p.ids_from_slot = sampling.ids_from_slot;
  p.slot = next_slot_;
  p.tokens = T;
  p.position = position;
  p.all_logits = all_logits;
  p.conv_parity = conv_parity_;
  p.serialize = serialize;
  InFlight f;
  f.enc = device_->new_encoder();
  gpu::ops::RecordingEncoder rec(*f.enc);  // counts commit()/wait() asked for while encoding
  gpu::encode_prefill_chunk(rec, spec_, m_, p);
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
  for (uint32_t i = 0; i < T && !sampling.ids_from_slot; ++i)
    if (ids[i] >= spec_.vocab) fail("forward: token id " + num(ids[i]) + " at index " + num(i) + " outside [0, " + num(spec_.vocab) + ")");
  void* id_dst = m_.s.ids.buffer->contents();
  if (id_dst && !sampling.ids_from_slot) std::memcpy(id_dst, ids, size_t(T) * 4);
  valid_ = false;  // until every step in flight finished: a device error leaves a half-updated state
  have_token_ = false;
  InFlight f;
  try {
    f = encode(T, position_, all_logits, sampling, want_logits);
  } catch (...) {
    failed_ = true;  // the devices may have half-run it (the emulator runs at commit)
    throw;
  }
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
  InFlight f = std::move(inflight_.front());
  inflight_.pop_front();
  try {
    f.enc->wait();
  } catch (...) {
    inflight_.clear();  // the state is invalid (valid_ stays false) until reset / restore
    failed_ = true;
    have_token_ = false;
    throw;
  }
  StepStats st = f.st;
  st.host_waits = st.waits_in_step + 1;
  correct_moe_flops(st, f.slot);
  const size_t V = spec_.vocab;
  const char* src = static_cast<const char*>(m_.s.logits.buffer->contents());
  if (logits && src && f.rows)
    std::memcpy(logits, src + (f.rows == 1 ? f.slot : 0) * V * 4, f.rows * V * 4);
  if (inflight_.empty() && !failed_) valid_ = true;
  last_ = st;
  if (f.sampled) {
    // The step itself is complete (state advanced, logits returned); a sampler error only means
    // there is no token to feed.
    const char* sp = static_cast<const char*>(m_.s.sample_state.buffer->contents());
    const auto* state = sp ? reinterpret_cast<const ::lily::SampleState*>(sp + f.slot * gpu::ops::sample_state_bytes(1)) : nullptr;
    if (state && state->status != 0) {
      if (inflight_.empty()) have_token_ = false;
      throw SampleError("engine: the sampler found a non-finite logit" +
                        (state->bad_id != 0xFFFFFFFFu ? " at token id " + num(state->bad_id) : std::string(" (all -inf)")) +
                        " (numerical failure in the model)");
    }
    if (const auto* tok = static_cast<const uint32_t*>(m_.s.token_slot.buffer->contents())) st.token = tok[f.slot];
    if (const auto* l = static_cast<const float*>(m_.s.chosen_logit.buffer->contents())) st.token_logit = l[f.slot];
    last_ = st;
  }
  return st;
}

void Engine::correct_moe_flops(StepStats& st, uint32_t slot) const {
  // The encoder counted the MoE tiled route's bound over every routing; each layer's plan wrote
  // the tiles it made (device memory, complete after the wait): count what ran instead.
  const ModelSpec& s = spec_;
  const uint32_t T = uint32_t(st.tokens);
  if (gpu::ops::moe_route(T, s.top_k) != gpu::ops::MoeRoute::tiled) return;
  const char* base = static_cast<const char*>(m_.s.moe_tile_stats.buffer->contents());
  if (!base) return;  // the counting device has no memory: the bound stays
  const auto bound = gpu::ops::moe_expert_flops(T, s.top_k, s.experts, s.hidden, s.moe_inter, s.shared_inter);
  const auto* stats = reinterpret_cast<const uint32_t*>(base + m_.s.moe_tile_stats.offset) + uint64_t(slot) * s.layers * 4;
  for (uint32_t li = 0; li < s.layers; ++li)
    st.flops_executed = st.flops_executed - bound.executed +
                        gpu::ops::moe_expert_flops_from_tiles(T, s.top_k, s.hidden, s.moe_inter, s.shared_inter, stats + 4 * li);
}

StepStats Engine::forward(const uint32_t* ids, uint32_t T, bool all_logits, float* logits,
                          const StepSampling& sampling, bool want_logits) {
  if (!inflight_.empty()) fail("forward: steps are in flight; complete() them first");
  submit(ids, T, all_logits, sampling, want_logits);
  return complete(logits);
}

StepStats Engine::count(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling,
                        bool want_logits) {
  if (std::string_view(device_->name()) != "count") fail("count() runs on the counting device only (device 'count')");
  StepStats st = encode(T, position, all_logits, sampling, want_logits).st;
  last_ = st;
  return st;
}

}  // namespace lily::core
