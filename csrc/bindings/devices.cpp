// lily_py._core.registry: the device registry (csrc/core/device_registry.h) for Python -
// backend="auto", lily_py.devices(), doctor and bench ask it - and the simulated limits tests use.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "core/device_registry.h"
#include "gpu/kernel_ids.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {

namespace {

nb::object opt_str(const std::string& s) { return s.empty() ? nb::none() : nb::cast(s); }
nb::object opt_bytes(uint64_t v) { return v == 0 ? nb::none() : nb::cast(v); }

// The OS this core was compiled for (Metal reports its own deployment target and SDK).
std::string host_build_target() {
#if defined(__APPLE__) && defined(__ENVIRONMENT_MAC_OS_X_VERSION_MIN_REQUIRED__)
  const long v = __ENVIRONMENT_MAC_OS_X_VERSION_MIN_REQUIRED__;
  return "macOS " + std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100);
#elif defined(__APPLE__)
  return "macOS";
#elif defined(__linux__)
  return "linux";
#else
  return "unknown";
#endif
}

}  // namespace

void init_devices(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("registry", "The device registry: every device, availability, info, limits.");

  m.def("list", [] {
    nb::list out;
    for (const devices::Status& s : devices::list()) {
      nb::dict d;
      d["name"] = s.name;
      d["available"] = s.available;
      d["reason"] = s.reason;
      d["description"] = s.description;
      out.append(d);
    }
    return out;
  }, "Every device in backend='auto' preference order: dicts of name, available, reason, description.");

  m.def("check_usable", &devices::check_usable, "name"_a,
        "'' when the device is available and every kernel's pipeline can be created on it; else why not.");

  m.def("info", [](const std::string& name) {
    gpu::DeviceInfo i;
    {
      std::unique_ptr<gpu::Device> dev = devices::create(name);
      i = dev->info();
    }
    nb::dict d;
    d["name"] = i.name;
    d["device_name"] = i.device_name;
    d["gpu_family"] = opt_str(i.gpu_family);
    d["working_set_bytes"] = opt_bytes(i.working_set_bytes);
    d["max_buffer_bytes"] = opt_bytes(i.max_buffer_bytes);
    d["library_path"] = opt_str(i.library_path);
    d["library_source"] = opt_str(i.library_source);
    d["metallib_error"] = opt_str(i.metallib_error);
    d["metallib_built"] = i.metallib_built;
    d["build_target"] = i.build_target.empty() ? host_build_target() : i.build_target;
    d["build_sdk"] = opt_str(i.build_sdk);
    d["math_mode"] = opt_str(i.math_mode);
    d["residency_set"] = i.residency_set;
    d["simulated"] = i.simulated;
    d["tensor_ops"] = i.tensor_ops;
    d["tensor_int8"] = i.tensor_int8;
    d["tensor_ops_reason"] = opt_str(i.tensor_ops_reason);
    return d;
  }, "name"_a, "Device facts (see docs/metal.md); raises ValueError when the device is unavailable.");

  m.def("pipeline_limits", [](const std::string& name) {
    std::unique_ptr<gpu::Device> dev = devices::create(name);
    const bool tensor_ops = dev->info().tensor_ops;
    nb::list out;
    for (const gpu::KernelInfo& k : gpu::kKernelTable) {
      gpu::PipelineInfo p;
      try {
        p = dev->pipeline_info(k.id);
      } catch (const std::exception&) {
        // A tensor-op kernel on a device without tensor ops (Metal without lily_m5.metallib) has
        // no pipeline: not listed. The emulator has them all.
        if (gpu::kernel_needs_tensor_ops(k.id) && !tensor_ops) continue;
        throw;
      }
      nb::dict d;
      d["kernel"] = std::string(k.name);
      d["max_threads"] = p.max_threads;
      d["static_threadgroup_bytes"] = p.static_threadgroup_bytes < 0 ? nb::none() : nb::cast(p.static_threadgroup_bytes);
      d["simd_width"] = p.simd_width;
      out.append(d);
    }
    return out;
  }, "name"_a, "Every kernel's pipeline limits on the device (creates every pipeline): kernel, max_threads, "
               "static_threadgroup_bytes (None: unknown), simd_width.");

  m.def("set_simulation",
        [](uint32_t default_max_threads, std::map<std::string, uint32_t> max_threads,
           std::map<std::string, int64_t> threadgroup_bytes, uint64_t working_set_bytes, uint64_t max_buffer_bytes,
           bool tensor_ops, bool tensor_int8) {
          for (const auto& [k, v] : max_threads)
            if (!gpu::find_kernel(k)) throw std::invalid_argument("set_simulation: no kernel named '" + k + "'");
          for (const auto& [k, v] : threadgroup_bytes)
            if (!gpu::find_kernel(k)) throw std::invalid_argument("set_simulation: no kernel named '" + k + "'");
          devices::Simulation s;
          s.active = true;
          s.default_max_threads = default_max_threads;
          s.max_threads = std::move(max_threads);
          s.threadgroup_bytes = std::move(threadgroup_bytes);
          s.working_set_bytes = working_set_bytes;
          s.max_buffer_bytes = max_buffer_bytes;
          s.tensor_ops = tensor_ops;
          s.tensor_int8 = tensor_int8;
          devices::set_simulation(s);
        },
        "default_max_threads"_a = 0, "max_threads"_a = std::map<std::string, uint32_t>{},
        "threadgroup_bytes"_a = std::map<std::string, int64_t>{}, "working_set_bytes"_a = 0, "max_buffer_bytes"_a = 0,
        "tensor_ops"_a = false, "tensor_int8"_a = false,
        "Simulate a Mac's limits on the emu and count devices made afterwards (0 = unlimited / the default); "
        "tensor_ops: the devices report Metal 4 tensor ops (host ops take their M5 routes); tensor_int8 (with "
        "tensor_ops): those routes take int8 activations where they have them (qmm_m5i8 for the bf16 "
        "projections, moe_*_m5i8 for the MoE 64-row tiles).");
  m.def("clear_simulation", [] { devices::set_simulation(devices::Simulation{}); });
  m.def("simulation_active", [] { return devices::simulation().active; });
}

}  // namespace lily::bindings
