// What the attention shader files share (shaders/attention.metal, attention_decode.metal,
// attention_prefill.metal): -infinity, the output gate's sigmoid and one int8 code of a q8 cache
// row. Args and route constants: common/args_attention.h; the paged cache: common/kv_blocks.h.
#pragma once

#include "common/lily_metal.h"

namespace lily {

// -infinity, spelled so that Metal, the emulator and the strict pass all accept it.
inline float neg_inf() { return as_type<float>(0xff800000u); }

inline float attn_sigmoid(float g) { return 1.0f / (1.0f + exp(-g)); }

// Code `byte` (0..3) of a word of four int8 cache codes, sign-extended.
inline float q8_code(uint32_t word, uint32_t byte) { return float(as_type<int32_t>(word << (24u - 8u * byte)) >> 24); }

}  // namespace lily
