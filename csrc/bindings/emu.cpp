// lily_py._core.emu: the emulator's registry, features and a raw dispatch (used by the emulator's
// own tests to run self-test kernels by name).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/device.h"
#include "core/device_registry.h"
#include "emu/emulator.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {

emu::Order parse_order(const std::string& s) {
  if (s == "forward") return emu::Order::forward;
  if (s == "reverse") return emu::Order::reverse;
  if (s == "shuffle") return emu::Order::shuffle;
  if (s == "ahead") return emu::Order::ahead;
  throw std::invalid_argument("order must be 'forward', 'reverse', 'shuffle' or 'ahead', got '" + s + "'");
}

std::unique_ptr<gpu::Device> make_device(const std::string& name, const std::string& order,
                                         uint64_t seed, bool fp_traps) {
  if (name == "count") throw std::invalid_argument("ops run on 'emu' or 'metal', not 'count'");
  devices::Options o;
  o.order = order;
  o.seed = seed;
  o.fp_traps = fp_traps;
  parse_order(order);  // validate even for devices that ignore it
  return devices::create(name, o);
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
      "set_races_default", [](std::optional<bool> on) { emu::set_races_default(on ? int(*on) : -1); }, "on"_a.none(),
      "The race detector's default for emulator runs started afterwards in this process: True / False, or None "
      "for the environment's (LILY_EMU_RACES=1 turns it on).");
  m.def("races_default", [] { return emu::races_default(); }, "The race detector's current default.");
  m.def(
      "set_ignored_fence", [](std::optional<std::string> site) { emu::set_ignored_fence(site ? *site : ""); },
      "site"_a.none(),
      "Tests of the memory-ordering model: the device-scope fence at `site` ('shaders/x.metal:LINE') loses "
      "mem_device in emulator runs started afterwards (None: every fence counts again).");

  m.def(
      "dispatch",
      [](const std::string& name, nb::bytes args, std::vector<InOutArray> buffers,
         std::tuple<uint32_t, uint32_t, uint32_t> groups, std::tuple<uint32_t, uint32_t, uint32_t> threads,
         const std::string& order, uint64_t seed, bool fp_traps, std::vector<std::tuple<size_t, size_t>> ranges,
         bool races) {
        const emu::KernelEntry* k = emu::find_kernel(name);
        LILY_REQUIRE(k != nullptr, "emu.dispatch: no kernel named '" + name + "' in the emulator registry");
        emu::RunOptions opt;
        opt.order = parse_order(order);
        opt.seed = seed;
        opt.fp_traps = fp_traps;
        opt.races = races;
        emu::EmuDevice dev(opt);
        std::vector<std::unique_ptr<gpu::Buffer>> bufs;
        require(ranges.empty() || ranges.size() == buffers.size(), "emu.dispatch: one range per buffer");
        emu::Launch L;
        L.kernel = k;
        std::string a(args.c_str(), args.size());
        L.args = a.data();
        L.args_size = a.size();
        for (size_t i = 0; i < buffers.size(); ++i) {
          LILY_REQUIRE(buffers[i].nbytes() > 0, "emu.dispatch: buffer " + std::to_string(i + 1) + " is empty");
          bufs.push_back(upload(dev, buffers[i].data(), buffers[i].nbytes()));
          size_t off = 0, bytes = bufs.back()->size();
          if (!ranges.empty()) {
            off = std::get<0>(ranges[i]);
            bytes = std::get<1>(ranges[i]) ? std::get<1>(ranges[i]) : bytes - std::min(off, bytes);
            require(off + bytes <= bufs.back()->size() && bytes > 0, "emu.dispatch: range " + std::to_string(i) + " outside its array");
          }
          L.buffers.push_back({bufs.back().get(), off, bytes});
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
      "seed"_a = 0, "fp_traps"_a = true, "ranges"_a = std::vector<std::tuple<size_t, size_t>>{},
      "races"_a = true,
      "Run one registered kernel on copies of `buffers` ([[buffer(1)]], ...; C-contiguous, writable) "
      "with `args` as the [[buffer(0)]] bytes; results of non-const buffers are copied back. "
      "`ranges`: (offset, bytes or 0 = to the end) bound of each buffer (default: all of it). "
      "`races`: the write-race detector (RunOptions::races). Raises EmulatorError for kernel faults.");

  m.def(
      "encode",
      [](std::vector<InOutArray> arrays, nb::list commands, bool execute, int64_t skip_barrier,
         const std::string& order, uint64_t seed) {
        emu::RunOptions opt;
        opt.order = parse_order(order);
        opt.seed = seed;
        opt.execute = execute;
        opt.skip_barrier = skip_barrier;
        emu::EmuDevice dev(opt);
        std::vector<std::unique_ptr<gpu::Buffer>> bufs;
        for (size_t i = 0; i < arrays.size(); ++i) {
          require(arrays[i].nbytes() > 0, "emu.encode: array " + std::to_string(i) + " is empty");
          bufs.push_back(upload(dev, arrays[i].data(), arrays[i].nbytes()));
        }
        auto enc = dev.new_encoder();
        struct Cmd {
          bool barrier = false;
          gpu::KernelId kernel{};
          std::string args;
          std::vector<gpu::Binding> bindings;
          gpu::Size3 groups, threads;
        };
        std::vector<Cmd> cmds;
        for (nb::handle h : commands) {
          Cmd c;
          if (nb::isinstance<nb::str>(h)) {
            require(nb::cast<std::string>(h) == "barrier", "emu.encode: a string command must be 'barrier'");
            c.barrier = true;
          } else {
            auto t = nb::cast<std::tuple<std::string, nb::bytes, std::vector<std::tuple<size_t, size_t, size_t>>,
                                         std::tuple<uint32_t, uint32_t, uint32_t>,
                                         std::tuple<uint32_t, uint32_t, uint32_t>>>(h);
            auto id = gpu::find_kernel(std::get<0>(t));
            require(id.has_value(), "emu.encode: no kernel named '" + std::get<0>(t) + "' in the kernel table");
            c.kernel = *id;
            c.args.assign(std::get<1>(t).c_str(), std::get<1>(t).size());
            for (auto [i, off, bytes] : std::get<2>(t)) {
              require(i < bufs.size(), "emu.encode: binding names array " + std::to_string(i));
              c.bindings.push_back({bufs[i].get(), off, bytes ? bytes : bufs[i]->size() - off});
            }
            auto [gx, gy, gz] = std::get<3>(t);
            auto [tx, ty, tz] = std::get<4>(t);
            c.groups = {gx, gy, gz};
            c.threads = {tx, ty, tz};
          }
          cmds.push_back(std::move(c));
        }
        {
          nb::gil_scoped_release release;
          for (const Cmd& c : cmds) {
            if (c.barrier) {
              enc->barrier();
              continue;
            }
            enc->set_kernel(c.kernel);
            enc->set_args_bytes(c.args.data(), c.args.size());
            for (size_t i = 0; i < c.bindings.size(); ++i) enc->set_buffer(uint32_t(i + 1), c.bindings[i]);
            enc->dispatch(c.groups, c.threads);
          }
          enc->commit();
          enc->wait();
        }
        for (size_t i = 0; i < arrays.size(); ++i) std::memcpy(arrays[i].data(), bufs[i]->contents(), arrays[i].nbytes());
        const gpu::Counters& k = enc->counters();
        nb::dict d;
        d["dispatches"] = k.dispatches;
        d["barriers"] = k.barriers;
        return d;
      },
      "arrays"_a, "commands"_a, nb::kw_only(), "execute"_a = true, "skip_barrier"_a = -1, "order"_a = "shuffle",
      "seed"_a = 0,
      "Encode `commands` on one emulator encoder over copies of `arrays` (copied back after): each "
      "command is 'barrier' or (kernel table name, args bytes, [(array index, offset, bytes or 0 = "
      "to the end), ...] for [[buffer(1)]].., groups, threads). Dispatch hazards raise EmulatorError; "
      "execute=False only checks; skip_barrier ignores that barrier. Returns the counters.");
}

}  // namespace lily::bindings
