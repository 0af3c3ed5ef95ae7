// The one place devices are made (issue 13): name -> factory, with availability and the reason a
// device is unavailable. The engine, the op bindings, backend="auto", doctor and bench all ask
// this registry; nothing else includes a concrete device's header.
//
//   metal  the GPU (macOS builds with LILY_METAL; Apple7+ family, library loaded)
//   emu    the CPU emulator of the Metal kernels (always)
//   count  counts what a step would dispatch; no memory, nothing runs (always)
//
// Simulation (tests): limits a Mac would impose, applied to the emu and count devices: per-kernel
// maxTotalThreadsPerThreadgroup (enforced at dispatch, as Metal refuses such a dispatch), static
// threadgroup memory, recommendedMaxWorkingSetSize and maxBufferLength; and, on request, Metal 4
// tensor ops (an M5), so the emulator runs and checks the M5 kernels.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/encoder.h"

namespace lily::devices {

struct Status {
  std::string name;
  bool available = false;
  std::string reason;       // why not available ("" when available)
  std::string description;  // one line: what the device is
};

// Emulator run options (ignored by other devices).
struct Options {
  std::string order = "shuffle";  // "forward", "reverse", "shuffle"
  uint64_t seed = 0;
  bool fp_traps = true;
};

// Every registered device, in the order backend="auto" prefers them.
std::vector<Status> list();
// Throws std::invalid_argument for a name the registry does not know.
Status status(const std::string& name);
// Throws std::invalid_argument (unknown / unavailable, with the reason).
std::unique_ptr<gpu::Device> create(const std::string& name, const Options& options = {});
// "" when `name` is available AND every kernel's pipeline can be created on it; else why not.
std::string check_usable(const std::string& name);

struct Simulation {
  bool active = false;
  uint32_t default_max_threads = 0;                   // 0: the device's own (1024)
  std::map<std::string, uint32_t> max_threads;        // kernel name -> limit
  std::map<std::string, int64_t> threadgroup_bytes;   // kernel name -> static threadgroup bytes
  uint64_t working_set_bytes = 0;                     // 0: unlimited
  uint64_t max_buffer_bytes = 0;                      // 0: unlimited
  bool tensor_ops = false;  // report Metal 4 tensor ops: host ops take their M5 routes (emu runs them)
  bool tensor_int8 = false;  // with tensor_ops: the M5 routes take int8 activations where they have them
};
void set_simulation(const Simulation& s);  // applies to emu / count devices created afterwards
Simulation simulation();

}  // namespace lily::devices
