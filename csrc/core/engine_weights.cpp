// Weights: the engine's construction (checkpoint files mapped once, every buffer placed by the
// DeviceAllocator: a weight the device maps from its file in place, or a buffer of its own that
// upload() fills), upload(), and what the engine reports of the weights and their files.
#include "core/engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "core/engine_internal.h"
#include "gpu/ops/attention.h"

namespace lily::core {

using detail::fail;
using detail::num;

// The engine's own buffers on its device.
class Engine::DeviceAllocator final : public detail::Allocator {
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
  detail::build_buffers(s, a, m_, device_->info().tensor_int8);
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

}  // namespace lily::core
