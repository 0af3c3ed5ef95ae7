// lily_py._core.ops: the Gated DeltaNet kernels over NumPy arrays (wrapped by
// lily_py._ops_gated_delta). Encoding lives in csrc/gpu/ops/gated_delta.cpp; this file only moves
// arrays in and out of device buffers. Registered from init_ops (ops.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/op_run.h"
#include "bindings/device.h"
#include "emu/emulator.h"
#include "gpu/dtype.h"
#include "gpu/kernel_ids.h"
#include "gpu/ops/gated_delta.h"
#include "gpu/ops/qmm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {


namespace {

using GdRun = OpRun;

size_t elem_bits(gpu::DType t) { return gpu::dtype_size(t) * 8; }

void check(const InArray& a, const char* fn, const char* what, std::vector<size_t> shape, size_t bits) {
  bool ok = a.ndim() == shape.size() && a.dtype().bits == bits;
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = a.shape(i) == shape[i];
  if (ok) return;
  std::string want = "[";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
  std::string got = "[";
  for (size_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
  throw std::invalid_argument(std::string(fn) + ": " + what + " must be " + want + "] of " + std::to_string(bits) +
                              "-bit elements, got " + got + "] of " + std::to_string(a.dtype().bits) + "-bit");
}

// Token counts per dispatch: empty means one dispatch of all T tokens.
std::vector<uint32_t> chunks_of(const std::vector<uint32_t>& chunks, uint32_t T, const char* fn) {
  if (chunks.empty()) return {T};
  uint64_t sum = 0;
  for (uint32_t c : chunks) {
    LILY_REQUIRE(c > 0, std::string(fn) + ": chunk sizes must be > 0");
    sum += c;
  }
  LILY_REQUIRE(sum == T, std::string(fn) + ": chunk sizes sum to " + std::to_string(sum) + ", T is " + std::to_string(T));
  return chunks;
}

gpu::Binding rows_from(const gpu::Binding& b, size_t offset_bytes) {
  return {b.buffer, b.offset + offset_bytes, b.bytes - offset_bytes};
}

}  // namespace

void init_ops_gated_delta(nb::module_& m) {
  m.def("gated_delta_route", [](uint32_t T, uint32_t Dk, uint32_t Dv) {
    return std::string(gpu::ops::gated_delta_route_name(gpu::ops::gated_delta_route(T, Dk, Dv)));
  }, "T"_a, "Dk"_a, "Dv"_a, "The delta rule's route for T tokens: 'scan' or 'chunked'.");
  m.def(
      "conv1d",
      [](InArray x, InArray weight, InArray state, std::vector<uint32_t> chunks, const std::string& x_dtype,
         const std::string& w_dtype, const std::string& device, const std::string& order, uint64_t seed,
         bool fp_traps) {
        const char* fn = "conv1d";
        const gpu::DType xt = gpu::parse_dtype(x_dtype, "conv1d: x"), wt = gpu::parse_dtype(w_dtype, "conv1d: weight");
        LILY_REQUIRE(x.ndim() == 2 && weight.ndim() == 2, "conv1d: x must be [T, C] and weight [C, K]");
        const uint32_t T = uint32_t(x.shape(0)), C = uint32_t(x.shape(1)), K = uint32_t(weight.shape(1));
        check(x, fn, "x", {T, C}, elem_bits(xt));
        check(weight, fn, "weight", {C, K}, elem_bits(wt));
        LILY_REQUIRE(K >= 2, "conv1d: kernel size must be >= 2");
        check(state, fn, "state", {K - 1, C}, elem_bits(xt));
        const std::vector<uint32_t> parts = chunks_of(chunks, T, fn);
        GdRun run(device, order, seed, fp_traps);
        const gpu::Binding xb = run.input(x), wb = run.input(weight);
        const size_t st_bytes = size_t(K - 1) * C * gpu::dtype_size(xt);
        gpu::Binding st[2] = {run.input(state), run.output(st_bytes)};  // ping-pong across chunks
        const gpu::Binding y = run.output(size_t(T) * C * gpu::dtype_size(xt));
        int cur = 0;
        run.run([&](gpu::Encoder& e) {
          uint32_t t0 = 0;
          for (size_t i = 0; i < parts.size(); ++i) {
            if (i) e.barrier();
            gpu::ops::Conv1dOperands op;
            op.x = rows_from(xb, size_t(t0) * C * gpu::dtype_size(xt));
            op.weight = wb;
            op.state_in = st[cur];
            op.state_out = st[1 - cur];
            op.y = rows_from(y, size_t(t0) * C * gpu::dtype_size(xt));
            op.x_dtype = xt;
            op.w_dtype = wt;
            op.T = parts[i];
            op.C = C;
            op.K = K;
            gpu::ops::encode_conv1d(e, op);
            cur = 1 - cur;
            t0 += parts[i];
          }
        });
        for (size_t i = 0; i < parts.size(); ++i) run.note(gpu::ops::conv1d_kernel(xt, wt));
        return nb::make_tuple(run.download(y, xt, {T, C}), run.download(st[cur], xt, {K - 1, C}), run.stats());
      },
      "x"_a, "weight"_a, "state"_a, nb::kw_only(), "chunks"_a = std::vector<uint32_t>{}, "x_dtype"_a, "w_dtype"_a,
      "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "Causal depthwise conv1d + SiLU with state; one dispatch per chunk; returns (y, new_state, stats). "
      "Use lily_py.ops.causal_conv1d.");

  m.def(
      "gated_delta",
      [](InArray qkv, InArray z, InArray a, InArray b, InArray A_log, InArray dt_bias, InArray norm_weight,
         InArray state, uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv, float eps, std::vector<uint32_t> chunks,
         const std::string& route, const std::string& x_dtype, const std::string& w_dtype, const std::string& device,
         const std::string& order, uint64_t seed, bool fp_traps) {
        const char* fn = "gated_delta";
        require(route == "scan" || route == "chunked" || route == "auto",
                "gated_delta: route must be 'scan', 'chunked' or 'auto', got '" + route + "'");
        const gpu::DType xt = gpu::parse_dtype(x_dtype, "gated_delta: activations");
        const gpu::DType wt = gpu::parse_dtype(w_dtype, "gated_delta: dt_bias / norm_weight");
        LILY_REQUIRE(qkv.ndim() == 2, "gated_delta: qkv must be [T, C]");
        const uint32_t T = uint32_t(qkv.shape(0)), C = 2 * Hk * Dk + Hv * Dv;
        check(qkv, fn, "qkv", {T, C}, elem_bits(xt));
        check(z, fn, "z", {T, Hv * Dv}, elem_bits(xt));
        check(a, fn, "a", {T, Hv}, elem_bits(xt));
        check(b, fn, "b", {T, Hv}, elem_bits(xt));
        check(A_log, fn, "A_log", {Hv}, 32);
        check(dt_bias, fn, "dt_bias", {Hv}, elem_bits(wt));
        check(norm_weight, fn, "norm_weight", {Dv}, elem_bits(wt));
        check(state, fn, "state", {Hv, Dv, Dk}, 32);
        const std::vector<uint32_t> parts = chunks_of(chunks, T, fn);
        GdRun run(device, order, seed, fp_traps);
        const gpu::Binding qb = run.input(qkv), zb = run.input(z), ab = run.input(a), bb = run.input(b);
        const gpu::Binding al = run.input(A_log), dt = run.input(dt_bias), nw = run.input(norm_weight);
        const gpu::Binding sb = run.input(state);
        const size_t xe = gpu::dtype_size(xt);
        const gpu::Binding y = run.output(size_t(T) * Hv * Dv * xe);
        auto chunked = [&](uint32_t n) {
          return route == "chunked" || (route == "auto" && gpu::ops::gated_delta_route(n, Dk, Dv) == gpu::ops::GdRoute::chunked);
        };
        uint32_t most = 0;
        for (uint32_t n : parts) most = std::max(most, n);
        const gpu::Binding scratch = run.output(gpu::ops::gated_delta_chunk_scratch_bytes(most, Hk, Hv, Dk, Dv));
        bool m5 = false;  // the device's tensor ops pick gd_chunk_wy_m5
        run.run([&](gpu::Encoder& e) {
          m5 = e.tensor_ops();
          uint32_t t0 = 0;
          for (size_t i = 0; i < parts.size(); ++i) {
            if (i) e.barrier();  // state written by chunk i-1 -> read by chunk i
            gpu::ops::GatedDeltaOperands op;
            op.qkv = rows_from(qb, size_t(t0) * C * xe);
            op.z = rows_from(zb, size_t(t0) * Hv * Dv * xe);
            op.a = rows_from(ab, size_t(t0) * Hv * xe);
            op.b = rows_from(bb, size_t(t0) * Hv * xe);
            op.A_log = al;
            op.dt_bias = dt;
            op.norm_weight = nw;
            op.state = sb;
            op.y = rows_from(y, size_t(t0) * Hv * Dv * xe);
            op.x_dtype = xt;
            op.w_dtype = wt;
            op.T = parts[i];
            op.Hk = Hk;
            op.Hv = Hv;
            op.Dk = Dk;
            op.Dv = Dv;
            op.eps = eps;
            if (chunked(parts[i])) {
              op.chunk_scratch = scratch;
              gpu::ops::encode_gated_delta_chunked(e, op);
            } else {
              gpu::ops::encode_gated_delta(e, op);
            }
            t0 += parts[i];
          }
        });
        for (size_t i = 0; i < parts.size(); ++i) {
          if (chunked(parts[i])) {
            for (gpu::KernelId k : gpu::ops::gd_chunk_kernels(false, m5, xt, wt)) run.note(k);
          } else {
            run.note(gpu::ops::gated_delta_kernel(xt, wt));
          }
        }
        return nb::make_tuple(run.download(y, xt, {T, Hv * Dv}), run.download(sb, gpu::DType::f32, {Hv, Dv, Dk}),
                              run.stats());
      },
      "qkv"_a, "z"_a, "a"_a, "b"_a, "A_log"_a, "dt_bias"_a, "norm_weight"_a, "state"_a, nb::kw_only(), "Hk"_a,
      "Hv"_a, "Dk"_a, "Dv"_a, "eps"_a, "chunks"_a = std::vector<uint32_t>{}, "route"_a = "scan", "x_dtype"_a,
      "w_dtype"_a, "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "Fused gated delta rule + gated RMSNorm; state float32 [Hv, Dv, Dk] (device layout); per chunk of "
      "tokens one scan dispatch, or (route 'chunked', or 'auto' past the engine's switch) the 4 dispatches "
      "of the WY form; returns (y, new_state, stats). Use lily_py.ops.gated_delta.");

  m.def(
      "gated_delta_chunk_flops",
      [](uint32_t T, uint32_t Hv, uint32_t Dk, uint32_t Dv, bool tensor_ops, const std::string& by) {
        const gpu::ops::GdChunkFlops f = gpu::ops::gated_delta_chunk_flops(T, Hv, Dk, Dv, tensor_ops);
        nb::dict d;
        if (by == "unit") {
          d["tensor"] = f.tensor;
          d["alu"] = f.alu;
        } else if (by == "dispatch") {
          d["wy"] = f.wy;
          d["state"] = f.state;
          d["feedback"] = f.feedback;
        } else {
          throw nb::value_error(("gated_delta_chunk_flops: by must be 'unit' or 'dispatch', got '" + by + "'").c_str());
        }
        return d;
      },
      "T"_a, "Hv"_a, "Dk"_a, "Dv"_a, "tensor_ops"_a = false, "by"_a = "unit",
      "FLOPs (2 per multiply-add) the chunked delta rule's products execute over T tokens. by='unit': "
      "{'tensor': on matmul2d (with tensor ops: gd_chunk_wy_m5's Gram products and all of "
      "gd_chunk_state_m5), 'alu': on simdgroup matrices}; by='dispatch': {'wy': gd_chunk_wy*, 'state': "
      "gd_chunk_state*, 'feedback': of the state's, its feedback products (U = u + W S, S += K^T U; the "
      "tail scaling too on the fp32 route)}.");

  m.def(
      "gated_delta_decode",
      [](InArray x, InArray z, InArray a, InArray b, InArray conv_weight, InArray conv_state, InArray A_log,
         InArray dt_bias, InArray norm_weight, InArray state, uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv,
         float eps, const std::string& x_dtype, const std::string& w_dtype, const std::string& device,
         const std::string& order, uint64_t seed, bool fp_traps) {
        const char* fn = "gated_delta_decode";
        gpu::ops::GdDecodeOperands op;
        op.x_dtype = gpu::parse_dtype(x_dtype, "gated_delta_decode: activations");
        op.w_dtype = gpu::parse_dtype(w_dtype, "gated_delta_decode: weights");
        LILY_REQUIRE(conv_weight.ndim() == 2, "gated_delta_decode: conv_weight must be [C, K]");
        const uint32_t C = 2 * Hk * Dk + Hv * Dv, VD = Hv * Dv, K = uint32_t(conv_weight.shape(1));
        LILY_REQUIRE(K >= 2, "gated_delta_decode: conv kernel size must be >= 2");
        const size_t xb = elem_bits(op.x_dtype), wb = elem_bits(op.w_dtype);
        check(x, fn, "x", {C}, xb);
        check(z, fn, "z", {VD}, xb);
        check(a, fn, "a", {Hv}, xb);
        check(b, fn, "b", {Hv}, xb);
        check(conv_weight, fn, "conv_weight", {C, K}, wb);
        check(conv_state, fn, "conv_state", {K - 1, C}, xb);
        check(A_log, fn, "A_log", {Hv}, 32);
        check(dt_bias, fn, "dt_bias", {Hv}, wb);
        check(norm_weight, fn, "norm_weight", {Dv}, wb);
        check(state, fn, "state", {Hv, Dv, Dk}, 32);
        GdRun run(device, order, seed, fp_traps);
        op.x = run.input(x);
        op.z = run.input(z);
        op.a = run.input(a);
        op.b = run.input(b);
        op.conv_weight = run.input(conv_weight);
        op.conv_in = run.input(conv_state);
        op.conv_out = run.output(conv_state.nbytes());
        op.A_log = run.input(A_log);
        op.dt_bias = run.input(dt_bias);
        op.norm_weight = run.input(norm_weight);
        op.state = run.input(state);
        op.o_raw = run.output(size_t(VD) * 4);
        op.y = run.output(size_t(VD) * gpu::dtype_size(op.x_dtype));
        op.Hk = Hk;
        op.Hv = Hv;
        op.Dk = Dk;
        op.Dv = Dv;
        op.K = K;
        op.eps = eps;
        run.run([&](gpu::Encoder& e) { gpu::ops::encode_gated_delta_decode(e, op); });
        run.note(gpu::ops::gated_delta_decode_kernel(op.x_dtype, op.w_dtype));
        run.note(gpu::ops::gd_chunk_kernels(false, false, op.x_dtype, op.w_dtype)[3]);
        return nb::make_tuple(run.download(op.y, op.x_dtype, {VD}),
                              run.download(op.conv_out, op.x_dtype, {K - 1, C}),
                              run.download(op.state, gpu::DType::f32, {Hv, Dv, Dk}), run.stats());
      },
      "x"_a, "z"_a, "a"_a, "b"_a, "conv_weight"_a, "conv_state"_a, "A_log"_a, "dt_bias"_a, "norm_weight"_a,
      "state"_a, nb::kw_only(), "Hk"_a, "Hv"_a, "Dk"_a, "Dv"_a, "eps"_a, "x_dtype"_a, "w_dtype"_a,
      "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "One decode token: conv1d (window conv_state [K-1, C]) fused into the gated delta rule (value "
      "heads split over threadgroups by columns), then the gated RMSNorm (a second dispatch); returns "
      "(y [Hv*Dv], new conv_state, state [Hv, Dv, Dk], stats). Use lily_py.ops.gated_delta_decode.");

  m.def(
      "gated_delta_mixer",
      [](InArray x, InArray in_w, InArray in_s, InArray in_b, InArray out_w, InArray out_s, InArray out_b,
         InArray conv_weight, InArray A_log, InArray dt_bias, InArray norm_weight, InArray conv_state, InArray state,
         uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv, float eps, uint32_t bits, uint32_t group_size,
         const std::string& x_dtype, const std::string& scale_dtype, const std::string& w_dtype,
         const std::string& device, const std::string& order, uint64_t seed, bool fp_traps) {
        const char* fn = "gated_delta_mixer";
        gpu::ops::GatedDeltaMixerOperands op;
        op.x_dtype = gpu::parse_dtype(x_dtype, "gated_delta_mixer: x");
        op.w_dtype = gpu::parse_dtype(w_dtype, "gated_delta_mixer: conv/norm weights");
        const gpu::DType st = gpu::parse_dtype(scale_dtype, "gated_delta_mixer: scales");
        LILY_REQUIRE(x.ndim() == 2 && conv_weight.ndim() == 2, "gated_delta_mixer: x must be [T, hidden], conv_weight [C, K]");
        LILY_REQUIRE(gpu::ops::qmm_width_supported(bits), "gated_delta_mixer: bits must be 2, 3, 4, 5, 6 or 8");
        LILY_REQUIRE(group_size == 32 || group_size == 64 || group_size == 128, "gated_delta_mixer: group_size must be 32, 64 or 128");
        const uint32_t T = uint32_t(x.shape(0)), H = uint32_t(x.shape(1));
        const uint32_t C = 2 * Hk * Dk + Hv * Dv, VD = Hv * Dv, K = uint32_t(conv_weight.shape(1));
        const uint32_t P = gpu::ops::gated_delta_mixer_proj_rows(Hk, Hv, Dk, Dv);
        LILY_REQUIRE(H % group_size == 0 && VD % group_size == 0, "gated_delta_mixer: hidden and Hv*Dv must be multiples of group_size");
        const size_t xb = elem_bits(op.x_dtype), sbits = elem_bits(st);
        check(x, fn, "x", {T, H}, xb);
        check(in_w, fn, "in_proj weight", {P, H * bits / 32}, 32);
        check(in_s, fn, "in_proj scales", {P, H / group_size}, sbits);
        check(in_b, fn, "in_proj biases", {P, H / group_size}, sbits);
        check(out_w, fn, "out_proj weight", {H, VD * bits / 32}, 32);
        check(out_s, fn, "out_proj scales", {H, VD / group_size}, sbits);
        check(out_b, fn, "out_proj biases", {H, VD / group_size}, sbits);
        check(conv_weight, fn, "conv_weight", {C, K}, elem_bits(op.w_dtype));
        LILY_REQUIRE(K >= 2, "gated_delta_mixer: conv kernel size must be >= 2");
        check(A_log, fn, "A_log", {Hv}, 32);
        check(dt_bias, fn, "dt_bias", {Hv}, elem_bits(op.w_dtype));
        check(norm_weight, fn, "norm_weight", {Dv}, elem_bits(op.w_dtype));
        check(conv_state, fn, "conv_state", {K - 1, C}, xb);
        check(state, fn, "state", {Hv, Dv, Dk}, 32);
        GdRun run(device, order, seed, fp_traps);
        op.x = run.input(x);
        op.in_proj = {run.input(in_w), run.input(in_s), run.input(in_b), st, bits, group_size};
        op.out_proj = {run.input(out_w), run.input(out_s), run.input(out_b), st, bits, group_size};
        op.conv_weight = run.input(conv_weight);
        op.A_log = run.input(A_log);
        op.dt_bias = run.input(dt_bias);
        op.norm_weight = run.input(norm_weight);
        op.conv_state_in = run.input(conv_state);
        op.conv_state_out = run.output(conv_state.nbytes());
        op.state = run.input(state);
        const size_t xe = gpu::dtype_size(op.x_dtype);
        op.proj = run.output(size_t(T) * P * xe);
        op.conv_out = run.output(size_t(T) * C * xe);
        op.o = run.output(size_t(T) * VD * xe);
        op.gd_o_raw = run.output(size_t(VD) * 4);
        op.out = run.output(size_t(T) * H * xe);
        // the engine's prefill route: chunked (with the conv fused into its prep) from 64 tokens
        const bool chunked = T > 1 && gpu::ops::gated_delta_route(T, Dk, Dv) == gpu::ops::GdRoute::chunked;
        if (chunked) op.chunk_scratch = run.output(gpu::ops::gated_delta_chunk_scratch_bytes(T, Hk, Hv, Dk, Dv));
        op.T = T;
        op.hidden = H;
        op.Hk = Hk;
        op.Hv = Hv;
        op.Dk = Dk;
        op.Dv = Dv;
        op.K = K;
        op.eps = eps;
        run.run([&](gpu::Encoder& e) { gpu::ops::encode_gated_delta_mixer(e, op); });
        // as encode_quantized_matmul picks it: the bf16 tiles take bf16 x only (qmm_bf16_allowed)
        const auto route = gpu::ops::qmm_route(T, bits, run.enc->tensor_ops(), op.x_dtype == gpu::DType::bf16);
        run.note(gpu::ops::qmm_kernel(route, bits, op.x_dtype, st, false, gpu::ops::qmv1_rows(P, H, bits),
                                      run.enc->tensor_int8()));
        const bool folds = gpu::ops::gated_delta_mixer_folds_norm(op);
        if (T == 1) {
          run.note(gpu::ops::gated_delta_decode_kernel(op.x_dtype, op.w_dtype));
          if (!folds) run.note(gpu::ops::gd_chunk_kernels(false, false, op.x_dtype, op.w_dtype)[3]);
        } else if (chunked) {
          for (gpu::KernelId k : gpu::ops::gd_chunk_kernels(true, run.enc->tensor_ops(), op.x_dtype, op.w_dtype))
            run.note(k);
        } else {
          run.note(gpu::ops::conv1d_kernel(op.x_dtype, op.w_dtype));
          run.note(gpu::ops::gated_delta_kernel(op.x_dtype, op.w_dtype));
        }
        run.note(folds ? gpu::ops::qmv1_gated_kernel(bits, op.x_dtype, st, gpu::ops::qmv1_rows(H, VD, bits))
                       : gpu::ops::qmm_kernel(route, bits, op.x_dtype, st, false, gpu::ops::qmv1_rows(H, VD, bits),
                                              run.enc->tensor_int8()));
        return nb::make_tuple(run.download(op.out, op.x_dtype, {T, H}),
                              run.download(op.conv_state_out, op.x_dtype, {K - 1, C}),
                              run.download(op.state, gpu::DType::f32, {Hv, Dv, Dk}), run.stats());
      },
      "x"_a, "in_w"_a, "in_s"_a, "in_b"_a, "out_w"_a, "out_s"_a, "out_b"_a, "conv_weight"_a, "A_log"_a, "dt_bias"_a,
      "norm_weight"_a, "conv_state"_a, "state"_a, nb::kw_only(), "Hk"_a, "Hv"_a, "Dk"_a, "Dv"_a, "eps"_a, "bits"_a,
      "group_size"_a, "x_dtype"_a, "scale_dtype"_a, "w_dtype"_a, "device"_a = "emu", "order"_a = "shuffle",
      "seed"_a = 0, "fp_traps"_a = true,
      "The Gated DeltaNet token mixer of one layer (in_proj rows qkv|z|b|a fused); returns "
      "(out, conv_state, state [Hv, Dv, Dk], stats). Use lily_py.ops.gated_delta_mixer.");
}

}  // namespace lily::bindings
