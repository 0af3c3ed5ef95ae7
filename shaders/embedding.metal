// Embedding lookup from the quantized table (MLX affine layout, common/quant.h).
// Host: csrc/gpu/ops/embedding.cpp. Reference: lily_py.reference.kernels.embedding.
//
//   grid:      (ceil(D / (kEmbedThreads * kEmbedPerThread)), tokens) threadgroups of kEmbedThreads
//   thread:    dequantizes kEmbedPerThread = 8 consecutive values of row ids[t] (`bits` bytes,
//              common/quant.h unpack_row; D is a multiple of the group size, so strips are whole)
//   ids:       uint32 [tokens] (e.g. the sampler's device slot); an id >= vocab yields a row of
//              NaN instead of reading outside the table
//   precision: s * q + b in fp32, rounded to T once; nothing but the looked-up rows is read.
#include "common/lily_metal.h"
#include "common/quant.h"

namespace lily {

template <typename T, typename S, int bits>
[[kernel]] void embedding(constant EmbeddingArgs& args [[buffer(0)]],
                          const device uint32_t* ids [[buffer(1)]],
                          const device uint32_t* table [[buffer(2)]],
                          const device S* scales [[buffer(3)]],
                          const device S* biases [[buffer(4)]],
                          device T* out [[buffer(5)]],
                          LILY_KERNEL_TAIL) {
  const uint32_t t = group_pos.y;
  const uint32_t c0 = (group_pos.x * kEmbedThreads + thread_pos.x) * kEmbedPerThread;
  if (c0 < args.D) {
    const uint32_t id = ids[t];
    device T* o = out + t * args.D + c0;
    if (id >= args.vocab) {
      for (uint32_t i = 0; i < kEmbedPerThread; ++i) o[i] = T(as_type<float>(0x7fc00000u));
    } else {
      float q[kEmbedPerThread];
      unpack_row<bits, kEmbedPerThread>(table + id * (args.D * bits / 32), c0, q);
      const uint32_t g = id * (args.D / args.group_size) + c0 / args.group_size;
      const float s = float(scales[g]);
      const float b = float(biases[g]);
      for (uint32_t i = 0; i < kEmbedPerThread; ++i) o[i] = T(s * q[i] + b);
    }
  }
}

LILY_INSTANTIATE("embedding_b4_xf32_sf32", embedding<float, float, 4>)
LILY_INSTANTIATE("embedding_b4_xf32_sbf16", embedding<float, bfloat, 4>)
LILY_INSTANTIATE("embedding_b4_xbf16_sf32", embedding<bfloat, float, 4>)
LILY_INSTANTIATE("embedding_b4_xbf16_sbf16", embedding<bfloat, bfloat, 4>)
LILY_INSTANTIATE("embedding_b8_xf32_sf32", embedding<float, float, 8>)
LILY_INSTANTIATE("embedding_b8_xf32_sbf16", embedding<float, bfloat, 8>)
LILY_INSTANTIATE("embedding_b8_xbf16_sf32", embedding<bfloat, float, 8>)
LILY_INSTANTIATE("embedding_b8_xbf16_sbf16", embedding<bfloat, bfloat, 8>)

// 2, 3, 5 and 6 bits (bfloat16 scales).
LILY_INSTANTIATE("embedding_b2_xf32_sbf16", embedding<float, bfloat, 2>)
LILY_INSTANTIATE("embedding_b2_xbf16_sbf16", embedding<bfloat, bfloat, 2>)
LILY_INSTANTIATE("embedding_b3_xf32_sbf16", embedding<float, bfloat, 3>)
LILY_INSTANTIATE("embedding_b3_xbf16_sbf16", embedding<bfloat, bfloat, 3>)
LILY_INSTANTIATE("embedding_b5_xf32_sbf16", embedding<float, bfloat, 5>)
LILY_INSTANTIATE("embedding_b5_xbf16_sbf16", embedding<bfloat, bfloat, 5>)
LILY_INSTANTIATE("embedding_b6_xf32_sbf16", embedding<float, bfloat, 6>)
LILY_INSTANTIATE("embedding_b6_xbf16_sbf16", embedding<bfloat, bfloat, 6>)

}  // namespace lily
