// gpu::Device / gpu::Encoder for the emulator: dispatches run at once, in encoding order. The GPU
// runs the dispatches between two barriers in any order or concurrently, so the encoder checks
// every stretch for hazards (DispatchHazards) before running its dispatches.
#include <algorithm>
#include <cstring>
#include <string>

#include "emu/emulator.h"

namespace lily::emu {

namespace {

std::string range_str(uint64_t lo, uint64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

}  // namespace

namespace {

// First bytes of `w` inside [lo, hi), or {0, 0}.
std::pair<uint64_t, uint64_t> first_overlap(const DispatchHazards::Intervals& w, uint64_t lo, uint64_t hi) {
  auto it = std::lower_bound(w.begin(), w.end(), std::pair<uint64_t, uint64_t>{lo, 0},
                             [](const auto& a, const auto& b) { return a.second <= b.first; });
  if (it == w.end() || it->first >= hi) return {0, 0};
  return {std::max(it->first, lo), std::min(it->second, hi)};
}

}  // namespace

void DispatchHazards::dispatch(const gpu::Dispatch& d, const KernelEntry& k, const std::vector<Intervals>* written) {
  Rec rec{k.name, seq_++, {}};
  for (uint32_t i = 1; i <= d.num_buffers; ++i) {
    const gpu::Binding& b = d.buffers[i];
    Use u{b.buffer, b.offset, b.offset + b.bytes, i, {}};
    if (written) u.writes = (*written)[i - 1];
    else if (!k.buffers[i - 1].read_only) u.writes.push_back({u.lo, u.hi});
    rec.uses.push_back(std::move(u));
  }
  for (const Rec& prev : stretch_)
    for (const Use& a : prev.uses)
      for (const Use& b : rec.uses) {
        if (a.buffer != b.buffer) continue;
        // Every binding may be read: a conflict is a write of one inside the other's binding.
        const Rec* wr = &rec;
        const Use* w = &b;
        const Rec* other = &prev;
        const Use* o = &a;
        auto ov = first_overlap(b.writes, a.lo, a.hi);
        if (ov.first == ov.second) {
          ov = first_overlap(a.writes, b.lo, b.hi);
          std::swap(wr, other);
          std::swap(w, o);
        }
        if (ov.first == ov.second) continue;
        const bool both = first_overlap(o->writes, ov.first, ov.second).second != 0;
        auto desc = [](const Rec& r, const Use& u) {
          return "dispatch #" + std::to_string(r.seq) + " '" + r.kernel + "' (buffer(" + std::to_string(u.index) +
                 ") bound to bytes " + range_str(u.lo, u.hi) + ")";
        };
        const std::string since = stretch_barrier_ < 0 ? "with no barrier before them"
                                                       : "both after barrier #" + std::to_string(stretch_barrier_);
        throw KernelError("hazard between dispatches with no barrier between them: " + desc(*wr, *w) +
                          " writes bytes " + range_str(ov.first, ov.second) + " of a " +
                          std::to_string(b.buffer->size()) + "-byte buffer that " + desc(*other, *o) +
                          (both ? " also writes" : " reads") + ", " + since +
                          "; on the GPU they may run in either order or at once (a barrier between them "
                          "is missing or misplaced)");
      }
  stretch_.push_back(std::move(rec));
}

void DispatchHazards::barrier() {
  if (int64_t(barriers_) != skip_) {
    stretch_.clear();
    stretch_barrier_ = int64_t(barriers_);
  }
  ++barriers_;
}

namespace {

// Appends the byte ranges of `b` (absolute offsets) that differ from `before`.
void changed(const gpu::Binding& b, const std::string& before, DispatchHazards::Intervals& out) {
  const unsigned char* now = static_cast<const unsigned char*>(b.buffer->contents()) + b.offset;
  const unsigned char* old = reinterpret_cast<const unsigned char*>(before.data());
  const size_t n = b.bytes;
  size_t i = 0;
  while (i < n) {
    if (i + 8 <= n && std::memcmp(now + i, old + i, 8) == 0) {
      i += 8;
      continue;
    }
    if (now[i] == old[i]) {
      ++i;
      continue;
    }
    const uint64_t lo = (b.offset + i) & ~uint64_t(1);  // whole 2-byte elements (bf16 is the smallest written)
    while (i < n && now[i] != old[i]) ++i;
    const uint64_t hi = std::min<uint64_t>((b.offset + i + 1) & ~uint64_t(1), b.offset + n);
    if (!out.empty() && out.back().second + 4 > lo) out.back().second = hi;  // a word's unchanged bytes
    else out.push_back({lo, hi});
  }
}

class EmuEncoder final : public gpu::Encoder {
 public:
  explicit EmuEncoder(RunOptions o) : options_(o), hazards_(o.skip_barrier) {}
  void commit() override {}
  void wait() override {}

 protected:
  void encode_dispatch(const gpu::Dispatch& d) override {
    const gpu::KernelInfo& info = gpu::kernel_info(d.kernel);
    Launch L;
    L.kernel = find_kernel(info.name);
    if (!L.kernel)
      throw KernelError("kernel '" + std::string(info.name) + "' is in the kernel table but not in the emulator registry");
    if (L.kernel->num_buffers != info.num_buffers)
      throw KernelError("kernel '" + std::string(info.name) + "': kernel table says " +
                        std::to_string(info.num_buffers) + " buffers, the shader takes " +
                        std::to_string(L.kernel->num_buffers));
    if (!options_.execute) {
      if (options_.hazards) hazards_.dispatch(d, *L.kernel);
      return;
    }
    L.args = d.args;
    L.args_size = d.args_size;
    L.buffers.assign(d.buffers + 1, d.buffers + 1 + d.num_buffers);
    L.groups = d.groups;
    L.threads = d.threads;
    if (!options_.hazards) {
      run(L, options_);
      return;
    }
    // What the dispatch writes: the bytes of its writable bindings that changed.
    std::vector<std::string> before(d.num_buffers);
    for (uint32_t i = 0; i < d.num_buffers; ++i)
      if (!L.kernel->buffers[i].read_only) {
        const gpu::Binding& b = L.buffers[i];
        before[i].assign(static_cast<const char*>(b.buffer->contents()) + b.offset, b.bytes);
      }
    run(L, options_);
    std::vector<DispatchHazards::Intervals> written(d.num_buffers);
    for (uint32_t i = 0; i < d.num_buffers; ++i)
      if (!L.kernel->buffers[i].read_only) changed(L.buffers[i], before[i], written[i]);
    hazards_.dispatch(d, *L.kernel, &written);
  }
  // Nothing to order at run time (dispatches ran in encoding order); ends the hazard stretch.
  void encode_barrier() override { hazards_.barrier(); }

 private:
  RunOptions options_;
  DispatchHazards hazards_;
};

}  // namespace

std::unique_ptr<gpu::Buffer> EmuDevice::new_buffer(size_t bytes) {
  return std::make_unique<GuardedBuffer>(bytes);
}

std::unique_ptr<gpu::Buffer> EmuDevice::wrap_host_memory(const void* ptr, size_t bytes) {
  return std::make_unique<GuardedBuffer>(ptr, bytes);
}

std::unique_ptr<gpu::Encoder> EmuDevice::new_encoder() { return std::make_unique<EmuEncoder>(options_); }

gpu::DeviceInfo EmuDevice::info() const {
  gpu::DeviceInfo i;
  i.name = "emu";
  i.device_name = std::string("CPU emulator (") + features().fibers + " fibers)";
  i.library_source = "emulator";
  i.math_mode = "-ffp-contract=off -fno-fast-math";
  return i;
}

gpu::PipelineInfo EmuDevice::pipeline_info(gpu::KernelId kernel) {
  const gpu::KernelInfo& info = gpu::kernel_info(kernel);
  if (!find_kernel(info.name))
    throw KernelError("kernel '" + std::string(info.name) + "' is in the kernel table but not in the emulator registry");
  gpu::PipelineInfo p;
  p.simd_width = kSimdWidth;
  return p;
}

std::unique_ptr<gpu::Encoder> EmuDevice::new_checking_encoder(int64_t skip_barrier, bool execute) {
  RunOptions o = options_;
  o.hazards = true;
  o.skip_barrier = skip_barrier;
  o.execute = execute;
  return new_encoder(o);
}

std::unique_ptr<gpu::Encoder> EmuDevice::new_encoder(const RunOptions& options) {
  return std::make_unique<EmuEncoder>(options);
}

}  // namespace lily::emu
