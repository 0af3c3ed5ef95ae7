// Staging helpers of the M1-M4 bf16 simdgroup GEMM tiles: qmm_bf16 (qmm.metal) and the MoE
// grouped bf16 tiles (moe_gate_up_mm_bf16 / moe_down_mm_bf16, moe_prefill_bf16.metal). A staging thread owns one
// row of a tile and its kQmmBf16TileK = 16 columns of a K step: 16 activations (QmmXRegs: two
// 16-byte loads for bf16, copied as is; four for fp32, rounded to bf16) or 16 dequantized weights
// (one 16-byte load of 128 / bits codes every 128 / bits / 16 steps, s * q + b in fp32 rounded to
// bf16), written to threadgroup memory as two 16-byte stores. Rounding: to nearest even, once.
#pragma once
#include "common/lily_metal.h"
#include "common/quant.h"

namespace lily {

// Two floats rounded to bf16 (to nearest even), packed low first.
inline uint32_t qmm_pack_bf16(float a, float b) {
  return uint32_t(as_type<ushort>(bfloat(a))) | (uint32_t(as_type<ushort>(bfloat(b))) << 16);
}

// Registers that carry one thread's 16 values of a row of x from the global load to the store.
template <typename T>
struct QmmXRegs;
template <>
struct QmmXRegs<bfloat> {
  uint4 v[2];
  void load(const device bfloat* src) {
    v[0] = reinterpret_cast<const device uint4*>(src)[0];
    v[1] = reinterpret_cast<const device uint4*>(src)[1];
  }
  void store(threadgroup bfloat* dst) const {
    reinterpret_cast<threadgroup uint4*>(dst)[0] = v[0];
    reinterpret_cast<threadgroup uint4*>(dst)[1] = v[1];
  }
};
template <>
struct QmmXRegs<float> {
  float4 v[4];
  void load(const device float* src) {
    for (uint32_t i = 0; i < 4; ++i) v[i] = reinterpret_cast<const device float4*>(src)[i];
  }
  void store(threadgroup bfloat* dst) const {  // rounded to bf16
    for (uint32_t i = 0; i < 2; ++i) {
      uint4 p;
      p.x = qmm_pack_bf16(v[2 * i].x, v[2 * i].y);
      p.y = qmm_pack_bf16(v[2 * i].z, v[2 * i].w);
      p.z = qmm_pack_bf16(v[2 * i + 1].x, v[2 * i + 1].y);
      p.w = qmm_pack_bf16(v[2 * i + 1].z, v[2 * i + 1].w);
      reinterpret_cast<threadgroup uint4*>(dst)[i] = p;
    }
  }
};

// Codes j and j + 1 of word `wd` (bits 4 or 8), dequantized in fp32 and packed as two bf16.
template <int bits>
inline uint32_t qmm_bf16_dq2(uint32_t wd, uint32_t j, float s, float b) {
  constexpr uint32_t mask = (1u << bits) - 1u;
  return qmm_pack_bf16(s * masked_code(wd >> (j * bits), mask) + b, s * masked_code(wd >> ((j + 1) * bits), mask) + b);
}

// 16 consecutive codes in words w0, w1 (4-bit: 8 codes each) or w0..w3 (8-bit: 4 each), as 16 bf16.
template <int bits>
inline uint4 qmm_bf16_dq8(uint32_t w0, uint32_t w1, float s, float b) {  // 8 codes
  uint4 p;
  if (bits == 4) {
    p.x = qmm_bf16_dq2<bits>(w0, 0, s, b);
    p.y = qmm_bf16_dq2<bits>(w0, 2, s, b);
    p.z = qmm_bf16_dq2<bits>(w0, 4, s, b);
    p.w = qmm_bf16_dq2<bits>(w0, 6, s, b);
  } else {
    p.x = qmm_bf16_dq2<bits>(w0, 0, s, b);
    p.y = qmm_bf16_dq2<bits>(w0, 2, s, b);
    p.z = qmm_bf16_dq2<bits>(w1, 0, s, b);
    p.w = qmm_bf16_dq2<bits>(w1, 2, s, b);
  }
  return p;
}

// The 16 codes of the current step from the 16-byte register wq (4-bit: half `sub` of it; 8-bit:
// all of it) into one row of the w stage: two 16-byte stores.
template <int bits>
inline void qmm_bf16_store_w(uint4 wq, uint32_t sub, float s, float b, threadgroup bfloat* dst) {
  uint4 lo, hi;
  if (bits == 4) {
    lo = qmm_bf16_dq8<bits>(sub != 0 ? wq.z : wq.x, 0u, s, b);
    hi = qmm_bf16_dq8<bits>(sub != 0 ? wq.w : wq.y, 0u, s, b);
  } else {
    lo = qmm_bf16_dq8<bits>(wq.x, wq.y, s, b);
    hi = qmm_bf16_dq8<bits>(wq.z, wq.w, s, b);
  }
  reinterpret_cast<threadgroup uint4*>(dst)[0] = lo;
  reinterpret_cast<threadgroup uint4*>(dst)[1] = hi;
}

// Global loads of K step k0 into registers: w (a new 16-byte word block when k0 starts one, and
// the group's scale and bias) for the w-staging simdgroups, 16 values of x for the others.
template <int bits, typename T, typename S>
inline void qmm_bf16_load(bool stages_w, uint32_t k0, uint32_t gshift, const device T* xrow,
                          const device uint32_t* wrow, const device S* srow, const device S* brow,
                          thread QmmXRegs<T>& xr, thread uint4& wq, thread float& sc, thread float& bi) {
  constexpr uint32_t CPL = 128 / bits;  // codes per 16-byte load of w
  if (stages_w) {
    if (k0 % CPL == 0) wq = *reinterpret_cast<const device uint4*>(wrow + k0 * bits / 32);
    sc = float(srow[k0 >> gshift]);
    bi = float(brow[k0 >> gshift]);
  } else {
    xr.load(xrow + k0);
  }
}

// The registers of step k0 into this thread's row of a stage (xd / wd: the row in the x / w stage).
template <int bits, typename T>
inline void qmm_bf16_store(bool stages_w, uint32_t k0, thread const QmmXRegs<T>& xr, uint4 wq, float sc,
                           float bi, threadgroup bfloat* xd, threadgroup bfloat* wd) {
  constexpr uint32_t CPL = 128 / bits;
  if (stages_w) qmm_bf16_store_w<bits>(wq, (k0 % CPL) / kQmmBf16TileK, sc, bi, wd);
  else xr.store(xd);
}

}  // namespace lily
