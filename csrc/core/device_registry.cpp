#include "core/device_registry.h"

#include <functional>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "emu/emulator.h"
#include "gpu/counting_device.h"
#if defined(LILY_HAVE_METAL)
#include "metal/metal_device.h"
#endif
#if defined(LILY_HAVE_CUDA)
#include "cuda/cuda_device.h"
#endif

namespace lily::devices {

namespace {

std::mutex g_mu;
Simulation g_sim;

emu::Order parse_order(const std::string& s) {
  if (s == "forward") return emu::Order::forward;
  if (s == "reverse") return emu::Order::reverse;
  if (s == "shuffle") return emu::Order::shuffle;
  if (s == "ahead") return emu::Order::ahead;
  throw std::invalid_argument("order must be 'forward', 'reverse', 'shuffle' or 'ahead', got '" + s + "'");
}

std::string kernel_name(gpu::KernelId k) { return std::string(gpu::kernel_info(k).name); }

// Applies a Simulation's limits to another device (emu, count): reports them and, like Metal,
// refuses a dispatch with more threads per threadgroup than the kernel's pipeline allows.
class SimulatedDevice final : public gpu::Device {
 public:
  SimulatedDevice(std::unique_ptr<gpu::Device> inner, Simulation sim) : inner_(std::move(inner)), sim_(std::move(sim)) {}
  std::string_view name() const override { return inner_->name(); }
  std::unique_ptr<gpu::Buffer> new_buffer(size_t bytes) override { return inner_->new_buffer(bytes); }
  std::unique_ptr<gpu::Encoder> new_encoder() override {
    return std::make_unique<LimitEncoder>(inner_->new_encoder(), *this);
  }
  gpu::DeviceInfo info() const override {
    gpu::DeviceInfo i = inner_->info();
    i.device_name += " with simulated limits";
    i.working_set_bytes = sim_.working_set_bytes;
    i.max_buffer_bytes = sim_.max_buffer_bytes;
    i.simulated = true;
    i.tensor_ops = sim_.tensor_ops;
    i.tensor_int8 = sim_.tensor_ops && sim_.tensor_int8;
    i.tensor_ops_reason = sim_.tensor_ops ? "" : "the simulation does not ask for tensor ops";
    if (sim_.tensor_ops) i.device_name += " and tensor ops";
    return i;
  }
  gpu::PipelineInfo pipeline_info(gpu::KernelId k) override {
    gpu::PipelineInfo p = inner_->pipeline_info(k);
    p.max_threads = limit(k);
    auto tg = sim_.threadgroup_bytes.find(kernel_name(k));
    if (tg != sim_.threadgroup_bytes.end()) p.static_threadgroup_bytes = tg->second;
    return p;
  }
  void make_resident(const std::vector<gpu::Buffer*>& b) override { inner_->make_resident(b); }
  std::unique_ptr<gpu::Encoder> new_checking_encoder(int64_t skip_barrier, bool execute) override {
    std::unique_ptr<gpu::Encoder> e = inner_->new_checking_encoder(skip_barrier, execute);
    if (!e) return nullptr;
    return std::make_unique<LimitEncoder>(std::move(e), *this);
  }

  uint32_t limit(gpu::KernelId k) const {
    auto it = sim_.max_threads.find(kernel_name(k));
    if (it != sim_.max_threads.end()) return it->second;
    return sim_.default_max_threads ? sim_.default_max_threads : gpu::kMaxThreadsPerGroup;
  }

 private:
  class LimitEncoder final : public gpu::Encoder {
   public:
    LimitEncoder(std::unique_ptr<gpu::Encoder> inner, const SimulatedDevice& dev) : inner_(std::move(inner)), dev_(dev) {}
    void commit() override { inner_->commit(); }
    void wait() override { inner_->wait(); }
    uint32_t thread_limit(gpu::KernelId k) const override { return dev_.limit(k); }
    bool tensor_ops() const override { return dev_.sim_.tensor_ops; }
    bool tensor_int8() const override { return dev_.sim_.tensor_ops && dev_.sim_.tensor_int8; }

   protected:
    void encode_dispatch(const gpu::Dispatch& d) override {
      const uint32_t lim = dev_.limit(d.kernel);
      if (d.threads.count() > lim)
        throw gpu::EncodeError(kernel_name(d.kernel) + ": " + std::to_string(d.threads.count()) +
                               " threads per threadgroup exceed this pipeline's (simulated) limit of " +
                               std::to_string(lim));
      inner_->set_kernel(d.kernel);
      inner_->set_args_bytes(d.args, d.args_size);
      for (uint32_t i = 1; i <= d.num_buffers; ++i) inner_->set_buffer(i, d.buffers[i]);
      inner_->dispatch(d.groups, d.threads);
    }
    void encode_barrier() override { inner_->barrier(); }

   private:
    std::unique_ptr<gpu::Encoder> inner_;
    const SimulatedDevice& dev_;
  };

  std::unique_ptr<gpu::Device> inner_;
  Simulation sim_;
};

struct Entry {
  const char* name;
  const char* description;
  std::function<std::string()> unavailable;  // "" when available
  std::function<std::unique_ptr<gpu::Device>(const Options&)> make;
  bool simulable;
};

const std::vector<Entry>& entries() {
  static const std::vector<Entry> table = {
      {"metal", "the GPU through Apple's Metal (macOS, Apple silicon)",
       [] {
#if defined(LILY_HAVE_METAL)
         return metal::unavailable_reason();
#else
         return std::string("this build has no Metal device (built without LILY_METAL: not macOS)");
#endif
       },
       [](const Options&) -> std::unique_ptr<gpu::Device> {
#if defined(LILY_HAVE_METAL)
         return metal::create_device();
#else
         throw std::invalid_argument("device 'metal' is not available in this build (built without LILY_METAL: not macOS); use 'emu'");
#endif
       },
       false},
      {"emu", "the Metal kernels compiled as C++ and run on the CPU (slow; checks what a GPU hides)",
       [] { return std::string(); },
       [](const Options& o) -> std::unique_ptr<gpu::Device> {
         emu::RunOptions r;
         r.order = parse_order(o.order);
         r.seed = o.seed;
         r.fp_traps = o.fp_traps;
         return std::make_unique<emu::EmuDevice>(r);
       },
       true},
      {"count", "counts what a step would dispatch; no memory, nothing runs",
       [] { return std::string(); },
       [](const Options&) -> std::unique_ptr<gpu::Device> { return std::make_unique<gpu::CountingDevice>(); },
       true},
      {"count_host", "counts like 'count', with host memory behind every buffer (times the host path: nothing runs)",
       [] { return std::string(); },
       [](const Options&) -> std::unique_ptr<gpu::Device> { return std::make_unique<gpu::CountingDevice>(true); },
       true},
      {"cuda", "the Metal kernels compiled as CUDA on an NVIDIA GPU (verification: docs/gpu.md)",
       [] {
#if defined(LILY_HAVE_CUDA)
         return cuda::unavailable_reason();
#else
         return std::string("this build has no cuda device (built without LILY_CUDA)");
#endif
       },
       [](const Options&) -> std::unique_ptr<gpu::Device> {
#if defined(LILY_HAVE_CUDA)
         return cuda::create_device();
#else
         throw std::invalid_argument("device 'cuda' is not available in this build (built without LILY_CUDA); use 'emu'");
#endif
       },
       false},
  };
  return table;
}

const Entry& find(const std::string& name) {
  for (const Entry& e : entries())
    if (name == e.name) return e;
  std::string known;
  for (const Entry& e : entries()) known += (known.empty() ? "'" : ", '") + std::string(e.name) + "'";
  throw std::invalid_argument("unknown device '" + name + "' (expected " + known + ")");
}

}  // namespace

std::vector<Status> list() {
  std::vector<Status> out;
  for (const Entry& e : entries()) out.push_back(status(e.name));
  return out;
}

Status status(const std::string& name) {
  const Entry& e = find(name);
  Status s;
  s.name = e.name;
  s.description = e.description;
  s.reason = e.unavailable();
  s.available = s.reason.empty();
  return s;
}

std::unique_ptr<gpu::Device> create(const std::string& name, const Options& options) {
  const Entry& e = find(name);
  std::unique_ptr<gpu::Device> d = e.make(options);
  const Simulation sim = simulation();
  if (sim.active && e.simulable) return std::make_unique<SimulatedDevice>(std::move(d), sim);
  return d;
}

std::string check_usable(const std::string& name) {
  const Status s = status(name);
  if (!s.available) return s.reason;
  try {
    std::unique_ptr<gpu::Device> d = create(name);
    const bool tensor_ops = d->info().tensor_ops;
    for (const gpu::KernelInfo& k : gpu::kKernelTable) {
      if (gpu::kernel_needs_tensor_ops(k.id) && !tensor_ops) continue;
      try {
        d->pipeline_info(k.id);
      } catch (const std::exception& ex) {
        return "pipeline '" + std::string(k.name) + "': " + ex.what();
      }
    }
  } catch (const std::exception& ex) {
    return ex.what();
  }
  return "";
}

void set_simulation(const Simulation& s) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_sim = s;
}

Simulation simulation() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_sim;
}

}  // namespace lily::devices
