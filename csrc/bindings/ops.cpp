// lily_py._core.ops: one function per kernel family over NumPy arrays (what lily_py.ops wraps),
// plus the kernel table. The routing/encoding lives in csrc/gpu/ops/; this file only moves
// arrays in and out of device buffers.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/op_run.h"
#include "bindings/device.h"
#include "emu/emulator.h"
#include "gpu/counting_device.h"
#include "gpu/dtype.h"
#include "gpu/kernel_ids.h"
#include "gpu/ops/elementwise.h"
#include "gpu/ops/embedding.h"
#include "gpu/ops/norm.h"
#include "gpu/ops/qmm.h"
#if defined(LILY_HAVE_METAL)
#include "metal/metal_device.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {

void init_emu(nb::module_& parent);              // emu.cpp
void init_ops_moe(nb::module_& ops);             // ops_moe.cpp
void init_ops_sampling(nb::module_& ops);        // ops_sampling.cpp

namespace {

using Run = OpRun;

size_t elem_bits(gpu::DType t) { return gpu::dtype_size(t) * 8; }

void check_array(const InArray& a, const char* fn, const char* what, size_t ndim, size_t bits) {
  LILY_REQUIRE(a.ndim() == ndim, std::string(fn) + ": " + what + " must be " + std::to_string(ndim) + "-D, got " +
                                std::to_string(a.ndim()) + "-D");
  LILY_REQUIRE(a.dtype().bits == bits, std::string(fn) + ": " + what + " has " + std::to_string(a.dtype().bits) +
                                      "-bit elements, expected " + std::to_string(bits));
}


}  // namespace

void init_ops(nb::module_& parent) {
  init_emu(parent);

  parent.def("kernel_table", [] {
    nb::list out;
    for (const gpu::KernelInfo& k : gpu::kKernelTable) {
      nb::dict d;
      d["name"] = std::string(k.name);
      d["args"] = std::string(k.args);
      d["args_size"] = k.args_size;
      d["num_buffers"] = k.num_buffers;
      d["tensor_ops"] = gpu::kernel_needs_tensor_ops(k.id);
      d["unit"] = gpu::exec_unit_name(gpu::kernel_default_unit(k.id));
      out.append(d);
    }
    return out;
  }, "The host kernel table (csrc/gpu/kernel_ids.h): name, args struct, args_size, num_buffers, "
     "tensor_ops (built into lily_m5.metallib, run only where the device reports tensor ops), unit (what runs "
     "its arithmetic by default: alu, simdgroup_fp32, simdgroup_bf16, tensor; gpu::kernel_default_unit).");

  parent.def(
      "encoder_error",
      [](const std::string& which) -> std::string {
        // One bad encoding on the counting device; returns the EncodeError message ("" if none).
        gpu::CountingDevice dev;
        auto buf = dev.new_buffer(64);
        auto enc = dev.new_encoder();
        const gpu::KernelId k = gpu::KernelId::sample_noise;  // 1 buffer, SampleArgs
        ::lily::SampleArgs args{};
        try {
          if (which == "dispatch_without_kernel") enc->dispatch({1, 1, 1}, {1, 1, 1});
          enc->set_kernel(k);
          if (which == "buffer_before_args") enc->set_buffer(1, *buf);  // allowed: order is free
          if (which != "no_args") enc->set_args(args);
          if (which == "index") enc->set_buffer(2, *buf);
          if (which == "null") enc->set_buffer(1, gpu::Binding{nullptr, 0, 4});
          if (which == "empty") enc->set_buffer(1, gpu::Binding{buf.get(), 0, 0});
          if (which == "range") enc->set_buffer(1, *buf, 32, 64);
          if (which != "unbound") enc->set_buffer(1, *buf);
          enc->dispatch(which == "grid" ? gpu::Size3{0, 1, 1} : gpu::Size3{1, 1, 1},
                        which == "threads" ? gpu::Size3{1025, 1, 1} : gpu::Size3{64, 1, 1});
        } catch (const gpu::EncodeError& e) {
          return e.what();
        }
        return "";
      },
      "which"_a, "Test hook: the EncodeError message of one bad encoding ('' when it encodes).");

#if defined(LILY_HAVE_METAL)
  nb::module_ mm = parent.def_submodule("metal", "The Metal device (macOS builds).");
  mm.def("available", &metal::available, "A Metal GPU that can run the kernels (family apple7 or newer) exists on this machine.");
  mm.def("unavailable_reason", &metal::unavailable_reason, "'' when the kernels can run here; else why not.");
  mm.def("info", [] {
    const gpu::DeviceInfo i = metal::info();
    nb::dict d;
    d["name"] = i.device_name;
    d["family"] = i.gpu_family;
    d["library"] = i.library_path;
    d["library_source"] = i.library_source;
    d["metallib_error"] = i.metallib_error;
    d["metallib_built"] = i.metallib_built;
    d["working_set_bytes"] = i.working_set_bytes;
    d["max_buffer_bytes"] = i.max_buffer_bytes;
    d["build_target"] = i.build_target;
    d["build_sdk"] = i.build_sdk;
    d["math_mode"] = i.math_mode;
    d["tensor_ops"] = i.tensor_ops;
    d["tensor_ops_reason"] = i.tensor_ops_reason;
    return d;
  }, "Any Metal device (also one that cannot run the kernels): name, family, library in use, its "
     "source ('metallib' / 'source'), metallib_error, metallib_built, working set, max buffer length, "
     "build target and SDK, math mode.");
  mm.def("library_functions", &metal::library_functions, "Kernel names in the loaded Metal library.");
  mm.def("pipeline_report", [] {
    nb::list out;
    for (const metal::PipelineReport& r : metal::pipeline_report()) {
      nb::dict d;
      d["kernel"] = r.kernel;
      d["max_threads"] = r.info.max_threads;
      d["static_threadgroup_bytes"] = r.info.static_threadgroup_bytes;
      d["simd_width"] = r.info.simd_width;
      d["error"] = r.error;
      out.append(d);
    }
    return out;
  }, "Every kernel's pipeline on any Metal device (also one that cannot run the kernels): kernel, "
     "max_threads, static_threadgroup_bytes, simd_width, error ('' when created).");
#endif

  nb::module_ m = parent.def_submodule("ops", "Kernels over NumPy arrays (wrapped by lily_py.ops).");

  init_ops_moe(m);

  m.def("qmm_route",
        [](uint32_t M, uint32_t bits, bool tensor_ops, bool bf16_tiles) {
          return std::string(gpu::ops::qmm_route_name(gpu::ops::qmm_route(M, bits, tensor_ops, bf16_tiles)));
        },
        "M"_a, "bits"_a = 4, "tensor_ops"_a = false, "bf16_tiles"_a = true,
        "Route quantized_matmul takes for M rows of x: 'qmv1' (M = 1), 'qmv', 'qmm', 'qmm_bf16' (M >= "
        "QMM_BF16_MIN_ROWS without tensor ops, or 8-bit, where the operands may be rounded to bf16: "
        "bf16_tiles), or 'qmm_m5' (4- or 8-bit, on a device with Metal 4 tensor ops).");
  m.def("qmv1_rows", [](uint32_t N, uint32_t K, uint32_t bits) { return gpu::ops::qmv1_rows(N, K, bits); },
        "N"_a, "K"_a, "bits"_a,
        "Rows per threadgroup of the qmv1 route (M = 1): QMV1_ROWS, 1 where ceil(N / QMV1_ROWS) * splits "
        "simdgroups would fall short of QMV1_MIN_SIMDGROUPS (the *_r1 kernels), or 16 where "
        "ceil(N / QMV1_ROWS) >= QMV1_ONE_SPLIT_GROUPS at 4 and 8 bits (K not split: the *_r16 kernels).");
  m.def("qmv1_gated_supported",
        [](uint32_t N, uint32_t K, uint32_t Dv, uint32_t bits) { return gpu::ops::qmv1_gated_supported(N, K, Dv, bits); },
        "N"_a, "K"_a, "Dv"_a, "bits"_a,
        "Whether qmv1_gated (a DeltaNet out_proj at one token with the gated RMSNorm folded in front) is "
        "built for N outputs, K = Hv * Dv inputs, value head dim Dv at these bits: 4 or 8 bits, Dv a power "
        "of two that is a multiple of a lane's codes (32 at 4 bits, 16 at 8) and at most 32 of them, the "
        "rows rule giving 8 or 1 rows. Where it is (and the operands allow it: group size, 16-byte aligned "
        "bindings, float32 norm weights, one weight block), one decode token's DeltaNet mixer takes 3 "
        "dispatches, not 4.");
  m.attr("QMV1_ROWS") = static_cast<uint32_t>(kQmv1Rows);
  m.attr("QMV1_MIN_SIMDGROUPS") = static_cast<uint32_t>(kQmv1MinSimdgroups);
  m.attr("QMV1_ONE_SPLIT_GROUPS") = static_cast<uint32_t>(kQmv1OneSplitGroups);
  m.def("qmv1_splits", [](uint32_t N, uint32_t K, uint32_t bits) { return gpu::ops::qmv1_splits(N, K, bits); },
        "N"_a, "K"_a, "bits"_a, "Simdgroups per threadgroup of the qmv1 route (they split K).");
  m.attr("QMM_BF16_MIN_ROWS") = static_cast<uint32_t>(kQmmBf16MinRows);
  m.attr("QMV_MAX_ROWS") = static_cast<uint32_t>(kQmvMaxRows);

  m.def(
      "quantized_matmul",
      [](InArray x, InArray w, InArray scales, InArray biases, uint32_t bits, uint32_t group_size,
         const std::string& x_dtype, const std::string& scale_dtype, bool y_f32, const std::string& device,
         const std::string& order, uint64_t seed, bool fp_traps, bool f32_x_bf16_tiles) {
        const gpu::DType xt = gpu::parse_dtype(x_dtype, "quantized_matmul: x");
        const gpu::DType st = gpu::parse_dtype(scale_dtype, "quantized_matmul: scales");
        const char* fn = "quantized_matmul";
        check_array(x, fn, "x", 2, elem_bits(xt));
        check_array(w, fn, "w", 2, 32);
        check_array(scales, fn, "scales", 2, elem_bits(st));
        check_array(biases, fn, "biases", 2, elem_bits(st));
        const uint32_t M = static_cast<uint32_t>(x.shape(0)), K = static_cast<uint32_t>(x.shape(1));
        const uint32_t N = static_cast<uint32_t>(w.shape(0));
        LILY_REQUIRE(gpu::ops::qmm_width_supported(bits),
                     "quantized_matmul: bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
        LILY_REQUIRE(w.shape(1) * 32 == size_t(K) * bits,
                "quantized_matmul: w has " + std::to_string(w.shape(1)) + " words per row, K=" +
                    std::to_string(K) + " at " + std::to_string(bits) + " bits needs " +
                    std::to_string(size_t(K) * bits / 32));
        LILY_REQUIRE(group_size != 0 && K % group_size == 0 && scales.shape(0) == N &&
                    scales.shape(1) == K / group_size && biases.shape(0) == N && biases.shape(1) == K / group_size,
                "quantized_matmul: scales/biases must be [N, K/group_size] = [" + std::to_string(N) + ", " +
                    std::to_string(group_size ? K / group_size : 0) + "]");

        gpu::ops::QmmOperands op;
        op.x_dtype = xt;
        op.scale_dtype = st;
        op.M = M;
        op.N = N;
        op.K = K;
        op.bits = bits;
        op.group_size = group_size;
        op.f32_x_bf16_tiles = f32_x_bf16_tiles;
        Run run(device, order, seed, fp_traps);
        op.x = run.input(x);
        op.w = run.input(w);
        op.scales = run.input(scales);
        op.biases = run.input(biases);
        op.y_f32 = y_f32;
        const gpu::DType yt = y_f32 ? gpu::DType::f32 : xt;
        op.y = run.output(size_t(M) * N * gpu::dtype_size(yt));
        // the int8 activation scratch, as the engine binds it on a tensor_int8 device
        if (run.enc->tensor_int8() && K % kI8StepK == 0) op.x_i8 = run.output(gpu::ops::qmm_i8_scratch_bytes(M, K));
        gpu::ops::validate(op);
        const bool tensor_ops = run.enc->tensor_ops() && gpu::ops::qmm_m5_allowed(op);
        const gpu::ops::QmmRoute route = gpu::ops::qmm_route(M, bits, tensor_ops, gpu::ops::qmm_bf16_allowed(op));
        const bool int8 = gpu::ops::qmm_takes_int8(*run.enc, op, route);
        if (int8) run.note(gpu::KernelId::quantize_i8_xbf16);
        run.encode(gpu::ops::qmm_kernel(route, bits, xt, st, y_f32, gpu::ops::qmv1_rows(N, K, bits), int8),
                   [&](gpu::Encoder& e) { gpu::ops::encode_quantized_matmul(e, op); });
        return nb::make_tuple(run.download(op.y, yt, {M, N}), run.stats());
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(), "bits"_a, "group_size"_a, "x_dtype"_a,
      "scale_dtype"_a, "y_f32"_a = false, "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "f32_x_bf16_tiles"_a = false,
      "y = x @ dequant(w).T on a device; returns (y, stats). bfloat16 arrays travel as uint16 "
      "(x_dtype / scale_dtype say which). Use lily_py.ops.quantized_matmul.");

  m.def(
      "quantize_i8",
      [](InArray x, const std::string& x_dtype, const std::string& device, const std::string& order, uint64_t seed,
         bool fp_traps) {
        const gpu::DType xt = gpu::parse_dtype(x_dtype, "quantize_i8: x");
        check_array(x, "quantize_i8", "x", 2, elem_bits(xt));
        const uint32_t rows = static_cast<uint32_t>(x.shape(0)), K = static_cast<uint32_t>(x.shape(1));
        LILY_REQUIRE(rows > 0 && K % kI8StepK == 0,
                     "quantize_i8: x must be [rows > 0, K] with K a multiple of 64, got K=" + std::to_string(K));
        Run run(device, order, seed, fp_traps);
        LILY_REQUIRE(run.enc->tensor_ops(), "quantize_i8: the device has no Metal 4 tensor ops (lily_m5.metallib)");
        const gpu::Binding xb = run.input(x);
        const gpu::Binding out = run.output(gpu::ops::qmm_i8_scratch_bytes(rows, K));
        run.encode(xt == gpu::DType::bf16 ? gpu::KernelId::quantize_i8_xbf16 : gpu::KernelId::quantize_i8_xf32,
                   [&](gpu::Encoder& e) { gpu::ops::encode_quantize_i8(e, xb, rows, K, K, out, xt); });
        gpu::Buffer& ob = *out.buffer;
        const size_t g = K / kI8Group;
        return nb::make_tuple(bindings::download<int8_t>(ob, out.offset, {rows, K}),
                              bindings::download<float>(ob, out.offset + i8_scales_offset(rows, K), {rows, g}),
                              bindings::download<float>(ob, out.offset + i8_sums_offset(rows, K), {rows, g}), run.stats());
      },
      "x"_a, nb::kw_only(), "x_dtype"_a, "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "x [rows, K] (bf16 as uint16, or fp32: the MoE's h) -> the int8 activation scratch (codes [rows, K] int8 in the permuted "
      "order, scales and sums [rows, K / 32] float32, stats). Use lily_py.ops._quantize_i8.");

  m.def(
      "quantized_matmul_norm",
      [](InArray x, InArray w, InArray scales, InArray biases, InArray norm_weight, std::optional<InArray> residual,
         bool side, uint32_t bits, uint32_t group_size, float eps, const std::string& x_dtype,
         const std::string& scale_dtype, bool y_f32, const std::string& device, const std::string& order, uint64_t seed,
         bool fp_traps) {
        const gpu::DType xt = gpu::parse_dtype(x_dtype, "quantized_matmul_norm: x");
        const gpu::DType st = gpu::parse_dtype(scale_dtype, "quantized_matmul_norm: scales");
        const char* fn = "quantized_matmul_norm";
        check_array(x, fn, "x", 1, elem_bits(xt));
        check_array(w, fn, "w", 2, 32);
        check_array(scales, fn, "scales", 2, elem_bits(st));
        check_array(biases, fn, "biases", 2, elem_bits(st));
        check_array(norm_weight, fn, "norm_weight", 1, 32);
        const uint32_t K = static_cast<uint32_t>(x.shape(0)), N = static_cast<uint32_t>(w.shape(0));
        require(w.shape(1) * 32 == size_t(K) * bits && norm_weight.shape(0) == K && group_size != 0 &&
                    K % group_size == 0 && scales.shape(0) == N && scales.shape(1) == K / group_size &&
                    biases.shape(0) == N && biases.shape(1) == K / group_size,
                "quantized_matmul_norm: shapes of w / scales / biases / norm_weight do not match K=" + std::to_string(K));
        gpu::ops::QmmOperands op;
        op.x_dtype = xt;
        op.scale_dtype = st;
        op.M = 1;
        op.N = N;
        op.K = K;
        op.bits = bits;
        op.group_size = group_size;
        op.eps = eps;
        Run run(device, order, seed, fp_traps);
        op.x = run.input(x);
        op.w = run.input(w);
        op.scales = run.input(scales);
        op.biases = run.input(biases);
        op.norm_weight = run.input(norm_weight);
        if (residual) {
          check_array(*residual, fn, "residual", 1, elem_bits(xt));
          require(residual->shape(0) == K, "quantized_matmul_norm: residual must have K elements");
          op.residual = run.input(*residual);
        }
        op.y_f32 = y_f32;
        const gpu::DType yt = y_f32 ? gpu::DType::f32 : xt;
        op.y = run.output(size_t(N) * gpu::dtype_size(yt));
        if (side) {
          op.h_out = run.output(size_t(K) * gpu::dtype_size(xt));
          op.xn_out = run.output(size_t(K) * gpu::dtype_size(xt));
        }
        gpu::ops::validate(op);
        run.encode(gpu::ops::qmm_kernel(gpu::ops::QmmRoute::qmv1, bits, xt, st, y_f32, gpu::ops::qmv1_rows(N, K, bits)),
                   [&](gpu::Encoder& e) { gpu::ops::encode_quantized_matmul(e, op); });
        nb::object h = nb::none(), xn = nb::none();
        if (side) {
          h = run.download(op.h_out, xt, {K});
          xn = run.download(op.xn_out, xt, {K});
        }
        return nb::make_tuple(run.download(op.y, yt, {N}), h, xn, run.stats());
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "norm_weight"_a, "residual"_a = nb::none(), nb::kw_only(), "side"_a,
      "bits"_a, "group_size"_a, "eps"_a, "x_dtype"_a, "scale_dtype"_a, "y_f32"_a = false, "device"_a = "emu", "order"_a = "shuffle",
      "seed"_a = 0, "fp_traps"_a = true,
      "One token through the qmv1 route with an RMSNorm fused in front: y = dequant(w) @ (rmsnorm(h) * "
      "norm_weight), h = x (+ residual); returns (y, h, xn, stats) (h, xn: None unless side). Use "
      "lily_py.ops.quantized_matmul_norm.");

  m.def(
      "rms_norm",
      [](InArray x, InArray weight, std::optional<InArray> residual, float eps, float weight_offset,
         const std::string& x_dtype, const std::string& w_dtype, const std::string& device,
         const std::string& order, uint64_t seed, bool fp_traps) {
        const char* fn = "rms_norm";
        gpu::ops::RmsNormOperands op;
        op.x_dtype = gpu::parse_dtype(x_dtype, "rms_norm: x");
        op.w_dtype = gpu::parse_dtype(w_dtype, "rms_norm: weight");
        check_array(x, fn, "x", 2, elem_bits(op.x_dtype));
        check_array(weight, fn, "weight", 1, elem_bits(op.w_dtype));
        op.rows = static_cast<uint32_t>(x.shape(0));
        op.D = static_cast<uint32_t>(x.shape(1));
        LILY_REQUIRE(weight.shape(0) == op.D, "rms_norm: weight has " + std::to_string(weight.shape(0)) +
                                             " elements, rows of x have " + std::to_string(op.D));
        op.eps = eps;
        op.weight_offset = weight_offset;
        Run run(device, order, seed, fp_traps);
        op.x = run.input(x);
        op.weight = run.input(weight);
        const size_t bytes = x.nbytes();
        if (residual) {
          check_array(*residual, fn, "residual", 2, elem_bits(op.x_dtype));
          LILY_REQUIRE(residual->shape(0) == op.rows && residual->shape(1) == op.D, "rms_norm: residual must have the shape of x");
          op.residual = run.input(*residual);
          op.h_out = run.output(bytes);
        }
        op.y = run.output(bytes);
        run.encode(gpu::ops::rms_norm_kernel(bool(residual), op.x_dtype, op.w_dtype),
                   [&](gpu::Encoder& e) { gpu::ops::encode_rms_norm(e, op); });
        nb::object y = run.download(op.y, op.x_dtype, {op.rows, op.D});
        nb::object h = residual ? run.download(op.h_out, op.x_dtype, {op.rows, op.D}) : nb::none();
        return nb::make_tuple(y, h, run.stats());
      },
      "x"_a, "weight"_a, "residual"_a.none(), nb::kw_only(), "eps"_a, "weight_offset"_a, "x_dtype"_a, "w_dtype"_a,
      "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "RMSNorm over rows of x (fused residual add when residual is given); returns (y, h or None, "
      "stats). Use lily_py.ops.rms_norm.");

  m.def(
      "embedding",
      [](InArray ids, InArray table, InArray scales, InArray biases, uint32_t bits, uint32_t group_size,
         const std::string& out_dtype, const std::string& scale_dtype, const std::string& device,
         const std::string& order, uint64_t seed, bool fp_traps) {
        const char* fn = "embedding";
        gpu::ops::EmbeddingOperands op;
        op.out_dtype = gpu::parse_dtype(out_dtype, "embedding: out");
        op.scale_dtype = gpu::parse_dtype(scale_dtype, "embedding: scales");
        check_array(ids, fn, "ids", 1, 32);
        check_array(table, fn, "table", 2, 32);
        check_array(scales, fn, "scales", 2, elem_bits(op.scale_dtype));
        check_array(biases, fn, "biases", 2, elem_bits(op.scale_dtype));
        op.tokens = static_cast<uint32_t>(ids.shape(0));
        op.vocab = static_cast<uint32_t>(table.shape(0));
        op.bits = bits;
        op.group_size = group_size;
        LILY_REQUIRE(gpu::ops::qmm_width_supported(bits), "embedding: bits must be 2, 3, 4, 5, 6 or 8");
        op.D = static_cast<uint32_t>(table.shape(1) * 32 / bits);
        LILY_REQUIRE(group_size != 0 && op.D % group_size == 0 && scales.shape(0) == op.vocab &&
                    scales.shape(1) == op.D / group_size && biases.shape(0) == op.vocab &&
                    biases.shape(1) == op.D / group_size,
                "embedding: scales/biases must be [vocab, D/group_size]");
        Run run(device, order, seed, fp_traps);
        op.ids = run.input(ids);
        op.table = run.input(table);
        op.scales = run.input(scales);
        op.biases = run.input(biases);
        op.out = run.output(size_t(op.tokens) * op.D * gpu::dtype_size(op.out_dtype));
        run.encode(gpu::ops::embedding_kernel(bits, op.out_dtype, op.scale_dtype),
                   [&](gpu::Encoder& e) { gpu::ops::encode_embedding(e, op); });
        return nb::make_tuple(run.download(op.out, op.out_dtype, {op.tokens, op.D}), run.stats());
      },
      "ids"_a, "table"_a, "scales"_a, "biases"_a, nb::kw_only(), "bits"_a, "group_size"_a, "out_dtype"_a,
      "scale_dtype"_a, "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "Rows ids of the quantized table, dequantized; returns (out, stats). Use lily_py.ops.embedding.");

  m.def(
      "elementwise",
      [](const std::string& which, InArray a, InArray b, bool b_per_row, const std::string& dtype,
         const std::string& device, const std::string& order, uint64_t seed, bool fp_traps) {
        gpu::ops::ElementwiseOperands op;
        if (which == "swiglu") op.op = gpu::ops::Elementwise::swiglu;
        else if (which == "sigmoid_mul") op.op = gpu::ops::Elementwise::sigmoid_mul;
        else throw std::invalid_argument("elementwise: unknown op '" + which + "'");
        const char* fn = which == "swiglu" ? "swiglu" : "sigmoid_mul";
        op.dtype = gpu::parse_dtype(dtype, fn);
        check_array(a, fn, "a", 2, elem_bits(op.dtype));
        check_array(b, fn, "b", 2, elem_bits(op.dtype));
        op.rows = static_cast<uint32_t>(a.shape(0));
        op.cols = static_cast<uint32_t>(a.shape(1));
        op.b_per_row = b_per_row;
        LILY_REQUIRE(b.shape(0) == op.rows && b.shape(1) == (b_per_row ? 1 : op.cols),
                std::string(fn) + ": b has the wrong shape");
        Run run(device, order, seed, fp_traps);
        op.a = run.input(a);
        op.b = run.input(b);
        op.y = run.output(a.nbytes());
        run.encode(gpu::ops::elementwise_kernel(op.op, op.dtype),
                   [&](gpu::Encoder& e) { gpu::ops::encode_elementwise(e, op); });
        return nb::make_tuple(run.download(op.y, op.dtype, {op.rows, op.cols}), run.stats());
      },
      "op"_a, "a"_a, "b"_a, nb::kw_only(), "b_per_row"_a, "dtype"_a, "device"_a = "emu", "order"_a = "shuffle",
      "seed"_a = 0, "fp_traps"_a = true,
      "swiglu (silu(a) * b) or sigmoid_mul (a * sigmoid(b)); returns (y, stats). Use lily_py.ops.");
  { void init_ops_gated_delta(nb::module_&); init_ops_gated_delta(m); }  // ops_gated_delta.cpp
  { void init_ops_attention(nb::module_&); init_ops_attention(parent); }  // ops_attention.cpp
  init_ops_sampling(m);
}

}  // namespace lily::bindings
