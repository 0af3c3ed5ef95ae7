// lily_py._core.emu: the emulator's registry, features and a raw dispatch (used by the emulator's
// own tests to run self-test kernels by name).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/device.h"
#include "emu/emulator.h"
#if defined(LILY_HAVE_METAL)
#include "metal/metal_device.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {

emu::Order parse_order(const std::string& s) {
  if (s == "forward") return emu::Order::forward;
  if (s == "reverse") return emu::Order::reverse;
  if (s == "shuffle") return emu::Order::shuffle;
  throw std::invalid_argument("order must be 'forward', 'reverse' or 'shuffle', got '" + s + "'");
}

std::unique_ptr<gpu::Device> make_device(const std::string& name, const std::string& order,
                                         uint64_t seed, bool fp_traps) {
  if (name == "emu") {
    emu::RunOptions o;
    o.order = parse_order(order);
    o.seed = seed;
    o.fp_traps = fp_traps;
    return std::make_unique<emu::EmuDevice>(o);
  }
  if (name == "metal") {
#if defined(LILY_HAVE_METAL)
    return metal::create_device();
#else
    throw std::invalid_argument("device 'metal' is not available in this build (built without "
                                "LILY_METAL: not macOS); use device='emu'");
#endif
  }
  throw std::invalid_argument("unknown device '" + name + "' (expected 'emu' or 'metal')");
}

void init_emu(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("emu", "The CPU emulator of the Metal kernels (device \"emu\").");

  nb::exception<emu::KernelError>(parent, "EmulatorError", PyExc_RuntimeError);

  m.def("kernels", [] {
    nb::list out;
    for (const emu::KernelEntry* k : emu::registered_kernels()) {
      nb::list ro;
      for (uint32_t i = 0; i < k->num_buffers; ++i) ro.append(k->buffers[i].read_only);
      nb::dict d;
      d["name"] = k->name;
      d["file"] = k->file;
      d["args_size"] = k->args_size;
      d["num_buffers"] = k->num_buffers;
      d["read_only"] = ro;
      out.append(d);
    }
    return out;
  }, "Every kernel registered in the emulator: name, file, args_size, num_buffers, read_only.");

  m.def("features", [] {
    emu::Features f = emu::features();
    nb::dict d;
    d["fibers"] = f.fibers;
    d["guard_pages"] = f.guard_pages;
    d["fp_traps"] = f.fp_traps;
    d["simd_width"] = emu::kSimdWidth;
    d["threadgroup_memory"] = emu::kThreadgroupMemory;
    return d;
  }, "What this build's emulator detects immediately (see csrc/emu/platform.h).");

  m.def(
      "dispatch",
      [](const std::string& name, nb::bytes args, std::vector<InOutArray> buffers,
         std::tuple<uint32_t, uint32_t, uint32_t> groups, std::tuple<uint32_t, uint32_t, uint32_t> threads,
         const std::string& order, uint64_t seed, bool fp_traps) {
        const emu::KernelEntry* k = emu::find_kernel(name);
        LILY_REQUIRE(k != nullptr, "emu.dispatch: no kernel named '" + name + "' in the emulator registry");
        emu::RunOptions opt;
        opt.order = parse_order(order);
        opt.seed = seed;
        opt.fp_traps = fp_traps;
        emu::EmuDevice dev(opt);
        std::vector<std::unique_ptr<gpu::Buffer>> bufs;
        emu::Launch L;
        L.kernel = k;
        std::string a(args.c_str(), args.size());
        L.args = a.data();
        L.args_size = a.size();
        for (size_t i = 0; i < buffers.size(); ++i) {
          LILY_REQUIRE(buffers[i].nbytes() > 0, "emu.dispatch: buffer " + std::to_string(i + 1) + " is empty");
          bufs.push_back(upload(dev, buffers[i].data(), buffers[i].nbytes()));
          L.buffers.push_back({bufs.back().get(), 0, bufs.back()->size()});
        }
        L.groups = {std::get<0>(groups), std::get<1>(groups), std::get<2>(groups)};
        L.threads = {std::get<0>(threads), std::get<1>(threads), std::get<2>(threads)};
        {
          nb::gil_scoped_release release;
          emu::run(L, opt);
        }
        for (size_t i = 0; i < buffers.size(); ++i)  // copy results back (writable parameters only)
          if (!k->buffers[i].read_only) std::memcpy(buffers[i].data(), bufs[i]->contents(), buffers[i].nbytes());
      },
      "kernel"_a, "args"_a, "buffers"_a, "groups"_a, "threads"_a, nb::kw_only(), "order"_a = "shuffle",
      "seed"_a = 0, "fp_traps"_a = true,
      "Run one registered kernel on copies of `buffers` ([[buffer(1)]], ...; C-contiguous, writable) "
      "with `args` as the [[buffer(0)]] bytes; results of non-const buffers are copied back. Raises "
      "EmulatorError for kernel faults.");
}

}  // namespace lily::bindings
