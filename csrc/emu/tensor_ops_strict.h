// Metal 4 tensors and MetalPerformancePrimitives' matmul2d for the strict pass: declarations only,
// the same names and signatures as csrc/emu/tensor_ops_emu.h, with `device` / `threadgroup` as
// address spaces carried by the tensor's element type (tensor<threadgroup half, ...> takes a
// threadgroup pointer only, as in Apple's compiler). Included by shaders/common/tensor_ops.h
// under LILY_STRICT. A class-type template parameter (matmul2d<descriptor, scope>, as Apple's
// header declares it) needs the pass to compile the M5 shaders as C++20
// (.ci/checks/strict_shaders.sh); their sources keep to what Metal 4 (C++17 based) accepts.
#pragma once

#include "msl/matmul2d_descriptor.h"

namespace metal {

constexpr size_t dynamic_extent = static_cast<size_t>(-1);

template <class IndexType, size_t Rank>
struct dextents {
  static_assert(Rank == 2, "the M5 kernels use rank-2 tensors");
  using index_type = IndexType;
  dextents(IndexType e0, IndexType e1);
  IndexType extent(size_t r) const;
};

struct tensor_inline {};

template <class ElementType, class Extents, class DescriptorType = tensor_inline>
class tensor {
 public:
  using element_type = ElementType;
  using index_type = typename Extents::index_type;
  tensor(ElementType* data, Extents ext);
  ElementType* data() const;
  index_type get_extent(size_t r) const;
};

template <int N>
struct execution_simdgroups {};
struct execution_simdgroup {};

template <class T, int Rank>
struct tensor_index {
  T operator[](int r) const;
};

template <class ElementType, int M, int N, int Threads>
class cooperative_tensor {
 public:
  using element_type = ElementType;
  uint16_t get_capacity() const;
  bool is_valid_element(uint16_t i) const;
  tensor_index<int, 2> get_multidimensional_index(uint16_t i) const;
  thread ElementType& operator[](uint16_t i);
};

}  // namespace metal

namespace mpp {
namespace tensor_ops {

template <matmul2d_descriptor D, class Scope>
class matmul2d {
 public:
  template <class Left, class Right, class ElementType>
  metal::cooperative_tensor<ElementType, D.m, D.n, 0> get_destination_cooperative_tensor() const;
  template <class Left, class Right, class Dest>
  void run(thread Left& left, thread Right& right, thread Dest& dest) const;
};

}  // namespace tensor_ops
}  // namespace mpp
