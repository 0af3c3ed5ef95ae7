// The device an op call from Python runs on (shared by every csrc/bindings/ops_*.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "gpu/encoder.h"

namespace lily::bindings {

// "emu": the CPU emulator with the given thread order ("forward", "reverse", "shuffle"), seed and
// floating-point traps; "metal": the GPU (macOS builds). Throws std::invalid_argument (a Python
// ValueError) for an unknown device or one this build lacks.
std::unique_ptr<gpu::Device> make_device(const std::string& name, const std::string& order,
                                         uint64_t seed, bool fp_traps);

}  // namespace lily::bindings
