// Metal Shading Language as C++: the subset of MSL the shaders use, implemented for the emulator.
//
// Included only by csrc/emu/shaders_emu.cpp, after every standard header (the address-space
// macros at the end of this file would break them). Implemented here:
//   types      bfloat (struct, round-to-nearest-even), half (_Float16 where the compiler has it),
//              vec<T,2|3|4> (float2..4, int2..4, uint2..4, ...; .x .y .z .w and [i], no swizzles),
//              uint/ushort/uchar/ulong; bfloat and the vectors are csrc/msl/msl_values.h (shared
//              with the cuda device)
//   math       abs min max clamp fma exp exp2 log log2 sqrt rsqrt floor ceil round rint trunc tanh
//              sin cos pow powr select mix saturate isnan isinf isfinite dot, also in fast:: and
//              precise:: (all precise here), as_type (csrc/msl/msl_values.h: the C library)
//   sync       threadgroup_barrier, simdgroup_barrier, atomic_thread_fence (memory is coherent; only
//              atomic_thread_fence(mem_device, .., thread_scope_device) feeds the memory-ordering
//              model between threadgroups, runtime.h: a barrier orders its own threadgroup only)
//   simd       simd_sum simd_max simd_min simd_prefix_{inclusive,exclusive}_sum simd_shuffle
//              simd_shuffle_{up,down,xor} simd_broadcast simd_broadcast_first simd_all simd_any
//              simd_is_first; every lane of the simdgroup must call each collective (checked)
//   atomics    atomic_int/atomic_uint/atomic_float: atomic_{load,store,exchange}_explicit,
//              atomic_fetch_{add,sub,min,max}_explicit, atomic_compare_exchange_weak_explicit
//   matrices   simdgroup_matrix<T,8,8> (float/half/bfloat), distributed over the lanes:
//              make_filled_simdgroup_matrix, diagonal constructor, simdgroup_load/store
//              (matrix_origin must be 0), simdgroup_multiply(_accumulate) (bfloat / half operands
//              into float accumulators too)
//   tensors    Metal 4 tensor_inline tensors, cooperative tensors and mpp::tensor_ops::matmul2d
//              (csrc/emu/tensor_ops_emu.h: semantics, scope checks and rounding stated there;
//              the element loop is csrc/msl/msl_values.h's)
//   kernels    LILY_INSTANTIATE registers a kernel under its host name; LILY_TG_ARRAY declares a
//              threadgroup array (shared by the threadgroup, poisoned with signalling NaN);
//              LILY_KERNEL_TAIL is the fixed list of built-in thread-position parameters.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emu/runtime.h"

#define LILY_EMU 1

namespace metal {

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = uint64_t;
using std::numeric_limits;

#if defined(__FLT16_MAX__)
using half = _Float16;
#endif

}  // namespace metal

// What csrc/msl/msl_values.h asks of its device.
namespace lily_msl {
inline uint32_t thread_in_group() { return ::lily::emu::thread_index_in_group(); }
inline void poison_fresh(void* p, size_t bytes) { std::memset(p, 0xFF, bytes); }  // NaN until written
}  // namespace lily_msl

// bfloat, the vectors, the math, Metal 4 tensors and matmul2d's element loop: MSL value semantics
// shared with the cuda device.
#include "msl/msl_values.h"  // NOLINT(build/include_order): needs metal::half above

namespace metal {

#define LILY_VEC_TYPES(T, name) \
  using name##2 = vec<T, 2>;    \
  using name##3 = vec<T, 3>;    \
  using name##4 = vec<T, 4>;
LILY_VEC_TYPES(float, float)
LILY_VEC_TYPES(int, int)
LILY_VEC_TYPES(unsigned int, uint)
LILY_VEC_TYPES(unsigned short, ushort)
LILY_VEC_TYPES(unsigned char, uchar)
LILY_VEC_TYPES(short, short)
LILY_VEC_TYPES(bfloat, bfloat)
LILY_VEC_TYPES(bool, bool)
LILY_VEC_TYPES(uint64_t, ulong)
#if defined(__FLT16_MAX__)
LILY_VEC_TYPES(_Float16, half)
#endif
#undef LILY_VEC_TYPES

// ---------------------------------------------------------------------------- synchronisation
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}

// With mem_device a barrier is also a device-scope fence for the emulator's memory-ordering model
// (runtime.h: device_fence): it orders the device stores of the threads it syncs before their later
// atomics (release) and their earlier atomics before their later reads (acquire).
inline void threadgroup_barrier(mem_flags f, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::lily::emu::threadgroup_sync(file, line, static_cast<unsigned>(f));
}
inline void simdgroup_barrier(mem_flags f, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::lily::emu::simd_sync("simdgroup_barrier", file, line, static_cast<unsigned>(f));
}

// ---------------------------------------------------------------------------- simd collectives
namespace detail {

// Every lane writes its value into its slot of the simdgroup's exchange area, waits until all
// lanes arrived at the same collective, then computes the result from all slots (each lane the
// same way, so all lanes agree). Two areas alternate so a fast lane cannot overwrite values that
// slower lanes still read.
template <class V>
struct Exchange {
  const unsigned char* base;
  uint32_t lane, width;
  const V& at(uint32_t l) const { return *reinterpret_cast<const V*>(base + l * ::lily::emu::kSlotBytes); }
};

template <class V>
inline Exchange<V> exchange(const V& value, const char* op, const char* file, int line) {
  static_assert(sizeof(V) <= ::lily::emu::kSlotBytes && std::is_trivially_copyable_v<V>,
                "simd collective on a type larger than the emulator's exchange slot");
  ::lily::emu::LaneView& lv = ::lily::emu::lane_view();
  unsigned char* base =
      lv.slots + (lv.simd_seq & 1u) * ::lily::emu::kSimdWidth * ::lily::emu::kSlotBytes;
  std::memcpy(base + lv.lane * ::lily::emu::kSlotBytes, &value, sizeof(V));
  const uint32_t lane = lv.lane, width = lv.simd_width;
  ::lily::emu::simd_sync(op, file, line);
  return {base, lane, width};
}

template <class T>
inline T add(const T& a, const T& b) {
  if constexpr (std::is_same_v<T, bfloat>) return bfloat(float(a) + float(b));
  else return a + b;
}

template <class T, class F>
inline T tree(const Exchange<T>& ex, F f) {  // pairwise reduction in lane order
  T vals[::lily::emu::kSimdWidth];
  for (uint32_t i = 0; i < ex.width; ++i) vals[i] = ex.at(i);
  for (uint32_t stride = 1; stride < ex.width; stride *= 2)
    for (uint32_t i = 0; i + stride < ex.width; i += 2 * stride) vals[i] = f(vals[i], vals[i + stride]);
  return vals[0];
}

struct WithIndex {  // value + per-lane parameter that must be uniform (delta, lane id, mask)
  alignas(16) unsigned char value[48];
  uint32_t param;
};

template <class T>
inline T shuffle_common(T v, uint32_t param, int kind, const char* op, const char* file, int line) {
  static_assert(sizeof(T) <= 48, "simd shuffle on a type larger than 48 bytes");
  WithIndex w{};
  std::memcpy(w.value, &v, sizeof(T));
  w.param = param;
  auto ex = exchange(w, op, file, line);
  uint32_t src = 0;
  switch (kind) {
    case 0: src = param; break;                   // simd_shuffle: any lane, per-lane index
    case 1: src = ex.lane + param; break;         // shuffle_down
    case 2: src = ex.lane - param; break;         // shuffle_up (wraps below 0: checked below)
    case 3: src = ex.lane ^ param; break;         // shuffle_xor
    case 4: src = param; break;                   // broadcast: uniform lane
  }
  if (kind != 0)
    for (uint32_t l = 0; l < ex.width; ++l)
      if (ex.at(l).param != param)
        ::lily::emu::kernel_fail(std::string(op) + ": argument differs between lanes (" +
                                     std::to_string(param) + " vs " + std::to_string(ex.at(l).param) +
                                     "); it must be uniform",
                                 file, line);
  if ((kind == 1 && src >= ex.width) || (kind == 2 && param > ex.lane)) return v;  // edge lanes keep theirs
  if (src >= ex.width)
    ::lily::emu::kernel_fail(std::string(op) + ": source lane " + std::to_string(src) +
                                 " does not exist (simdgroup has " + std::to_string(ex.width) + " lanes)",
                             file, line);
  T out;
  std::memcpy(&out, ex.at(src).value, sizeof(T));
  return out;
}

}  // namespace detail

template <class T>
inline T simd_sum(T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  auto ex = detail::exchange(v, "simd_sum", file, line);
  return detail::tree(ex, [](const T& a, const T& b) { return detail::add(a, b); });
}
template <class T>
inline T simd_max(T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  auto ex = detail::exchange(v, "simd_max", file, line);
  return detail::tree(ex, [](const T& a, const T& b) { return max(a, b); });
}
template <class T>
inline T simd_min(T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  auto ex = detail::exchange(v, "simd_min", file, line);
  return detail::tree(ex, [](const T& a, const T& b) { return min(a, b); });
}
template <class T>
inline T simd_prefix_inclusive_sum(T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  auto ex = detail::exchange(v, "simd_prefix_inclusive_sum", file, line);
  T s = ex.at(0);
  for (uint32_t l = 1; l <= ex.lane; ++l) s = detail::add(s, ex.at(l));
  return s;
}
template <class T>
inline T simd_prefix_exclusive_sum(T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  auto ex = detail::exchange(v, "simd_prefix_exclusive_sum", file, line);
  T s = T(0);
  for (uint32_t l = 0; l < ex.lane; ++l) s = detail::add(s, ex.at(l));
  return s;
}
template <class T>
inline T simd_shuffle(T v, ushort lane, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return detail::shuffle_common(v, lane, 0, "simd_shuffle", file, line);
}
template <class T>
inline T simd_shuffle_down(T v, ushort delta, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return detail::shuffle_common(v, delta, 1, "simd_shuffle_down", file, line);
}
template <class T>
inline T simd_shuffle_up(T v, ushort delta, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return detail::shuffle_common(v, delta, 2, "simd_shuffle_up", file, line);
}
template <class T>
inline T simd_shuffle_xor(T v, ushort mask, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return detail::shuffle_common(v, mask, 3, "simd_shuffle_xor", file, line);
}
template <class T>
inline T simd_broadcast(T v, ushort lane, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return detail::shuffle_common(v, lane, 4, "simd_broadcast", file, line);
}
template <class T>
inline T simd_broadcast_first(T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return detail::shuffle_common(v, 0, 4, "simd_broadcast_first", file, line);
}
inline bool simd_all(bool b, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  auto ex = detail::exchange(b, "simd_all", file, line);
  for (uint32_t l = 0; l < ex.width; ++l)
    if (!ex.at(l)) return false;
  return true;
}
inline bool simd_any(bool b, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  auto ex = detail::exchange(b, "simd_any", file, line);
  for (uint32_t l = 0; l < ex.width; ++l)
    if (ex.at(l)) return true;
  return false;
}
inline bool simd_is_first() { return ::lily::emu::lane_view().lane == 0; }  // all lanes active

// ---------------------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release,
                    memory_order_acq_rel, memory_order_seq_cst };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

// MSL 3.2 fence: with mem_device and thread_scope_device, a device-scope fence of the calling thread
// (runtime.h: device_fence). A narrower scope orders nothing between threadgroups.
inline void atomic_thread_fence(mem_flags f, memory_order, thread_scope scope, const char* file = __builtin_FILE(),
                                int line = __builtin_LINE()) {
  if ((static_cast<unsigned>(f) & static_cast<unsigned>(mem_flags::mem_device)) && scope == thread_scope_device)
    ::lily::emu::device_fence(file, line);
}


template <class T, class U>
inline void atomic_store_explicit(volatile atomic<T>* a, U v, memory_order) {
  ::lily::emu::note_atomic(const_cast<const T*>(&a->value));
  T t = static_cast<T>(v);
  __atomic_store(&a->value, &t, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomic_load_explicit(volatile atomic<T>* a, memory_order) {
  ::lily::emu::note_atomic(const_cast<const T*>(&a->value));
  T t;
  __atomic_load(&a->value, &t, __ATOMIC_SEQ_CST);
  return t;
}
template <class T, class U>
inline T atomic_exchange_explicit(volatile atomic<T>* a, U v, memory_order) {
  ::lily::emu::note_atomic(const_cast<const T*>(&a->value));
  T t = static_cast<T>(v), old;
  __atomic_exchange(&a->value, &t, &old, __ATOMIC_SEQ_CST);
  return old;
}
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* a, T* expected, U desired,
                                                  memory_order, memory_order) {
  ::lily::emu::note_atomic(const_cast<const T*>(&a->value));
  T d = static_cast<T>(desired);
  return __atomic_compare_exchange(&a->value, expected, &d, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
namespace detail {
template <class T, class F>
inline T atomic_update(volatile atomic<T>* a, F f) {
  ::lily::emu::note_atomic(const_cast<const T*>(&a->value));
  T old;
  __atomic_load(&a->value, &old, __ATOMIC_SEQ_CST);
  T next = f(old);
  while (!__atomic_compare_exchange(&a->value, &old, &next, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
    next = f(old);
  return old;
}
}  // namespace detail
template <class T, class U>
inline T atomic_fetch_add_explicit(volatile atomic<T>* a, U v, memory_order) {
  return detail::atomic_update(a, [&](T o) { return static_cast<T>(o + static_cast<T>(v)); });
}
template <class T, class U>
inline T atomic_fetch_sub_explicit(volatile atomic<T>* a, U v, memory_order) {
  return detail::atomic_update(a, [&](T o) { return static_cast<T>(o - static_cast<T>(v)); });
}
template <class T, class U>
inline T atomic_fetch_max_explicit(volatile atomic<T>* a, U v, memory_order) {
  return detail::atomic_update(a, [&](T o) { return o < static_cast<T>(v) ? static_cast<T>(v) : o; });
}
template <class T, class U>
inline T atomic_fetch_min_explicit(volatile atomic<T>* a, U v, memory_order) {
  return detail::atomic_update(a, [&](T o) { return static_cast<T>(v) < o ? static_cast<T>(v) : o; });
}

// ---------------------------------------------------------------------------- simdgroup_matrix
// 8x8 matrices distributed over the 32 lanes like on the GPU: lane l holds elements (r, c) and
// (r, c + 1) with r = l / 4, c = 2 * (l % 4) (the emulator's layout; MSL leaves it opaque, so
// thread_elements() is not provided). Loads and stores touch only the lane's two elements; the
// multiply is a simd collective that gathers the rows and columns it needs from the other lanes
// (so divergence is caught there) and accumulates in float, k = 0..7 in order.
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator implements 8x8 simdgroup matrices");
  T e[2];
  simdgroup_matrix() { std::memset(static_cast<void*>(e), 0xFF, sizeof e); }  // uninitialised: NaN
  explicit simdgroup_matrix(T diagonal) {  // MSL: a diagonal matrix
    const uint32_t l = ::lily::emu::lane_view().lane, r = l / 4, c = 2 * (l % 4);
    e[0] = r == c ? diagonal : T(0);
    e[1] = r == c + 1 ? diagonal : T(0);
  }
};
using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;
#if defined(__FLT16_MAX__)
using simdgroup_half8x8 = simdgroup_matrix<_Float16, 8, 8>;
#endif

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e[0] = value;
  m.e[1] = value;
  return m;
}

namespace detail {
inline void check_origin(ulong2 origin, const char* op, const char* file, int line) {
  if (origin.x != 0 || origin.y != 0)
    ::lily::emu::kernel_fail(std::string(op) + ": a nonzero matrix_origin is not emulated; offset the pointer",
                             file, line);
}
}  // namespace detail

template <class T, int Cols, int Rows>
inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  detail::check_origin(matrix_origin, "simdgroup_load", file, line);
  const uint32_t l = ::lily::emu::lane_view().lane, r = l / 4, c = 2 * (l % 4);
  for (uint32_t i = 0; i < 2; ++i)
    d.e[i] = transpose_matrix ? src[(c + i) * elements_per_row + r] : src[r * elements_per_row + c + i];
}
template <class T, int Cols, int Rows>
inline void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& m, T* dst, ulong elements_per_row = Cols,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                            const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  detail::check_origin(matrix_origin, "simdgroup_store", file, line);
  const uint32_t l = ::lily::emu::lane_view().lane, r = l / 4, c = 2 * (l % 4);
  for (uint32_t i = 0; i < 2; ++i)
    (transpose_matrix ? dst[(c + i) * elements_per_row + r] : dst[r * elements_per_row + c + i]) = m.e[i];
}

namespace detail {
template <class TA, class TB, class TC>
struct MmaOperands {
  TA a[2];
  TB b[2];
  TC c[2];
};
template <class T>
inline constexpr bool is_low_precision_elem = std::is_same_v<T, bfloat>
#if defined(__FLT16_MAX__)
                                       || std::is_same_v<T, _Float16>
#endif
    ;
}  // namespace detail

// d = a * b + c (all 8x8). Operand types as Apple's compiler takes them: all four of one element
// type, or a and b of half / bfloat (each its own) with c and d float. The mixed form is
// not in the MSL specification's table (which lists one T); it is what Apple's headers accept:
// llama.cpp's kernel_mul_mm multiplies simdgroup_bfloat8x8 (and simdgroup_half8x8) operands into
// simdgroup_float8x8 accumulators in kernels shipped for macOS. Semantics here: each product
// float(a) * float(b) in fp32 (exact for half and bfloat operands: at most 22 significant bits),
// summed into float(c) for k = 0..7 in order with fp32 rounding after each add; then d is rounded
// to its type.
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_same_v<TD, TC>, "simdgroup_multiply_accumulate: c and d must have the same type");
  static_assert((std::is_same_v<TA, TD> && std::is_same_v<TB, TD>) ||
                    (std::is_same_v<TD, float> && detail::is_low_precision_elem<TA> &&
                     detail::is_low_precision_elem<TB>),
                "simdgroup_multiply_accumulate: a, b, c and d of one type, or float c and d with half / bfloat "
                "a and b");
  const detail::MmaOperands<TA, TB, TC> mine{{a.e[0], a.e[1]}, {b.e[0], b.e[1]}, {c.e[0], c.e[1]}};
  auto ex = detail::exchange(mine, "simdgroup_multiply_accumulate", file, line);
  if (ex.width != ::lily::emu::kSimdWidth)
    ::lily::emu::kernel_fail("simdgroup_multiply_accumulate needs a full simdgroup of 32 lanes", file, line);
  const uint32_t r = ex.lane / 4, c0 = 2 * (ex.lane % 4);
  TD out[2];
  for (uint32_t i = 0; i < 2; ++i) {
    const uint32_t col = c0 + i;
    float s = static_cast<float>(mine.c[i]);
    for (uint32_t k = 0; k < 8; ++k)
      s += static_cast<float>(ex.at(4 * r + k / 2).a[k % 2]) * static_cast<float>(ex.at(4 * k + col / 2).b[col % 2]);
    out[i] = static_cast<TD>(s);
  }
  d.e[0] = out[0];
  d.e[1] = out[1];
}
template <class T>
inline void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                               const simdgroup_matrix<T, 8, 8>& b, const char* file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, 8, 8>(T(0)), file, line);
}

}  // namespace metal

// Metal 4 tensors and mpp::tensor_ops::matmul2d (M5 kernels, through shaders/common/tensor_ops.h).
#include "emu/tensor_ops_emu.h"  // NOLINT(build/include_order): needs metal::half above

// ---------------------------------------------------------------------------- kernel registration
namespace lily::emu::shim {

template <class F>
struct KernelTraits;
template <class A, class... P>
struct KernelTraits<void (*)(const A&, P...)> {
  using Args = A;
  using Params = std::tuple<P...>;
  static constexpr size_t kTail = 6;  // LILY_KERNEL_TAIL
  static_assert(sizeof...(P) >= kTail, "kernel must end with LILY_KERNEL_TAIL");
  static constexpr size_t kBuffers = sizeof...(P) - kTail;
  static_assert(std::is_same_v<std::tuple_element_t<kBuffers + 0, Params>, metal::uint3> &&
                    std::is_same_v<std::tuple_element_t<kBuffers + 1, Params>, metal::uint3> &&
                    std::is_same_v<std::tuple_element_t<kBuffers + 2, Params>, metal::uint3> &&
                    std::is_same_v<std::tuple_element_t<kBuffers + 3, Params>, metal::uint3> &&
                    std::is_same_v<std::tuple_element_t<kBuffers + 4, Params>, metal::uint> &&
                    std::is_same_v<std::tuple_element_t<kBuffers + 5, Params>, metal::uint>,
                "kernel parameters must end with LILY_KERNEL_TAIL");
};

inline metal::uint3 u3(const uint32_t v[3]) { return metal::uint3(v[0], v[1], v[2]); }

template <auto F, size_t... I>
inline void call(const void* args, void* const* bufs, const ThreadIds& ids, std::index_sequence<I...>) {
  using Tr = KernelTraits<decltype(F)>;
  using P = typename Tr::Params;
  F(*static_cast<const typename Tr::Args*>(args), static_cast<std::tuple_element_t<I, P>>(bufs[I])...,
    u3(ids.group_pos), u3(ids.thread_pos), u3(ids.group_size), u3(ids.grid_pos), ids.lane, ids.simd_id);
}

template <auto F>
void thread_entry(const void* args, void* const* bufs, const ThreadIds& ids) {
  call<F>(args, bufs, ids, std::make_index_sequence<KernelTraits<decltype(F)>::kBuffers>{});
}

template <class T>
struct is_atomic : std::false_type {};
template <class T>
struct is_atomic<metal::atomic<T>> : std::true_type {};

template <auto F, size_t... I>
void describe_buffers(KernelEntry& e, std::index_sequence<I...>) {
  using P = typename KernelTraits<decltype(F)>::Params;
  auto one = [&](auto i, auto* ptr_tag) {
    using Ptr = std::remove_pointer_t<decltype(ptr_tag)>;
    static_assert(std::is_pointer_v<Ptr>, "kernel buffer parameters must be pointers");
    using Elem = std::remove_pointer_t<Ptr>;
    e.buffers[decltype(i)::value] = {std::is_const_v<Elem>, static_cast<uint32_t>(sizeof(Elem)),
                                     is_atomic<std::remove_cv_t<Elem>>::value};
  };
  (one(std::integral_constant<size_t, I>{}, static_cast<std::tuple_element_t<I, P>*>(nullptr)), ...);
}

template <auto F>
bool add(const char* name, const char* file) {
  using Tr = KernelTraits<decltype(F)>;
  static_assert(Tr::kBuffers <= kMaxKernelBuffers, "too many buffer parameters");
  KernelEntry e;
  e.name = name;
  e.file = file;
  e.entry = &thread_entry<F>;
  e.args_size = sizeof(typename Tr::Args);
  e.num_buffers = static_cast<uint32_t>(Tr::kBuffers);
  describe_buffers<F>(e, std::make_index_sequence<Tr::kBuffers>{});
  return register_kernel(e);
}

}  // namespace lily::emu::shim

#define LILY_EMU_CAT_(a, b) a##b
#define LILY_EMU_CAT(a, b) LILY_EMU_CAT_(a, b)

// LILY_INSTANTIATE("host_name", function<template args>): registers the instantiation.
#define LILY_INSTANTIATE(name, ...)                                                  \
  [[maybe_unused]] static const bool LILY_EMU_CAT(lily_emu_registered_, __COUNTER__) = \
      ::lily::emu::shim::add<&__VA_ARGS__>(name, __FILE__);

// LILY_TG_ARRAY(float, tile, [32][36]): threadgroup float tile[32][36]; (at kernel scope, unconditionally)
#define LILY_TG_ARRAY(T, name, dims)                                                  \
  T(&name) dims = *reinterpret_cast<T(*) dims>(                                       \
      ::lily::emu::threadgroup_alloc(sizeof(T dims), alignof(T) > 16 ? alignof(T) : 16, __FILE__, __LINE__))

// LILY_KERNEL_TAIL and the address-space macros, last.
#include "msl/msl_address_spaces.h"
