// MSL value semantics, written once for the two C++ builds of the shaders: the emulator
// (csrc/emu/metal_emu.h, host C++20) and the cuda device (csrc/cuda/metal_cuda.h, NVRTC device
// code). What a value is, how it converts and rounds, not how threads meet: the collectives,
// barriers, atomics, simdgroup matrices and matmul2d's execution scope stay in each device's header.
//
//   bfloat        a struct of 16 bits; from float: round to nearest, ties to even, NaN kept quiet
//                 (a half converts through float, exactly)
//   vec<T, N>     N = 2, 3, 4 (a 3-vector is padded to 4, as in MSL); .x .y .z .w and [i]; built
//                 by broadcast (float4(s)), from scalars and smaller vectors (float4(a.xy, b, c)),
//                 or converted per component (float4(int4)); operators + - * / & | ^ << >> and
//                 unary -, per component, with a scalar operand broadcast
//   math          exp .. saturate, abs, max, min, fma (also in fast:: and precise::, the same
//                 functions here), clamp, mix, select, pow, powr, dot, isnan, isinf, isfinite,
//                 as_type: a vector applies the scalar function per component; the scalar
//                 functions are each device's (lily_msl::scalar, below: the C library in the
//                 emulator, CUDA's float functions under NVRTC), side by side
//   tensors       Metal 4 tensor_inline tensors over a pointer (element (i0, i1) at
//                 ptr[i1 * e0 + i0], 0 outside the extents), execution scopes, cooperative
//                 tensors (element e = row * n + col in thread e % T of the scope, slot e / T;
//                 reversed slots for integer elements: csrc/emu/tensor_ops_emu.h says why)
//   matmul2d      each destination element of mpp::tensor_ops::matmul2d (the element loop):
//                 sum_k float(a) * float(b) in fp32 with one rounding per multiply and add, k in
//                 order (int8 operands: int32, exact); relaxed_precision rounds the sum to half;
//                 accumulate in fp32 then round to the destination's type (docs/tensor-ops.md)
//
// Each device defines, before including this header: metal::half (the emulator's _Float16 where
// the compiler has one, the cuda device's PTX-converted struct), lily_msl::thread_in_group() (the
// calling thread's linear index in its threadgroup) and lily_msl::poison_fresh(p, bytes) (what a
// fresh cooperative tensor holds: NaN bits in the emulator, nothing written under NVRTC).
// LILY_MSL_FN qualifies every function: constexpr host code in the emulator, __device__ code
// under NVRTC (whose -default-device would make it device code anyway).
#pragma once

#include "msl/matmul2d_descriptor.h"

#if defined(__CUDACC__)
// NVRTC has no C++ library: the traits are csrc/cuda/metal_cuda.h's lily_cuda ones.
#define LILY_MSL_FN __device__
#define LILY_MSL_HAS_HALF 1
namespace lily_msl {
template <class A, class B>
inline constexpr bool is_same_v = lily_cuda::is_same_v<A, B>;
template <bool B, class T = void>
using enable_if_t = lily_cuda::enable_if_t<B, T>;
template <class T>
using remove_cv_t = lily_cuda::remove_cv_t<T>;
template <class S>  // a scalar that broadcasts against a vector
inline constexpr bool is_scalar_v = lily_cuda::is_scalar_v<S>;
template <class T>
inline constexpr bool is_integral_v = lily_cuda::is_scalar_v<T> && !lily_cuda::is_float_v<T>;
using size_t = unsigned long;
template <class To, class From>
__device__ inline To bit_cast(const From& f) { return lily_cuda::bit_cast<To>(f); }
__device__ inline unsigned float_bits(float f) { return __float_as_uint(f); }
__device__ inline float bits_float(unsigned u) { return __uint_as_float(u); }
__device__ inline float fmul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline float fadd_rn(float a, float b) { return __fadd_rn(a, b); }
}  // namespace lily_msl
#else
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#define LILY_MSL_FN constexpr
#if defined(__FLT16_MAX__)
#define LILY_MSL_HAS_HALF 1
#endif
namespace lily_msl {
using std::enable_if_t;
using std::is_same_v;
using std::remove_cv_t;
template <class S>  // a scalar that broadcasts against a vector
inline constexpr bool is_scalar_v = std::is_arithmetic_v<S>;
using std::bit_cast;
using std::is_integral_v;
using std::size_t;
constexpr uint32_t float_bits(float f) { return std::bit_cast<uint32_t>(f); }
constexpr float bits_float(uint32_t u) { return std::bit_cast<float>(u); }
// One rounding each: the shader translation unit is compiled with -ffp-contract=off.
constexpr float fmul_rn(float a, float b) { return a * b; }
constexpr float fadd_rn(float a, float b) { return a + b; }
}  // namespace lily_msl
#endif

namespace metal {

// ---------------------------------------------------------------------------- bfloat
struct bfloat {
  unsigned short bits;
  bfloat() = default;
  explicit LILY_MSL_FN bfloat(float f) : bits(from_float(f)) {}
  explicit LILY_MSL_FN bfloat(double d) : bfloat(static_cast<float>(d)) {}
  explicit LILY_MSL_FN bfloat(int i) : bfloat(static_cast<float>(i)) {}
  explicit LILY_MSL_FN bfloat(unsigned i) : bfloat(static_cast<float>(i)) {}
#if defined(LILY_MSL_HAS_HALF)
  explicit LILY_MSL_FN bfloat(half h) : bfloat(static_cast<float>(h)) {}
#endif
  LILY_MSL_FN operator float() const { return lily_msl::bits_float(static_cast<unsigned>(bits) << 16); }

  static LILY_MSL_FN unsigned short from_float(float f) {
    unsigned u = lily_msl::float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<unsigned short>(u >> 16);
  }
};
static_assert(sizeof(bfloat) == 2, "bfloat is 2 bytes");

// ---------------------------------------------------------------------------- vectors
template <class T, int N>
struct vec_storage;
template <class T>
struct alignas(2 * sizeof(T)) vec_storage<T, 2> {
  union {
    struct { T x, y; };
    T v[2];
  };
};
template <class T>
struct alignas(4 * sizeof(T)) vec_storage<T, 3> {
  union {
    struct { T x, y, z; };
    T v[4];
  };
};
template <class T>
struct alignas(4 * sizeof(T)) vec_storage<T, 4> {
  union {
    struct { T x, y, z, w; };
    T v[4];
  };
};

template <class T, int N>
struct vec;

template <class U>
struct vec_info {
  static constexpr int size = 1;
};
template <class U, int M>
struct vec_info<vec<U, M>> {
  static constexpr int size = M;
};

template <class T, int N>
struct vec : vec_storage<T, N> {
  using value_type = T;
  vec() = default;
  LILY_MSL_FN vec(T s) {  // broadcast (MSL: float4(1.0f))
    for (int i = 0; i < N; ++i) this->v[i] = s;
  }
  // Component-wise construction from scalars and smaller vectors: float4(a, b, c, d),
  // float4(float2, float2), float4(float3, w), uint3(x, y, z).
  template <class A, class B, class... C>
  LILY_MSL_FN vec(const A& a, const B& b, const C&... c) {
    static_assert(vec_info<A>::size + vec_info<B>::size + (vec_info<C>::size + ... + 0) == N,
                  "vector constructor: component count must equal the vector size");
    int k = 0;
    put(k, a);
    put(k, b);
    (put(k, c), ...);
  }
  template <class U>
  explicit LILY_MSL_FN vec(const vec<U, N>& o) {  // conversion: float4(int4) converts each value
    for (int i = 0; i < N; ++i) this->v[i] = static_cast<T>(o.v[i]);
  }
  LILY_MSL_FN T& operator[](int i) { return this->v[i]; }
  LILY_MSL_FN const T& operator[](int i) const { return this->v[i]; }

 private:
  template <class U>
  LILY_MSL_FN void put(int& k, const U& u) {
    if constexpr (vec_info<U>::size == 1) {
      this->v[k++] = static_cast<T>(u);
    } else {
      for (int i = 0; i < vec_info<U>::size; ++i) this->v[k++] = static_cast<T>(u.v[i]);
    }
  }
};

#define LILY_VEC_BINOP(op)                                                                    \
  template <class T, int N>                                                                   \
  LILY_MSL_FN vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {                 \
    vec<T, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r.v[i] = static_cast<T>(a.v[i] op b.v[i]);                    \
    return r;                                                                                 \
  }                                                                                           \
  template <class T, int N, class S, class = lily_msl::enable_if_t<lily_msl::is_scalar_v<S>>> \
  LILY_MSL_FN vec<T, N> operator op(const vec<T, N>& a, S s) {                                \
    return a op vec<T, N>(static_cast<T>(s));                                                 \
  }                                                                                           \
  template <class T, int N, class S, class = lily_msl::enable_if_t<lily_msl::is_scalar_v<S>>> \
  LILY_MSL_FN vec<T, N> operator op(S s, const vec<T, N>& a) {                                \
    return vec<T, N>(static_cast<T>(s)) op a;                                                 \
  }                                                                                           \
  template <class T, int N, class S>                                                          \
  LILY_MSL_FN vec<T, N>& operator op##=(vec<T, N>& a, const S& b) {                           \
    a = a op b;                                                                               \
    return a;                                                                                 \
  }
LILY_VEC_BINOP(+)
LILY_VEC_BINOP(-)
LILY_VEC_BINOP(*)
LILY_VEC_BINOP(/)
LILY_VEC_BINOP(&)
LILY_VEC_BINOP(|)
LILY_VEC_BINOP(^)
LILY_VEC_BINOP(<<)
LILY_VEC_BINOP(>>)
#undef LILY_VEC_BINOP

template <class T, int N>
LILY_MSL_FN vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = -a.v[i];
  return r;
}

}  // namespace metal

// ---------------------------------------------------------------------------- scalar math, per device
// The one place where the two devices' values may differ: what a scalar function computes.
#if defined(__CUDACC__)
namespace lily_msl::scalar {
// CUDA's float functions; every other type goes through float (half and bfloat round the result
// once). fast:: and precise:: are these same functions.
__device__ inline float f_exp(float x) { return ::expf(x); }
__device__ inline float f_exp2(float x) { return ::exp2f(x); }
__device__ inline float f_log(float x) { return ::logf(x); }
__device__ inline float f_log2(float x) { return ::log2f(x); }
__device__ inline float f_sqrt(float x) { return ::sqrtf(x); }
__device__ inline float f_rsqrt(float x) { return 1.0f / ::sqrtf(x); }
__device__ inline float f_floor(float x) { return ::floorf(x); }
__device__ inline float f_ceil(float x) { return ::ceilf(x); }
__device__ inline float f_round(float x) { return ::roundf(x); }
__device__ inline float f_rint(float x) { return ::rintf(x); }
__device__ inline float f_trunc(float x) { return ::truncf(x); }
__device__ inline float f_tanh(float x) { return ::tanhf(x); }
__device__ inline float f_sin(float x) { return ::sinf(x); }
__device__ inline float f_cos(float x) { return ::cosf(x); }
__device__ inline float f_saturate(float x) { return ::fminf(::fmaxf(x, 0.0f), 1.0f); }
#define LILY_MSL_SCALAR1(name, expr) \
  template <class T>                 \
  __device__ inline T name(T x) {    \
    return static_cast<T>(f_##name(static_cast<float>(x))); \
  }
template <class T>
__device__ inline T abs(T x) {
  if constexpr (lily_cuda::is_float_v<T>) {
    return ::fabsf(x);
  } else if constexpr (lily_cuda::is_scalar_v<T> && lily_cuda::is_unsigned_v<T>) {
    return x;
  } else if constexpr (lily_cuda::is_scalar_v<T>) {
    return x < 0 ? -x : x;
  } else {
    return T(::fabsf(float(x)));
  }
}
// MSL max/min on floats return the non-NaN operand (fmax/fmin); half and bfloat through float.
template <class T>
__device__ inline T max(T a, T b) {
  if constexpr (lily_cuda::is_float_v<T>) return ::fmaxf(a, b);
  else if constexpr (lily_cuda::is_scalar_v<T>) return a < b ? b : a;
  else return T(::fmaxf(float(a), float(b)));
}
template <class T>
__device__ inline T min(T a, T b) {
  if constexpr (lily_cuda::is_float_v<T>) return ::fminf(a, b);
  else if constexpr (lily_cuda::is_scalar_v<T>) return b < a ? b : a;
  else return T(::fminf(float(a), float(b)));
}
template <class T>
__device__ inline T fma(T a, T b, T c) {
  if constexpr (lily_cuda::is_same_v<T, metal::half>) {  // a * b + c rounded once to half
    unsigned short r;
    asm("fma.rn.f16 %0, %1, %2, %3;" : "=h"(r) : "h"(a.bits), "h"(b.bits), "h"(c.bits));
    metal::half h;
    h.bits = r;
    return h;
  } else {
    return ::fmaf(a, b, c);
  }
}
template <class T>
__device__ inline T pow(T a, T b) { return T(::powf(float(a), float(b))); }
__device__ inline bool isnan(float x) { return ::isnan(x); }
__device__ inline bool isinf(float x) { return ::isinf(x); }
__device__ inline bool isfinite(float x) { return ::isfinite(x); }
}  // namespace lily_msl::scalar
#else
namespace lily_msl::scalar {
// The C library, in the argument's own type (bfloat through float: one rounding of the result).
#define LILY_MSL_SCALAR1(name, expr)                                                          \
  template <class T>                                                                          \
  inline T name(T x) {                                                                        \
    if constexpr (std::is_same_v<T, metal::bfloat>) return metal::bfloat(name(static_cast<float>(x))); \
    else return static_cast<T>(expr);                                                         \
  }
template <class T>
inline T abs(T x) {
  if constexpr (std::is_floating_point_v<T>) {
    return std::fabs(x);
  } else if constexpr (std::is_unsigned_v<T>) {
    return x;
  } else {
    return x < 0 ? -x : x;
  }
}
// MSL max/min on floats return the non-NaN operand (fmax/fmin).
template <class T>
inline T max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return std::fmax(a, b);
  else if constexpr (std::is_same_v<T, metal::bfloat>) return metal::bfloat(std::fmax(float(a), float(b)));
  else return a < b ? b : a;
}
template <class T>
inline T min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return std::fmin(a, b);
  else if constexpr (std::is_same_v<T, metal::bfloat>) return metal::bfloat(std::fmin(float(a), float(b)));
  else return b < a ? b : a;
}
template <class T>
inline T fma(T a, T b, T c) {
  if constexpr (std::is_same_v<T, metal::half>) {  // the fused a * b + c rounded once to half: the
    return T(std::fma(double(a), double(b), double(c)));  // double fma is exact for half operands
  } else {                                                // (22-bit product) but for far-apart sums
    return std::fma(a, b, c);
  }
}
template <class T>
inline T pow(T a, T b) { return std::pow(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
}  // namespace lily_msl::scalar
#endif

namespace lily_msl::scalar {
LILY_MSL_SCALAR1(exp, std::exp(x))
LILY_MSL_SCALAR1(exp2, std::exp2(x))
LILY_MSL_SCALAR1(log, std::log(x))
LILY_MSL_SCALAR1(log2, std::log2(x))
LILY_MSL_SCALAR1(sqrt, std::sqrt(x))
LILY_MSL_SCALAR1(rsqrt, 1.0f / std::sqrt(x))
LILY_MSL_SCALAR1(floor, std::floor(x))
LILY_MSL_SCALAR1(ceil, std::ceil(x))
LILY_MSL_SCALAR1(round, std::round(x))
LILY_MSL_SCALAR1(rint, std::rint(x))
LILY_MSL_SCALAR1(trunc, std::trunc(x))
LILY_MSL_SCALAR1(tanh, std::tanh(x))
LILY_MSL_SCALAR1(sin, std::sin(x))
LILY_MSL_SCALAR1(cos, std::cos(x))
LILY_MSL_SCALAR1(saturate, std::fmin(std::fmax(x, T(0)), T(1)))
#undef LILY_MSL_SCALAR1
}  // namespace lily_msl::scalar

// ---------------------------------------------------------------------------- math
namespace metal {

// Templates (not overloads) so the C library's float overloads stay unambiguous; a vector applies
// the scalar function per component.
#define LILY_MSL_MATH1(name)                                               \
  template <class T>                                                       \
  LILY_MSL_FN T name(T x) {                                                \
    if constexpr (vec_info<T>::size > 1) {                                 \
      T r;                                                                 \
      for (int i = 0; i < vec_info<T>::size; ++i) r.v[i] = name(x.v[i]);  \
      return r;                                                            \
    } else {                                                               \
      return ::lily_msl::scalar::name(x);                                  \
    }                                                                      \
  }
#define LILY_MSL_MATH_FUNCS                                                                      \
  LILY_MSL_MATH1(exp) LILY_MSL_MATH1(exp2) LILY_MSL_MATH1(log) LILY_MSL_MATH1(log2)              \
  LILY_MSL_MATH1(sqrt) LILY_MSL_MATH1(rsqrt) LILY_MSL_MATH1(floor) LILY_MSL_MATH1(ceil)          \
  LILY_MSL_MATH1(round) LILY_MSL_MATH1(rint) LILY_MSL_MATH1(trunc) LILY_MSL_MATH1(tanh)          \
  LILY_MSL_MATH1(sin) LILY_MSL_MATH1(cos) LILY_MSL_MATH1(saturate)
LILY_MSL_MATH_FUNCS
namespace precise {
LILY_MSL_MATH_FUNCS
}
namespace fast {
LILY_MSL_MATH_FUNCS
}
#undef LILY_MSL_MATH_FUNCS
#undef LILY_MSL_MATH1

template <class T>
LILY_MSL_FN T abs(T x) {
  if constexpr (vec_info<T>::size > 1) {
    T r;
    for (int i = 0; i < vec_info<T>::size; ++i) r.v[i] = abs(x.v[i]);
    return r;
  } else {
    return ::lily_msl::scalar::abs(x);
  }
}
template <class T>
LILY_MSL_FN T max(T a, T b) {
  if constexpr (vec_info<T>::size > 1) {
    T r;
    for (int i = 0; i < vec_info<T>::size; ++i) r.v[i] = max(a.v[i], b.v[i]);
    return r;
  } else {
    return ::lily_msl::scalar::max(a, b);
  }
}
template <class T>
LILY_MSL_FN T min(T a, T b) {
  if constexpr (vec_info<T>::size > 1) {
    T r;
    for (int i = 0; i < vec_info<T>::size; ++i) r.v[i] = min(a.v[i], b.v[i]);
    return r;
  } else {
    return ::lily_msl::scalar::min(a, b);
  }
}
template <class T>
LILY_MSL_FN T fma(T a, T b, T c) {
  if constexpr (vec_info<T>::size > 1) {
    T r;
    for (int i = 0; i < vec_info<T>::size; ++i) r.v[i] = fma(a.v[i], b.v[i], c.v[i]);
    return r;
  } else {
    return ::lily_msl::scalar::fma(a, b, c);
  }
}
template <class T>
LILY_MSL_FN T fabs(T x) { return abs(x); }
template <class T>
LILY_MSL_FN T fmax(T a, T b) { return max(a, b); }
template <class T>
LILY_MSL_FN T fmin(T a, T b) { return min(a, b); }
template <class T>
LILY_MSL_FN T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T>
LILY_MSL_FN T pow(T a, T b) { return ::lily_msl::scalar::pow(a, b); }
template <class T>
LILY_MSL_FN T powr(T a, T b) { return ::lily_msl::scalar::pow(a, b); }
template <class T>
LILY_MSL_FN T mix(T a, T b, T t) { return a + (b - a) * t; }
template <class T>
LILY_MSL_FN T select(T a, T b, bool c) { return c ? b : a; }
template <class T>
LILY_MSL_FN bool isnan(T x) { return ::lily_msl::scalar::isnan(static_cast<float>(x)); }
template <class T>
LILY_MSL_FN bool isinf(T x) { return ::lily_msl::scalar::isinf(static_cast<float>(x)); }
template <class T>
LILY_MSL_FN bool isfinite(T x) { return ::lily_msl::scalar::isfinite(static_cast<float>(x)); }
template <class T, int N>
LILY_MSL_FN T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a.v[0] * b.v[0];
  for (int i = 1; i < N; ++i) s += a.v[i] * b.v[i];
  return s;
}
template <class To, class From>
LILY_MSL_FN To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return ::lily_msl::bit_cast<To>(f);
}

// ---------------------------------------------------------------------------- atomics
// The storage of an atomic (each device's atomic_*_explicit functions act on it).
template <class T>
struct atomic {
  T value;
};
using atomic_int = atomic<int>;
using atomic_uint = atomic<unsigned int>;
using atomic_float = atomic<float>;

// ---------------------------------------------------------------------------- Metal 4 tensors
inline constexpr lily_msl::size_t dynamic_extent = static_cast<lily_msl::size_t>(-1);  // k from the operands

template <class IndexType, lily_msl::size_t Rank>
struct dextents {  // e0 is the innermost (contiguous) dimension
  static_assert(Rank == 2, "rank-2 tensors only");
  using index_type = IndexType;
  IndexType e[Rank];
  LILY_MSL_FN dextents(IndexType e0, IndexType e1) : e{e0, e1} {}
  LILY_MSL_FN IndexType extent(lily_msl::size_t r) const { return e[r]; }
};

struct tensor_inline {};

template <class ElementType, class Extents, class DescriptorType = tensor_inline>
class tensor {
  static_assert(lily_msl::is_same_v<DescriptorType, tensor_inline>, "tensor_inline tensors only");

 public:
  using element_type = ElementType;
  using extents_type = Extents;
  using index_type = typename Extents::index_type;
  LILY_MSL_FN tensor(ElementType* data, Extents ext) : data_(data), ext_(ext) {}
  LILY_MSL_FN ElementType* data() const { return data_; }
  LILY_MSL_FN Extents extents() const { return ext_; }
  LILY_MSL_FN index_type get_extent(lily_msl::size_t r) const { return ext_.extent(r); }
  // Element (i0, i1): 0 outside the extents (edge checking).
  LILY_MSL_FN float at(long i0, long i1) const {
    if (i0 < 0 || i1 < 0 || i0 >= long(ext_.extent(0)) || i1 >= long(ext_.extent(1))) return 0.0f;
    return static_cast<float>(data_[i1 * long(ext_.extent(0)) + i0]);
  }
  // The same, as an integer (the int8 rows).
  LILY_MSL_FN int at_int(long i0, long i1) const {
    if (i0 < 0 || i1 < 0 || i0 >= long(ext_.extent(0)) || i1 >= long(ext_.extent(1))) return 0;
    return static_cast<int>(data_[i1 * long(ext_.extent(0)) + i0]);
  }

 private:
  ElementType* data_;
  Extents ext_;
};

template <int N>
struct execution_simdgroups {
  static_assert(N >= 1, "execution_simdgroups<N> needs N >= 1");
  static constexpr int simdgroups = N;
};
struct execution_simdgroup {
  static constexpr int simdgroups = 1;
};

template <class T, int Rank>
struct tensor_index {  // what get_multidimensional_index returns: index[0], index[1]
  T v[Rank];
  LILY_MSL_FN T operator[](int r) const { return v[r]; }
};

// A matmul2d destination held in the threads of the op's scope: element e = row * n + col of the
// m x n tile in thread e % Threads, slot e / Threads, element index slot (float, half) or
// capacity - 1 - slot (integers; the map is an involution, index_of is its own inverse).
template <class ElementType, int M, int N, int Threads>
class cooperative_tensor {
 public:
  using element_type = ElementType;
  static constexpr int kCapacity = (M * N + Threads - 1) / Threads;
  LILY_MSL_FN cooperative_tensor() : owner_(lily_msl::thread_in_group() % Threads) {
    lily_msl::poison_fresh(static_cast<void*>(e_), sizeof e_);
  }
  static constexpr unsigned short get_capacity() { return static_cast<unsigned short>(kCapacity); }
  LILY_MSL_FN bool is_valid_element(unsigned short i) const { return i < kCapacity && flat(i) < M * N; }
  LILY_MSL_FN tensor_index<int, 2> get_multidimensional_index(unsigned short i) const {
    const int f = flat(i);
    return {{f % N, f / N}};
  }
  LILY_MSL_FN ElementType& operator[](unsigned short i) { return e_[i]; }
  LILY_MSL_FN const ElementType& operator[](unsigned short i) const { return e_[i]; }
  LILY_MSL_FN int owner() const { return owner_; }
  static constexpr unsigned short index_of(int s) {
    return static_cast<unsigned short>(lily_msl::is_integral_v<ElementType> ? kCapacity - 1 - s : s);
  }
  LILY_MSL_FN int flat(unsigned short i) const { return int(index_of(i)) * Threads + owner_; }

 private:
  ElementType e_[kCapacity];
  int owner_;
};

}  // namespace metal

// ---------------------------------------------------------------------------- matmul2d's elements
namespace mpp::tensor_ops::detail {

template <class T>
struct is_coop {
  static constexpr bool value = false;
};
template <class E, int M, int N, int Th>
struct is_coop<metal::cooperative_tensor<E, M, N, Th>> {
  static constexpr bool value = true;
};

// What each device's matmul2d<D, Scope> has besides run(): the descriptor, the scope's threads
// and its cooperative destination type.
template <matmul2d_descriptor D, class Scope>
class matmul2d_base {
  static_assert(D.m > 0 && D.n > 0, "matmul2d_descriptor: m and n must be positive");

 public:
  static constexpr int kThreads = Scope::simdgroups * 32;
  static constexpr matmul2d_descriptor descriptor = D;
  using scope = Scope;

  template <class Left, class Right, class ElementType>
  using destination_t = metal::cooperative_tensor<ElementType, D.m, D.n, kThreads>;

  template <class Left, class Right, class ElementType>
  LILY_MSL_FN destination_t<Left, Right, ElementType> get_destination_cooperative_tensor() const {
    return destination_t<Left, Right, ElementType>();
  }
};

// Destination element (row, col) of left * right: sum over k = 0 .. K-1 in order of
// left(row, k) * right(k, col), stored m x k / k x n or transposed as the descriptor says
// (operands read 0 outside their extents: Left::at). Acc int: int8 operands, exact in int32.
template <matmul2d_descriptor D, class Acc, class Left, class Right>
LILY_MSL_FN Acc matmul2d_element(const Left& l, const Right& r, int K, long row, long col) {
  Acc s = Acc(0);
  for (long k = 0; k < K; ++k) {
    if constexpr (lily_msl::is_same_v<Acc, int>) {
      s += (D.transpose_left ? l.at_int(row, k) : l.at_int(k, row)) *
           (D.transpose_right ? r.at_int(k, col) : r.at_int(col, k));
    } else {
      const float a = D.transpose_left ? l.at(row, k) : l.at(k, row);
      const float b = D.transpose_right ? r.at(k, col) : r.at(col, k);
      s = lily_msl::fadd_rn(s, lily_msl::fmul_rn(a, b));
    }
  }
  return s;
}

// Stores a thread's i-th element (f = row * n + col) with sum s: rounded to half first under
// relaxed_precision, added to the destination (fp32; int32 for int8) under multiply_accumulate,
// rounded to the destination's type. A cooperative destination keeps it in slot index_of(i); a
// tensor one at (col, row) when inside its extents.
template <matmul2d_descriptor D, class Dest, class Acc>
LILY_MSL_FN void matmul2d_store(Dest& dest, int i, int f, Acc s) {
  using DE = lily_msl::remove_cv_t<typename Dest::element_type>;
  constexpr bool kInt = lily_msl::is_same_v<Acc, int>;
  if constexpr (!kInt) {
    if (D.relaxed_precision) s = float(metal::half(s));
  }
  constexpr bool kAcc = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
  if constexpr (is_coop<Dest>::value) {
    DE& d = dest[Dest::index_of(i)];
    if constexpr (kInt) d = kAcc ? d + s : s;
    else d = DE(kAcc ? lily_msl::fadd_rn(float(d), s) : s);
  } else {
    const long col = f % D.n, row = f / D.n;
    if (col >= long(dest.get_extent(0)) || row >= long(dest.get_extent(1))) return;
    auto& d = dest.data()[row * long(dest.get_extent(0)) + col];
    if constexpr (kInt) d = kAcc ? d + s : s;
    else d = DE(kAcc ? lily_msl::fadd_rn(float(d), s) : s);
  }
}

}  // namespace mpp::tensor_ops::detail
