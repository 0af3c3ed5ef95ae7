// Counter-based noise and exactly specified float32 math for the sampling kernels.
//
// Everything here must match src/lily_py/sampling.py operation for operation (the reference
// reproduces a device's choice bit for bit): lily_hash32 = hash32, lily_sample_key = sample_key,
// lily_uniform = uniform, lily_log = log32, lily_exp = exp32, lily_mass = mass_fixed.
// Only correctly rounded operations are used (+, -, *, fma, int <-> float conversions, bit
// casts); every multiply that feeds an add is an explicit fma, so FMA contraction by a compiler
// cannot change a result, and no library log/exp (whose last bits differ between libms) is called.
#pragma once
#include "common/lily_metal.h"

namespace lily {

// lowbias32 (xor-shift-multiply); uint32 wraps on every side.
inline uint32_t lily_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

inline uint32_t lily_sample_key(uint32_t seed_lo, uint32_t seed_hi, uint32_t step) {
  const uint32_t key = lily_hash32(seed_lo ^ lily_hash32(seed_hi + 0x9E3779B9u));
  return lily_hash32(key ^ lily_hash32(step));
}

// (top 23 bits + 0.5) * 2^-23: exact in float32, in [2^-24, 1 - 2^-24].
inline float lily_uniform(uint32_t key, uint32_t i) {
  const uint32_t h = lily_hash32((i * 0x9E3779B9u) ^ key);
  return (float(h >> 9) + 0.5f) * 1.1920928955078125e-7f;
}

// Natural log for positive normal x (Cephes logf), about 1 ulp.
inline float lily_log(float x) {
  const uint32_t b = as_type<uint32_t>(x);
  int e = int(b >> 23) - 126;                                      // x = m 2^e, m in [0.5, 1)
  const float m = as_type<float>((b & 0x007FFFFFu) | 0x3F000000u);
  float f;
  if (m < 0.7071067811865476f) {
    e -= 1;
    f = (m + m) - 1.0f;                                            // exact
  } else {
    f = m - 1.0f;                                                  // exact
  }
  const float z = f * f;
  float y = 0.070376836292f;
  y = fma(y, f, -0.1151461031f);
  y = fma(y, f, 0.1167699874f);
  y = fma(y, f, -0.12420140846f);
  y = fma(y, f, 0.14249322787f);
  y = fma(y, f, -0.16668057665f);
  y = fma(y, f, 0.20000714765f);
  y = fma(y, f, -0.24999993993f);
  y = fma(y, f, 0.33333331174f);
  y = (y * f) * z;
  const float ef = float(e);
  y = fma(ef, -0.00021219444f, y);
  y = fma(z, -0.5f, y);
  const float r = f + y;
  return fma(ef, 0.693359375f, r);
}

// Gumbel noise -log(-log(u)), finite for every u lily_uniform produces.
inline float lily_gumbel(uint32_t key, uint32_t i) { return -lily_log(-lily_log(lily_uniform(key, i))); }

// exp(s) for -32 <= s <= 0 (EXP_MIN in sampling.py) (Cephes expf, k = rint(s log2 e)), 0 below (and for -inf).
inline float lily_exp(float s) {
  if (!(s >= -32.0f)) return 0.0f;  // also -inf (and NaN, never passed)
  const float k = rint(s * 1.4426950408889634f);
  float r = fma(k, -0.693359375f, s);
  r = fma(k, 0.00021219444f, r);
  const float z = r * r;
  float y = 0.000198756915f;
  y = fma(y, r, 0.0013981999507f);
  y = fma(y, r, 0.0083334519073f);
  y = fma(y, r, 0.041665795894f);
  y = fma(y, r, 0.16666665459f);
  y = fma(y, r, 0.50000001201f);
  y = fma(y, z, r);
  y = y + 1.0f;
  return y * as_type<float>(uint32_t(int(k) + 127) << 23);
}

// Fixed-point mass floor(exp(s) * 2^40) for s <= 0 (<= 2^40), built from two exact 20-bit
// halves so only 32-bit float -> uint conversions are used.
inline ulong lily_mass(float s) {
  const float e = lily_exp(s) * 1048576.0f;  // exact: a power of two
  const uint32_t hi = uint32_t(e);           // <= 2^20
  const uint32_t lo = uint32_t((e - float(hi)) * 1048576.0f);  // exact fraction, < 2^20
  return (ulong(hi) << 20) + ulong(lo);
}

inline ulong lily_u64(uint32_t lo, uint32_t hi) { return (ulong(hi) << 32) | ulong(lo); }

// Order-preserving key of a float (larger float -> larger key; -inf lowest of the non-NaN).
inline uint32_t lily_order_key(float s) {
  const uint32_t b = as_type<uint32_t>(s);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// P = max(1, ceil(Z * t / 2^32)) without a 96-bit product (Z < 2^58, t < 2^32).
inline ulong lily_top_p_limit(ulong Z, uint32_t t) {
  const ulong hi = (Z >> 32) * ulong(t);
  const ulong lo = ((Z & ulong(0xFFFFFFFFu)) * ulong(t) + ulong(0xFFFFFFFFu)) >> 32;
  const ulong p = hi + lo;
  return p == 0 ? 1 : p;
}

}  // namespace lily
