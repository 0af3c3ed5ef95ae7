// The counting device: records what a step would dispatch (the encoder's counters) without
// allocating device memory or executing anything. Lets the engine report per-token dispatches,
// barriers and bytes bound for the real 35B config on any machine, with no weights.
#pragma once
#include <memory>

#include "gpu/encoder.h"

namespace lily::gpu {

class CountingDevice final : public Device {
 public:
  std::string_view name() const override { return "count"; }
  // A buffer with a size and no storage: contents() is nullptr (nothing may read or write it).
  std::unique_ptr<Buffer> new_buffer(size_t bytes) override;
  std::unique_ptr<Encoder> new_encoder() override;
  DeviceInfo info() const override;
  PipelineInfo pipeline_info(KernelId) override { return PipelineInfo{}; }  // Apple's limits
};

}  // namespace lily::gpu
