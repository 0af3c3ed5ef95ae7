// The last lines of both C++ builds of the shaders (csrc/emu/metal_emu.h, csrc/cuda/metal_cuda.h):
// the fixed tail of built-in thread-position parameters every kernel ends with, and MSL's address
// spaces and function qualifiers as macros. Included last: a standard header seen after these
// macros breaks (<thread>, glibc's struct timex has a field named `constant`).
#pragma once

#define LILY_KERNEL_TAIL \
  uint3 group_pos, uint3 thread_pos, uint3 group_size, uint3 grid_pos, uint lane, uint simd_id

// MSL address spaces and function qualifiers. `constant` is read-only, as in MSL.
#define device
#define threadgroup
#define thread
#define constant const
#define kernel
