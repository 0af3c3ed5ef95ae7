// The only shader header that uses simdgroup_matrix (8x8 fp32 tiles, Apple GPU family 7+ / M1+).
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
// weight tile [n][k] is stored.
template <int TM, int TN>
inline void mma_step(thread MmaTile<TM, TN>& t, const threadgroup float* a, uint32_t lda,
                     const threadgroup float* bt, uint32_t ldb) {
  simdgroup_float8x8 af[TM];
  simdgroup_float8x8 bf[TN];
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

}  // namespace lily
