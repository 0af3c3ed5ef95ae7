// lily_py._core.ops.moe: the mixture-of-experts block over NumPy arrays (wrapped by
// lily_py._ops_moe). Routing/encoding lives in csrc/gpu/ops/moe.cpp; this file moves arrays in
// and out of device buffers and reports what the block encoded.
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
#include "bindings/device.h"
#include "emu/emulator.h"
#include "gpu/dtype.h"
#include "gpu/ops/moe.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {


namespace {

template <class T>
nb::object copy_out(const gpu::Binding& b, std::vector<size_t> shape) {
  return nb::cast(download<T>(*b.buffer, b.offset, shape));
}

}  // namespace

void init_ops_moe(nb::module_& m) {
  m.def("moe_route", [](uint32_t tokens, uint32_t top_k) {
    return std::string(gpu::ops::moe_route_name(gpu::ops::moe_route(tokens, top_k)));
  }, "tokens"_a, "top_k"_a, "Route the MoE block takes: 'mv', 'mm32' or 'mm64'.");
  m.attr("MOE_MV_MAX_TOKENS") = static_cast<uint32_t>(kMoeMvMaxTokens);
  m.attr("MOE_FEW_MAX_ROWS") = static_cast<uint32_t>(kMoeFewMaxRows);
  m.attr("MOE_TILE32_MAX_ROWS") = static_cast<uint32_t>(kMoeTile32MaxRows);
  m.attr("MOE_FEW_MAX_ROWS_M5") = static_cast<uint32_t>(kMoeFewMaxRowsM5);
  m.attr("MOE_TILE16_MAX_ROWS") = static_cast<uint32_t>(kMoeTile16MaxRows);
  m.attr("MOE_MAX_EXPERTS") = static_cast<uint32_t>(kMoeMaxExperts);
  m.attr("MOE_MAX_TOP_K") = static_cast<uint32_t>(kMoeMaxTopK);
  m.attr("MOE_MV_ROWS") = static_cast<uint32_t>(kMoeMvRows);
  m.attr("MOE_GATE_UP_ROWS") = static_cast<uint32_t>(kMoeGateUpRows);
  m.attr("MOE_GATE_UP_ROWS_ONE") = static_cast<uint32_t>(kMoeGateUpRowsOne);
  m.attr("MOE_MV_ROUTE_MIN_TOKENS") = gpu::ops::kMoeMvRouteMinTokens;
  m.attr("MOE_GATE_UP_MAX_SPLITS") = static_cast<uint32_t>(kMoeGateUpMaxSplits);
  m.attr("MOE_GATE_UP_MAX_SIMDS") = static_cast<uint32_t>(kMoeGateUpMaxSimds);
  m.attr("MOE_DOWN_MAX_SPLITS") = static_cast<uint32_t>(kMoeDownMaxSplits);

  m.def(
      "moe",
      [](InArray x, std::vector<InArray> mats, std::optional<InArray> residual, uint32_t top_k,
         uint32_t group_size, uint32_t router_bits, uint32_t router_group_size, const std::string& router_scale_dtype,
         const std::string& x_dtype, const std::string& device, const std::string& order, uint64_t seed,
         bool fp_traps, uint32_t bits, uint32_t down_bits, uint32_t shared_bits, uint32_t shared_down_bits) {
        // mats: router (w, s, b) [E + 1, H], gate, up, down (stacked), shared gate, up, down.
        LILY_REQUIRE(mats.size() == 21, "moe: expected 21 quantized arrays (7 matrices x (w, scales, biases))");
        const gpu::DType xt = gpu::parse_dtype(x_dtype, "moe: x");
        const size_t xbits = gpu::dtype_size(xt) * 8;
        LILY_REQUIRE(x.ndim() == 2 && x.dtype().bits == xbits, "moe: x must be a 2-D " + x_dtype + " array");
        for (size_t i = 0; i < 21; ++i) {
          const bool packed = i % 3 == 0;
          const size_t nd = (i >= 3 && i < 12) ? 3 : 2;
          LILY_REQUIRE(mats[i].ndim() == nd, "moe: array " + std::to_string(i) + " must be " + std::to_string(nd) + "-D");
          LILY_REQUIRE(mats[i].dtype().bits == (packed ? 32u : (i < 3 ? (router_scale_dtype == "float32" ? 32u : 16u) : 16u)),
                  "moe: array " + std::to_string(i) + " has the wrong element size");
        }
        gpu::ops::MoeOperands op;
        op.tokens = uint32_t(x.shape(0));
        op.hidden = uint32_t(x.shape(1));
        op.experts = uint32_t(mats[0].shape(0)) - 1;
        op.top_k = top_k;
        op.inter = uint32_t(mats[3].shape(1));
        op.shared_inter = uint32_t(mats[12].shape(0));
        op.group_size = group_size;
        op.router_bits = router_bits;
        op.bits = bits;            // gate / up (routed and shared)
        op.down_bits = down_bits;  // down (routed and shared); 0: as gate / up
        op.shared_bits = shared_bits;            // the shared expert's gate / up; 0: as the routed
        op.shared_down_bits = shared_down_bits;  // its down; 0: as the routed down
        op.router_group_size = router_group_size;
        op.x_dtype = xt;
        op.router_scale_dtype = gpu::parse_dtype(router_scale_dtype, "moe: router scales");
        LILY_REQUIRE(mats[3].shape(0) == op.experts && mats[6].shape(0) == op.experts && mats[9].shape(0) == op.experts,
                "moe: expert stacks must have E = router rows - 1 = " + std::to_string(op.experts) + " experts");
        auto dev = make_device(device, order, seed, fp_traps);
        std::vector<std::unique_ptr<gpu::Buffer>> bufs;
        auto input = [&](const InArray& a) {
          bufs.push_back(upload(*dev, a.data(), a.nbytes()));
          return gpu::Binding{bufs.back().get(), 0, bufs.back()->size()};
        };
        auto output = [&](size_t bytes) {  // poisoned on the emulator: unwritten elements read NaN
          if (bytes == 0) return gpu::Binding{};
          bufs.push_back(dev->new_buffer(bytes));
          return gpu::Binding{bufs.back().get(), 0, bytes};
        };
        op.x = input(x);
        if (residual) {
          LILY_REQUIRE(residual->ndim() == 2 && residual->shape(0) == op.tokens && residual->shape(1) == op.hidden &&
                      residual->dtype().bits == xbits, "moe: residual must have x's dtype and shape");
          op.residual = input(*residual);
        }
        gpu::ops::QuantMatrix* qm[7] = {&op.router, &op.gate, &op.up, &op.down, &op.shared_gate, &op.shared_up,
                                        &op.shared_down};
        for (int i = 0; i < 7; ++i) {
          qm[i]->w = input(mats[3 * i]);
          qm[i]->scales = input(mats[3 * i + 1]);
          qm[i]->biases = input(mats[3 * i + 2]);
        }
        const gpu::ops::MoeScratchBytes sb = gpu::ops::moe_scratch_bytes(op);
        op.out = output(size_t(op.tokens) * op.hidden * gpu::dtype_size(xt));
        op.scratch.logits = output(sb.logits);
        op.scratch.ids = output(sb.ids);
        op.scratch.weights = output(sb.weights);
        op.scratch.plan = output(sb.plan);
        op.scratch.row_weight = output(sb.row_weight);
        op.scratch.h = output(sb.h);
        op.scratch.y = output(sb.y);
        op.scratch.tile_stats = output(sb.tile_stats);
        if (dev->info().tensor_int8) {  // the int8 scratches, as the engine binds them on such a device
          op.scratch.x_i8 = output(sb.x_i8);
          op.scratch.h_i8 = output(sb.h_i8);
        }
        gpu::ops::validate(op);

        auto enc = dev->new_encoder();
        gpu::ops::RecordingEncoder rec(*enc);
        {
          nb::gil_scoped_release release;
          gpu::ops::encode_moe(rec, op);  // the block: must not synchronise with the host
        }
        const uint64_t syncs = rec.commits + rec.waits;
        {
          nb::gil_scoped_release release;
          enc->commit();
          enc->wait();
        }
        const gpu::Counters& c = rec.counters();
        nb::dict stats;
        nb::list kernels;
        for (const auto& k : rec.kernels) kernels.append(std::string(k));
        stats["kernels"] = kernels;
        nb::list shapes;  // per dispatch: (grid x, grid y, grid z, threads per threadgroup)
        for (size_t i = 0; i < rec.groups.size(); ++i)
          shapes.append(nb::make_tuple(rec.groups[i].x, rec.groups[i].y, rec.groups[i].z,
                                       rec.threads[i].x * rec.threads[i].y * rec.threads[i].z));
        stats["shapes"] = shapes;
        stats["route"] = std::string(gpu::ops::moe_route_name(gpu::ops::moe_route(op.tokens, op.top_k)));
        stats["dispatches"] = c.dispatches;
        stats["barriers"] = c.barriers;
        stats["bytes_bound"] = c.bytes_bound;
        stats["threads"] = c.threads;
        stats["flops_executed"] = c.flops_executed;
        stats["flops_useful"] = c.flops_useful;
        stats["host_syncs"] = syncs;
        if (op.scratch.tile_stats.bytes) {  // the tiled route: what the plan made (read after the wait)
          uint32_t ts[kMoeTileStats];
          op.scratch.tile_stats.buffer->read(op.scratch.tile_stats.offset, ts, sizeof ts);
          nb::dict tiles;
          tiles["64"] = ts[0];
          tiles["32"] = ts[1];
          tiles["few"] = ts[2];
          tiles["few_rows"] = ts[3];
          tiles["16"] = ts[4];  // of the 32-row list: tiles of <= 16 rows (run as 16 rows on M5)
          stats["tiles"] = tiles;
          // The encoder counted the bound over every routing; the plan says what ran.
          const bool m5 = rec.tensor_ops();
          const auto bound = gpu::ops::moe_expert_flops(op.tokens, op.top_k, op.experts, op.hidden, op.inter,
                                                        op.shared_inter, m5);
          stats["flops_executed"] = c.flops_executed - bound.executed +
                                    gpu::ops::moe_expert_flops_from_tiles(op.tokens, op.top_k, op.hidden, op.inter,
                                                                          op.shared_inter, ts, m5);
        }
        const uint32_t T = op.tokens, k = op.top_k;
        nb::object out = xt == gpu::DType::bf16 ? copy_out<uint16_t>(op.out, {T, op.hidden})
                                                : copy_out<float>(op.out, {T, op.hidden});
        return nb::make_tuple(out, copy_out<uint32_t>(op.scratch.ids, {T, k}),
                              copy_out<float>(op.scratch.weights, {T, k + 1}), stats);
      },
      "x"_a, "mats"_a, "residual"_a.none(), nb::kw_only(), "top_k"_a, "group_size"_a, "router_bits"_a,
      "router_group_size"_a, "router_scale_dtype"_a, "x_dtype"_a = "float32", "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0,
      "fp_traps"_a = true, "bits"_a = 4, "down_bits"_a = 0, "shared_bits"_a = 0, "shared_down_bits"_a = 0,
      "The MoE block on a device; returns (out, ids, weights, stats). bfloat16 scales and activations travel as uint16. "
      "Use lily_py.ops.moe.");
}

}  // namespace lily::bindings
