#include "core/engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>

#include "gpu/ops/attention.h"
#include "gpu/ops/gated_delta.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/sampling.h"

namespace lily::core {

namespace {

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument("engine: " + m); }

std::string num(uint64_t v) { return std::to_string(v); }

template <size_t N>
std::string list(const uint32_t (&v)[N]) {
  std::string s;
  for (uint32_t x : v) s += (s.empty() ? "" : "/") + num(x);
  return s;
}

// experts: read by the MoE expert kernels (kEngineExpertBits), else by the quantized matmul or
// the embedding (kEngineBits).
void check_quant(const QuantSpec& q, const std::string& what, bool experts = false) {
  const bool bits_ok = experts ? std::ranges::find(kEngineExpertBits, q.bits) != std::end(kEngineExpertBits)
                               : std::ranges::find(kEngineBits, q.bits) != std::end(kEngineBits);
  if (!bits_ok)
    fail(what + ": bits=" + num(q.bits) + " unsupported (" + (experts ? list(kEngineExpertBits) : list(kEngineBits)) +
         ")");
  if (std::ranges::find(kEngineGroupSizes, q.group_size) == std::end(kEngineGroupSizes))
    fail(what + ": group_size=" + num(q.group_size) + " unsupported (" + list(kEngineGroupSizes) + ")");
}

std::string describe(const QuantSpec& q) { return num(q.bits) + "-bit group " + num(q.group_size); }

// Every name ModelSpec::quant_overrides may hold -> whether the MoE expert kernels read it.
std::map<std::string, bool> quant_names(const ModelSpec& s) {
  std::map<std::string, bool> n{{"embed", false}, {"lm_head", false}};
  for (uint32_t i = 0; i < s.layers; ++i) {
    const std::string p = "layers." + num(i) + ".";
    if (s.full_attention[i]) {
      for (const char* part : kQkvParts) n[p + "qkv_proj:" + part] = false;
      n[p + "o_proj"] = false;
    } else {
      for (const char* part : kInProjParts) n[p + "in_proj:" + part] = false;
      n[p + "out_proj"] = false;
    }
    for (const char* part : kRouterParts) n[p + "router:" + part] = false;
    for (const char* w : {"experts.gate", "experts.up", "experts.down", "shared.gate", "shared.up", "shared.down"})
      n[p + w] = true;
  }
  return n;
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
  op.x_dtype = s.activations;
  return gpu::ops::moe_scratch_bytes(op);
}

}  // namespace

void ModelSpec::validate() const {
  if (vocab == 0 || hidden == 0 || layers == 0) fail("empty model (vocab, hidden, layers)");
  if (full_attention.size() != layers) fail("full_attention has " + num(full_attention.size()) + " entries for " + num(layers) + " layers");
  if (lin_k_heads == 0 || lin_v_heads == 0 || lin_k_dim == 0 || lin_v_dim == 0) fail("empty DeltaNet dims");
  if (experts == 0 || top_k == 0 || moe_inter == 0 || shared_inter == 0) fail("empty MoE dims");
  if (context_length == 0) fail("context_length must be >= 1");
  if (kv_block_tokens < 32 || (kv_block_tokens & (kv_block_tokens - 1)) != 0)
    fail("kv_block_tokens must be a power of two >= 32, got " + num(kv_block_tokens));
  if (kv_format == gpu::KvFormat::q8 && head_dim != 64 && head_dim != 128 && head_dim != 256 && std::count(full_attention.begin(), full_attention.end(), 1))
    fail("kv_dtype int8 needs head_dim 64, 128 or 256 (the int8 attention routes), got " + num(head_dim));
  if (prefill_chunk == 0) fail("prefill_chunk must be >= 1");
  if (logit_rows == 0 || logit_rows > prefill_chunk) fail("logit_rows must be in [1, prefill_chunk]");
  check_quant(embed, "embed");
  check_quant(lm_head, "lm_head");
  check_quant(mixer, "mixer projections");
  check_quant(experts_q, "experts", true);
  check_quant(router, "router");
  const std::map<std::string, bool> names = quant_names(*this);
  for (const auto& [name, q] : quant_overrides) {
    auto it = names.find(name);
    if (it == names.end()) fail("quant_overrides: the model has no weight (or fused part) '" + name + "'");
    check_quant(q, name, it->second);
  }
  // The MoE kernels read the routed and the shared expert in one dispatch per stage: gate + up
  // (experts.gate, experts.up, shared.gate, shared.up) and down (experts.down, shared.down).
  for (uint32_t i = 0; i < layers; ++i) {
    const std::string p = "layers." + num(i) + ".";
    for (const auto& stage : {std::vector<std::string>{"experts.gate", "experts.up", "shared.gate", "shared.up"},
                              std::vector<std::string>{"experts.down", "shared.down"}}) {
      const QuantSpec& first = quant(p + stage[0], experts_q);
      for (const std::string& w : stage)
        if (!(quant(p + w, experts_q) == first))
          fail(p + w + " is " + describe(quant(p + w, experts_q)) + " but " + p + stage[0] + " is " + describe(first) +
               ": one MoE kernel reads both (the stage's matrices must agree in quantization)");
    }
  }
  if (!(eps > 0)) fail("eps must be > 0");
}

std::string ModelSpec::summary() const {
  std::ostringstream o;
  uint32_t attn = 0;
  for (uint8_t a : full_attention) attn += a;
  o << layers << " layers (" << layers - attn << " DeltaNet, " << attn << " attention), hidden " << hidden << ", vocab "
    << vocab << ", " << experts << " experts top-" << top_k << ", context " << context_length << ", chunk "
    << prefill_chunk;
  if (kv_format != gpu::KvFormat::bf16) o << ", " << gpu::kv_format_name(kv_format) << " KV cache";
  return o.str();
}

// Where build_buffers() puts each buffer: the engine's device (Engine), or nowhere, only adding
// up the sizes (MemoryPlan: the memory check before anything is allocated).
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual gpu::Binding weight(const std::string& name, uint64_t bytes) = 0;
  virtual gpu::Binding state(uint64_t bytes, bool kv_cache) = 0;
  virtual gpu::Binding scratch(uint64_t bytes) = 0;
};

namespace {

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

// Every buffer of the engine for spec `s`: weights in checkpoint order, the conversation state
// (KV caches, DeltaNet state and conv windows) and the scratch of one prefill_chunk step; int8:
// the device takes int8 activations (DeviceInfo::tensor_int8), which read the int8 scratch.
void build_buffers(const ModelSpec& s, Allocator& a, gpu::ModelBuffers& m_, bool int8 = false) {
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
// into an ostringstream crashed the process inside the extension (docs/gpu.md, "Found on the GPU").
std::string gib(uint64_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(1ull << 30));
  return buf;
}

}  // namespace

MemoryPlan plan_memory(const ModelSpec& spec, bool int8) {
  gpu::ModelBuffers m;
  Planner p;
  build_buffers(spec, p, m, int8);
  return p.plan;
}

// The engine's own buffers on its device.
class Engine::DeviceAllocator final : public Allocator {
 public:
  explicit DeviceAllocator(Engine& e) : e_(e) {}
  gpu::Binding weight(const std::string& name, uint64_t bytes) override {
    e_.weight_order_.push_back(name);
    Weight w;
    auto src = e_.mapping_.weights.find(name);
    if (src == e_.mapping_.weights.end()) {
      w.why_copied = "not in the mapping";
    } else {
      const WeightSource& at = src->second;
      const bool have = at.file < e_.file_buffers_.size() && e_.file_buffers_[at.file] != nullptr;
      if (at.file >= e_.files_.size())
        fail("weight '" + name + "': mapped file index " + num(at.file) + " out of range");
      const MappedFile& f = *e_.files_[at.file];
      if (at.offset + bytes > f.file_bytes)
        fail("weight '" + name + "': bytes [" + num(at.offset) + ", " + num(at.offset + bytes) + ") lie past the end of " +
             f.path + " (" + num(f.file_bytes) + " bytes)");
      if (!have) {
        w.why_copied = "device '" + std::string(e_.device_->name()) + "' does not map " + f.path;
      } else if (at.offset % kMappedAlignment) {
        w.why_copied = "offset " + num(at.offset) + " in " + f.path + " is not a multiple of " + num(kMappedAlignment);
      } else {
        w.binding = gpu::Binding{e_.file_buffers_[at.file].get(), at.offset, bytes};
        w.loaded = true;
        w.file = at.file;
        w.offset = at.offset;
        e_.weights_[name] = std::move(w);
        return e_.weights_[name].binding;
      }
    }
    w.buffer = e_.device_->new_buffer(bytes);
    w.binding = gpu::Binding{w.buffer.get(), 0, bytes};
    e_.weights_[name] = std::move(w);
    return e_.weights_[name].binding;
  }
  gpu::Binding state(uint64_t bytes, bool kv) override {
    gpu::Binding b = alloc(e_.state_, bytes);
    if (kv) e_.kv_cache_.push_back(e_.state_.size() - 1);
    return b;
  }
  gpu::Binding scratch(uint64_t bytes) override { return alloc(e_.scratch_, bytes); }

 private:
  gpu::Binding alloc(std::vector<std::unique_ptr<gpu::Buffer>>& pool, uint64_t bytes) {
    pool.push_back(e_.device_->new_buffer(std::max<size_t>(bytes, 4)));
    return gpu::Binding{pool.back().get(), 0, bytes};
  }
  Engine& e_;
};

Engine::MappedFile::~MappedFile() {
  if (data) munmap(data, length);
}

Engine::Engine(ModelSpec spec, std::unique_ptr<gpu::Device> device, const WeightMapping& mapping)
    : spec_(std::move(spec)), device_(std::move(device)), mapping_(mapping) {
  const ModelSpec& s = spec_;
  s.validate();
  spec_.kv_pool_blocks = 1;  // the KV pools start at one block each and grow with the conversation
  check_memory(plan_memory(s, device_->info().tensor_int8));  // before anything is allocated
  // Map each checkpoint file whole (read-only, shared: the page cache's pages, nothing copied) and
  // wrap it in a device buffer; a device that cannot leaves nullptr and those weights are copied.
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  for (const std::string& path : mapping_.files) {
    auto f = std::make_unique<MappedFile>();
    f->path = path;
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) fail("cannot open " + path + " to map it: " + std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
      ::close(fd);
      fail("cannot map " + path + ": empty or unreadable");
    }
    f->file_bytes = uint64_t(st.st_size);
    f->length = (size_t(st.st_size) + page - 1) / page * page;  // the last page reads zeros past the end
    void* m = mmap(nullptr, f->length, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) fail("cannot map " + path + ": " + std::strerror(errno));
    f->data = m;
    file_buffers_.push_back(device_->wrap_host_memory(f->data, f->length));
    files_.push_back(std::move(f));
  }
  DeviceAllocator a(*this);
  build_buffers(s, a, m_, device_->info().tensor_int8);
  std::vector<bool> used(files_.size(), false);  // a mapping no weight is bound to is let go now
  for (const auto& [name, w] : weights_)
    if (w.file >= 0) used[size_t(w.file)] = true;
  for (size_t i = 0; i < files_.size(); ++i)
    if (!used[i]) {
      file_buffers_[i].reset();
      files_[i].reset();
    }
  if (m_.kv_table.buffer && m_.kv_table.buffer->has_storage()) {  // logical block b -> pool block b
    std::vector<uint32_t> t(s.kv_blocks());
    for (uint32_t b = 0; b < t.size(); ++b) t[b] = b;
    m_.kv_table.buffer->write(m_.kv_table.offset, t.data(), t.size() * 4);
  }
  if (m_.inv_freq.buffer) {
    const std::vector<float> f = gpu::ops::rope_inv_freq(s.rotary_dim, s.rope_theta);
    if (m_.inv_freq.buffer->has_storage()) m_.inv_freq.buffer->write(m_.inv_freq.offset, f.data(), f.size() * 4);
  }
  for (const auto& b : state_)
    if (b->has_storage()) b->fill(0, 0, b->size());
  std::vector<gpu::Buffer*> resident;  // weights and state: the GPU keeps them resident (Metal, macOS 15+)
  // Mapped files stay out of the residency set: the OS may page out what the GPU does not touch.
  for (const auto& [name, w] : weights_)
    if (w.buffer) resident.push_back(w.buffer.get());
  for (const auto& b : state_) resident.push_back(b.get());
  device_->make_resident(resident);
  check_pipelines();  // every pipeline a step uses, created and checked now rather than at the first step
  reset();
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

std::vector<std::pair<std::string, size_t>> Engine::weight_list() const {
  std::vector<std::pair<std::string, size_t>> out;
  for (const auto& n : weight_order_) out.emplace_back(n, weights_.at(n).binding.bytes);
  return out;
}

std::vector<WeightPlacement> Engine::weight_sources() const {
  std::vector<WeightPlacement> out;
  for (const auto& n : weight_order_) {
    const Weight& w = weights_.at(n);
    out.push_back(WeightPlacement{n, w.binding.bytes, w.file, w.offset, w.why_copied});
  }
  return out;
}

size_t Engine::mapped_weight_bytes() const {
  size_t n = 0;
  for (const auto& [k, w] : weights_)
    if (!w.buffer) n += w.binding.bytes;
  return n;
}

uint64_t Engine::mapped_file_bytes() const {
  uint64_t n = 0;
  for (size_t i = 0; i < files_.size(); ++i)
    if (file_buffers_[i]) n += files_[i]->file_bytes;
  return n;
}

void Engine::upload(const std::string& name, const std::vector<std::pair<const void*, size_t>>& parts) {
  auto it = weights_.find(name);
  if (it == weights_.end()) fail("no weight named '" + name + "'");
  if (!it->second.buffer)
    fail("weight '" + name + "' is bound to " + files_[size_t(it->second.file)]->path + " at offset " +
         num(it->second.offset) + " (mapped): nothing to upload");
  gpu::Buffer& b = *it->second.buffer;
  size_t total = 0;
  for (const auto& p : parts) total += p.second;
  if (total != b.size())
    fail("weight '" + name + "': got " + num(total) + " bytes in " + num(parts.size()) + " part(s), expected " + num(b.size()));
  if (!b.has_storage()) fail("weight '" + name + "': device '" + std::string(device_->name()) + "' has no storage to upload to");
  size_t at = 0;
  for (const auto& p : parts) {
    b.write(at, p.first, p.second);
    at += p.second;
  }
  copied_bytes_ += total;
  it->second.loaded = true;
}

void Engine::check_loaded() const {
  for (const auto& n : weight_order_)
    if (!weights_.at(n).loaded) fail("weight '" + n + "' was never uploaded");
}

size_t Engine::weight_bytes() const {
  size_t n = 0;
  for (const auto& [k, w] : weights_) n += w.binding.bytes;
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

size_t Engine::kv_filled_bytes(uint32_t position) const {
  const size_t B = spec_.kv_block_tokens, blocks = (size_t(position) + B - 1) / B;
  return blocks * spec_.kv_heads * B * spec_.kv_row_bytes();
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
      if (inflight_.front().enc) inflight_.front().enc->wait();
      if (inflight_.front().sampler) inflight_.front().sampler->wait();
    } catch (...) {
    }
    inflight_.pop_front();
  }
  have_token_ = false;
}

uint64_t Engine::kv_block_bytes() const {
  return uint64_t(spec_.kv_heads) * spec_.kv_block_tokens * spec_.kv_row_bytes() * kv_cache_.size();
}

uint64_t Engine::kv_bytes() const { return uint64_t(spec_.kv_pool()) * kv_block_bytes(); }

uint64_t Engine::kv_bytes_in_use() const {
  const uint64_t B = spec_.kv_block_tokens;
  return (uint64_t(position_) + B - 1) / B * kv_block_bytes();
}

void Engine::resize_kv(uint32_t blocks, uint32_t keep_rows) {
  const uint64_t B = spec_.kv_block_tokens;
  const uint64_t pool = uint64_t(blocks) * spec_.kv_heads * B * spec_.kv_row_bytes();
  const size_t keep = std::min<size_t>(kv_filled_bytes(keep_rows), pool);
  // Every new buffer first: an allocation failure leaves the engine as it was.
  std::vector<std::unique_ptr<gpu::Buffer>> fresh;
  try {
    for (size_t n = 0; n < kv_cache_.size(); ++n) fresh.push_back(device_->new_buffer(pool));
  } catch (const std::exception& e) {
    throw DeviceMemoryError("engine: the KV cache cannot grow to " + num(uint64_t(blocks) * B) + " tokens (" +
                            num(pool * kv_cache_.size()) + " bytes): " + e.what() + "; " +
                            num(uint64_t(spec_.kv_pool()) * B) + " tokens fit");
  }
  for (size_t n = 0; n < kv_cache_.size(); ++n) {
    gpu::Buffer& old = *state_[kv_cache_[n]];
    // The filled blocks (the table is the identity), on the device where it can (cuda: not
    // through host memory; a 32K cache's 660 MB took a decode token ~100 ms that way).
    if (keep && old.has_storage() && fresh[n]->has_storage()) fresh[n]->copy_from(old, 0, 0, keep);
    gpu::Buffer* before = state_[kv_cache_[n]].get();
    for (gpu::Layer& L : m_.layers) {
      if (L.at.k_cache.buffer == before) L.at.k_cache = gpu::Binding{fresh[n].get(), 0, pool};
      if (L.at.v_cache.buffer == before) L.at.v_cache = gpu::Binding{fresh[n].get(), 0, pool};
    }
    state_[kv_cache_[n]] = std::move(fresh[n]);
  }
  memory_.state_bytes = memory_.state_bytes - kv_bytes() + pool * kv_cache_.size();
  spec_.kv_pool_blocks = blocks;
}

void Engine::ensure_kv(uint64_t rows) {
  const uint64_t B = spec_.kv_block_tokens;
  const uint32_t need = uint32_t((rows + B - 1) / B), have = spec_.kv_pool();
  if (need <= have || kv_cache_.empty()) return;
  // Doubling keeps the copies linear in the context; never past the context, nor past the limit.
  uint32_t want = std::min(spec_.kv_blocks(), std::max(need, 2 * have));
  uint64_t limit = kv_limit_bytes;
  const uint64_t others = memory_.total() - kv_bytes();
  if (limit == 0 && memory_.working_set_bytes)  // what the device has left beside the other buffers
    limit = memory_.working_set_bytes > others ? memory_.working_set_bytes - others : 1;
  if (limit) {
    const uint64_t fit = limit / kv_block_bytes();
    if (fit < need)
      throw DeviceMemoryError("engine: " + num(rows) + " tokens need " + num(need) + " KV cache blocks of " +
                              num(B) + " tokens (" + num(uint64_t(need) * kv_block_bytes()) + " bytes), but " +
                              num(fit) + " fit in " + num(limit) + " bytes: " + num(fit * B) +
                              " tokens fit (reset() or a restore to a shorter snapshot frees blocks)");
    want = uint32_t(std::min<uint64_t>(want, fit));
  }
  for (InFlight& f : inflight_) f.enc->wait();  // their rows are copied (complete() reads them later)
  resize_kv(want, position_);
}

void Engine::reset() {
  discard_inflight();
  if (spec_.kv_pool() > 1) resize_kv(1, 0);  // the blocks go back to the device
  // The KV caches need no clearing: attention reads rows [0, position) only.
  for (size_t i = 0; i < state_.size(); ++i)
    if (!is_kv(i) && state_[i]->has_storage()) state_[i]->fill(0, 0, state_[i]->size());
  position_ = 0;
  conv_parity_ = 0;
  valid_ = true;
  failed_ = false;
  have_token_ = false;
  last_rows_ = 0;
}

Snapshot Engine::snapshot() const {
  require_idle("snapshot");
  if (!valid_) fail("the engine state is invalid after a failed step: call Model.reset() (or restore a snapshot)");
  Snapshot s;
  s.position = position_;
  s.conv_parity = conv_parity_;
  for (size_t i = 0; i < state_.size(); ++i) {
    gpu::Buffer& b = *state_[i];
    if (!b.has_storage()) {
      s.buffers.emplace_back();
    } else if (is_kv(i)) {  // the filled blocks (pool blocks 0 .. ceil(position / B) - 1)
      std::vector<char> v(kv_filled_bytes(position_));
      b.read(0, v.data(), v.size());
      s.buffers.push_back(std::move(v));
    } else {
      std::vector<char> v(b.size());
      b.read(0, v.data(), v.size());
      s.buffers.push_back(std::move(v));
    }
  }
  return s;
}

void Engine::restore(const Snapshot& s) {
  discard_inflight();
  if (s.buffers.size() != state_.size() || s.position > spec_.context_length || s.conv_parity > 1)
    fail("snapshot is from a different engine");
  for (size_t i = 0; i < state_.size(); ++i) {
    const bool has = state_[i]->has_storage();
    const size_t want = !has ? 0 : is_kv(i) ? kv_filled_bytes(s.position) : state_[i]->size();
    if (s.buffers[i].size() != want) fail("snapshot is from a different engine");
  }
  {  // the pools take the snapshot's blocks: a shorter one releases blocks, a longer one takes them
    const uint32_t B = spec_.kv_block_tokens, blocks = std::max<uint32_t>(1, (s.position + B - 1) / B);
    if (blocks > spec_.kv_pool()) ensure_kv(uint64_t(blocks) * B);
    else if (blocks < spec_.kv_pool()) resize_kv(blocks, 0);
  }
  for (size_t i = 0; i < state_.size(); ++i) {
    gpu::Buffer& b = *state_[i];
    const bool has = b.has_storage();
    const size_t want = !has ? 0 : is_kv(i) ? kv_filled_bytes(s.position) : b.size();
    if (s.buffers[i].size() != want) fail("snapshot is from a different engine");
    if (!has) continue;
    b.write(0, s.buffers[i].data(), want);
  }
  position_ = s.position;
  conv_parity_ = s.conv_parity;
  valid_ = true;
  failed_ = false;
  have_token_ = false;
  last_rows_ = 0;
}

Engine::InFlight Engine::encode(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling,
                                bool want_logits, std::unique_ptr<gpu::Encoder> enc) {
  gpu::StepParams p;
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
        throw SampleError("engine: the sampler found a non-finite logit" +
                          (state.bad_id != 0xFFFFFFFFu ? " at token id " + num(state.bad_id) : std::string(" (all -inf)")) +
                          " (numerical failure in the model)");
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
    throw SampleError("engine: the sampler found a non-finite logit" +
                      (state.bad_id != 0xFFFFFFFFu ? " at token id " + num(state.bad_id) : std::string(" (all -inf)")) +
                      " in the row given to sample_row");
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
  recording_ = true;
  InFlight f;
  try {
    f = encode(T, position, all_logits, sampling, want_logits);
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
