// The only shader header that uses Metal 4 tensors and MetalPerformancePrimitives' tensor ops
// (mpp::tensor_ops::matmul2d; Apple GPU family 10 / M5 neural accelerators, macOS 26).
//   Metal:     Apple's headers; the including shader is compiled with -std=metal4.0 into the
//              second library (lily_m5.metallib), never into lily.metallib (CMakeLists.txt).
//   emulator:  csrc/emu/tensor_ops_emu.h (included by csrc/emu/metal_emu.h): the documented
//              semantics, execution-scope checks and the stated rounding.
//   strict:    csrc/emu/tensor_ops_strict.h: the same declarations with address spaces.
// What of this rests on Apple's documentation rather than on a compiler: docs/metal.md,
// "Metal 4 tensor ops (M5)".
#pragma once
#include "common/lily_metal.h"

#if defined(__METAL_VERSION__)
#if __METAL_VERSION__ >= 400 && defined(__HAVE_TENSOR__)
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#else
#error "common/tensor_ops.h needs the Metal 4 language (-std=metal4.0) and tensor support (macOS 26 SDK)"
#endif
#elif defined(LILY_STRICT)
#include "emu/tensor_ops_strict.h"
#endif
// (LILY_EMU: csrc/emu/metal_emu.h already included csrc/emu/tensor_ops_emu.h.)

using namespace mpp::tensor_ops;
