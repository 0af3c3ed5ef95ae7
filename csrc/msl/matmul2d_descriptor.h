// mpp::tensor_ops::matmul2d_descriptor, as Apple's MetalPerformancePrimitives declares it: the one
// definition the emulator (csrc/emu/tensor_ops_emu.h), the strict pass (csrc/emu/tensor_ops_strict.h)
// and the cuda device (csrc/cuda/metal_cuda.h) compile. A literal class type: matmul2d takes
// it as a template parameter (C++20). k = -1 is Apple's dynamic_extent: k from the operands.
#pragma once

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = -1, bool transpose_left_ = false,
                                bool transpose_right_ = false, bool relaxed_precision_ = false,
                                mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
};

}  // namespace tensor_ops
}  // namespace mpp
