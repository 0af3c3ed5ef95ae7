// The only shader header that uses simdgroup_matrix (8x8 tiles, Apple GPU family 7+ / M1+: fp32
// accumulators, fp32 or bf16 operands; bfloat needs MSL 3.1).
// The emulator implements these MSL calls in csrc/emu/metal_emu.h; Metal 4 tensor ops (M5) will
// get a header of their own.
#pragma once
#include "common/lily_metal.h"

namespace lily {

// A simdgroup's (8*TM) x (8*TN) fp32 accumulator tile.
template <int TM, int TN>
struct MmaTile {
  simdgroup_float8x8 c[TM][TN];
};

template <int TM, int TN>
inline void mma_zero(thread MmaTile<TM, TN>& t) {
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) t.c[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

// t += A[8*TM x 8] * B[8 x 8*TN] for one 8-wide k slice. A is row-major with leading dimension
// lda; B is given transposed (bt: row n holds B[:, n], leading dimension ldb), which is how a
// weight tile [n][k] is stored. E: the operands' element type in threadgroup memory, float or
// bfloat (bfloat x bfloat products accumulate into the fp32 tile: see metal_emu.h).
template <int TM, int TN, typename E>
inline void mma_step(thread MmaTile<TM, TN>& t, const threadgroup E* a, uint32_t lda,
                     const threadgroup E* bt, uint32_t ldb) {
  simdgroup_matrix<E, 8, 8> af[TM];
  simdgroup_matrix<E, 8, 8> bf[TN];
  for (int i = 0; i < TM; ++i) simdgroup_load(af[i], a + uint32_t(8 * i) * lda, ulong(lda), ulong2(0), false);
  for (int j = 0; j < TN; ++j) simdgroup_load(bf[j], bt + uint32_t(8 * j) * ldb, ulong(ldb), ulong2(0), true);
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) simdgroup_multiply_accumulate(t.c[i][j], af[i], bf[j], t.c[i][j]);
}

template <int TM, int TN>
inline void mma_store(thread const MmaTile<TM, TN>& t, threadgroup float* out, uint32_t ldo) {
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j)
      simdgroup_store(t.c[i][j], out + uint32_t(8 * i) * ldo + uint32_t(8 * j), ulong(ldo), ulong2(0), false);
}

// ---- single-tile helpers (attention prefill: rows rescaled by the online softmax) -------------

// c = diag * c: row r of the 8x8 tile scaled by diag[r * 8 + r] (diag: an 8x8 diagonal matrix in
// threadgroup memory, zeros off the diagonal; the product is exact: one nonzero term per output).
inline void mma_tile_scale_rows(thread simdgroup_float8x8& c, const threadgroup float* diag) {
  simdgroup_float8x8 d;
  simdgroup_load(d, diag, ulong(8), ulong2(0), false);
  simdgroup_multiply(c, d, c);
}

// c += A[8 x 8] * B[8 x 8], both row-major in threadgroup memory (leading dimensions lda, ldb).
inline void mma_tile_step(thread simdgroup_float8x8& c, const threadgroup float* a, uint32_t lda,
                          const threadgroup float* b, uint32_t ldb) {
  simdgroup_float8x8 af;
  simdgroup_float8x8 bf;
  simdgroup_load(af, a, ulong(lda), ulong2(0), false);
  simdgroup_load(bf, b, ulong(ldb), ulong2(0), false);
  simdgroup_multiply_accumulate(c, af, bf, c);
}

inline void mma_tile_store(thread const simdgroup_float8x8& c, threadgroup float* out, uint32_t ldo) {
  simdgroup_store(c, out, ulong(ldo), ulong2(0), false);
}

}  // namespace lily
