// lily_py._core.ops.sample / sample_noise: the argmax / sampling kernels over NumPy arrays
// (wrapped by lily_py._ops_sampling). Encoding lives in csrc/gpu/ops/sampling.cpp.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/device.h"
#include "emu/emulator.h"
#include "gpu/kernel_ids.h"
#include "gpu/ops/sampling.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {


namespace {

nb::list kernel_names(const gpu::ops::SamplePlan& plan) {
  nb::list k;
  auto add = [&](gpu::KernelId id) { k.append(std::string(gpu::kernel_info(id).name)); };
  add(gpu::KernelId::sample_max_partial_f32);
  add(plan.buckets ? gpu::KernelId::sample_max_final_buckets : gpu::KernelId::sample_max_final);
  if (plan.small_k) {
    add(gpu::KernelId::sample_topk_partial_f32);
    add(gpu::KernelId::sample_topk_merge_f32);
  } else if (plan.plain) {
    add(gpu::KernelId::sample_gumbel_partial_f32);
    add(gpu::KernelId::sample_gumbel_final);
  } else if (plan.buckets) {
    add(gpu::KernelId::sample_hist_partial_f32);
    add(gpu::KernelId::sample_select);
    add(gpu::KernelId::sample_collect_f32);
    add(gpu::KernelId::sample_resolve_f32);
  }
  if (plan.logprobs > 0) add(gpu::KernelId::sample_topk_partial_f32);
  if (plan.logprobs >= 0) {
    add(gpu::KernelId::sample_lse_partial_f32);
    add(gpu::KernelId::sample_logprobs);
  }
  return k;
}

}  // namespace

void init_ops_sampling(nb::module_& m) {
  m.attr("SAMPLE_NO_ID") = static_cast<uint32_t>(kSampleNoId);
  m.attr("SAMPLE_CHUNK") = static_cast<uint32_t>(kSampleChunk);
  m.attr("SAMPLE_MAX_LOGPROBS") = static_cast<uint32_t>(kSampleMaxLogprobs);
  m.def(
      "sample",
      [](InArray logits, uint32_t valid_vocab, bool greedy, double temperature, uint32_t top_k, double top_p,
         double min_p, uint64_t seed, uint32_t step, uint32_t slot, const std::string& device,
         const std::string& order, uint64_t emu_seed, bool fp_traps, uint32_t candidate_cap, int32_t logprobs,
         nb::object mask) {
        LILY_REQUIRE(logits.ndim() == 2 && logits.dtype() == nb::dtype<float>(), "sample: logits must be a 2-D float32 array");
        gpu::ops::SampleOperands op;
        op.rows = static_cast<uint32_t>(logits.shape(0));
        op.stride = static_cast<uint32_t>(logits.shape(1));
        op.valid_vocab = valid_vocab;
        op.slot = slot;
        op.params = {greedy, temperature, top_k, top_p, min_p, seed, step, logprobs};
        op.candidate_cap = candidate_cap;
        auto dev = make_device(device, order, emu_seed, fp_traps);
        std::vector<std::unique_ptr<gpu::Buffer>> bufs;
        auto buffer = [&](size_t bytes, int fill) {
          bufs.push_back(dev->new_buffer(bytes));
          if (fill >= 0) bufs.back()->fill(0, fill, bytes);
          return gpu::Binding{bufs.back().get(), 0, bytes};
        };
        op.logits = buffer(logits.nbytes(), -1);
        op.logits.buffer->write(0, logits.data(), logits.nbytes());
        const size_t out_n = size_t(slot) + op.rows;
        op.ids = buffer(out_n * 4, 0xAB);           // untouched slots keep 0xABABABAB
        op.chosen_logit = buffer(out_n * 4, 0xAB);
        op.state = buffer(gpu::ops::sample_state_bytes(op.rows), -1);
        op.partials = buffer(gpu::ops::sample_partials_bytes(op.rows, valid_vocab), -1);
        op.hist = buffer(gpu::ops::sample_hist_bytes(op.rows, valid_vocab), -1);
        if (!mask.is_none()) {
          auto m = nb::cast<nb::ndarray<const uint32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>>(mask);
          LILY_REQUIRE(m.shape(0) == op.rows && m.shape(1) == gpu::ops::mask_words(valid_vocab),
                       "sample: mask must be uint32 [rows, ceil(valid_vocab / 32)]");
          op.mask = buffer(m.nbytes(), -1);
          op.mask.buffer->write(0, m.data(), m.nbytes());
        }
        if (logprobs >= 0) op.logprobs = buffer(out_n * kSampleLogprobWords * 4, 0xAB);
        gpu::ops::validate(op);
        const gpu::ops::SamplePlan plan = gpu::ops::sample_plan(op);
        auto enc = dev->new_encoder();
        {
          nb::gil_scoped_release release;
          gpu::ops::encode_sample(*enc, op);
          enc->commit();
          enc->wait();
        }
        std::vector<uint32_t> status(op.rows), bad(op.rows);
        nb::list fallback, collected, split_k;
        std::vector<SampleState> st(op.rows);
        op.state.buffer->read(0, st.data(), st.size() * sizeof(SampleState));
        for (uint32_t r = 0; r < op.rows; ++r) {
          status[r] = st[r].status;
          bad[r] = st[r].bad_id;
          if (plan.buckets) {  // the bucket route's per-row resolve mode and candidate count
            fallback.append(st[r].fallback != 0);
            collected.append(st[r].collected);
            split_k.append(st[r].bin_k != kSampleNoId);  // Z searched inside the top-k entry's bucket
          }
        }
        const gpu::Counters& c = enc->counters();
        nb::dict stats;
        stats["kernels"] = kernel_names(plan);
        stats["dispatches"] = c.dispatches;
        stats["barriers"] = c.barriers;
        stats["bytes_bound"] = c.bytes_bound;
        stats["threads"] = c.threads;
        stats["planned_dispatches"] = plan.dispatches();
        stats["fallback"] = fallback;
        stats["collected"] = collected;
        stats["split_k"] = split_k;
        if (logprobs >= 0)  // the records [slot + R, kSampleLogprobWords] as uint32 words
          stats["logprobs"] = download<uint32_t>(*op.logprobs.buffer, 0, {out_n, size_t(kSampleLogprobWords)});
        return nb::make_tuple(download<uint32_t>(*op.ids.buffer, 0, {out_n}),
                              download<float>(*op.chosen_logit.buffer, 0, {out_n}),
                              download<uint32_t>(status.data(), {op.rows}), download<uint32_t>(bad.data(), {op.rows}),
                              stats);
      },
      "logits"_a, nb::kw_only(), "valid_vocab"_a, "greedy"_a, "temperature"_a, "top_k"_a, "top_p"_a, "min_p"_a,
      "seed"_a, "step"_a, "slot"_a, "device"_a = "emu", "order"_a = "shuffle", "emu_seed"_a = 0, "fp_traps"_a = true,
      "candidate_cap"_a = static_cast<uint32_t>(kSampleCandidates), "logprobs"_a = -1, "mask"_a = nb::none(),
      "Argmax / sampling of each row of logits [R, V]; returns (ids [slot + R], chosen_logit [slot + R], status [R], "
      "bad_id [R], stats). Use lily_py.ops.argmax / lily_py.ops.sample.");
  m.def(
      "sample_noise",
      [](uint32_t n, uint64_t seed, uint32_t step, const std::string& device) {
        auto dev = make_device(device, "forward", 0, true);
        auto buf = dev->new_buffer(size_t(n) * 4);
        auto enc = dev->new_encoder();
        {
          nb::gil_scoped_release release;
          gpu::ops::encode_sample_noise(*enc, {buf.get(), 0, size_t(n) * 4}, n, seed, step);
          enc->commit();
          enc->wait();
        }
        return download<float>(*buf, 0, {n});
      },
      "n"_a, "seed"_a, "step"_a, "device"_a = "emu", "The Gumbel noise of (seed, step) for ids 0..n-1 (float32).");
}

}  // namespace lily::bindings
