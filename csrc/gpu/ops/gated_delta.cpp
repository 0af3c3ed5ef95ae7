#include "gpu/ops/gated_delta.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "gpu/ops/qmm.h"

namespace lily::gpu::ops {

namespace {

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// The byte range [offset, offset + bytes) of a binding that must hold at least `bytes`.
Binding need(const char* fn, const Binding& b, uint64_t bytes, const char* what) {
  if (b.buffer == nullptr) throw std::invalid_argument(std::string(fn) + ": " + what + " not bound");
  if (b.bytes < bytes)
    throw std::invalid_argument(std::string(fn) + ": " + what + " range has " + std::to_string(b.bytes) +
                                " bytes, needs " + std::to_string(bytes));
  Binding r = b;
  r.bytes = bytes;
  return r;
}

// Bytes of `rows` rows of `width` elements `stride` apart.
uint64_t rows_bytes(uint32_t rows, uint32_t stride, uint32_t width, DType t) {
  return ((uint64_t(rows) - 1) * stride + width) * dtype_size(t);
}

bool overlap(const Binding& a, const Binding& b) {
  return a.buffer == b.buffer && a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}

}  // namespace

KernelId conv1d_kernel(DType x, DType w) {
  const bool xb = x == DType::bf16, wb = w == DType::bf16;
  return xb ? (wb ? KernelId::conv1d_xbf16_wbf16 : KernelId::conv1d_xbf16_wf32)
            : (wb ? KernelId::conv1d_xf32_wbf16 : KernelId::conv1d_xf32_wf32);
}

KernelId gated_delta_kernel(DType x, DType w) {
  const bool xb = x == DType::bf16, wb = w == DType::bf16;
  return xb ? (wb ? KernelId::gated_delta_xbf16_wbf16 : KernelId::gated_delta_xbf16_wf32)
            : (wb ? KernelId::gated_delta_xf32_wbf16 : KernelId::gated_delta_xf32_wf32);
}

uint32_t gated_delta_threads(uint32_t Dv) { return ceil_div(Dv, kGdColsPerSimd) * 32; }

void encode_conv1d(Encoder& enc, const Conv1dOperands& op) {
  const char* fn = "conv1d";
  auto fail = [&](const std::string& m) { throw std::invalid_argument(std::string(fn) + ": " + m); };
  if (op.T == 0 || op.C == 0) fail("empty shape");
  if (op.K < 2 || op.K > kConvMaxKernel) fail("kernel size K=" + std::to_string(op.K) + " outside [2, 8]");
  const uint32_t xs = op.x_stride ? op.x_stride : op.C, ys = op.y_stride ? op.y_stride : op.C;
  if (xs < op.C || ys < op.C) fail("row strides must be >= C");
  const uint64_t st = uint64_t(op.K - 1) * op.C * dtype_size(op.x_dtype);
  Conv1dArgs args{op.T, op.C, op.K, xs, ys};
  enc.set_kernel(conv1d_kernel(op.x_dtype, op.w_dtype));
  enc.set_args(args);
  const Binding x = need(fn, op.x, rows_bytes(op.T, xs, op.C, op.x_dtype), "x");
  const Binding sin = need(fn, op.state_in, st, "state_in");
  const Binding sout = need(fn, op.state_out, st, "state_out");
  if (op.T > 1 && overlap(sin, sout))
    fail("state_out must not overlap state_in when T > 1 (threads of different tokens read and write it)");
  enc.set_buffer(1, x);
  enc.set_buffer(2, need(fn, op.weight, uint64_t(op.C) * op.K * dtype_size(op.w_dtype), "weight"));
  enc.set_buffer(3, sin);
  enc.set_buffer(4, need(fn, op.y, rows_bytes(op.T, ys, op.C, op.x_dtype), "y"));
  enc.set_buffer(5, sout);
  enc.dispatch({ceil_div(op.C, kConvThreads), op.T, 1}, {kConvThreads, 1, 1});
}

void encode_gated_delta(Encoder& enc, const GatedDeltaOperands& op) {
  const char* fn = "gated_delta";
  auto fail = [&](const std::string& m) { throw std::invalid_argument(std::string(fn) + ": " + m); };
  if (op.T == 0 || op.Hk == 0 || op.Hv == 0 || op.Dk == 0 || op.Dv == 0) fail("empty shape");
  if (op.Hv % op.Hk) fail("value heads Hv=" + std::to_string(op.Hv) + " must be a multiple of key heads Hk=" + std::to_string(op.Hk));
  if (op.Dk > kGdMaxDk) fail("key head dim Dk=" + std::to_string(op.Dk) + " > " + std::to_string(kGdMaxDk));
  if (op.Dv > kGdMaxDv) fail("value head dim Dv=" + std::to_string(op.Dv) + " > " + std::to_string(kGdMaxDv));
  if (!(op.eps > 0.0f)) fail("eps must be > 0");
  const uint32_t C = 2 * op.Hk * op.Dk + op.Hv * op.Dv, VD = op.Hv * op.Dv;
  const uint32_t qs = op.qkv_stride ? op.qkv_stride : C, zs = op.z_stride ? op.z_stride : VD;
  const uint32_t abs_ = op.ab_stride ? op.ab_stride : op.Hv;
  if (qs < C || zs < VD || abs_ < op.Hv) fail("row strides smaller than the rows");
  const float q_scale = static_cast<float>(1.0 / std::sqrt(double(op.Dk)));
  GatedDeltaArgs args{op.T, op.Hk, op.Hv, op.Dk, op.Dv, qs, zs, abs_, q_scale, op.eps};
  enc.set_kernel(gated_delta_kernel(op.x_dtype, op.w_dtype));
  enc.set_args(args);
  const DType xt = op.x_dtype, wt = op.w_dtype;
  enc.set_buffer(1, need(fn, op.qkv, rows_bytes(op.T, qs, C, xt), "qkv"));
  enc.set_buffer(2, need(fn, op.z, rows_bytes(op.T, zs, VD, xt), "z"));
  enc.set_buffer(3, need(fn, op.a, rows_bytes(op.T, abs_, op.Hv, xt), "a"));
  enc.set_buffer(4, need(fn, op.b, rows_bytes(op.T, abs_, op.Hv, xt), "b"));
  enc.set_buffer(5, need(fn, op.A_log, uint64_t(op.Hv) * 4, "A_log"));
  enc.set_buffer(6, need(fn, op.dt_bias, uint64_t(op.Hv) * dtype_size(wt), "dt_bias"));
  enc.set_buffer(7, need(fn, op.norm_weight, uint64_t(op.Dv) * dtype_size(wt), "norm_weight"));
  enc.set_buffer(8, need(fn, op.state, uint64_t(op.Hv) * op.Dv * op.Dk * 4, "state"));
  enc.set_buffer(9, need(fn, op.y, uint64_t(op.T) * VD * dtype_size(xt), "y"));
  enc.dispatch({op.Hv, 1, 1}, {gated_delta_threads(op.Dv), 1, 1});
}

uint32_t gated_delta_mixer_proj_rows(uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv) {
  return 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv;  // qkv (C) | z (Hv Dv) | b (Hv) | a (Hv)
}

void encode_gated_delta_mixer(Encoder& enc, const GatedDeltaMixerOperands& op) {
  const uint32_t C = 2 * op.Hk * op.Dk + op.Hv * op.Dv, VD = op.Hv * op.Dv;
  const uint32_t P = gated_delta_mixer_proj_rows(op.Hk, op.Hv, op.Dk, op.Dv);
  const size_t xe = dtype_size(op.x_dtype);
  auto at = [&](const Binding& b, uint32_t col) {  // binding of proj starting at column `col`
    return Binding{b.buffer, b.offset + size_t(col) * xe, b.bytes - size_t(col) * xe};
  };

  QmmOperands in;
  in.x = op.x;
  in.w = op.in_proj.w;
  in.scales = op.in_proj.scales;
  in.biases = op.in_proj.biases;
  in.y = op.proj;
  in.x_dtype = op.x_dtype;
  in.scale_dtype = op.in_proj.scale_dtype;
  in.M = op.T;
  in.N = P;
  in.K = op.hidden;
  in.bits = op.in_proj.bits;
  in.group_size = op.in_proj.group_size;
  in.norm_weight = op.in_norm;
  in.eps = op.in_norm_eps;
  validate(in);
  encode_quantized_matmul(enc, in);
  enc.barrier();  // proj written -> read by conv1d (qkv columns) and gated_delta (z, b, a columns)

  Conv1dOperands cv;
  cv.x = op.proj;
  cv.weight = op.conv_weight;
  cv.state_in = op.conv_state_in;
  cv.state_out = op.conv_state_out;
  cv.y = op.conv_out;
  cv.x_dtype = op.x_dtype;
  cv.w_dtype = op.w_dtype;
  cv.T = op.T;
  cv.C = C;
  cv.K = op.K;
  cv.x_stride = P;
  encode_conv1d(enc, cv);
  enc.barrier();  // conv_out written -> read by gated_delta

  GatedDeltaOperands gd;
  gd.qkv = op.conv_out;
  gd.z = at(op.proj, C);
  gd.b = at(op.proj, C + VD);
  gd.a = at(op.proj, C + VD + op.Hv);
  gd.A_log = op.A_log;
  gd.dt_bias = op.dt_bias;
  gd.norm_weight = op.norm_weight;
  gd.state = op.state;
  gd.y = op.o;
  gd.x_dtype = op.x_dtype;
  gd.w_dtype = op.w_dtype;
  gd.T = op.T;
  gd.Hk = op.Hk;
  gd.Hv = op.Hv;
  gd.Dk = op.Dk;
  gd.Dv = op.Dv;
  gd.z_stride = P;
  gd.ab_stride = P;
  gd.eps = op.eps;
  encode_gated_delta(enc, gd);
  enc.barrier();  // o written -> read by out_proj

  QmmOperands out;
  out.x = op.o;
  out.w = op.out_proj.w;
  out.scales = op.out_proj.scales;
  out.biases = op.out_proj.biases;
  out.y = op.out;
  out.x_dtype = op.x_dtype;
  out.scale_dtype = op.out_proj.scale_dtype;
  out.M = op.T;
  out.N = op.hidden;
  out.K = VD;
  out.bits = op.out_proj.bits;
  out.group_size = op.out_proj.group_size;
  validate(out);
  encode_quantized_matmul(enc, out);
}

}  // namespace lily::gpu::ops
