// Entry header of every shader: the same .metal sources build the Metal library (Apple's
// compiler), the emulator (as C++, csrc/emu/shaders_emu.cpp) and the strict address-space pass
// (clang -fsyntax-only, .ci/checks/strict_shaders.sh) and, with NVRTC, the cuda device's kernel
// module (csrc/cuda/nvrtc_build.py).
//
// Shader rules (DESIGN.md "Shader sources that also compile as C++"):
//  * Kernels are function templates `template <...> [[kernel]] void f(...)`, instantiated only via
//    LILY_INSTANTIATE("host_name", f<...>) whose host name is a row of csrc/gpu/kernel_ids.h.
//  * Parameters: `constant XxxArgs& args [[buffer(0)]]`, then device buffers [[buffer(1)]],
//    [[buffer(2)]], ... in order, then LILY_KERNEL_TAIL (the built-in positions, always uint3).
//  * Threadgroup arrays: LILY_TG_ARRAY(T, name, [n][m]) at kernel scope, unconditionally (16-byte
//    aligned: tensor operands need it).
//  * No early return before a barrier or a simd_* collective; every lane calls every collective.
//  * Write bfloat(x) / float(x) conversions explicitly; no MSL literal suffixes (0.5h).
//  * Vectors: construct from one scalar (float4(0.0f)) and set components (v.y = ...); the strict
//    pass models vectors as clang ext_vector_type, which has no multi-argument constructors.
//  * simdgroup_matrix only through common/mma.h.
#pragma once

#if defined(__METAL_VERSION__)
// Also compiled by the MSL semantic check (tools/msl_check, docs/msl-check.md) against stand-in
// headers; it replaces LILY_INSTANTIATE and LILY_TG_ARRAY after this header (#pragma once).
#include <metal_stdlib>
using namespace metal;

#define LILY_INSTANTIATE(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
// 16-byte aligned on every path: arrays that back tensor operands need it (Metal 4 tensors).
#define LILY_TG_ARRAY(T, name, dims) alignas(16) threadgroup T name dims
#define LILY_KERNEL_TAIL                                \
  uint3 group_pos [[threadgroup_position_in_grid]],     \
  uint3 thread_pos [[thread_position_in_threadgroup]],  \
  uint3 group_size [[threads_per_threadgroup]],         \
  uint3 grid_pos [[thread_position_in_grid]],           \
  uint lane [[thread_index_in_simdgroup]],              \
  uint simd_id [[simdgroup_index_in_threadgroup]]

#elif defined(LILY_EMU) || defined(LILY_STRICT)
// The translation unit already included csrc/emu/metal_emu.h (emulator) or
// .ci/checks/metal_strict.h (strict pass), after its standard headers.
using namespace metal;
#elif defined(LILY_CUDA)
// The translation unit already included csrc/cuda/metal_cuda.h (NVRTC, -default-device).
using namespace metal;
#else
#error "shaders are compiled by Metal, by the emulator TU, by the strict pass or by NVRTC only"
#endif

// LILY_UNROLL before a loop of compile-time trip count: unroll it fully, so private arrays indexed
// by its counter stay in registers (a loop the compiler leaves rolled indexes them at run time:
// stack memory; the qmv1 *_r16 kernels had a 128-byte frame without it).
#if defined(__METAL_VERSION__) || defined(__clang__)
#define LILY_UNROLL _Pragma("clang loop unroll(full)")
#elif defined(LILY_CUDA)
#define LILY_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define LILY_UNROLL _Pragma("GCC unroll 64")
#else
#define LILY_UNROLL
#endif

#include "common/args.h"
