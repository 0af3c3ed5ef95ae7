// Metal Shading Language as CUDA: the MSL subset of csrc/emu/metal_emu.h, for NVRTC.
//
// Compiled by csrc/cuda/nvrtc_build.py with -default-device (the shaders' unannotated functions
// are device functions) into the cuda device's kernel module. The shaders are unchanged: their
// common/lily_metal.h takes its third branch (LILY_CUDA). Mapping:
//   types      bfloat and the vectors: csrc/msl/msl_values.h (shared with the emulator; the vectors
//              behind the MSL names as lily_float4, ...: CUDA's float4 has no operator[]); half (a
//              struct over PTX conversions),
//              uint/ushort/uchar/ulong; no C++ library (NVRTC has none): the few traits below
//   math       csrc/msl/msl_values.h: the emulator's list, on CUDA's float functions (fast:: and
//              precise:: the same)
//   sync       threadgroup_barrier -> __syncthreads, preceded and followed by __threadfence when
//              the flags include mem_device (the DeltaNet ticket publishes to other threadgroups);
//              simdgroup_barrier -> __syncwarp; atomic_thread_fence -> __threadfence
//   simd       warp shuffles over the lanes present in the simdgroup; reductions end with a
//              broadcast of lane 0's value so every lane holds the same result (as on Metal)
//   atomics    atomic_int/uint/float over CUDA atomics (relaxed order as asked; fences separate)
//   matrices   simdgroup_matrix 8x8 in the emulator's lane layout (lane l holds (l/4, 2(l%4)) and
//              the next column); multiply gathers rows and columns by shuffles and sums
//              k = 0..7 in order in fp32 with one rounding per multiply and add, as the emulator
//   tensors    matmul2d with the emulator's semantics (csrc/emu/tensor_ops_emu.h): each thread of
//              the scope computes its destination elements e = i * T + thread, k in order (the
//              element loop of csrc/msl/msl_values.h)
//   kernels    csrc/cuda/metal_cuda_entry.h: every entry is __launch_bounds__(max_threads(name)):
//              1024 (Apple's threadgroup limit) except the kernels the host never gives more than
//              64-256 threads (a bound of 1024 caps a thread at 64 registers: `nvrtc_build.py
//              --usage` prints the spills); a dispatch past the bound fails the plan's thread check
//              at load (max_threads); LILY_INSTANTIATE emits extern "C" __global__
//              lily_kernel_<file>_<line>(Args, Buffers) plus ..._name (the host name) and ..._meta
//              (args bytes, buffers); LILY_TG_ARRAY is a __shared__ array; the tail positions are
//              computed from blockIdx / threadIdx (lane and simdgroup from the linear thread index,
//              as Metal).
#pragma once

#define LILY_CUDA_DEV __device__ __forceinline__

// ---------------------------------------------------------------------------- traits (no std)
namespace lily_cuda {
template <class T, T v>
struct integral_constant {
  static constexpr T value = v;
};
using true_type = integral_constant<bool, true>;
using false_type = integral_constant<bool, false>;
template <class A, class B>
struct is_same : false_type {};
template <class A>
struct is_same<A, A> : true_type {};
template <class A, class B>
inline constexpr bool is_same_v = is_same<A, B>::value;
template <class T> struct remove_cv { using type = T; };
template <class T> struct remove_cv<const T> { using type = T; };
template <class T> struct remove_cv<volatile T> { using type = T; };
template <class T> struct remove_cv<const volatile T> { using type = T; };
template <class T>
using remove_cv_t = typename remove_cv<T>::type;
template <bool B, class A, class C> struct conditional { using type = A; };
template <class A, class C> struct conditional<false, A, C> { using type = C; };
template <bool B, class A, class C>
using conditional_t = typename conditional<B, A, C>::type;
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <bool B, class T = void>
using enable_if_t = typename enable_if<B, T>::type;
template <class T>
inline constexpr bool is_float_v = is_same_v<remove_cv_t<T>, float> || is_same_v<remove_cv_t<T>, double>;
template <class T>
inline constexpr bool is_unsigned_v = T(0) < T(-1);
template <class T> struct is_scalar : false_type {};
#define LILY_CUDA_SCALAR(T) template <> struct is_scalar<T> : true_type {};
LILY_CUDA_SCALAR(bool) LILY_CUDA_SCALAR(char) LILY_CUDA_SCALAR(signed char) LILY_CUDA_SCALAR(unsigned char)
LILY_CUDA_SCALAR(short) LILY_CUDA_SCALAR(unsigned short) LILY_CUDA_SCALAR(int) LILY_CUDA_SCALAR(unsigned)
LILY_CUDA_SCALAR(long) LILY_CUDA_SCALAR(unsigned long) LILY_CUDA_SCALAR(long long)
LILY_CUDA_SCALAR(unsigned long long) LILY_CUDA_SCALAR(float) LILY_CUDA_SCALAR(double)
#undef LILY_CUDA_SCALAR
template <class T>
inline constexpr bool is_scalar_v = is_scalar<remove_cv_t<T>>::value;
template <int... I>
struct index_seq {};
template <int N, int... I>
struct make_seq : make_seq<N - 1, N - 1, I...> {};
template <int... I>
struct make_seq<0, I...> {
  using type = index_seq<I...>;
};
template <int I, class... P>
struct nth;
template <class H, class... P>
struct nth<0, H, P...> {
  using type = H;
};
template <int I, class H, class... P>
struct nth<I, H, P...> : nth<I - 1, P...> {};
LILY_CUDA_DEV void copy_bytes(void* dst, const void* src, unsigned n) {
  for (unsigned i = 0; i < n; ++i) static_cast<unsigned char*>(dst)[i] = static_cast<const unsigned char*>(src)[i];
}
template <class To, class From>
LILY_CUDA_DEV To bit_cast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t;
  copy_bytes(&t, &f, sizeof(To));
  return t;
}
}  // namespace lily_cuda

namespace metal {

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = unsigned long long;

// ---------------------------------------------------------------------------- half
// IEEE binary16 by PTX conversions (no cuda_fp16.h: NVRTC alone has no toolkit headers).
// Arithmetic goes through float; each store to a half rounds to nearest even.
struct half {
  unsigned short bits;
  half() = default;
  half(float f) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f)); }
  explicit half(double d) : half(static_cast<float>(d)) {}
  explicit half(int i) : half(static_cast<float>(i)) {}
  explicit half(unsigned i) : half(static_cast<float>(i)) {}
  operator float() const {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
  }
  half& operator+=(float o) { return *this = half(float(*this) + o); }
  half& operator-=(float o) { return *this = half(float(*this) - o); }
  half& operator*=(float o) { return *this = half(float(*this) * o); }
};
static_assert(sizeof(half) == 2, "half is 2 bytes");

}  // namespace metal

// What csrc/msl/msl_values.h asks of its device.
namespace lily_msl {
__device__ inline unsigned thread_in_group() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
__device__ inline void poison_fresh(void*, unsigned long) {}  // a fresh cooperative tensor: as it comes
}  // namespace lily_msl

// bfloat, the vectors, the math, Metal 4 tensors and matmul2d's element loop: MSL value semantics
// shared with the emulator.
#include "msl/msl_values.h"

namespace metal {

template <class T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static float infinity() { return __int_as_float(0x7f800000); }
  static float max() { return 3.402823466e38f; }
  static float lowest() { return -3.402823466e38f; }
  static float quiet_NaN() { return __int_as_float(0x7fc00000); }
};
template <>
struct numeric_limits<unsigned int> {
  static unsigned int max() { return 0xffffffffu; }
  static unsigned int min() { return 0u; }
};
template <>
struct numeric_limits<int> {
  static int max() { return 0x7fffffff; }
  static int min() { return -0x7fffffff - 1; }
};

// ---------------------------------------------------------------------------- synchronisation
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release,
                    memory_order_acq_rel, memory_order_seq_cst };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

inline void threadgroup_barrier(mem_flags f) {
  const bool dev = (static_cast<unsigned>(f) & static_cast<unsigned>(mem_flags::mem_device)) != 0;
  if (dev) __threadfence();
  __syncthreads();
  if (dev) __threadfence();
}

namespace detail {
// The lanes present in the calling thread's simdgroup (a threadgroup whose size is not a multiple
// of 32 ends with a partial one, as on Metal).
inline unsigned simd_width() {
  const unsigned n = blockDim.x * blockDim.y * blockDim.z;
  const unsigned linear = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned rest = n - (linear & ~31u);
  return rest >= 32u ? 32u : rest;
}
inline unsigned simd_mask() {
  const unsigned w = simd_width();
  return w >= 32u ? 0xffffffffu : ((1u << w) - 1u);
}
inline unsigned lane_id() {
  return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u;
}
}  // namespace detail

inline void simdgroup_barrier(mem_flags) { __syncwarp(detail::simd_mask()); }
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope) { __threadfence(); }

// ---------------------------------------------------------------------------- simd collectives
namespace detail {
// Shuffle any trivially copyable value word by word (up to 48 bytes, as the emulator).
template <class T>
inline T shfl(unsigned mask, const T& v, unsigned src) {
  static_assert(sizeof(T) <= 48, "simd shuffle on a type larger than 48 bytes");
  constexpr int kWords = (sizeof(T) + 3) / 4;
  unsigned w[kWords] = {};
  lily_cuda::copy_bytes(w, &v, sizeof(T));
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_sync(mask, w[i], src);
  T out;
  lily_cuda::copy_bytes(&out, w, sizeof(T));
  return out;
}
template <class T>
inline T add(const T& a, const T& b) {
  if constexpr (lily_cuda::is_same_v<T, bfloat>) return bfloat(float(a) + float(b));
  else return a + b;
}
template <class T>
inline T shfl_xor(const T& v, unsigned lane_mask) {
  constexpr int kWords = (sizeof(T) + 3) / 4;
  unsigned w[kWords] = {};
  lily_cuda::copy_bytes(w, &v, sizeof(T));
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_xor_sync(0xffffffffu, w[i], lane_mask);
  T out;
  lily_cuda::copy_bytes(&out, w, sizeof(T));
  return out;
}
// Pairwise tree in lane order, as the emulator: at stride s lane i (i % 2s == 0) takes i + s.
// The result is lane 0's, broadcast: every lane holds the same value.
template <class T, class F>
inline T tree(T v, F f) {
  const unsigned width = simd_width();
  if (width == 32u) {
    // A full simdgroup: a butterfly. At stride s every lane combines its aligned block of s lanes
    // with the neighbouring one, lower block first, so after each step every lane of an aligned
    // 2s block holds what the tree gives its first lane: the same value, bit for bit, with five
    // shuffles and no broadcast.
    const unsigned lane = lane_id();
    for (unsigned s = 1; s < 32u; s *= 2) {
      const T other = shfl_xor(v, s);
      const bool upper = (lane & s) != 0;
      v = upper ? f(other, v) : f(v, other);
    }
    return v;
  }
  const unsigned mask = simd_mask(), lane = lane_id();
  for (unsigned s = 1; s < width; s *= 2) {
    const T other = shfl(mask, v, lane + s < width ? lane + s : lane);
    if ((lane % (2 * s)) == 0 && lane + s < width) v = f(v, other);
  }
  return shfl(mask, v, 0);
}
}  // namespace detail

template <class T>
T simd_sum(T v) {
  return detail::tree(v, [](const T& a, const T& b) { return detail::add(a, b); });
}
template <class T>
T simd_max(T v) {
  return detail::tree(v, [](const T& a, const T& b) { return max(a, b); });
}
template <class T>
T simd_min(T v) {
  return detail::tree(v, [](const T& a, const T& b) { return min(a, b); });
}
template <class T>
T simd_prefix_inclusive_sum(T v) {
  const unsigned mask = detail::simd_mask(), lane = detail::lane_id(), width = detail::simd_width();
  T s = detail::shfl(mask, v, 0);
  for (unsigned l = 1; l < width; ++l) {
    const T o = detail::shfl(mask, v, l);
    if (l <= lane) s = detail::add(s, o);
  }
  return s;
}
template <class T>
T simd_prefix_exclusive_sum(T v) {
  const unsigned mask = detail::simd_mask(), lane = detail::lane_id(), width = detail::simd_width();
  T s = T(0);
  for (unsigned l = 0; l < width; ++l) {
    const T o = detail::shfl(mask, v, l);
    if (l < lane) s = detail::add(s, o);
  }
  return s;
}
template <class T>
T simd_shuffle(T v, ushort lane) {
  const unsigned w = detail::simd_width();
  return detail::shfl(detail::simd_mask(), v, lane < w ? lane : detail::lane_id());
}
template <class T>
T simd_shuffle_down(T v, ushort delta) {
  const unsigned l = detail::lane_id(), w = detail::simd_width();
  const T o = detail::shfl(detail::simd_mask(), v, l + delta < w ? l + delta : l);
  return l + delta < w ? o : v;
}
template <class T>
T simd_shuffle_up(T v, ushort delta) {
  const unsigned l = detail::lane_id();
  const T o = detail::shfl(detail::simd_mask(), v, delta <= l ? l - delta : l);
  return delta <= l ? o : v;
}
template <class T>
T simd_shuffle_xor(T v, ushort mask) {
  const unsigned l = detail::lane_id(), w = detail::simd_width();
  return detail::shfl(detail::simd_mask(), v, (l ^ mask) < w ? (l ^ mask) : l);
}
template <class T>
T simd_broadcast(T v, ushort lane) {
  return detail::shfl(detail::simd_mask(), v, lane);
}
template <class T>
T simd_broadcast_first(T v) {
  return detail::shfl(detail::simd_mask(), v, 0);
}
inline bool simd_all(bool b) { return __all_sync(detail::simd_mask(), b); }
inline bool simd_any(bool b) { return __any_sync(detail::simd_mask(), b); }
inline bool simd_is_first() { return detail::lane_id() == 0; }

// ---------------------------------------------------------------------------- atomics

template <class T, class U>
void atomic_store_explicit(volatile atomic<T>* a, U v, memory_order) {
  atomicExch(const_cast<T*>(&a->value), static_cast<T>(v));
}
template <class T>
T atomic_load_explicit(volatile atomic<T>* a, memory_order) {
  return a->value;  // volatile: a fresh load
}
template <class T, class U>
T atomic_exchange_explicit(volatile atomic<T>* a, U v, memory_order) {
  return atomicExch(const_cast<T*>(&a->value), static_cast<T>(v));
}
template <class T, class U>
bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* a, T* expected, U desired, memory_order,
                                           memory_order) {
  const T old = atomicCAS(const_cast<T*>(&a->value), *expected, static_cast<T>(desired));
  const bool ok = old == *expected;
  *expected = old;
  return ok;
}
template <class T, class U>
T atomic_fetch_add_explicit(volatile atomic<T>* a, U v, memory_order) {
  return atomicAdd(const_cast<T*>(&a->value), static_cast<T>(v));
}
template <class T, class U>
T atomic_fetch_sub_explicit(volatile atomic<T>* a, U v, memory_order) {
  if constexpr (lily_cuda::is_same_v<T, float>) return atomicAdd(const_cast<T*>(&a->value), -static_cast<T>(v));
  else return atomicSub(const_cast<T*>(&a->value), static_cast<T>(v));
}
namespace detail {
template <class T, class F>
inline T atomic_update_float(volatile atomic<T>* a, F f) {
  unsigned* p = reinterpret_cast<unsigned*>(const_cast<T*>(&a->value));
  unsigned old = *p, assumed;
  do {
    assumed = old;
    old = atomicCAS(p, assumed, __float_as_uint(f(__uint_as_float(assumed))));
  } while (old != assumed);
  return __uint_as_float(old);
}
}  // namespace detail
template <class T, class U>
T atomic_fetch_max_explicit(volatile atomic<T>* a, U v, memory_order) {
  if constexpr (lily_cuda::is_same_v<T, float>)
    return detail::atomic_update_float(a, [&](float o) { return o < float(v) ? float(v) : o; });
  else return atomicMax(const_cast<T*>(&a->value), static_cast<T>(v));
}
template <class T, class U>
T atomic_fetch_min_explicit(volatile atomic<T>* a, U v, memory_order) {
  if constexpr (lily_cuda::is_same_v<T, float>)
    return detail::atomic_update_float(a, [&](float o) { return float(v) < o ? float(v) : o; });
  else return atomicMin(const_cast<T*>(&a->value), static_cast<T>(v));
}

// ---------------------------------------------------------------------------- simdgroup_matrix
// The emulator's layout: lane l holds (r, c) and (r, c + 1), r = l / 4, c = 2 * (l % 4).
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "8x8 simdgroup matrices only");
  T e[2];
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal) {
    const unsigned l = detail::lane_id(), r = l / 4, c = 2 * (l % 4);
    e[0] = r == c ? diagonal : T(0.0f);
    e[1] = r == c + 1 ? diagonal : T(0.0f);
  }
};
using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;

template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e[0] = value;
  m.e[1] = value;
  return m;
}

template <class T, int Cols, int Rows, class P, class O>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const P* src, ulong elements_per_row, O,
                    bool transpose_matrix) {
  const unsigned l = detail::lane_id(), r = l / 4, c = 2 * (l % 4);
  for (unsigned i = 0; i < 2; ++i)
    d.e[i] = transpose_matrix ? src[(c + i) * elements_per_row + r] : src[r * elements_per_row + c + i];
}
template <class T, int Cols, int Rows, class P, class O>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& m, P* dst, ulong elements_per_row, O,
                     bool transpose_matrix) {
  const unsigned l = detail::lane_id(), r = l / 4, c = 2 * (l % 4);
  for (unsigned i = 0; i < 2; ++i)
    (transpose_matrix ? dst[(c + i) * elements_per_row + r] : dst[r * elements_per_row + c + i]) = m.e[i];
}

// d = a * b + c: each product float(a) * float(b) and each add rounded once in fp32, k = 0..7 in
// order (the emulator's semantics), then rounded to d's type.
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
  static_assert(lily_cuda::is_same_v<TD, TC>, "simdgroup_multiply_accumulate: c and d must have the same type");
  const unsigned l = detail::lane_id(), r = l / 4, c0 = 2 * (l % 4);
  const float a0 = float(a.e[0]), a1 = float(a.e[1]), b0 = float(b.e[0]), b1 = float(b.e[1]);
  float s[2] = {float(c.e[0]), float(c.e[1])};
  for (unsigned k = 0; k < 8; ++k) {
    const float ak0 = __shfl_sync(0xffffffffu, a0, 4 * r + k / 2);
    const float ak1 = __shfl_sync(0xffffffffu, a1, 4 * r + k / 2);
    const float ak = (k % 2) ? ak1 : ak0;
    const float bk0 = __shfl_sync(0xffffffffu, b0, 4 * k + c0 / 2);
    const float bk1 = __shfl_sync(0xffffffffu, b1, 4 * k + c0 / 2);
    s[0] = __fadd_rn(s[0], __fmul_rn(ak, bk0));
    s[1] = __fadd_rn(s[1], __fmul_rn(ak, bk1));
  }
  d.e[0] = static_cast<TD>(s[0]);
  d.e[1] = static_cast<TD>(s[1]);
}
template <class T>
void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                        const simdgroup_matrix<T, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, 8, 8>(T(0.0f)));
}

}  // namespace metal

namespace mpp::tensor_ops {

namespace detail {
template <class T>
inline constexpr bool is_int8 = lily_cuda::is_same_v<lily_cuda::remove_cv_t<T>, signed char> ||
                                lily_cuda::is_same_v<lily_cuda::remove_cv_t<T>, unsigned char>;
}  // namespace detail

// The emulator's semantics (csrc/emu/tensor_ops_emu.h): destination[m x n] = left * right (or +=),
// operands outside their extents read as 0, destination elements outside its extents not written,
// each output sum_k float(a) * float(b) in fp32, k in order; relaxed_precision rounds the sum to
// half before it is added.
template <matmul2d_descriptor D, class Scope>
class matmul2d : public detail::matmul2d_base<D, Scope> {
  static constexpr int kThreads = detail::matmul2d_base<D, Scope>::kThreads;

 public:
  template <class Left, class Right, class Dest>
  void run(Left& left, Right& right, Dest& dest) const {
    using LE = typename Left::element_type;
    using RE = typename Right::element_type;
    constexpr bool kInt = detail::is_int8<LE> && detail::is_int8<RE>;
    using Acc = lily_cuda::conditional_t<kInt, int, float>;
    // The threads of the scope enter together (execution-scope uniform): operands written before
    // by other threads were ordered by the caller's threadgroup_barrier.
    if constexpr (lily_cuda::is_same_v<Scope, metal::execution_simdgroup>) __syncwarp();
    else __syncthreads();
    const int lk = int(D.transpose_left ? left.get_extent(1) : left.get_extent(0));
    const int K = D.k < 0 ? lk : D.k;
    const int me = int((threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % kThreads);
    constexpr int kMine = (D.m * D.n + kThreads - 1) / kThreads;
    for (int i = 0; i < kMine; ++i) {
      const int f = i * kThreads + me;
      if (f >= D.m * D.n) break;
      detail::matmul2d_store<D>(dest, i, f, detail::matmul2d_element<D, Acc>(left, right, K, f / D.n, f % D.n));
    }
    if constexpr (lily_cuda::is_same_v<Scope, metal::execution_simdgroup>) __syncwarp();
    else __syncthreads();
  }
};

}  // namespace mpp::tensor_ops

// The MSL vector names and the kernel entries (LILY_INSTANTIATE, LILY_TG_ARRAY, launch bounds).
#include "cuda/metal_cuda_entry.h"

// LILY_KERNEL_TAIL and the address-space macros, last.
#include "msl/msl_address_spaces.h"
