// MLX affine quantization, shared by the quantized kernels.
//
// Layout (MODEL_FACTS.md section 5): w is uint32 [N, K * bits / 32]; element j of a word sits in
// bits [bits*j, bits*(j+1)), least significant first; scales/biases are [N, K / group_size];
// dequantized w[n, k] = scales[n, k / group_size] * q[n, k] + biases[n, k / group_size].
// Must match src/lily_py/reference/quant.py (the NumPy oracle).
#pragma once
#include "common/lily_metal.h"

namespace lily {

// Codes [k, k + count) of one row as floats; `words` points at the word holding code k, and k is
// a multiple of count (count * bits is a multiple of 32, so no code straddles the loaded words).
template <int bits, int count>
inline void unpack_codes(const device uint32_t* words, thread float* q) {
  constexpr uint32_t per_word = 32 / bits;
  constexpr uint32_t mask = (1u << bits) - 1u;
  for (uint32_t i = 0; i < uint32_t(count); ++i)
    q[i] = float((words[i / per_word] >> ((i % per_word) * bits)) & mask);
}

}  // namespace lily
