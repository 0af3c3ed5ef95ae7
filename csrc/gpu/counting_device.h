// The counting device: records what a step would dispatch (the encoder's counters) without
// executing anything. Lets the engine report per-token dispatches, barriers and bytes for the
// real 35B config on any machine, with no weights.
//
// Two flavours: "count" allocates no memory (contents() is nullptr), "count_host" backs every
// buffer with zeroed host memory (still nothing runs), so the engine's host-side reads (token
// slot, sampler status, logits rows) work and a whole Model can generate on it: tokens are all 0
// and the time measured is the host's alone (benchmarks/host_overhead.py).
#pragma once
#include <memory>

#include "gpu/encoder.h"

namespace lily::gpu {

class CountingDevice final : public Device {
 public:
  explicit CountingDevice(bool host_memory = false) : host_memory_(host_memory) {}
  std::string_view name() const override { return host_memory_ ? "count_host" : "count"; }
  // "count": a buffer with a size and no storage (nothing may read or write it).
  std::unique_ptr<Buffer> new_buffer(size_t bytes) override;
  std::unique_ptr<Encoder> new_encoder() override;
  DeviceInfo info() const override;
  PipelineInfo pipeline_info(KernelId) override { return PipelineInfo{}; }  // Apple's limits
  bool host_memory() const { return host_memory_; }

 private:
  bool host_memory_;
};

}  // namespace lily::gpu
