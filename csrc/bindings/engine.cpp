// lily_py._core.Engine: the whole model on a device (csrc/core/engine.h). Python builds the spec
// (lily_py/_engine.py), uploads the memory-mapped checkpoint tensors once, then calls forward()
// per step; the GIL is released while the device encodes and runs a step.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <iterator>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "core/device_registry.h"
#include "core/engine.h"
#include "gpu/ops/moe.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {

namespace {

template <class T>
T get(const nb::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("engine spec: missing '") + key + "'");
  return nb::cast<T>(d[key]);
}

core::QuantSpec quant_spec(const nb::dict& q, const std::string& key) {
  core::QuantSpec s;
  s.bits = get<uint32_t>(q, "bits");
  s.group_size = get<uint32_t>(q, "group_size");
  s.scale_dtype = gpu::parse_dtype(get<std::string>(q, "scale_dtype"), key + " scale_dtype");
  return s;
}

core::QuantSpec quant(const nb::dict& d, const char* key) { return quant_spec(get<nb::dict>(d, key), key); }

core::ModelSpec spec_from(const nb::dict& d) {
  core::ModelSpec s;
  s.vocab = get<uint32_t>(d, "vocab");
  s.hidden = get<uint32_t>(d, "hidden");
  s.full_attention = get<std::vector<uint8_t>>(d, "full_attention");
  s.layers = uint32_t(s.full_attention.size());
  s.q_heads = get<uint32_t>(d, "q_heads");
  s.kv_heads = get<uint32_t>(d, "kv_heads");
  s.head_dim = get<uint32_t>(d, "head_dim");
  s.rotary_dim = get<uint32_t>(d, "rotary_dim");
  s.rope_theta = get<double>(d, "rope_theta");
  s.lin_k_heads = get<uint32_t>(d, "lin_k_heads");
  s.lin_v_heads = get<uint32_t>(d, "lin_v_heads");
  s.lin_k_dim = get<uint32_t>(d, "lin_k_dim");
  s.lin_v_dim = get<uint32_t>(d, "lin_v_dim");
  s.conv_kernel = get<uint32_t>(d, "conv_kernel");
  s.experts = get<uint32_t>(d, "experts");
  s.top_k = get<uint32_t>(d, "top_k");
  s.moe_inter = get<uint32_t>(d, "moe_inter");
  s.shared_inter = get<uint32_t>(d, "shared_inter");
  s.eps = get<float>(d, "eps");
  s.embed = quant(d, "embed");
  s.lm_head = quant(d, "lm_head");
  s.mixer = quant(d, "mixer");
  s.experts_q = quant(d, "experts_q");
  s.router = quant(d, "router");
  if (d.contains("quant_overrides"))  // mixed-bit checkpoints: {engine weight or part name: quant dict}
    for (auto [k, v] : get<nb::dict>(d, "quant_overrides")) {
      const std::string name = nb::cast<std::string>(k);
      s.quant_overrides[name] = quant_spec(nb::cast<nb::dict>(v), name);
    }
  s.context_length = get<uint32_t>(d, "context_length");
  s.prefill_chunk = get<uint32_t>(d, "prefill_chunk");
  if (d.contains("kv_block_tokens")) s.kv_block_tokens = get<uint32_t>(d, "kv_block_tokens");
  if (d.contains("kv_dtype")) s.kv_format = gpu::parse_kv_format(get<std::string>(d, "kv_dtype"), "kv_dtype");
  s.logit_rows = get<uint32_t>(d, "logit_rows");
  if (d.contains("activations")) s.activations = gpu::parse_dtype(get<std::string>(d, "activations"), "activations");
  return s;
}

nb::dict stats_dict(const core::StepStats& s) {
  nb::dict d;
  d["tokens"] = s.tokens;
  d["dispatches"] = s.dispatches;
  d["barriers"] = s.barriers;
  d["bytes_bound"] = s.bytes_bound;
  d["bytes_touched"] = s.bytes_touched;
  d["threads"] = s.threads;
  d["flops_executed"] = s.flops_executed;
  d["flops_useful"] = s.flops_useful;
  d["commits"] = s.commits;
  d["waits_in_step"] = s.waits_in_step;
  d["host_waits"] = s.host_waits;
  d["ids_from_slot"] = s.ids_from_slot;
  d["in_flight"] = s.in_flight;
  d["encode_ns"] = s.encode_ns;
  if (s.token != 0xFFFFFFFFu) d["token"] = s.token;
  return d;
}

using IdArray = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A constraint's allowed-token bitset (uint32 [ceil(valid_vocab / 32)]) for `s`; the array must
// outlive the call that uses `s` (the binding's argument does).
void set_mask(core::StepSampling& s, nb::object mask, uint32_t vocab) {
  if (mask.is_none()) return;
  if (!s.enabled) throw std::invalid_argument("engine: a token mask needs sampling parameters");
  IdArray m;
  if (!nb::try_cast(mask, m, false))
    throw std::invalid_argument("engine: mask must be a C-contiguous uint32 array [ceil(valid_vocab / 32)]");
  const uint32_t valid = s.valid_vocab ? s.valid_vocab : vocab;
  if (m.shape(0) != gpu::ops::mask_words(valid))
    throw std::invalid_argument("engine: mask has " + std::to_string(m.shape(0)) + " words, valid_vocab " +
                                std::to_string(valid) + " needs " + std::to_string(gpu::ops::mask_words(valid)));
  s.mask = m.data();
}

}  // namespace

// A memory plan's byte counts (plan_memory and Engine.memory).
nb::dict plan_dict(const core::MemoryPlan& p) {
  nb::dict d;
  d["weight_bytes"] = p.weight_bytes;
  d["state_bytes"] = p.state_bytes;
  d["scratch_bytes"] = p.scratch_bytes;
  d["total_bytes"] = p.total();
  d["largest_buffer_bytes"] = p.largest_buffer_bytes;
  d["largest_buffer"] = p.largest_buffer;
  return d;
}

core::StepSampling sampling_from(nb::object sample, bool from_slot) {
  core::StepSampling s;
  s.ids_from_slot = from_slot;
  if (sample.is_none()) return s;
  nb::dict d = nb::cast<nb::dict>(sample);
  s.enabled = true;
  const double t = get<double>(d, "temperature");
  s.params.greedy = t == 0.0;
  s.params.temperature = t == 0.0 ? 1.0 : t;
  s.params.top_k = get<uint32_t>(d, "top_k");
  s.params.top_p = get<double>(d, "top_p");
  s.params.min_p = get<double>(d, "min_p");
  s.params.seed = get<uint64_t>(d, "seed");
  s.params.step = get<uint32_t>(d, "step");
  s.valid_vocab = get<uint32_t>(d, "valid_vocab");
  if (d.contains("logprobs")) s.params.logprobs = nb::cast<int32_t>(d["logprobs"]);
  return s;
}

// time_step() / time_batch() as a dict (docs/gpu.md, "Timing").
static nb::dict timing_dict(const gpu::StepTiming& t) {
  nb::dict out;
  out["step_us"] = t.step_us;
  out["step_us_min"] = t.step_us_min;
  out["step_us_max"] = t.step_us_max;
  out["empty_us"] = t.empty_us;
  out["levels"] = t.levels;
  out["nodes"] = t.nodes;
  out["copy_gbps"] = t.copy_gbps;
  out["read_gbps"] = t.read_gbps;
  nb::list ds;
  for (const gpu::DispatchTime& d : t.dispatches) {
    nb::dict x;
    x["kernel"] = std::string(gpu::kernel_info(d.record.kernel).name);
    x["groups"] = nb::make_tuple(d.record.groups.x, d.record.groups.y, d.record.groups.z);
    x["threads"] = nb::make_tuple(d.record.threads.x, d.record.threads.y, d.record.threads.z);
    x["level"] = d.record.level;
    x["bytes_touched"] = d.record.bytes_touched;
    x["flops_useful"] = d.record.flops_useful;
    x["unit"] = gpu::exec_unit_name(d.record.unit);
    x["us"] = d.us;
    x["us_min"] = d.us_min;
    x["us_max"] = d.us_max;
    x["copy_us"] = d.copy_us;
    x["read_us"] = d.read_us;
    ds.append(x);
  }
  out["dispatches"] = ds;
  return out;
}

void init_engine(nb::module_& m) {
  nb::exception<core::SampleError>(m, "SampleError", PyExc_FloatingPointError);
  nb::exception<core::DeviceMemoryError>(m, "DeviceMemoryError", PyExc_MemoryError);
  m.def(
      "engine_quant_support",
      [] {
        nb::dict d;
        d["bits"] = std::vector<uint32_t>(std::begin(core::kEngineBits), std::end(core::kEngineBits));
        d["expert_bits"] = std::vector<uint32_t>(std::begin(core::kEngineExpertBits), std::end(core::kEngineExpertBits));
        d["group_sizes"] = std::vector<uint32_t>(std::begin(core::kEngineGroupSizes), std::end(core::kEngineGroupSizes));
        nb::list pairs;  // (routed, shared) expert widths of one MoE stage the kernels take, unequal
        for (auto [b, s] : gpu::ops::moe_shared_widths()) pairs.append(nb::make_tuple(b, s));
        d["moe_shared_widths"] = pairs;
        return d;
      },
      "The bit widths and group sizes the engine's kernels take (moe_shared_widths: the (routed, "
      "shared) expert widths of a mixed MoE stage).");
  m.def(
      "plan_memory",
      [](nb::dict spec, bool int8) {
        const core::MemoryPlan p = core::plan_memory(spec_from(spec), int8);
        return plan_dict(p);
      },
      "spec"_a, "int8"_a = false,
      "Device memory an Engine of `spec` allocates (bytes: weights, state (KV caches, DeltaNet state, conv "
      "windows), scratch), computed without allocating or validating the kernels' widths.");
  nb::exception<core::DeviceLimitError>(m, "DeviceLimitError", PyExc_RuntimeError);
  nb::class_<core::StepSampling>(m, "Sampling",
                                 "Sampling parameters parsed once (Engine.submit_slot takes them per token).")
      .def("__init__",
           [](core::StepSampling* self, nb::dict sample) {
             new (self) core::StepSampling(sampling_from(nb::object(sample), false));
           },
           "sample"_a, "dict(temperature, top_k, top_p, min_p, seed, step, valid_vocab)");
  nb::class_<core::Snapshot>(m, "EngineSnapshot", "A host copy of an Engine's conversation state.")
      .def_ro("position", &core::Snapshot::position)
      .def_prop_ro("nbytes",
                   [](const core::Snapshot& s) {
                     size_t n = 0;
                     for (const auto& b : s.buffers) n += b.size();
                     return n;
                   },
                   "Bytes of state held (KV rows up to the position, recurrent and conv state).")
      .def("to_bytes",
           [](const core::Snapshot& s) {
             std::string out;
             for (const auto& b : s.buffers) out.append(b.data(), b.size());
             return nb::bytes(out.data(), out.size());
           },
           "Every state buffer, concatenated (for comparing two states bit for bit).");

  nb::class_<core::Engine>(m, "Engine",
                           "One model on one device ('emu', 'metal', or 'count': counters only, no memory).")
      .def("__init__",
           [](core::Engine* self, nb::dict spec, const std::string& device, std::vector<std::string> files,
              nb::dict mapped) {
             core::ModelSpec s = spec_from(spec);
             core::WeightMapping mapping;
             mapping.files = std::move(files);
             for (auto [k, v] : mapped) {
               const auto at = nb::cast<std::pair<uint32_t, uint64_t>>(v);
               mapping.weights[nb::cast<std::string>(k)] = core::WeightSource{at.first, at.second};
             }
             std::unique_ptr<gpu::Device> dev = devices::create(device);
             {
               nb::gil_scoped_release release;  // creating pipelines can take a while on Metal
               new (self) core::Engine(std::move(s), std::move(dev), mapping);
             }
             // Above ~85% of the device's working set: one Python warning (an error under -W error).
             if (!self->memory_warning().empty() &&
                 PyErr_WarnEx(PyExc_RuntimeWarning, self->memory_warning().c_str(), 1) != 0) {
               self->~Engine();
               throw nb::python_error();
             }
           },
           "spec"_a, "device"_a, "files"_a = std::vector<std::string>(), "mapped"_a = nb::dict(),
           "files: checkpoint files to map; mapped: {weight: (file index, byte offset)}, the weights bound to "
           "the mapped files at those offsets (zero copy) where the device wraps host memory and the offset "
           "is 16-byte aligned (the others are uploaded). "
           "Checks the memory the model needs against the device first (DeviceMemoryError, a MemoryError; "
           "RuntimeWarning above 85% of the working set), then creates and checks every pipeline a step "
           "uses (DeviceLimitError).")
      .def_prop_ro("memory", [](const core::Engine& e) {
        const core::MemoryPlan& p = e.memory();
        nb::dict d = plan_dict(p);
        d["working_set_bytes"] = p.working_set_bytes ? nb::cast(p.working_set_bytes) : nb::none();
        d["max_buffer_bytes"] = p.max_buffer_bytes ? nb::cast(p.max_buffer_bytes) : nb::none();
        d["warning"] = e.memory_warning().empty() ? nb::none() : nb::cast(e.memory_warning());
        return d;
      }, "Device memory planned at load (bytes) and the device's limits (None: unlimited).")
      .def_prop_ro("pipelines", [](const core::Engine& e) {
        nb::list out;
        for (const core::PlannedKernel& k : e.pipelines()) {
          nb::dict d;
          d["kernel"] = std::string(gpu::kernel_info(k.kernel).name);
          d["threads"] = k.threads;
          d["max_threads"] = k.pipeline.max_threads;
          d["static_threadgroup_bytes"] = k.pipeline.static_threadgroup_bytes < 0 ? nb::none() : nb::cast(k.pipeline.static_threadgroup_bytes);
          out.append(d);
        }
        return out;
      }, "Every kernel the engine's steps use, checked at load: kernel, threads (most per threadgroup "
         "dispatched), max_threads, static_threadgroup_bytes (None: unknown).")
      .def_prop_ro("device", [](const core::Engine& e) { return std::string(e.device_name()); })
      .def_prop_ro("position", &core::Engine::position)
      .def_prop_ro("valid", &core::Engine::valid)
      .def_rw("serialize", &core::Engine::serialize, "Barrier between every two dispatches (debugging).")
      .def_rw("skip_barrier", &core::Engine::skip_barrier,
              "Emulator, debugging: every step ignores its barrier #skip_barrier (-1: none).")
      .def("summary", [](const core::Engine& e) { return e.spec().summary(); })
      .def("weight_list", &core::Engine::weight_list, "Every weight the engine expects: (name, bytes).")
      .def(
          "upload",
          [](core::Engine& e, const std::string& name, std::vector<InArray> parts) {
            std::vector<std::pair<const void*, size_t>> p;
            for (const auto& a : parts) p.emplace_back(a.data(), a.nbytes());
            nb::gil_scoped_release release;
            e.upload(name, p);
          },
          "name"_a, "parts"_a, "Copy C-contiguous arrays back to back into weight `name` (row concatenation).")
      .def("check_loaded", &core::Engine::check_loaded)
      .def_prop_ro("weight_bytes", &core::Engine::weight_bytes)
      .def_prop_ro("mapped_weight_bytes", &core::Engine::mapped_weight_bytes,
                   "Bytes of weights bound to the mapped checkpoint files (zero copy).")
      .def_prop_ro("copied_weight_bytes", &core::Engine::copied_weight_bytes,
                   "Bytes copied into weight buffers by upload() since construction.")
      .def_prop_ro("mapped_file_bytes", &core::Engine::mapped_file_bytes,
                   "Bytes of the checkpoint files mapped into device buffers.")
      .def("weight_sources",
           [](const core::Engine& e) {
             nb::list out;
             for (const core::WeightPlacement& w : e.weight_sources()) {
               nb::dict d;
               d["name"] = w.name;
               d["bytes"] = w.bytes;
               d["file"] = w.file < 0 ? nb::none() : nb::cast(w.file);
               d["offset"] = w.offset;
               d["why_copied"] = w.why_copied.empty() ? nb::none() : nb::cast(w.why_copied);
               out.append(d);
             }
             return out;
           },
           "Every weight's placement: name, bytes, file (index into the mapped files; None: its own "
           "buffer), offset in that file, why_copied (None when mapped).")
      .def_prop_ro("state_bytes", &core::Engine::state_bytes)
      .def_prop_ro("kv_bytes", &core::Engine::kv_bytes, "Bytes of the KV pools allocated now.")
      .def_prop_ro("kv_bytes_in_use", &core::Engine::kv_bytes_in_use,
                   "Bytes of the KV blocks that hold the positions so far.")
      .def_rw("kv_limit_bytes", &core::Engine::kv_limit_bytes,
              "Most bytes the KV pools may take (0: the device's working set decides).")
      .def_prop_ro("scratch_bytes", &core::Engine::scratch_bytes)
      .def(
          "forward",
          [](core::Engine& e, IdArray ids, bool all_logits, nb::object sample, bool from_slot, bool logits,
             bool fetch, nb::object mask) -> nb::tuple {
            core::StepSampling sampling = sampling_from(sample, from_slot);
            set_mask(sampling, mask, e.spec().vocab);
            const uint32_t T = uint32_t(ids.shape(0));
            const size_t rows = !logits || !fetch ? 0 : all_logits ? T : 1, V = e.spec().vocab;
            float* out = fetch ? new float[rows * V + 1] : nullptr;
            core::StepStats st;
            try {
              nb::gil_scoped_release release;
              st = e.forward(ids.data(), T, all_logits, out, sampling, logits);
            } catch (...) {
              delete[] out;
              throw;
            }
            if (!fetch) return nb::make_tuple(nb::none(), stats_dict(st));
            nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
            size_t shape[2] = {rows, V};
            return nb::make_tuple(nb::ndarray<nb::numpy, float>(out, 2, shape, owner), stats_dict(st));
          },
          "ids"_a, "all_logits"_a = false, "sample"_a = nb::none(), "from_slot"_a = false, "logits"_a = true,
          "fetch"_a = true, "mask"_a = nb::none(),
          "`logits=False`: a prefill chunk that is not the last (no final norm / lm_head; [0, V] returned). Feed uint32 ids [T] (one step, one command buffer); returns (float32 logits [T or 1, V], stats). "
          "`sample`: dict(temperature, top_k, top_p, min_p, seed, step, valid_vocab) samples the last "
          "position on the device into the token slot (stats['token']); `from_slot`: feed that slot "
          "(the previous step's sample) instead of `ids` (which must then hold one placeholder id). "
          "`fetch=False`: the logits stay on the device (None returned; last_logits() copies them later). "
          "`mask`: uint32 [ceil(valid_vocab / 32)], a constraint's allowed-token bitset for the sampler.")
      .def(
          "submit",
          [](core::Engine& e, IdArray ids, nb::object sample, bool from_slot) {
            const core::StepSampling sampling = sampling_from(sample, from_slot);
            core::StepStats st;
            {
              nb::gil_scoped_release release;
              st = e.submit(ids.data(), uint32_t(ids.shape(0)), false, sampling, true);
            }
            return stats_dict(st);
          },
          "ids"_a, "sample"_a = nb::none(), "from_slot"_a = false,
          "Encode and commit one step without waiting (logits of the last position); see complete().")
      .def(
          "complete",
          [](core::Engine& e) {
            const size_t V = e.spec().vocab;
            float* out = new float[V];
            nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
            core::StepStats st;
            {
              nb::gil_scoped_release release;
              st = e.complete(out);
            }
            size_t shape[1] = {V};
            return nb::make_tuple(nb::ndarray<nb::numpy, float>(out, 1, shape, owner), stats_dict(st));
          },
          "Wait for the oldest step in flight: (float32 logits [V], stats with 'token').")
      .def(
          "submit_slot",
          [](core::Engine& e, const core::StepSampling& sampling, uint32_t step) {
            // The per-token call of generation: no arrays, no dicts.
            core::StepSampling s = sampling;
            s.params.step = step;
            s.ids_from_slot = true;
            const uint32_t placeholder = 0;
            nb::gil_scoped_release release;
            e.submit(&placeholder, 1, false, s, true);
          },
          "sampling"_a, "step"_a,
          "Commit a one-token step fed from the device slot (the previous step's sample) that samples "
          "with `sampling` at `step`, without waiting; stats via last_stats() after complete_token().")
      .def(
          "submit_logits_slot",
          [](core::Engine& e) {
            core::StepSampling s;
            s.ids_from_slot = true;
            const uint32_t placeholder = 0;
            nb::gil_scoped_release release;
            e.submit(&placeholder, 1, false, s, true);
          },
          "Commit a one-token step fed from the device slot that does not sample: its logits row "
          "stays on the device for submit_sampler (constrained generation), without waiting.")
      .def(
          "submit_sampler",
          [](core::Engine& e, const core::StepSampling& sampling, uint32_t step, nb::object mask) {
            core::StepSampling s = sampling;
            s.params.step = step;
            s.ids_from_slot = false;
            set_mask(s, mask, e.spec().vocab);
            nb::gil_scoped_release release;
            e.submit_sampler(s);
          },
          "sampling"_a, "step"_a, "mask"_a = nb::none(),
          "Commit the sampler of the newest step in flight (submitted by submit_logits_slot), with "
          "the allowed-token bitset `mask` (uint32 [ceil(valid_vocab / 32)], None: every token), in a "
          "command buffer of its own; with nothing in flight, of the last completed step's row. "
          "complete_token() returns its token.")
      .def_prop_ro(
          "counters",
          [](const core::Engine& e) {
            const core::EngineCounters& c = e.counters();
            nb::dict d;
            d["commits"] = c.commits;
            d["idle_commits"] = c.idle_commits;
            d["host_waits"] = c.host_waits;
            d["masks_written"] = c.masks_written;
            return d;
          },
          "Totals since construction: command buffers committed, those committed with nothing in "
          "flight (the device waited for the host), host waits, masks written.")
      .def(
          "complete_token",
          [](core::Engine& e) -> nb::object {
            core::StepStats st;
            {
              nb::gil_scoped_release release;
              st = e.complete(nullptr);
            }
            if (st.token == 0xFFFFFFFFu) return nb::none();
            return nb::int_(st.token);
          },
          "Wait for the oldest step in flight; its sampled token (None if it did not sample). The "
          "logits stay on the device (last_logits()); stats via last_stats().")
      .def(
          "last_logprobs",
          [](const core::Engine& e) {
            const std::vector<uint32_t> rec = e.logprob_record();
            const uint32_t* r = rec.data();
            float chosen;
            std::memcpy(&chosen, r, 4);
            const uint32_t n = std::min<uint32_t>(r[1], kSampleMaxLogprobs);
            std::vector<uint32_t> ids(n);
            std::vector<float> lps(n);
            for (uint32_t j = 0; j < n; ++j) {
              ids[j] = r[2 + 2 * j];
              std::memcpy(&lps[j], r + 3 + 2 * j, 4);
            }
            return nb::make_tuple(chosen, download<uint32_t>(ids.data(), {n}), download<float>(lps.data(), {n}));
          },
          "(logprob of the sampled token, top ids, top logprobs) of the last completed sampling step "
          "(its sampling dict had logprobs=k >= 0): 2 + 2k words read from the device, no logits row.")
      .def(
          "last_logits",
          [](const core::Engine& e) {
            const size_t V = e.spec().vocab;
            float* out = new float[V];
            try {
              e.last_logits(out);
            } catch (...) {
              delete[] out;
              throw;
            }
            nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
            size_t shape[1] = {V};
            return nb::ndarray<nb::numpy, float>(out, 1, shape, owner);
          },
          "float32 logits [V] of the last position of the last completed step (copied from the device).")
      .def(
          "sample_row",
          [](core::Engine& e, nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> row,
             const core::StepSampling& sampling, nb::object mask) {
            LILY_REQUIRE(row.shape(0) == e.spec().vocab,
                         "sample_row: the row has " + std::to_string(row.shape(0)) + " logits, the model's vocab is " +
                             std::to_string(e.spec().vocab));
            core::StepSampling s = sampling;
            set_mask(s, mask, e.spec().vocab);
            return e.sample_row(row.data(), s);
          },
          "row"_a, "sampling"_a, "mask"_a = nb::none(),
          "Sample one token on the device from a float32 logits row [V] held by the host (the "
          "sampler alone, one wait); the state is untouched.")
      .def_prop_ro("has_last_logits", &core::Engine::has_last_logits)
      .def_prop_ro("logit_bytes_copied", &core::Engine::logit_bytes_copied,
                   "Bytes of logits copied from the device to the host since construction.")
      .def_prop_ro("in_flight", &core::Engine::in_flight)
      .def(
          "count",
          [](core::Engine& e, uint32_t T, uint32_t position, bool all_logits, nb::object sample, bool from_slot,
             bool logits) {
            return stats_dict(e.count(T, position, all_logits, sampling_from(sample, from_slot), logits));
          },
          "tokens"_a, "position"_a = 0, "all_logits"_a = false, "sample"_a = nb::none(), "from_slot"_a = false,
          "logits"_a = true,
          "Counters of one step encoded on the counting device (nothing runs).")
      .def(
          "check",
          [](core::Engine& e, uint32_t T, uint32_t position, bool all_logits, nb::object sample, bool from_slot,
             bool logits, int64_t skip_barrier) {
            return stats_dict(e.check(T, position, all_logits, sampling_from(sample, from_slot), logits, skip_barrier));
          },
          "tokens"_a, "position"_a = 0, "all_logits"_a = false, "sample"_a = nb::none(), "from_slot"_a = false,
          "logits"_a = true, "skip_barrier"_a = -1,
          "Emulator only: encode one step at `position` on an encoder that runs nothing and checks "
          "hazards between dispatches (EmulatorError names them), ignoring barrier #skip_barrier "
          "(-1: none). The state is untouched; returns the counters.")
      .def(
          "time_step",
          [](core::Engine& e, uint32_t T, uint32_t position, bool all_logits, nb::object sample, uint32_t repeats,
             uint32_t trials, bool per_dispatch) {
            gpu::TimingOptions o;
            o.repeats = repeats;
            o.trials = trials;
            o.per_dispatch = per_dispatch;
            gpu::StepTiming t;
            {
              const core::StepSampling sampling = sampling_from(sample, false);
              nb::gil_scoped_release release;
              t = e.time_step(T, position, all_logits, sampling, o);
            }
            return timing_dict(t);
          },
          "tokens"_a, "position"_a = 0, "all_logits"_a = false, "sample"_a = nb::none(), "repeats"_a = 20,
          "trials"_a = 5, "per_dispatch"_a = true,
          "cuda only: GPU times of one step of `tokens` at `position` (the whole step as one graph, each "
          "dispatch alone, an empty graph of the same levels, copy / streaming-read references). Runs "
          "the step many times over the state, then resets it (docs/gpu.md, \"Timing\").")
      .def(
          "count_kernels",
          [](const core::Engine& e) {
            nb::dict out;  // kernel name -> dict(dispatches, bytes_touched, threads, groups)
            const auto& ks = e.counted_kernels();
            for (size_t i = 0; i < ks.size(); ++i) {
              if (ks[i].dispatches == 0) continue;
              nb::dict d;
              d["dispatches"] = ks[i].dispatches;
              d["bytes_touched"] = ks[i].bytes_touched;
              d["threads"] = ks[i].threads;
              d["groups"] = ks[i].groups;
              d["flops_executed"] = ks[i].flops_executed;
              d["flops_useful"] = ks[i].flops_useful;
              d["unit"] = gpu::exec_unit_name(gpu::kernel_default_unit(gpu::kKernelTable[i].id));
              out[std::string(gpu::kKernelTable[i].name).c_str()] = d;
            }
            return out;
          },
          "Per-kernel totals of the last count(): name -> dict(dispatches, bytes_touched, threads, groups, "
          "flops_executed, flops_useful, unit (the kernel's default: alu, simdgroup_fp32, simdgroup_bf16, tensor)).")
      .def(
          "count_dispatches",
          [](const core::Engine& e) {
            nb::list out;  // every dispatch of the last count(), in order
            for (const auto& r : e.counted_dispatches()) {
              nb::dict d;
              d["kernel"] = std::string(gpu::kernel_info(r.kernel).name);
              d["groups"] = nb::make_tuple(r.groups.x, r.groups.y, r.groups.z);
              d["threads"] = nb::make_tuple(r.threads.x, r.threads.y, r.threads.z);
              d["bytes_touched"] = r.bytes_touched;
              d["bytes_bound"] = r.bytes_bound;
              d["level"] = r.level;
              d["unit"] = gpu::exec_unit_name(r.unit);
              d["flops_executed"] = r.flops_executed;
              d["flops_useful"] = r.flops_useful;
              out.append(d);
            }
            return out;
          },
          "Every dispatch of the last count(): kernel, groups, threads, bytes_touched, bytes_bound, level, "
          "unit, flops_executed, flops_useful (the add_flops called right after it).")
      .def("add_sequence", &core::Engine::add_sequence,
           "A new empty sequence (its own DeltaNet state, conv windows and KV pools); returns its id.")
      .def("select_sequence", &core::Engine::select_sequence, "id"_a,
           "Make sequence `id` the active one (forward, snapshot, restore, reset act on it); no copy.")
      .def("drop_sequence", &core::Engine::drop_sequence, "id"_a, "Free a sequence's buffers (not the active one).")
      .def_prop_ro("active_sequence", &core::Engine::active_sequence)
      .def_prop_ro("sequences", &core::Engine::sequences)
      .def("sequence_position", &core::Engine::sequence_position, "id"_a)
      .def("sequence_valid", &core::Engine::sequence_valid, "id"_a)
      .def_prop_ro("max_batch", &core::Engine::max_batch)
      .def(
          "decode_batch",
          [](core::Engine& e, IdArray seqs, IdArray ids, bool fetch) -> nb::tuple {
            const uint32_t B = uint32_t(ids.shape(0)), V = e.spec().vocab;
            if (seqs.shape(0) != ids.shape(0))
              throw std::invalid_argument("decode_batch: " + std::to_string(seqs.shape(0)) + " sequences for " +
                                          std::to_string(ids.shape(0)) + " token ids");
            float* out = fetch ? new float[size_t(B) * V + 1] : nullptr;
            core::StepStats st;
            try {
              nb::gil_scoped_release release;
              st = e.decode_batch(seqs.data(), ids.data(), B, out);
            } catch (...) {
              delete[] out;
              throw;
            }
            if (!fetch) return nb::make_tuple(nb::none(), stats_dict(st));
            nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
            size_t shape[2] = {B, V};
            return nb::make_tuple(nb::ndarray<nb::numpy, float>(out, 2, shape, owner), stats_dict(st));
          },
          "seqs"_a, "ids"_a, "fetch"_a = true,
          "One token for each of B distinct sequences in one step: ids[t] (uint32) fed to sequence "
          "seqs[t] (uint32); returns (float32 logits [B, V], row t for seqs[t], stats). B == 1 is the "
          "single-stream step. Leaves the batch's last sequence active.")
      .def(
          "submit_batch",
          [](core::Engine& e, IdArray seqs, nb::object ids, std::vector<core::StepSampling> samplings, IdArray steps) {
            const uint32_t B = uint32_t(seqs.shape(0));
            if (samplings.size() != B || steps.shape(0) != B)
              throw std::invalid_argument("submit_batch: " + std::to_string(B) + " sequences for " +
                                          std::to_string(samplings.size()) + " samplings and " +
                                          std::to_string(steps.shape(0)) + " steps");
            for (uint32_t t = 0; t < B; ++t) samplings[t].params.step = steps.data()[t];
            const bool from_slot = ids.is_none();
            std::vector<uint32_t> host(B, 0);
            if (!from_slot) {
              const IdArray a = nb::cast<IdArray>(ids);
              if (a.shape(0) != B)
                throw std::invalid_argument("submit_batch: " + std::to_string(B) + " sequences for " +
                                            std::to_string(a.shape(0)) + " token ids");
              std::copy(a.data(), a.data() + B, host.begin());
            }
            core::StepStats st;
            {
              nb::gil_scoped_release release;
              st = e.submit_batch(seqs.data(), host.data(), B, samplings, from_slot);
            }
            return stats_dict(st);
          },
          "seqs"_a, "ids"_a.none(), "samplings"_a, "steps"_a,
          "Commit a batched decode step that samples each row on the device, without waiting: seqs "
          "(uint32 [B]) fed ids (uint32 [B]), or None: each the token the previous submit_batch() of "
          "the same sequences sampled for it (device slot). samplings: a Sampling per row, steps "
          "(uint32 [B]) its step. At most two steps in flight; complete_batch() returns the oldest's "
          "tokens.")
      .def(
          "complete_batch",
          [](core::Engine& e) {
            std::vector<uint32_t> tok;
            {
              nb::gil_scoped_release release;
              e.complete_batch(tok);
            }
            return tok;
          },
          "Wait for the oldest submit_batch() step in flight: its sampled tokens, a list with one per "
          "row (stats via last_stats()).")
      .def(
          "count_batch", [](core::Engine& e, uint32_t B, uint32_t position) { return stats_dict(e.count_batch(B, position)); },
          "batch"_a, "position"_a = 0, "Counters of a batched step of `batch` sequences at `position` (counting device).")
      .def(
          "check_batch",
          [](core::Engine& e, uint32_t B, uint32_t position, int64_t skip, std::vector<core::StepSampling> samplings) {
            return stats_dict(e.check_batch(B, position, skip, samplings));
          },
          "batch"_a, "position"_a = 0, "skip_barrier"_a = -1, "samplings"_a = std::vector<core::StepSampling>{},
          "Emulator only: check() of a batched step of `batch` sequences at `position` (with "
          "`samplings`, a Sampling per row: the step with its device samplers, as submit_batch).")
      .def(
          "time_batch",
          [](core::Engine& e, uint32_t B, uint32_t position, uint32_t repeats, uint32_t trials, bool per_dispatch) {
            gpu::TimingOptions o;
            o.repeats = repeats;
            o.trials = trials;
            o.per_dispatch = per_dispatch;
            gpu::StepTiming t;
            {
              nb::gil_scoped_release release;
              t = e.time_batch(B, position, o);
            }
            return timing_dict(t);
          },
          "batch"_a, "position"_a = 0, "repeats"_a = 20, "trials"_a = 5, "per_dispatch"_a = true,
          "cuda only: time_step() of a batched step of `batch` sequences at `position`.")
      .def("last_stats", [](const core::Engine& e) { return stats_dict(e.last_stats()); })
      .def("reset", &core::Engine::reset)
      .def("snapshot", &core::Engine::snapshot)
      .def("restore", &core::Engine::restore, "snapshot"_a);
}

}  // namespace lily::bindings
