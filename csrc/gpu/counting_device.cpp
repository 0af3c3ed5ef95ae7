#include "gpu/counting_device.h"

#include <cstdlib>
#include <new>

namespace lily::gpu {

namespace {

class SizeOnlyBuffer final : public Buffer {
 public:
  explicit SizeOnlyBuffer(size_t bytes) : size_(bytes) {}
  void* contents() override { return nullptr; }
  size_t size() const override { return size_; }

 private:
  size_t size_;
};

// Validation and counting happen in Encoder::dispatch / barrier; nothing runs.
class CountingEncoder final : public Encoder {
 public:
  void commit() override {}
  void wait() override {}

 protected:
  void encode_dispatch(const Dispatch&) override {}
  void encode_barrier() override {}
};

class HostBuffer final : public Buffer {
 public:
  explicit HostBuffer(size_t bytes) : size_(bytes), data_(std::calloc(bytes ? bytes : 1, 1)) {
    if (data_ == nullptr) throw std::bad_alloc();
  }
  ~HostBuffer() override { std::free(data_); }
  void* contents() override { return data_; }
  size_t size() const override { return size_; }

 private:
  size_t size_;
  void* data_;
};

}  // namespace

std::unique_ptr<Buffer> CountingDevice::new_buffer(size_t bytes) {
  if (host_memory_) return std::make_unique<HostBuffer>(bytes);
  return std::make_unique<SizeOnlyBuffer>(bytes);
}
std::unique_ptr<Encoder> CountingDevice::new_encoder() { return std::make_unique<CountingEncoder>(); }

DeviceInfo CountingDevice::info() const {
  DeviceInfo i;
  i.name = std::string(name());
  i.device_name = host_memory_ ? "counting device (nothing runs, host memory)" : "counting device (nothing runs, no memory)";
  return i;
}

}  // namespace lily::gpu
