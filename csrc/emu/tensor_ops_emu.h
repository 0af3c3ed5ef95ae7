// Metal 4 tensors and MetalPerformancePrimitives' matmul2d, emulated: the subset the M5 kernels use
// (shaders/common/tensor_ops.h includes this in the emulator; csrc/emu/tensor_ops_strict.h has
// the same declarations for the strict pass). Included by csrc/emu/metal_emu.h before its
// address-space macros. Sources for the API and its semantics: docs/tensor-ops.md, "Metal 4 tensor
// ops (M5)". The tensor types and matmul2d's element loop are csrc/msl/msl_values.h (shared with the
// cuda device); this file adds the emulator's matmul2d: its scope checks and rendezvous.
//
//   metal::dextents<I, 2>(e0, e1)       extents, e0 the innermost (contiguous) dimension
//   metal::tensor_inline                a tensor over a pointer it does not own
//   metal::tensor<E, dextents<I,2>, tensor_inline>(ptr, extents)   packed: element (i0, i1) at
//                                       ptr[i1 * e0 + i0]; E may be a device or threadgroup type
//   metal::execution_simdgroups<N>, metal::execution_simdgroup      execution scopes
//   metal::cooperative_tensor<...>      get_capacity, is_valid_element, get_multidimensional_index,
//                                       operator[] (the destination of a matmul2d, kept per thread)
//   mpp::tensor_ops::matmul2d_descriptor(m, n, k, transpose_left, transpose_right,
//                                        relaxed_precision, mode)
//   mpp::tensor_ops::matmul2d<Descriptor, Scope>::run(left, right, destination)
//   ::get_destination_cooperative_tensor<Left, Right, ElementType>()
//
// Semantics (Apple's MPPTensorOpsMatMul2d.h): destination[m x n] = left[m x k] * right[k x n]
// (mode::multiply) or += (mode::multiply_accumulate). Left is stored m x k (extents (k, m)) or,
// with transpose_left, k x m (extents (m, k)); right is stored k x n (extents (n, k)) or, with
// transpose_right, n x k (extents (k, n)). Operand elements outside their tensor's extents read
// as 0 and destination elements outside its extents are not written (the header's edge checking).
// Types: the header's rows (half, half) -> float or half, and (int8_t or uint8_t, int8_t or uint8_t)
// -> int32_t (the int8 rows with an integer destination; exact: 8-bit products summed in 32 bits).
// Precision (the emulator's choice, stated; the element loop is csrc/msl/msl_values.h's, which the
// cuda device runs too): each output is sum_k float(a) * float(b) in fp32,
// k = 0.. in order (half x half products are exact in fp32), then added to the destination in
// fp32 and rounded to its type. relaxed_precision = true (documented only as "allow the
// implementation to sacrifice accuracy for performance") is modelled as that sum rounded to half
// before it is added.
// Execution scope: all threads of the scope must call run at the same call site ("execution scope
// uniform"); execution_simdgroups<N> needs exactly N simdgroups in the threadgroup (documented:
// undefined behaviour otherwise). Both are checked: a threadgroup-wide collective
// (execution_simdgroups<N>) or a simd collective (execution_simdgroup). Each thread computes its
// own destination elements from the operands both before and after that rendezvous and fails
// when they differ: an operand written by another thread without a threadgroup_barrier between
// the write and the run (before or after it) is reported instead of being hidden by the
// rendezvous.
// Cooperative destination layout (implementation defined on the GPU): element e = row * n + col
// of the m x n tile is held by thread (e % T) of the scope in its slot s = e / T (T = threads of
// the scope); get_multidimensional_index(i) = {col, row}. Slot s is element index s for float and
// half destinations and index capacity - 1 - s for integer ones: Apple documents index pairing
// only between destinations of one op with one element type, so a kernel that pairs an int32
// destination with a float one by index reads the wrong elements here. A fresh cooperative tensor is poisoned
// (NaN) until written, like uninitialised simdgroup matrices.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "emu/runtime.h"
#include "msl/msl_values.h"  // matmul2d_descriptor and its element loop (after metal_emu.h's half)

namespace mpp::tensor_ops {

namespace detail {
template <class T>
inline constexpr bool is_half = std::is_same_v<std::remove_cv_t<T>, metal::half>;
template <class T>
inline constexpr bool is_int8 = std::is_same_v<std::remove_cv_t<T>, int8_t> || std::is_same_v<std::remove_cv_t<T>, uint8_t>;
template <class T>
struct coop_shape;
template <class E, int M, int N, int Th>
struct coop_shape<metal::cooperative_tensor<E, M, N, Th>> {
  static constexpr int m = M, n = N, threads = Th;
};
}  // namespace detail

template <matmul2d_descriptor D, class Scope>
class matmul2d : public detail::matmul2d_base<D, Scope> {
  static constexpr int kThreads = detail::matmul2d_base<D, Scope>::kThreads;
  static_assert(::lily::emu::kSimdWidth == 32, "matmul2d_base counts 32 threads per simdgroup");

 public:
  template <class Left, class Right, class Dest>
  void run(Left& left, Right& right, Dest& dest, const char* file = __builtin_FILE(),
           int line = __builtin_LINE()) const {
    using LE = typename Left::element_type;
    using RE = typename Right::element_type;
    using DE = std::remove_cv_t<typename Dest::element_type>;
    constexpr bool kInt = detail::is_int8<LE> && detail::is_int8<RE>;
    static_assert((detail::is_half<LE> && detail::is_half<RE>) || kInt,
                  "matmul2d (emulated): left and right must both be half, or both int8_t / uint8_t tensors");
    static_assert(kInt ? std::is_same_v<DE, int32_t> : (std::is_same_v<DE, float> || std::is_same_v<DE, metal::half>),
                  "matmul2d (emulated): the destination must be float or half (half operands), int32_t (int8 operands)");
    static_assert(!kInt || !D.relaxed_precision, "matmul2d (emulated): relaxed_precision is for half operands");
    check_scope(file, line);
    const int K = inner(left, right, file, line);
    const uint32_t me = ::lily::emu::thread_index_in_group() % uint32_t(kThreads);
    if constexpr (detail::is_coop<Dest>::value) {
      static_assert(detail::coop_shape<Dest>::m == D.m && detail::coop_shape<Dest>::n == D.n &&
                        detail::coop_shape<Dest>::threads == kThreads,
                    "matmul2d::run (emulated): a cooperative destination must come from an op with this "
                    "descriptor's m x n and scope (its layout depends on the op: Apple's header)");
      if (uint32_t(dest.owner()) != me)
        ::lily::emu::kernel_fail("matmul2d::run: a cooperative tensor used by a thread that did not create it", file, line);
    }
    // Each thread's elements: before the rendezvous ...
    constexpr int kMine = (D.m * D.n + kThreads - 1) / kThreads;
    using Acc = std::conditional_t<kInt, int32_t, float>;
    Acc before[kMine], after[kMine];
    compute<Acc>(left, right, K, me, before);
    rendezvous(file, line);
    // ... and after it: an operand that changed in between was written without a barrier.
    compute<Acc>(left, right, K, me, after);
    if (std::memcmp(before, after, sizeof before) != 0)
      ::lily::emu::kernel_fail(
          "matmul2d::run: an operand changed while the threads of the execution scope entered run "
          "(another thread wrote it without a threadgroup_barrier between the write and the run)", file, line);
    for (int i = 0; i < kMine; ++i) {
      const int f = i * kThreads + int(me);
      if (f >= D.m * D.n) break;
      detail::matmul2d_store<D>(dest, i, f, after[i]);
    }
  }

 private:
  static void check_scope(const char* file, int line) {
    if constexpr (!std::is_same_v<Scope, metal::execution_simdgroup>) {
      const uint32_t have = ::lily::emu::threads_in_group();
      if (have != uint32_t(kThreads))
        ::lily::emu::kernel_fail("matmul2d::run: execution_simdgroups<" + std::to_string(Scope::simdgroups) +
                                     "> needs exactly " + std::to_string(kThreads) +
                                     " threads in the threadgroup, the dispatch has " + std::to_string(have),
                                 file, line);
    } else if (::lily::emu::lane_view().simd_width != ::lily::emu::kSimdWidth) {
      ::lily::emu::kernel_fail("matmul2d::run: execution_simdgroup needs a full simdgroup", file, line);
    }
  }
  static void rendezvous(const char* file, int line) {
    if constexpr (std::is_same_v<Scope, metal::execution_simdgroup>)
      ::lily::emu::simd_sync("matmul2d::run", file, line);
    else
      ::lily::emu::threadgroup_collective("matmul2d::run", file, line);
  }
  // K of the product: the descriptor's, or (k < 0: dynamic) the left operand's.
  template <class Left, class Right>
  static int inner(const Left& l, const Right& r, const char* file, int line) {
    const int lk = int(D.transpose_left ? l.get_extent(1) : l.get_extent(0));
    const int rk = int(D.transpose_right ? r.get_extent(0) : r.get_extent(1));
    if (D.k < 0 && lk != rk)
      ::lily::emu::kernel_fail("matmul2d::run: dynamic k, but the operands' k extents differ (" + std::to_string(lk) +
                                   " vs " + std::to_string(rk) + ")", file, line);
    return D.k < 0 ? lk : D.k;
  }
  template <class Acc, class Left, class Right>
  static void compute(const Left& l, const Right& r, int K, uint32_t me, Acc* out) {
    constexpr int kMine = (D.m * D.n + kThreads - 1) / kThreads;
    for (int i = 0; i < kMine; ++i) {
      const int f = i * kThreads + int(me);
      if (f >= D.m * D.n) {
        out[i] = Acc(0);
        continue;
      }
      out[i] = detail::matmul2d_element<D, Acc>(l, r, K, f / D.n, f % D.n);
    }
  }
};

}  // namespace mpp::tensor_ops
