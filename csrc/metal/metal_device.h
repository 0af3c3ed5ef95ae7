// The Metal device (Apple only; compiled when LILY_METAL). Plain C++ interface: the Objective-C++
// lives in device.mm, nothing else in the project sees a Metal type.
//
// Libraries, each found the same way next to the extension module: the prebuilt metallib, else the
// installed amalgamated source compiled at run time (math mode safe / precise functions on macOS
// 15+, fastMathEnabled = NO before; csrc/metal/amalgamate.py, CMakeLists.txt):
//   base:  lily.metallib (shaders/*.metal, MSL 3.1, the wheel's deployment target), else
//          lily_shaders.metal compiled as MSL 3.1;
//   M5:    on an Apple10+ GPU under macOS 26+ only: lily_m5.metallib (shaders/m5/*.metal, Metal 4
//          tensor ops; only a macOS 26 SDK's Metal toolchain builds it), else lily_shaders_m5.metal
//          compiled as MSL 4.0 (MTLLanguageVersion4_0, by raw value: older SDKs lack it).
// info() records which: library_path is the base file, plus " + <M5 file>" when the tensor-op
// library loaded (.metallib: prebuilt; .metal: compiled at run time); library_source is the base's
// ("metallib" | "source"); tensor_ops_reason says why there is no M5 library; metallib_error why
// an installed metallib (either) did not load; math_mode how each was compiled.
// Limits: info() reports recommendedMaxWorkingSetSize and maxBufferLength; new_buffer refuses a
// buffer over maxBufferLength; pipeline_info() creates a pipeline and reports its limits.
// Residency: make_resident() puts buffers in an MTLResidencySet on the queue (macOS 15+ SDK and OS).
// Pipelines are cached per kernel id. The MTLDevice comes from MTLCreateSystemDefaultDevice (needs
// CoreGraphics linked), MTLCopyAllDevices as fallback. Buffers use shared storage (CPU and GPU
// see the same memory, no copies). Every encoder is one command buffer with one compute encoder.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "gpu/encoder.h"

namespace lily::metal {

bool available();                              // a Metal device that can run the kernels (apple7+) exists
std::string unavailable_reason();              // "" when create_device() works: apple7+ GPU, library loaded
gpu::DeviceInfo info();                        // any Metal device; throws std::runtime_error when none
std::unique_ptr<gpu::Device> create_device();  // shares one MTLDevice / queue / library / cache;
                                               // throws std::runtime_error unless unavailable_reason() is ""
std::vector<std::string> library_functions();  // function names in the loaded libraries (any device)

// Every kernel's pipeline on any Metal device (also one that cannot run the kernels, e.g. a VM's
// paravirtual GPU): its limits, or the error creating it. For CI logs and doctor.
struct PipelineReport {
  std::string kernel;
  gpu::PipelineInfo info;
  std::string error;  // "" when the pipeline was created
};
std::vector<PipelineReport> pipeline_report();

}  // namespace lily::metal
