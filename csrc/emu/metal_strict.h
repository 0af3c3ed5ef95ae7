// Strict address-space pass: MSL as clang C++ with `device`, `constant` and `threadgroup` as
// distinct address spaces, so passing a device pointer where a thread (generic) or threadgroup
// pointer is expected fails here as it does in Apple's compiler. Declarations only: this header
// is used with `clang -fsyntax-only` (.ci/checks/strict_shaders.sh), never to generate code.
//
// Needs clang >= 17 (arithmetic __bf16 on x86-64). Vector types are ext_vector_type (their casts
// are bitcasts, unlike MSL, which is harmless for a syntax pass). Keep in step with the subset of
// MSL that csrc/emu/metal_emu.h implements.
#pragma once

#include <cstddef>
#include <cstdint>

#define LILY_STRICT 1

#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#define kernel

namespace metal {

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = unsigned long;
// half and bfloat are built-in type names in MSL (keywords, like int): macros, so a declaration
// that uses either as a name (`uint32_t half = ...`) fails here as in Apple's compiler.
#define bfloat __bf16
#define half _Float16

#define LILY_STRICT_VEC(T, name)                              \
  typedef T name##2 __attribute__((ext_vector_type(2)));      \
  typedef T name##3 __attribute__((ext_vector_type(3)));      \
  typedef T name##4 __attribute__((ext_vector_type(4)));
LILY_STRICT_VEC(float, float)
LILY_STRICT_VEC(int, int)
LILY_STRICT_VEC(unsigned int, uint)
LILY_STRICT_VEC(unsigned short, ushort)
LILY_STRICT_VEC(unsigned char, uchar)
LILY_STRICT_VEC(short, short)
LILY_STRICT_VEC(__bf16, bfloat)
LILY_STRICT_VEC(_Float16, half)
LILY_STRICT_VEC(unsigned long, ulong)
#undef LILY_STRICT_VEC

template <class T> T exp(T);
template <class T> T exp2(T);
template <class T> T log(T);
template <class T> T log2(T);
template <class T> T sqrt(T);
template <class T> T rsqrt(T);
template <class T> T floor(T);
template <class T> T ceil(T);
template <class T> T round(T);
template <class T> T rint(T);
template <class T> T trunc(T);
template <class T> T tanh(T);
template <class T> T sin(T);
template <class T> T cos(T);
template <class T> T saturate(T);
template <class T> T abs(T);
template <class T> T fabs(T);
template <class T> T max(T, T);
template <class T> T min(T, T);
template <class T> T fmax(T, T);
template <class T> T fmin(T, T);
template <class T> T clamp(T, T, T);
template <class T> T fma(T, T, T);
template <class T> T pow(T, T);
template <class T> T powr(T, T);
template <class T> T mix(T, T, T);
template <class T> T select(T, T, bool);
template <class T> bool isnan(T);
template <class T> bool isinf(T);
template <class T> bool isfinite(T);
template <class V> auto dot(V, V) -> decltype(V()[0]);
template <class To, class From> To as_type(From);
namespace precise { using metal::exp; using metal::exp2; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh; }
namespace fast { using metal::exp; using metal::exp2; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh; }

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);

template <class T> T simd_sum(T);
template <class T> T simd_max(T);
template <class T> T simd_min(T);
template <class T> T simd_prefix_inclusive_sum(T);
template <class T> T simd_prefix_exclusive_sum(T);
template <class T> T simd_shuffle(T, ushort);
template <class T> T simd_shuffle_down(T, ushort);
template <class T> T simd_shuffle_up(T, ushort);
template <class T> T simd_shuffle_xor(T, ushort);
template <class T> T simd_broadcast(T, ushort);
template <class T> T simd_broadcast_first(T);
bool simd_all(bool);
bool simd_any(bool);
bool simd_is_first();

// Atomics are relaxed; memory_order_seq_cst is for MSL 3.2's atomic_thread_fence.
enum memory_order { memory_order_relaxed, memory_order_seq_cst };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
void atomic_thread_fence(mem_flags, memory_order, thread_scope);
template <class T> struct atomic { T value; };
using atomic_int = atomic<int>;
using atomic_uint = atomic<unsigned int>;
using atomic_float = atomic<float>;
#define LILY_STRICT_ATOMICS(AS)                                                                    \
  template <class T, class U> void atomic_store_explicit(volatile AS atomic<T>*, U, memory_order); \
  template <class T> T atomic_load_explicit(volatile AS atomic<T>*, memory_order);                 \
  template <class T, class U> T atomic_exchange_explicit(volatile AS atomic<T>*, U, memory_order); \
  template <class T, class U> T atomic_fetch_add_explicit(volatile AS atomic<T>*, U, memory_order); \
  template <class T, class U> T atomic_fetch_sub_explicit(volatile AS atomic<T>*, U, memory_order); \
  template <class T, class U> T atomic_fetch_max_explicit(volatile AS atomic<T>*, U, memory_order); \
  template <class T, class U> T atomic_fetch_min_explicit(volatile AS atomic<T>*, U, memory_order); \
  template <class T, class U>                                                                       \
  bool atomic_compare_exchange_weak_explicit(volatile AS atomic<T>*, thread T*, U, memory_order, memory_order);
LILY_STRICT_ATOMICS(device)
LILY_STRICT_ATOMICS(threadgroup)
#undef LILY_STRICT_ATOMICS

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  T e[2];
  simdgroup_matrix();
  explicit simdgroup_matrix(T diagonal);
};
using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
template <class T, int Cols, int Rows> simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T);
#define LILY_STRICT_MATRIX_IO(AS)                                                                             \
  template <class T, int C, int R>                                                                             \
  void simdgroup_load(thread simdgroup_matrix<T, C, R>&, const AS T*, ulong = C, ulong2 = ulong2(0), bool = false); \
  template <class T, int C, int R>                                                                             \
  void simdgroup_store(thread const simdgroup_matrix<T, C, R>&, AS T*, ulong = C, ulong2 = ulong2(0), bool = false);
LILY_STRICT_MATRIX_IO(device)
LILY_STRICT_MATRIX_IO(threadgroup)
#undef LILY_STRICT_MATRIX_IO
template <class T>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, 8, 8>&, thread const simdgroup_matrix<T, 8, 8>&,
                                   thread const simdgroup_matrix<T, 8, 8>&, thread const simdgroup_matrix<T, 8, 8>&);
// float accumulators with half / bfloat operands, as Apple's headers take them (llama.cpp's
// kernel_mul_mm: bfloat x bfloat and half x half into float). Any other mix (a half accumulator,
// c and d of different types) matches no declaration.
template <class T> struct lily_strict_mma_operand {};
template <> struct lily_strict_mma_operand<half> { using type = void; };
template <> struct lily_strict_mma_operand<bfloat> { using type = void; };
template <class TA, class TB, class = typename lily_strict_mma_operand<TA>::type,
          class = typename lily_strict_mma_operand<TB>::type>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<float, 8, 8>&, thread const simdgroup_matrix<TA, 8, 8>&,
                                   thread const simdgroup_matrix<TB, 8, 8>&, thread const simdgroup_matrix<float, 8, 8>&);
template <class T>
void simdgroup_multiply(thread simdgroup_matrix<T, 8, 8>&, thread const simdgroup_matrix<T, 8, 8>&,
                        thread const simdgroup_matrix<T, 8, 8>&);

}  // namespace metal

// Explicit instantiation type-checks each kernel body with its template arguments.
#define LILY_STRICT_CAT_(a, b) a##b
#define LILY_STRICT_CAT(a, b) LILY_STRICT_CAT_(a, b)
#define LILY_INSTANTIATE(name, ...) \
  [[maybe_unused]] static auto LILY_STRICT_CAT(lily_strict_kernel_, __COUNTER__) = &__VA_ARGS__;
// Apple's compiler accepts threadgroup variables only in a kernel's own scope: the kernel tail
// declares a marker parameter, and a threadgroup array anywhere else (a helper function) names
// an undeclared identifier here.
struct LilyKernelScope {};
#define LILY_TG_ARRAY(T, name, dims)                                                                   \
  static_assert(sizeof(lily_kernel_scope_only) > 0, "threadgroup arrays only in a kernel's own scope"); \
  alignas(16) static threadgroup T name dims
#define LILY_KERNEL_TAIL \
  uint3 group_pos, uint3 thread_pos, uint3 group_size, uint3 grid_pos, uint lane, uint simd_id, \
  LilyKernelScope lily_kernel_scope_only
