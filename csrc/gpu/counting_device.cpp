#include "gpu/counting_device.h"

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

}  // namespace

std::unique_ptr<Buffer> CountingDevice::new_buffer(size_t bytes) { return std::make_unique<SizeOnlyBuffer>(bytes); }
std::unique_ptr<Encoder> CountingDevice::new_encoder() { return std::make_unique<CountingEncoder>(); }

DeviceInfo CountingDevice::info() const {
  DeviceInfo i;
  i.name = "count";
  i.device_name = "counting device (nothing runs, no memory)";
  return i;
}

}  // namespace lily::gpu
