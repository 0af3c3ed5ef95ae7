// Elementwise activations. Host: csrc/gpu/ops/elementwise.cpp.
// Reference: lily_py.reference.kernels.swiglu / sigmoid_mul.
//
//   grid:      (ceil(cols / kElementwiseThreads), rows) threadgroups of kElementwiseThreads
//   thread:    one element (r = group_pos.y, c = group_pos.x * threads + thread_pos.x)
//   precision: inputs widened to fp32, exp in fp32 (not fast-math), y rounded to T once.
//   swiglu:      y = silu(a) * b = a / (1 + exp(-a)) * b        (MoE / shared-expert MLP)
//   sigmoid_mul: y = a * 1 / (1 + exp(-b)), b per element or one per row (b_col_step = 0):
//                the attention output gate and the shared-expert gate.
#include "common/lily_metal.h"

namespace lily {

inline float sigmoid(float v) { return 1.0f / (1.0f + exp(-v)); }

template <typename T>
[[kernel]] void swiglu(constant ElementwiseArgs& args [[buffer(0)]],
                       const device T* a [[buffer(1)]],
                       const device T* b [[buffer(2)]],
                       device T* y [[buffer(3)]],
                       LILY_KERNEL_TAIL) {
  const uint32_t r = group_pos.y;
  const uint32_t c = group_pos.x * kElementwiseThreads + thread_pos.x;
  if (c < args.cols) {
    const float g = float(a[r * args.a_stride + c]);
    y[r * args.y_stride + c] = T(g * sigmoid(g) * float(b[r * args.b_stride + c]));
  }
}

template <typename T>
[[kernel]] void sigmoid_mul(constant ElementwiseArgs& args [[buffer(0)]],
                            const device T* a [[buffer(1)]],
                            const device T* b [[buffer(2)]],
                            device T* y [[buffer(3)]],
                            LILY_KERNEL_TAIL) {
  const uint32_t r = group_pos.y;
  const uint32_t c = group_pos.x * kElementwiseThreads + thread_pos.x;
  if (c < args.cols) {
    const float gate = sigmoid(float(b[r * args.b_stride + c * args.b_col_step]));
    y[r * args.y_stride + c] = T(float(a[r * args.a_stride + c]) * gate);
  }
}

LILY_INSTANTIATE("swiglu_f32", swiglu<float>)
LILY_INSTANTIATE("swiglu_bf16", swiglu<bfloat>)
LILY_INSTANTIATE("sigmoid_mul_f32", sigmoid_mul<float>)
LILY_INSTANTIATE("sigmoid_mul_bf16", sigmoid_mul<bfloat>)

}  // namespace lily
