// The "cuda" device: the shaders compiled as CUDA (csrc/cuda/metal_cuda.h, nvrtc_build.py) and run
// on an NVIDIA GPU through the driver API, loaded at run time (dlopen libcuda.so.1): the extension
// imports on machines without a driver, and the device then reports why it is unavailable.
// A verification device (docs/gpu.md): the same kernels and dispatch plan on a real GPU.
#pragma once
#include <memory>
#include <string>

#include "gpu/encoder.h"

namespace lily::cuda {

std::string unavailable_reason();  // "" when a driver, a GPU and the kernel modules are present
std::unique_ptr<gpu::Device> create_device();

}  // namespace lily::cuda
