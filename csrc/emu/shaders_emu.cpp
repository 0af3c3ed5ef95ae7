// The emulator's shader translation unit: every shaders/*.metal compiled as C++, once.
//
// Order matters: standard headers first, then the Metal shim (it defines `device`, `thread`,
// `constant`, `threadgroup` and `kernel` as macros), then the shaders. Each LILY_INSTANTIATE
// registers its kernel with the emulator registry during static initialisation.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emu/runtime.h"
#include "emu/metal_emu.h"

// clang-format off
#include "attention.metal"
#include "attention_decode.metal"
#include "attention_prefill.metal"
#include "elementwise.metal"
#include "embedding.metal"
#include "gated_delta.metal"
#include "gated_delta_chunk.metal"
#include "moe_plan.metal"
#include "moe_decode.metal"
#include "moe_prefill.metal"
#include "moe_prefill_bf16.metal"
#include "norm.metal"
#include "qmm.metal"
#include "m5/qmm_m5.metal"
#include "m5/moe_m5.metal"
#include "m5/attention_m5.metal"
#include "m5/gated_delta_chunk_m5.metal"
#include "sampling.metal"
#include "sampling_buckets.metal"
#include "sampling_logprobs.metal"
#include "emu/selftest.metal"
#include "emu/selftest_m5.metal"
// clang-format on
