// Declarations-only stand-in for Apple's <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
// (macOS 26): mpp::tensor_ops::matmul2d, for the MSL semantic check (see
// tools/msl_check/include/metal_stdlib). Operand and destination types: the rows of Apple's table
// that the M5 kernels use (docs/tensor-ops.md, "Types"): half x half -> float or half, and
// int8_t / uint8_t x int8_t / uint8_t -> int32_t; run() with any other combination fails here.
//
// Deviation: Apple declares `template <matmul2d_descriptor Descriptor, class Scope> struct
// matmul2d`, a class-type template parameter, which clang's C++ for OpenCL 2021 (C++17) rejects.
// Here the descriptor converts (constexpr) to an integer that packs m, n, k and the flags, and
// matmul2d takes that integer: `matmul2d<desc, execution_simdgroup>` with a constexpr descriptor
// compiles the same way, and a descriptor that is not a constant expression fails as in Metal.
#pragma once
#include <metal_tensor>

namespace mpp {
namespace tensor_ops {

typedef unsigned long lily_msl_descriptor_bits;

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = static_cast<int>(metal::dynamic_extent),
                                bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
  constexpr operator lily_msl_descriptor_bits() const {
    return (lily_msl_descriptor_bits(m & 0xFFFF)) | (lily_msl_descriptor_bits(n & 0xFFFF) << 16) |
           (lily_msl_descriptor_bits(k & 0xFFFF) << 32) | (lily_msl_descriptor_bits(transpose_left) << 48) |
           (lily_msl_descriptor_bits(transpose_right) << 49) | (lily_msl_descriptor_bits(relaxed_precision) << 50) |
           (lily_msl_descriptor_bits(matmul_mode == mode::multiply_accumulate) << 51);
  }
};

// Apple's table rows the kernels use: (left, right) element types -> the allowed destinations.
template <class L, class R, class D> struct lily_msl_matmul_types { static constant constexpr bool value = false; };
template <> struct lily_msl_matmul_types<half, half, float> { static constant constexpr bool value = true; };
template <> struct lily_msl_matmul_types<half, half, half> { static constant constexpr bool value = true; };
template <> struct lily_msl_matmul_types<int8_t, int8_t, int32_t> { static constant constexpr bool value = true; };
template <> struct lily_msl_matmul_types<int8_t, uint8_t, int32_t> { static constant constexpr bool value = true; };
template <> struct lily_msl_matmul_types<uint8_t, int8_t, int32_t> { static constant constexpr bool value = true; };
template <> struct lily_msl_matmul_types<uint8_t, uint8_t, int32_t> { static constant constexpr bool value = true; };

// The element type of a tensor operand without its address space (decltype(t) of a local tensor t
// is `thread tensor<...>`).
template <class T> struct lily_msl_element;
template <class T> struct lily_msl_element<__private T> : lily_msl_element<T> {};
template <class T> struct lily_msl_element<__private const T> : lily_msl_element<T> {};
template <class T> struct lily_msl_element<const T> : lily_msl_element<T> {};
template <class E, class X, class D> struct lily_msl_element<metal::tensor<__global E, X, D>> { typedef E type; };
template <class E, class X, class D> struct lily_msl_element<metal::tensor<__global const E, X, D>> { typedef E type; };
template <class E, class X, class D> struct lily_msl_element<metal::tensor<__local E, X, D>> { typedef E type; };
template <class E, class X, class D> struct lily_msl_element<metal::tensor<__local const E, X, D>> { typedef E type; };
template <class E, int M, int N, int T> struct lily_msl_element<metal::cooperative_tensor<E, M, N, T>> { typedef E type; };

// A cooperative destination must be one of this op's m x n (the header: its layout depends on the op).
template <class T, int M, int N> struct lily_msl_fits { static constant constexpr bool value = true; };
template <class T, int M, int N> struct lily_msl_fits<__private T, M, N> : lily_msl_fits<T, M, N> {};
template <class E, int M, int N, int T, int M2, int N2>
struct lily_msl_fits<metal::cooperative_tensor<E, M, N, T>, M2, N2> { static constant constexpr bool value = M == M2 && N == N2; };

template <lily_msl_descriptor_bits D, class Scope>
class matmul2d {
  static constant constexpr int M = int(D & 0xFFFF), N = int((D >> 16) & 0xFFFF);
  static_assert(M > 0 && N > 0, "matmul2d_descriptor: m and n must be positive");

 public:
  // Any element type: the header's example takes a float bias tensor of the op's layout; run()
  // checks the types of the destination it is given.
  template <class Left, class Right, class ElementType>
  metal::cooperative_tensor<ElementType, M, N, 0> get_destination_cooperative_tensor() const;
  template <class Left, class Right, class Dest>
  void run(thread Left& left, thread Right& right, thread Dest& dest) const {
    static_assert(lily_msl_matmul_types<typename lily_msl_element<Left>::type, typename lily_msl_element<Right>::type,
                                        typename lily_msl_element<Dest>::type>::value,
                  "matmul2d: operand / destination element types not in the table");
    static_assert(lily_msl_fits<Dest, M, N>::value, "matmul2d: a cooperative destination of another op's shape");
    (void)left, (void)right, (void)dest;
  }
};

}  // namespace tensor_ops
}  // namespace mpp
