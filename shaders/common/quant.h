// MLX affine quantization, shared by the quantized kernels.
//
// Layout (MODEL_FACTS.md section 5): w is uint32 [N, K * bits / 32]; element j of a word sits in
// bits [bits*j, bits*(j+1)), least significant first; scales/biases are [N, K / group_size];
// dequantized w[n, k] = scales[n, k / group_size] * q[n, k] + biases[n, k / group_size].
// Must match src/lily_py/reference/quant.py (the NumPy oracle).
#pragma once
#include "common/lily_metal.h"

namespace lily {

// A code masked in place (v & mask < 2^23) as a float: OR-ed into the mantissa of 2^23 it gives
// 2^23 + (v & mask) exactly, and subtracting 2^23 is exact. One logic operation and one add per
// code instead of an integer-to-float conversion (a quarter- to eighth-rate instruction on many
// GPUs: on the H200 it bound qmv1, docs/gpu.md). Every unpacking of codes goes through it.
inline float masked_code(uint32_t v, uint32_t mask) {
  return as_type<float>((v & mask) | 0x4B000000u) - 8388608.0f;
}

// log2 of a quantization group size (32, 64 or 128: the hosts check), so that a code's group is
// a shift of its index, not a division: for the kernels whose args carry only group_size
// (QmmArgs); MoeArgs and Qmv1Args carry the host's group_shift.
inline uint32_t group_shift_of(uint32_t group_size) {
  return group_size == 32 ? 5u : group_size == 64 ? 6u : 7u;
}

// Codes [k, k + count) of one row as floats; `words` points at the word holding code k, and k is
// a multiple of count (count * bits is a multiple of 32, so no code straddles the loaded words).
// Widths that divide 32 (2, 4, 8) only: unpack_row takes every width.
template <int bits, int count>
inline void unpack_codes(const device uint32_t* words, thread float* q) {
  static_assert(32 % bits == 0 && (count * bits) % 32 == 0, "whole words of codes");
  constexpr uint32_t per_word = 32 / bits;
  constexpr uint32_t mask = (1u << bits) - 1u;
  for (uint32_t i = 0; i < uint32_t(count); ++i)
    q[i] = masked_code(words[i / per_word] >> ((i % per_word) * bits), mask);
}

// Codes per lane per step of the strip kernels (qmv, moe_*_few): two words at 2, 4 and 8 bits;
// at 3, 5 and 6 bits 8 codes (`bits` bytes: 8 codes are the smallest whole number of bytes).
template <int bits>
constexpr uint32_t strip_codes() {
  return 32 % bits == 0 ? 64 / bits : 8;
}

// Codes [k, k + count) of the row starting at word `row`, any width 2..8, as floats; k and count
// multiples of 8 (count of 32 / bits at 2, 4, 8 bits). At 3, 5 and 6 bits a code may straddle two
// words: 8 codes fill `bits` bytes starting at bit k * bits (a byte boundary), read as the one to
// three words that hold them (never a word past them: the last row's codes end at its last word).
template <int bits, int count>
inline void unpack_row(const device uint32_t* row, uint32_t k, thread float* q) {
  if (32 % bits == 0 && (count * bits) % 32 == 0) {
    constexpr uint32_t per_word = 32 / bits;
    constexpr uint32_t mask = (1u << bits) - 1u;
    const device uint32_t* words = row + k * bits / 32;
    for (uint32_t i = 0; i < uint32_t(count); ++i)
      q[i] = masked_code(words[i / per_word] >> ((i % per_word) * bits), mask);
    return;
  }
  static_assert(count % 8 == 0, "8-code strips");
  constexpr uint32_t mask = (1u << bits) - 1u;
  for (uint32_t c = 0; c < uint32_t(count); c += 8) {
    const uint32_t bit0 = (k + c) * bits;  // a multiple of 8
    const device uint32_t* p = row + bit0 / 32;
    const uint32_t sh = bit0 % 32, end = sh + 8 * bits;  // end <= 24 + 64
    ulong v = ulong(p[0]);
    if (end > 32) v |= ulong(p[1]) << 32;
    v >>= sh;
    if (end > 64) v |= ulong(p[2]) << (64 - sh);
    for (uint32_t i = 0; i < 8; ++i) q[c + i] = masked_code(uint32_t(v >> (i * bits)), mask);
  }
}

// Single-token matvec codes (qmv1 in qmm.metal, moe_gate_up_mv / moe_down_mv in moe_decode.metal), after
// MLX's qmv_fast: a lane holds V = 128 / bits codes of a row = one 16-byte (uint4) load. The V
// activations are pre-scaled by scale_of(i) (16^-(i % 4) at 4 bits, 256^-(i % 2) at 8 bits; exact:
// powers of two) so that code i is masked in place, never shifted: dot(wv, xs) = sum_i x_i q_i.
// Eight consecutive activations widened to float through 16-byte loads (p must be 16-byte
// aligned): bf16 as one uint4 (a bf16's bits << 16 are its float), float as two float4s. The
// values equal float(p[i]); one load instruction per 16 bytes instead of one per element.
inline void load8(const device bfloat* p, thread float* out) {
  const uint4 u = *reinterpret_cast<const device uint4*>(p);
  for (uint32_t c = 0; c < 4; ++c) {
    out[2 * c] = as_type<float>(u[c] << 16);
    out[2 * c + 1] = as_type<float>(u[c] & 0xffff0000u);
  }
}
inline void load8(const device float* p, thread float* out) {
  const float4 a = *reinterpret_cast<const device float4*>(p);
  const float4 b = *reinterpret_cast<const device float4*>(p + 4);
  for (uint32_t c = 0; c < 4; ++c) {
    out[c] = a[c];
    out[4 + c] = b[c];
  }
}

// The generic width (2, 3, 5, 6 bits): a lane holds V = 32 codes of a row, `bits` whole words
// (8 to 24 bytes, word-aligned: 32 codes start at a word boundary), loaded as words; code i is
// shifted down from bit i * bits (joined with the next word where it straddles one), masked and
// widened with masked_code; activations unscaled (scale_of = 1).
template <int bits>
struct Qmv1Codes;

// A lane's codes of one row and block, as loaded (Qmv1Codes::load): `bits` words at 2, 3, 5 and
// 6 bits; one uint4 at 4 and 8. Loading every row's words before any dot product keeps R loads
// in flight per lane (qmv1's row batches).
template <int bits>
struct Qmv1Words {
  uint32_t w[bits];
};

// Codes::dot() of RB rows held as uint4 (4 and 8 bits), word-major: every row's first word is used
// at once, so a compiler issues all RB rows' loads before the first product instead of each next
// to its own row (ptxas did, docs/gpu.md). The same operations per row as dot(): bit-identical.
template <typename Codes, uint32_t RB>
inline void dot_rows_u4(thread const uint4* wv, thread const float* xs, thread float* out) {
  constexpr uint32_t step = Codes::V / 4;  // x values per word
  float d[RB][4];
  LILY_UNROLL
  for (uint32_t j = 0; j < 4; ++j) {
    LILY_UNROLL
    for (uint32_t r = 0; r < RB; ++r) d[r][j] = Codes::word(wv[r][j], xs + step * j);
  }
  LILY_UNROLL
  for (uint32_t r = 0; r < RB; ++r) out[r] = (d[r][0] + d[r][1]) + (d[r][2] + d[r][3]);
}

template <int bits>
struct Qmv1Codes {
  static_assert(bits >= 2 && bits <= 8 && bits != 4 && bits != 8, "4 and 8 bits: the specialisations");
  enum : uint32_t { V = 32 };  // an enumerator: MSL has no static data members outside `constant`
  typedef Qmv1Words<bits> Words;
  static float scale_of(uint32_t) { return 1.0f; }
  static Words load(const device uint32_t* p) {
    Words r;
    for (uint32_t j = 0; j < uint32_t(bits); ++j) r.w[j] = p[j];
    return r;
  }
  static float dot_at(const device uint32_t* p, thread const float* xs) { return dot(load(p), xs); }
  template <uint32_t RB>
  static void dot_rows(thread const Words* wv, thread const float* xs, thread float* out) {
    for (uint32_t r = 0; r < RB; ++r) out[r] = dot(wv[r], xs);
  }
  static float dot(Words wv, thread const float* xs) {
    constexpr uint32_t mask = (1u << bits) - 1u;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (uint32_t i = 0; i < V; ++i) {
      const uint32_t bit = i * bits, j = bit / 32, sh = bit % 32;
      uint32_t v = wv.w[j] >> sh;
      if (sh + bits > 32) v |= wv.w[j + 1] << (32 - sh);
      d[i % 4] = fma(xs[i], masked_code(v, mask), d[i % 4]);
    }
    return (d[0] + d[1]) + (d[2] + d[3]);
  }
};

template <>
struct Qmv1Codes<4> {
  enum : uint32_t { V = 32 };  // an enumerator: MSL has no static data members outside `constant`
  typedef uint4 Words;
  static uint4 load(const device uint32_t* p) { return *reinterpret_cast<const device uint4*>(p); }
  static float scale_of(uint32_t i) { return i % 4 == 0 ? 1.0f : i % 4 == 1 ? 0.0625f : i % 4 == 2 ? 0.00390625f : 0.000244140625f; }
  // sum_i x[i] * (code i masked in place) over one word: its 8 nibbles, low half then high half.
  static float word(uint32_t w, thread const float* x) {
    const uint32_t lo = w & 0xffffu, hi = w >> 16;
    float a = x[0] * masked_code(lo, 0x000fu);
    a = fma(x[1], masked_code(lo, 0x00f0u), a);
    a = fma(x[2], masked_code(lo, 0x0f00u), a);
    a = fma(x[3], masked_code(lo, 0xf000u), a);
    a = fma(x[4], masked_code(hi, 0x000fu), a);
    a = fma(x[5], masked_code(hi, 0x00f0u), a);
    a = fma(x[6], masked_code(hi, 0x0f00u), a);
    return fma(x[7], masked_code(hi, 0xf000u), a);
  }
  static float dot(uint4 wv, thread const float* xs) {
    float d[4];
    for (uint32_t j = 0; j < 4; ++j) d[j] = word(wv[j], xs + 8 * j);
    return (d[0] + d[1]) + (d[2] + d[3]);
  }
  template <uint32_t RB>
  static void dot_rows(thread const uint4* wv, thread const float* xs, thread float* out) {
    dot_rows_u4<Qmv1Codes<4>, RB>(wv, xs, out);
  }
  static float dot_at(const device uint32_t* p, thread const float* xs) {
    return dot(*reinterpret_cast<const device uint4*>(p), xs);
  }
};
template <>
struct Qmv1Codes<8> {
  enum : uint32_t { V = 16 };
  typedef uint4 Words;
  static uint4 load(const device uint32_t* p) { return *reinterpret_cast<const device uint4*>(p); }
  static float scale_of(uint32_t i) { return i % 2 == 0 ? 1.0f : 0.00390625f; }
  static float word(uint32_t w, thread const float* x) {
    const uint32_t lo = w & 0xffffu, hi = w >> 16;
    float a = x[0] * masked_code(lo, 0x00ffu);
    a = fma(x[1], masked_code(lo, 0xff00u), a);
    a = fma(x[2], masked_code(hi, 0x00ffu), a);
    return fma(x[3], masked_code(hi, 0xff00u), a);
  }
  static float dot(uint4 wv, thread const float* xs) {
    float d[4];
    for (uint32_t j = 0; j < 4; ++j) d[j] = word(wv[j], xs + 4 * j);
    return (d[0] + d[1]) + (d[2] + d[3]);
  }
  template <uint32_t RB>
  static void dot_rows(thread const uint4* wv, thread const float* xs, thread float* out) {
    dot_rows_u4<Qmv1Codes<8>, RB>(wv, xs, out);
  }
  static float dot_at(const device uint32_t* p, thread const float* xs) {
    return dot(*reinterpret_cast<const device uint4*>(p), xs);
  }
};

}  // namespace lily
