// Buffers and the memory plan: build_buffers() (every weight, state and scratch buffer of the
// model, fused projections included), plan_memory() (the sizes alone, before anything is
// allocated), the engine's memory check against the device and its pipeline check (every kernel
// a conversation dispatches, against the device's thread and threadgroup-memory limits).
#include "core/engine.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "core/engine_internal.h"
#include "gpu/ops/attention.h"
#include "gpu/ops/gated_delta.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/sampling.h"

namespace lily::core {

using detail::Allocator;
using detail::fail;
using detail::gib;
using detail::num;

namespace {

// The MoE scratch for T tokens (moe_scratch_bytes reads only the shape fields).
gpu::ops::MoeScratchBytes moe_bytes(const ModelSpec& s, uint32_t T) {
  gpu::ops::MoeOperands op;
  op.tokens = T;
  op.hidden = s.hidden;
  op.experts = s.experts;
  op.top_k = s.top_k;
  op.inter = s.moe_inter;
  op.shared_inter = s.shared_inter;
  op.x_dtype = s.activations;
  return gpu::ops::moe_scratch_bytes(op);
}

gpu::QuantWeight alloc_quant(Allocator& a, const std::string& name, uint64_t rows, uint64_t cols, const QuantSpec& q,
                             uint64_t count = 1) {
  if (cols % q.group_size) fail(name + ": in-features " + num(cols) + " not a multiple of group_size " + num(q.group_size));
  const uint64_t w = count * rows * cols * q.bits / 8;
  const uint64_t s = count * rows * (cols / q.group_size) * gpu::dtype_size(q.scale_dtype);
  return gpu::QuantWeight{a.weight(name + ".weight", w), a.weight(name + ".scales", s), a.weight(name + ".biases", s), q,
                          uint32_t(rows)};
}

// A projection fused at load from `parts` (name within `name`, rows; in row order) of class
// default `cls`: one weight `name` when every part has the same quantization (the fused route),
// else one weight per run of agreeing neighbours, "name:part+part" (the split route: one dispatch
// per run). lily_py uploads the same runs (backends/engine.py: fused_runs).
template <size_t N>
gpu::QuantBlocks alloc_fused(Allocator& a, const ModelSpec& s, const std::string& name, const char* const (&parts)[N],
                             const uint64_t (&rows)[N], uint64_t cols, const QuantSpec& cls) {
  struct Run {
    std::string label;
    uint64_t rows;
    QuantSpec q;
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < N; ++i) {
    const QuantSpec& q = s.quant(name + ":" + parts[i], cls);
    if (!runs.empty() && runs.back().q == q) {
      runs.back().label += std::string("+") + parts[i];
      runs.back().rows += rows[i];
    } else {
      runs.push_back({parts[i], rows[i], q});
    }
  }
  gpu::QuantBlocks out;
  for (const Run& r : runs) out.push_back(alloc_quant(a, runs.size() == 1 ? name : name + ":" + r.label, r.rows, cols, r.q));
  return out;
}

}  // namespace

// Every buffer of the engine for spec `s`: weights in checkpoint order, the conversation state
// (KV caches, DeltaNet state and conv windows) and the scratch of one prefill_chunk step; int8:
// the device takes int8 activations (DeviceInfo::tensor_int8), which read the int8 scratch.
void detail::build_buffers(const ModelSpec& s, Allocator& a, gpu::ModelBuffers& m_, bool int8) {
  const uint64_t H = s.hidden, V = s.vocab, E = s.experts, I = s.moe_inter, Is = s.shared_inter;
  const uint64_t C = s.conv_dim(), VD = s.value_dim(), Hv = s.lin_v_heads, K = s.conv_kernel;
  const uint64_t P = gpu::ops::gated_delta_mixer_proj_rows(s.lin_k_heads, s.lin_v_heads, s.lin_k_dim, s.lin_v_dim);
  const uint64_t xe = gpu::dtype_size(s.activations);  // bytes per activation element

  // Weights, in checkpoint order.
  m_.embed = alloc_quant(a, "embed", V, H, s.quant("embed", s.embed));
  for (uint32_t i = 0; i < s.layers; ++i) {
    const std::string p = "layers." + num(i) + ".";
    gpu::Layer L;
    L.attention = s.full_attention[i] != 0;
    L.input_norm = a.weight(p + "input_norm", H * 4);
    L.post_norm = a.weight(p + "post_norm", H * 4);
    if (L.attention) {
      // bf16, int8 or float32 pool of kv_pool() blocks of [kv_heads, kv_block_tokens] rows (shaders/common/kv_blocks.h)
      const uint64_t D = s.head_dim, kv = uint64_t(s.kv_pool()) * s.kv_heads * s.kv_block_tokens * s.kv_row_bytes();
      const uint64_t nkv = uint64_t(s.kv_heads) * D;
      L.at.qkv_proj = alloc_fused(a, s, p + "qkv_proj", kQkvParts, {2ull * s.q_heads * D, nkv, nkv}, H, s.mixer);
      L.at.o_proj = alloc_quant(a, p + "o_proj", H, uint64_t(s.q_heads) * D, s.quant(p + "o_proj", s.mixer));
      L.at.q_norm = a.weight(p + "q_norm", D * 4);
      L.at.k_norm = a.weight(p + "k_norm", D * 4);
      L.at.k_cache = a.state(kv, true);
      L.at.v_cache = a.state(kv, true);
    } else {
    L.dn.in_proj = alloc_fused(a, s, p + "in_proj", kInProjParts, {C, VD, Hv, Hv}, H, s.mixer);
    L.dn.out_proj = alloc_quant(a, p + "out_proj", H, VD, s.quant(p + "out_proj", s.mixer));
    L.dn.conv = a.weight(p + "conv1d", C * K * 4);
    L.dn.A_log = a.weight(p + "A_log", Hv * 4);
    L.dn.dt_bias = a.weight(p + "dt_bias", Hv * 4);
    L.dn.norm = a.weight(p + "gated_norm", uint64_t(s.lin_v_dim) * 4);
    L.dn.conv_state[0] = a.state((K - 1) * C * xe, false);
    L.dn.conv_state[1] = a.state((K - 1) * C * xe, false);
    L.dn.state = a.state(Hv * s.lin_v_dim * s.lin_k_dim * 4, false);
    }
    L.moe.router = alloc_fused(a, s, p + "router", kRouterParts, {E, 1}, H, s.router);
    const auto ex = [&](const char* w) { return s.quant(p + w, s.experts_q); };
    L.moe.gate = alloc_quant(a, p + "experts.gate", I, H, ex("experts.gate"), E);
    L.moe.up = alloc_quant(a, p + "experts.up", I, H, ex("experts.up"), E);
    L.moe.down = alloc_quant(a, p + "experts.down", H, I, ex("experts.down"), E);
    L.moe.shared_gate = alloc_quant(a, p + "shared.gate", Is, H, ex("shared.gate"));
    L.moe.shared_up = alloc_quant(a, p + "shared.up", Is, H, ex("shared.up"));
    L.moe.shared_down = alloc_quant(a, p + "shared.down", H, Is, ex("shared.down"));
    m_.layers.push_back(L);
  }
  m_.norm = a.weight("norm", H * 4);
  m_.lm_head = alloc_quant(a, "lm_head", V, H, s.quant("lm_head", s.lm_head));

  // Scratch for prefill_chunk tokens.
  const uint64_t T = s.prefill_chunk;
  gpu::StepScratch& t = m_.s;
  t.ids = a.scratch(T * 4);
  t.x = a.scratch(T * H * xe);
  t.h = a.scratch(T * H * xe);
  t.xn = a.scratch(T * H * xe);
  t.mix = a.scratch(T * H * xe);
  t.proj = a.scratch(T * P * xe);
  t.conv_out = a.scratch(T * C * xe);
  t.o = a.scratch(T * VD * xe);
  // the int8 scratches (only a bf16 engine whose chunks reach the tiled routes takes int8)
  const bool i8_scratch = int8 && s.activations == gpu::DType::bf16 && T > kQmvMaxRows;
  if (i8_scratch) {  // the projections' int8 x (qmm_m5i8) and the MoE's (moe_gate_up_m5i8)
    const uint64_t widest = std::max<uint64_t>({H, VD, uint64_t(s.q_heads) * s.head_dim});
    t.x_i8 = a.scratch(gpu::ops::qmm_i8_scratch_bytes(uint32_t(T), uint32_t(widest)));
  }
  const bool any_deltanet = std::find(s.full_attention.begin(), s.full_attention.end(), 0) != s.full_attention.end();
  if (any_deltanet)  // the one-token route (gated_delta_decode): raw outputs before the gated norm
    t.gd_o_raw = a.scratch(VD * 4);
  if (any_deltanet && gpu::ops::gated_delta_route(uint32_t(T), s.lin_k_dim, s.lin_v_dim) == gpu::ops::GdRoute::chunked)
    t.gd_chunk = a.scratch(gpu::ops::gated_delta_chunk_scratch_bytes(uint32_t(T), s.lin_k_heads, s.lin_v_heads,
                                                                           s.lin_k_dim, s.lin_v_dim));
  if (std::find(s.full_attention.begin(), s.full_attention.end(), 1) != s.full_attention.end()) {
    const uint64_t qd = uint64_t(s.q_heads) * s.head_dim;
    t.qkv = a.scratch(T * s.attn_qkv_rows() * xe);
    t.q = a.scratch(T * qd * xe);
    t.attn = a.scratch(T * qd * xe);
    uint64_t partials = 0;  // the split-K partials for the longest context
    for (uint32_t len : {s.context_length, std::min<uint32_t>(s.context_length, 257u)})
      partials = std::max(partials, gpu::ops::attention_scratch_bytes(s.q_heads, s.head_dim, len, s.kv_block_tokens));
    t.attn_partials = a.scratch(partials);
    m_.inv_freq = a.scratch(uint64_t(s.rotary_dim / 2) * 4);  // filled by the Engine
    m_.kv_table = a.scratch(uint64_t(s.kv_blocks()) * 4);     // filled by the Engine
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
  t.moe_logits = a.scratch(mb.logits);
  t.moe_ids = a.scratch(mb.ids);
  t.moe_weights = a.scratch(mb.weights);
  t.moe_plan = a.scratch(mb.plan);
  t.moe_row_weight = a.scratch(mb.row_weight);
  t.moe_h = a.scratch(mb.h);
  t.moe_y = a.scratch(mb.y);
  t.moe_tile_stats = a.scratch(2ull * s.layers * kMoeTileStats * 4);
  if (i8_scratch)  // the MoE's int8 h (moe_down_m5i8)
    t.moe_h_i8 = a.scratch(gpu::ops::qmm_i8_scratch_bytes(uint32_t(T * (uint64_t(s.top_k) + 1)),
                                                          std::max(s.moe_inter, s.shared_inter)));
  t.logits = a.scratch(uint64_t(std::max(s.logit_rows, 2u)) * V * 4);
  t.token_slot = a.scratch(2 * 4);  // two slots: two steps in flight
  t.chosen_logit = a.scratch(2 * 4);
  t.sample_state = a.scratch(2 * gpu::ops::sample_state_bytes(1));
  t.sample_partials = a.scratch(gpu::ops::sample_partials_bytes(1, uint32_t(V)));
  t.sample_hist = a.scratch(gpu::ops::sample_hist_bytes(1, uint32_t(V)));
  t.logprobs = a.scratch(2 * kSampleLogprobWords * 4);
  t.token_mask = a.scratch(2ull * gpu::ops::mask_words(uint32_t(V)) * 4);  // two slots, as token_slot
}

namespace {

// Sizes only: nothing is allocated.
class Planner final : public Allocator {
 public:
  MemoryPlan plan;
  gpu::Binding weight(const std::string& name, uint64_t bytes) override {
    plan.weight_bytes += bytes;
    largest(name, bytes);
    return gpu::Binding{nullptr, 0, bytes};
  }
  gpu::Binding state(uint64_t bytes, bool kv) override {
    bytes = std::max<uint64_t>(bytes, 4);
    plan.state_bytes += bytes;
    largest(kv ? "a KV cache" : "DeltaNet state", bytes);
    return gpu::Binding{nullptr, 0, bytes};
  }
  gpu::Binding scratch(uint64_t bytes) override {
    const uint64_t b = std::max<uint64_t>(bytes, 4);
    plan.scratch_bytes += b;
    largest("scratch", b);
    return gpu::Binding{nullptr, 0, bytes};
  }

 private:
  void largest(const std::string& what, uint64_t bytes) {
    if (bytes > plan.largest_buffer_bytes) {
      plan.largest_buffer_bytes = bytes;
      plan.largest_buffer = what;
    }
  }
};

// snprintf, not an ostream: on the lent H200's Python (its own libstdc++), inserting a double

}  // namespace

MemoryPlan plan_memory(const ModelSpec& spec, bool int8) {
  gpu::ModelBuffers m;
  Planner p;
  detail::build_buffers(spec, p, m, int8);
  return p.plan;
}

void Engine::check_memory(const MemoryPlan& p) {
  memory_ = p;
  const gpu::DeviceInfo di = device_->info();
  memory_.working_set_bytes = di.working_set_bytes;
  memory_.max_buffer_bytes = di.max_buffer_bytes;
  const std::string dev = "device '" + std::string(device_->name()) + "' (" + di.device_name + ")";
  if (di.max_buffer_bytes && p.largest_buffer_bytes > di.max_buffer_bytes)
    throw DeviceMemoryError("engine: " + p.largest_buffer + " needs one buffer of " + num(p.largest_buffer_bytes) +
                            " bytes (" + gib(p.largest_buffer_bytes) + "), more than " + dev +
                            " allows in one buffer (maxBufferLength " + num(di.max_buffer_bytes) + " bytes, " +
                            gib(di.max_buffer_bytes) + ")");
  if (di.working_set_bytes == 0) return;
  const uint64_t need = p.total(), avail = di.working_set_bytes;
  const std::string parts = " (weights " + gib(p.weight_bytes) + ", KV cache and state " + gib(p.state_bytes) +
                            ", scratch " + gib(p.scratch_bytes) + ")";
  if (need > avail) {
    // The largest context_length whose buffers fit (KV caches and attention scratch grow with it).
    auto total_at = [&](uint32_t ctx, uint32_t chunk) {
      ModelSpec t = spec_;
      t.context_length = ctx;
      t.prefill_chunk = std::min(chunk, ctx);
      t.logit_rows = std::min(t.logit_rows, t.prefill_chunk);
      return plan_memory(t, device_->info().tensor_int8).total();
    };
    // The largest x in [1, hi) with fits(x), 0 if none (fits is monotone: more is bigger).
    auto largest = [&](uint32_t hi, auto fits) {
      if (hi <= 1 || !fits(1u)) return 0u;
      uint32_t lo = 1;  // fits(lo), !fits(hi)
      while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        (fits(mid) ? lo : hi) = mid;
      }
      return lo;
    };
    const uint32_t chunk = spec_.prefill_chunk;
    // KV caches and attention scratch grow with context_length, the step's scratch with prefill_chunk.
    const uint32_t ctx_fit = largest(spec_.context_length, [&](uint32_t c) { return total_at(c, chunk) <= avail; });
    const uint32_t chunk_fit = largest(chunk, [&](uint32_t k) { return total_at(spec_.context_length, k) <= avail; });
    std::string fit;
    if (ctx_fit > 0)
      fit = "context_length=" + num(ctx_fit) + (ctx_fit < chunk ? " (prefill_chunk " + num(ctx_fit) + ")" : "") +
            " would fit (this load asked for " + num(spec_.context_length) + ")";
    if (chunk_fit > 0)
      fit += (fit.empty() ? "" : ", or ") + std::string("prefill_chunk=") + num(chunk_fit) + " at context_length " +
             num(spec_.context_length);
    if (fit.empty()) {
      const uint32_t both = largest(spec_.context_length, [&](uint32_t c) { return total_at(c, 1) <= avail; });
      fit = both > 0 ? "context_length=" + num(both) + " with prefill_chunk=1 would fit"
                     : "no context_length fits: the weights alone need " + gib(p.weight_bytes);
    }
    throw DeviceMemoryError("engine: the model needs " + num(need) + " bytes (" + gib(need) + ") of device memory" + parts +
                            ", but " + dev + " has " + num(avail) + " bytes (" + gib(avail) +
                            ") available (recommendedMaxWorkingSetSize); " + fit);
  }
  if (double(need) > 0.85 * double(avail))
    memory_warning_ = "engine: the model uses " + gib(need) + parts + " of the " + gib(avail) + " " + dev +
                      " recommends (recommendedMaxWorkingSetSize): " + num(uint64_t(100.0 * double(need) / double(avail))) +
                      "%, above 85%; other programs' GPU memory may push it out (a smaller context_length uses less)";
}

namespace {

// Records what a step would dispatch (kernel, threads per threadgroup) without running anything;
// host code that fits its threads to a pipeline (rms_norm) sees the device's limits.
class PlanEncoder final : public gpu::Encoder {
 public:
  explicit PlanEncoder(gpu::Device& dev)
      : dev_(dev), tensor_ops_(dev.info().tensor_ops), tensor_int8_(dev.info().tensor_int8) {}
  void commit() override {}
  void wait() override {}
  uint32_t thread_limit(gpu::KernelId k) const override { return pipeline(k).max_threads; }
  bool tensor_ops() const override { return tensor_ops_; }
  bool tensor_int8() const override { return tensor_int8_; }
  const gpu::PipelineInfo& pipeline(gpu::KernelId k) const {
    auto it = pipelines_.find(k);
    if (it == pipelines_.end()) it = pipelines_.emplace(k, dev_.pipeline_info(k)).first;
    return it->second;
  }
  std::map<gpu::KernelId, uint64_t> threads;  // most threads per threadgroup dispatched, per kernel

 protected:
  void encode_dispatch(const gpu::Dispatch& d) override {
    pipeline(d.kernel);
    uint64_t& t = threads[d.kernel];
    t = std::max(t, d.threads.count());
  }
  void encode_barrier() override {}

 private:
  gpu::Device& dev_;
  bool tensor_ops_;
  bool tensor_int8_;
  mutable std::map<gpu::KernelId, gpu::PipelineInfo> pipelines_;
};

}  // namespace

void Engine::check_pipelines() {
  PlanEncoder plan(*device_);
  const ModelSpec& s = spec_;
  const uint32_t chunk = s.prefill_chunk, ctx = s.context_length;
  auto step = [&](uint32_t T, uint32_t position, bool all_logits, bool logits, int sample) {
    gpu::StepParams p;
    p.tokens = T;
    p.position = position;
    p.all_logits = all_logits;
    p.logits = logits;
    p.sample = sample > 0;
    p.sample_params.greedy = sample == 1;
    if (sample == 2) {  // every sampler stage: temperature, top-k, top-p, min-p
      p.sample_params.temperature = 0.7;
      p.sample_params.top_k = 20;
      p.sample_params.top_p = 0.9;
      p.sample_params.min_p = 0.05;
    }
    gpu::encode_prefill_chunk(plan, s, m_, p);
  };
  // The routes a conversation takes: decode at the start and the end of the context (attention's
  // split-K switch), small / medium / full prefill chunks (qmv / qmm, MoE matvec / tiled), all logits.
  step(1, 0, false, true, 1);
  step(1, ctx - 1, false, true, 2);
  step(std::min(chunk, 9u), 0, false, true, 0);
  step(chunk, 0, false, false, 0);
  step(chunk, ctx - chunk, false, true, 0);
  step(s.logit_rows, 0, true, true, 0);
  const gpu::DeviceInfo di = device_->info();
  const std::string dev = "device '" + std::string(device_->name()) + "' (" + di.device_name + ")";
  for (const auto& [k, threads] : plan.threads) {
    const gpu::PipelineInfo& pi = plan.pipeline(k);
    const std::string name(gpu::kernel_info(k).name);
    if (threads > pi.max_threads)
      throw DeviceLimitError("engine: kernel '" + name + "' dispatches " + num(threads) +
                             " threads per threadgroup for this model, but its pipeline on " + dev + " allows at most " +
                             num(pi.max_threads) + " (maxTotalThreadsPerThreadgroup); no route of this kernel fits");
    if (pi.static_threadgroup_bytes > int64_t(gpu::kMaxThreadgroupMemory))
      throw DeviceLimitError("engine: kernel '" + name + "' uses " + num(uint64_t(pi.static_threadgroup_bytes)) +
                             " bytes of threadgroup memory on " + dev + ", more than the " + num(gpu::kMaxThreadgroupMemory) +
                             " bytes a threadgroup has");
    plan_.push_back(PlannedKernel{k, uint32_t(threads), pi});
  }
}

}  // namespace lily::core
