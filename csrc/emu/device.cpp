// gpu::Device / gpu::Encoder for the emulator: dispatches run at once, in encoding order, so a
// barrier has nothing left to order (it is still counted).
#include <string>

#include "emu/emulator.h"

namespace lily::emu {

namespace {

class EmuEncoder final : public gpu::Encoder {
 public:
  explicit EmuEncoder(RunOptions o) : options_(o) {}
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
    L.args = d.args;
    L.args_size = d.args_size;
    L.buffers.assign(d.buffers + 1, d.buffers + 1 + d.num_buffers);
    L.groups = d.groups;
    L.threads = d.threads;
    run(L, options_);
  }
  void encode_barrier() override {}

 private:
  RunOptions options_;
};

}  // namespace

std::unique_ptr<gpu::Buffer> EmuDevice::new_buffer(size_t bytes) {
  return std::make_unique<GuardedBuffer>(bytes);
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

}  // namespace lily::emu
