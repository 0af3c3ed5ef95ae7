// The cuda device's kernel entries, after csrc/cuda/metal_cuda.h's MSL subset (which includes this
// file): the shaders' vector names mapped to types of their own, LILY_INSTANTIATE (an extern "C"
// __global__ entry per instantiation, with its host name and args / buffer counts beside it, read
// back by nvrtc_build.py), each entry's launch bound (max_threads) and LILY_TG_ARRAY.
#pragma once

// ---------------------------------------------------------------------------- MSL names
// CUDA declares float4, uint4, ... (without operator[]) in the global namespace: the shaders'
// vector names map to types of their own.
using lily_float2 = metal::vec<float, 2>;
using lily_float3 = metal::vec<float, 3>;
using lily_float4 = metal::vec<float, 4>;
using lily_int2 = metal::vec<int, 2>;
using lily_int3 = metal::vec<int, 3>;
using lily_int4 = metal::vec<int, 4>;
using lily_uint2 = metal::vec<unsigned, 2>;
using lily_uint3 = metal::vec<unsigned, 3>;
using lily_uint4 = metal::vec<unsigned, 4>;
using lily_ushort2 = metal::vec<unsigned short, 2>;
using lily_ushort4 = metal::vec<unsigned short, 4>;
using lily_uchar4 = metal::vec<unsigned char, 4>;
using lily_half2 = metal::vec<metal::half, 2>;
using lily_half4 = metal::vec<metal::half, 4>;
using lily_bfloat2 = metal::vec<metal::bfloat, 2>;
using lily_bfloat4 = metal::vec<metal::bfloat, 4>;
using lily_ulong2 = metal::vec<unsigned long long, 2>;
#define float2 lily_float2
#define float3 lily_float3
#define float4 lily_float4
#define int2 lily_int2
#define int3 lily_int3
#define int4 lily_int4
#define uint2 lily_uint2
#define uint3 lily_uint3
#define uint4 lily_uint4
#define ushort2 lily_ushort2
#define ushort4 lily_ushort4
#define uchar4 lily_uchar4
#define half2 lily_half2
#define half4 lily_half4
#define bfloat2 lily_bfloat2
#define bfloat4 lily_bfloat4
#define ulong2 lily_ulong2

// ---------------------------------------------------------------------------- kernel entries
namespace lily_cuda {
inline constexpr int kMaxBuffers = 17;  // as the emulator (csrc/emu/runtime.h kMaxKernelBuffers)
struct Buffers {
  void* p[kMaxBuffers];
};
template <class F>
struct KernelTraits;
template <class A, class... P>
struct KernelTraits<void (*)(const A&, P...)> {
  using Args = A;
  static constexpr int kTail = 6;
  static_assert(sizeof...(P) >= kTail, "kernel must end with LILY_KERNEL_TAIL");
  static constexpr int kBuffers = int(sizeof...(P)) - kTail;
  static_assert(kBuffers <= kMaxBuffers, "too many buffer parameters");
  template <int I>
  using Param = typename nth<I, P...>::type;
};

template <auto F, int... I>
__device__ __forceinline__ void call(const typename KernelTraits<decltype(F)>::Args& args, const Buffers& b,
                                     index_seq<I...>) {
  using Tr = KernelTraits<decltype(F)>;
  const unsigned linear = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const lily_uint3 group_pos(blockIdx.x, blockIdx.y, blockIdx.z);
  const lily_uint3 thread_pos(threadIdx.x, threadIdx.y, threadIdx.z);
  const lily_uint3 group_size(blockDim.x, blockDim.y, blockDim.z);
  const lily_uint3 grid_pos(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y,
                            blockIdx.z * blockDim.z + threadIdx.z);
  F(args, static_cast<typename Tr::template Param<I>>(b.p[I])..., group_pos, thread_pos, group_size, grid_pos,
    linear & 31u, linear >> 5);
}
}  // namespace lily_cuda

namespace lily_cuda {
// The most threads per threadgroup the host dispatches a kernel with, as its __launch_bounds__,
// which sets the registers NVRTC may give a thread: a bound of 1024 caps it at 64, and the
// decode matvecs and vec attention (at most 64-256 threads; their per-lane arrays need more)
// then spilled to local memory. Metal's compiler makes this choice itself and reports
// maxTotalThreadsPerThreadgroup; here cuFuncGetAttribute reports the bound and the engine checks
// every dispatch against it at load (DeviceLimitError), as on Metal. The numbers are the host's:
// kAttnVecSimds * 32, kQmv1MaxSplits * 32 (qmv1 and qmv), kMoeGateUpMaxSimds * 32,
// kMoeDownMaxSplits * 32.
constexpr bool starts_with(const char* s, const char* p) {
  for (; *p; ++s, ++p)
    if (*s != *p) return false;
  return true;
}
constexpr unsigned max_threads(const char* name) {
  return starts_with(name, "attn_decode_vec_")       ? 256u
         : starts_with(name, "qmv1_")                ? 128u
         : starts_with(name, "qmv_")                 ? 128u
         : starts_with(name, "moe_gate_up_mv_")      ? 544u  // kMoeGateUpMaxSimds * 32
         : starts_with(name, "moe_down_mv_")         ? 256u
         : starts_with(name, "gated_delta_decode_")  ? 256u  // kGdDecodeThreads
         : starts_with(name, "qmm_")                 ? 128u  // every tiled qmm: 4 simdgroups
         : starts_with(name, "moe_gate_up_") || starts_with(name, "moe_down_") ? 128u  // tiles
         : starts_with(name, "attn_prefill_mma_") || starts_with(name, "attn_prefill_tiles_") ||
                   starts_with(name, "attn_prefill_m5_")
             ? 128u  // kAttnMmaThreads, kAttnTilesThreads, kAttnM5Threads
         : starts_with(name, "gd_chunk_state")        ? 128u  // 32, or kGdChunkM5StateThreads
         : starts_with(name, "sample_topk_partial_") || starts_with(name, "sample_max_partial_")
             ? 64u  // kSampleThreads
             : 1024u;
}
}  // namespace lily_cuda

#define LILY_CUDA_CAT_(a, b) a##b
#define LILY_CUDA_CAT(a, b) LILY_CUDA_CAT_(a, b)
#define LILY_CUDA_ENTRY_(n, name, ...)                                                                 \
  extern "C" __global__ void __launch_bounds__(lily_cuda::max_threads(name)) LILY_CUDA_CAT(lily_kernel_, n)(            \
      const typename lily_cuda::KernelTraits<decltype(&__VA_ARGS__)>::Args args, const lily_cuda::Buffers bufs) { \
    lily_cuda::call<&__VA_ARGS__>(                                                                     \
        args, bufs, typename lily_cuda::make_seq<lily_cuda::KernelTraits<decltype(&__VA_ARGS__)>::kBuffers>::type{}); \
  }                                                                                                    \
  extern "C" __device__ const char LILY_CUDA_CAT(LILY_CUDA_CAT(lily_kernel_, n), _name)[] = name;      \
  extern "C" __device__ const unsigned LILY_CUDA_CAT(LILY_CUDA_CAT(lily_kernel_, n), _meta)[2] = {      \
      unsigned(sizeof(typename lily_cuda::KernelTraits<decltype(&__VA_ARGS__)>::Args)),                \
      unsigned(lily_cuda::KernelTraits<decltype(&__VA_ARGS__)>::kBuffers)};
#define LILY_CUDA_ENTRY(n, name, ...) LILY_CUDA_ENTRY_(n, name, __VA_ARGS__)
// NVRTC has no __COUNTER__: each shader file is its own program (nvrtc_build.py passes
// LILY_CUDA_FILE, the file's index) and an entry is named by file and line.
#define LILY_INSTANTIATE(name, ...) \
  LILY_CUDA_ENTRY(LILY_CUDA_CAT(LILY_CUDA_CAT(LILY_CUDA_FILE, _), __LINE__), name, __VA_ARGS__)

// LILY_TG_ARRAY(float, tile, [32][36]): __shared__ float tile[32][36];
#define LILY_TG_ARRAY(T, name, dims) __shared__ __align__(16) T name dims
