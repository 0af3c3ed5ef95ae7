// The Metal device (Apple only; compiled when LILY_METAL). Plain C++ interface: the Objective-C++
// lives in device.mm, nothing else in the project sees a Metal type.
//
// Library: lily.metallib next to the extension module (built from shaders/ by CMake with
// `xcrun metal -fno-fast-math`); where it is missing (no Metal toolchain at build time) or fails
// to load, the shipped amalgamated source lily_shaders.metal is compiled at run time (fast math
// off).
// Pipelines are cached per kernel id. The MTLDevice comes from MTLCreateSystemDefaultDevice (needs
// CoreGraphics linked), MTLCopyAllDevices as fallback. Buffers use shared storage (CPU and GPU
// see the same memory, no copies). Every encoder is one command buffer with one compute encoder.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "gpu/encoder.h"

namespace lily::metal {

struct Info {
  std::string name;        // MTLDevice name, e.g. "Apple M3 Max"
  std::string family;      // highest supported "apple7" (M1) / "apple8" (M2) / "apple9" (M3, M4) ...
  std::string library;     // path of the metallib or of the source compiled at run time
  bool supported = false;  // family >= apple7: the kernels can run (not e.g. a VM's paravirtual GPU)
};

bool available();                              // a Metal device that can run the kernels (apple7+) exists
Info info();                                   // any Metal device; throws std::runtime_error when none
std::unique_ptr<gpu::Device> create_device();  // shares one MTLDevice / queue / library / cache;
                                               // throws std::runtime_error unless available()
std::vector<std::string> library_functions();  // function names in the loaded library (any device)

}  // namespace lily::metal
