// The device-independent encoding interface (plain C++, no Metal headers).
//
// Host code in csrc/gpu/ops/ decides what to dispatch (kernel, args struct, buffers, grid,
// barriers) and talks only to these classes; devices (csrc/emu/, csrc/metal/) implement them.
// Every dispatch is validated against the kernel table (csrc/gpu/kernel_ids.h) before it reaches
// a device, and counted, so the engine can report per-step dispatches / barriers / bytes bound.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/kernel_ids.h"

namespace lily::gpu {

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
  uint64_t count() const { return uint64_t(x) * y * z; }
};

// A device allocation whose contents the host can read and write: in place through contents()
// where the host addresses the storage (shared storage on Apple Silicon, guarded host memory in
// the emulator), by copies where it does not (device memory on cuda).
class Buffer {
 public:
  virtual ~Buffer() = default;
  // The host's pointer to the storage; nullptr where the host reaches it only by copies (cuda)
  // or there is none (the count device).
  virtual void* contents() = 0;
  virtual size_t size() const = 0;
  // Whether there is storage to write and read (false on the count device only).
  virtual bool has_storage() { return contents() != nullptr; }
  // Copies between the host and bytes [offset, offset + n) (EncodeError when out of range or
  // without storage). On a device whose copies are queued (cuda), write and fill are ordered after
  // the work committed before them and before the work committed after; read sees both.
  virtual void write(size_t offset, const void* src, size_t n);
  virtual void read(size_t offset, void* dst, size_t n);
  virtual void fill(size_t offset, int byte, size_t n);
  // Bytes [src_offset, src_offset + n) of src into [offset, offset + n) of this buffer, ordered as
  // write: in place where the host addresses both, on the device where it holds both (cuda:
  // cuMemcpyDtoD on its stream, never through host memory), else through a host copy.
  virtual void copy_from(Buffer& src, size_t src_offset, size_t offset, size_t n);
  template <class T>
  T read_value(size_t offset) {
    T v;
    read(offset, &v, sizeof(T));
    return v;
  }

 protected:
  void check_range(size_t offset, size_t n, const char* what) const;  // EncodeError outside [0, size())
  char* host_range(size_t offset, size_t n, const char* what);         // contents() + offset, checked
};

// One buffer argument: the byte range [offset, offset + bytes) of `buffer`.
struct Binding {
  Buffer* buffer = nullptr;
  size_t offset = 0;
  size_t bytes = 0;
};

inline constexpr uint32_t kMaxBuffers = 17;   // buffer indices 1..17 (0 holds the args struct; Metal allows 31)
inline constexpr size_t kMaxArgsBytes = 256;  // args structs go through setBytes

// Which unit of the GPU does a dispatch's arithmetic (for estimates by unit; the counters only
// record it): plain ALU code (matvecs, scans, norms, elementwise), fp32 8x8 simdgroup-matrix
// tiles, bf16 simdgroup-matrix tiles (the M1-M4 prefill design: 64-wide, double-buffered), or
// Metal 4 tensor ops (M5 neural accelerators). Default per kernel: kernel_default_unit
// (kernel_ids.h); host code may override it per dispatch with Encoder::set_unit.
enum class ExecUnit : uint8_t { alu, simdgroup_fp32, simdgroup_bf16, tensor };
const char* exec_unit_name(ExecUnit u);  // "alu", "simdgroup_fp32", "simdgroup_bf16", "tensor"
ExecUnit kernel_default_unit(KernelId id);

struct Dispatch {
  KernelId kernel{};
  ExecUnit unit = ExecUnit::alu;  // set_kernel: kernel_default_unit; set_unit overrides
  // Bytes the kernel reads plus bytes it writes through each buffer (set_buffer: the range bound;
  // set_touched overrides it: a KV cache read up to the position, the routed experts of a stack,
  // a state read and written in place).
  uint64_t touched[kMaxBuffers + 1] = {};
  alignas(16) unsigned char args[kMaxArgsBytes] = {};
  size_t args_size = 0;
  Binding buffers[kMaxBuffers + 1];  // [0] unused: index 0 is the args struct
  uint32_t num_buffers = 0;          // == kernel_info(kernel).num_buffers
  Size3 groups;                      // threadgroups in the grid
  Size3 threads;                     // threads per threadgroup
};

// Per-kernel totals of one encoder (indexed by KernelId).
struct KernelCounters {
  uint64_t dispatches = 0, bytes_touched = 0, threads = 0, groups = 0;
  uint64_t flops_executed = 0, flops_useful = 0;  // add_flops attributed to this kernel's dispatches
};

struct Counters {
  uint64_t dispatches = 0;
  uint64_t barriers = 0;
  uint64_t bytes_bound = 0;    // sum over dispatches of the byte ranges bound
  uint64_t bytes_touched = 0;  // sum over dispatches of the bytes the kernels read and write
  uint64_t threads = 0;        // GPU threads launched
  // Matrix work (2 FLOPs per multiply-add of the matmul-like products: projections, router,
  // experts, attention scores and values, the delta rule; norms, gates, softmax, conv1d and
  // elementwise ops are not counted). Added by the host ops (csrc/gpu/ops/*.cpp) with add_flops.
  uint64_t flops_executed = 0;  // what the dispatched tiles compute, padding included (MoE tiled
                                // routes: the grid's bound over every routing, see ops/moe.cpp)
  uint64_t flops_useful = 0;    // what the math needs: no tile padding, routed rows only
  KernelCounters kernels[kNumKernels];
};

// One dispatch as counted (Encoder::record, for tables of a step's kernels).
struct DispatchRecord {
  KernelId kernel{};
  Size3 groups, threads;
  uint64_t bytes_touched = 0, bytes_bound = 0;
  uint64_t level = 0;  // barriers encoded before it (dispatches with the same level may overlap)
  ExecUnit unit = ExecUnit::alu;
  uint64_t flops_executed = 0, flops_useful = 0;  // add_flops called right after it
};

// Raised for host-side encoding mistakes (unbound buffer, wrong args struct, empty grid...).
class EncodeError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

class Encoder {
 public:
  virtual ~Encoder() = default;

  void set_kernel(KernelId id);
  template <class Args>
  void set_args(const Args& args) {
    set_args_bytes(&args, sizeof(Args));
  }
  void set_args_bytes(const void* data, size_t size);
  // Binds [offset, offset + bytes) of `buffer` at [[buffer(index)]]; bytes = 0 means "to the end".
  void set_buffer(uint32_t index, Buffer& buffer, size_t offset = 0, size_t bytes = 0);
  void set_buffer(uint32_t index, const Binding& binding);
  // The bytes the pending kernel reads plus writes through buffer `index` (after set_buffer, which
  // sets the bound range), when that differs from the range bound.
  void set_touched(uint32_t index, uint64_t bytes);
  // The unit that runs the pending dispatch's arithmetic, when it differs from the kernel's
  // default (kernel_default_unit); set_kernel resets it.
  void set_unit(ExecUnit unit);
  // Validates the pending kernel/args/buffers, hands the dispatch to the device, counts it and
  // clears the bindings (every dispatch binds all of its buffers: no stale bindings).
  void dispatch(Size3 groups, Size3 threads_per_group);
  // Orders every later dispatch after every earlier one (buffer memory).
  void barrier();
  // Counts the matrix work of the dispatch just encoded (see Counters) and attributes it to that
  // dispatch (its kernel's KernelCounters and, when recording, its DispatchRecord): call it right
  // after the dispatch that does the work, once per dispatch. Forwarding encoders pass it on to
  // the encoder they wrap (which attributes it to the forwarded dispatch).
  void add_flops(uint64_t executed, uint64_t useful);

  virtual void commit() = 0;  // submit what was encoded
  virtual void wait() = 0;    // block until the submitted work finished (errors surface here)

  const Counters& counters() const { return counters_; }
  std::vector<DispatchRecord>* record = nullptr;  // when set, every dispatch is appended

  // Most threads per threadgroup `kernel`'s pipeline takes on this encoder's device (Metal:
  // maxTotalThreadsPerThreadgroup). Host code with a flexible thread count (rms_norm) fits it;
  // wrapping encoders forward it to the encoder they wrap.
  virtual uint32_t thread_limit(KernelId kernel) const;
  // Whether this encoder's device runs the Metal 4 tensor-op kernels (DeviceInfo::tensor_ops;
  // kernel_needs_tensor_ops): host ops pick their M5 routes on it. Wrapping encoders forward it.
  virtual bool tensor_ops() const { return false; }
  // Whether the tensor-op routes may take int8 activations (DeviceInfo::tensor_int8: qmm_m5i8 for
  // bf16 x and 4-bit weights, moe_*_m5i8 for the MoE 64-row tiles). Wrapping encoders forward it.
  virtual bool tensor_int8() const { return false; }

 protected:
  virtual void encode_dispatch(const Dispatch& d) = 0;
  virtual void encode_barrier() = 0;
  virtual void forward_flops(uint64_t /*executed*/, uint64_t /*useful*/) {}

 private:
  [[noreturn]] void bad_binding(uint32_t index, const Binding& b) const;  // throws the EncodeError
  [[noreturn]] void bad_dispatch(Size3 groups, Size3 threads) const;
  Dispatch pending_;
  bool have_kernel_ = false;
  bool have_args_ = false;
  uint32_t bound_mask_ = 0;
  int64_t last_kernel_ = -1;    // kernel of the last dispatch (add_flops attributes to it)
  size_t last_record_ = 0;      // record->size() after the last dispatch (0: none recorded)
  Counters counters_;
};

inline constexpr uint32_t kMaxThreadsPerGroup = 1024;        // Apple GPUs' largest threadgroup
inline constexpr uint64_t kMaxThreadgroupMemory = 32 * 1024;  // bytes, Apple7+ (and the emulator)

// One kernel's compiled pipeline on a device (Metal: MTLComputePipelineState).
struct PipelineInfo {
  uint32_t max_threads = kMaxThreadsPerGroup;  // maxTotalThreadsPerThreadgroup
  int64_t static_threadgroup_bytes = -1;       // staticThreadgroupMemoryLength; -1: unknown
  uint32_t simd_width = 32;                    // threadExecutionWidth
};

// What a device is and what it allows (doctor, the engine's load checks). 0 = unlimited/unknown.
struct DeviceInfo {
  std::string name;            // registry name: "metal", "emu", "count"
  std::string device_name;     // "Apple M3 Max", "CPU emulator", ...
  std::string gpu_family;      // "apple9" ("" where not a GPU)
  uint64_t working_set_bytes = 0;  // recommendedMaxWorkingSetSize
  uint64_t max_buffer_bytes = 0;   // maxBufferLength
  std::string library_path;    // metallib or run-time-compiled source in use
  std::string library_source;  // "metallib" | "source" | ""
  std::string metallib_error;  // why an installed lily.metallib was not used ("" if it was / none)
  bool metallib_built = false; // a lily.metallib is installed next to the module
  std::string build_target;    // OS the core was built for, e.g. "macOS 14.0", "linux"
  std::string build_sdk;       // SDK it was compiled against, e.g. "macOS SDK 14.2"
  std::string math_mode;       // how the library's math was compiled
  bool residency_set = false;  // weights and state in an MTLResidencySet
  bool simulated = false;      // limits set by a test (emu / count)
  // Metal 4 tensor ops (mpp::tensor_ops::matmul2d): Metal reports it for an Apple GPU family 10+
  // device on macOS 26+ with lily_m5.metallib loaded; emu / count when a simulation asks for it.
  bool tensor_ops = false;
  // The tensor-op routes take int8 activations where they have them (qmm_m5i8, moe_*_m5i8; docs/int8.md,
  // "int8 activations on the tensor ops"). Only with tensor_ops.
  bool tensor_int8 = false;
  std::string tensor_ops_reason;  // why not ("" when tensor_ops)
};
// GPU times of one step's dispatches (Device::new_timing_encoder: the cuda device). Each dispatch is
// timed alone (a graph of `repeats` launches of it, `trials` times: median, min, max of the
// per-launch time); the whole step as the device records it (one graph), replayed `trials` times;
// a graph of the same levels and node counts whose kernels do nothing; and, for each dispatch's
// bytes_touched, a device copy (cuMemcpyDtoD of half the bytes: read + write = the same bytes) and
// a read-only streaming kernel of those bytes.
struct TimingOptions {
  uint32_t repeats = 20;      // launches per timed graph of one dispatch
  uint32_t trials = 5;        // timed graphs per dispatch (and replays of the whole step)
  bool per_dispatch = true;   // time every dispatch alone (false: the whole step and the empty graph only)
};
struct DispatchTime {
  DispatchRecord record;                   // kernel, grid, level, bytes, flops
  double us = 0, us_min = 0, us_max = 0;   // median / min / max per launch
  double copy_us = 0, read_us = 0;         // the references for record.bytes_touched
};
struct StepTiming {
  std::vector<DispatchTime> dispatches;   // in encoding order (empty unless per_dispatch)
  double step_us = 0, step_us_min = 0, step_us_max = 0;
  double empty_us = 0;                    // the empty graph of the same levels
  uint64_t levels = 0, nodes = 0;
  double copy_gbps = 0, read_gbps = 0;    // 1 GiB references: device copy (bytes read + written) and streaming read
};

// Re-encodes a dispatch `d` (as a device received it) on `inner`: for encoders that wrap another.
void forward_dispatch(Encoder& inner, const Dispatch& d);

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string_view name() const = 0;
  virtual std::unique_ptr<Buffer> new_buffer(size_t bytes) = 0;
  // A buffer over host memory [ptr, ptr + bytes) without copying it (Metal:
  // newBufferWithBytesNoCopy; the emulator: its buffer type over those pages): `ptr` page-aligned,
  // `bytes` a multiple of the page size, the memory kept alive (and unchanged) by the caller for
  // the buffer's lifetime; the kernels only read it. nullptr where the device cannot (count, cuda:
  // device memory) or will not (over maxBufferLength): the caller copies instead.
  virtual std::unique_ptr<Buffer> wrap_host_memory(const void* /*ptr*/, size_t /*bytes*/) { return nullptr; }
  virtual std::unique_ptr<Encoder> new_encoder() = 0;

  virtual DeviceInfo info() const = 0;
  // Creates `kernel`'s pipeline if needed and reports its limits; throws std::runtime_error when
  // the pipeline cannot be created.
  virtual PipelineInfo pipeline_info(KernelId kernel) = 0;
  // Buffers the GPU should keep resident (weights, state): Metal on macOS 15+ adds them to an
  // MTLResidencySet attached to the queue; elsewhere a no-op.
  virtual void make_resident(const std::vector<Buffer*>& buffers) {}
  // Devices that can check a plan (the emulator): an encoder that checks hazards between
  // dispatches, ignores its barrier number `skip_barrier` (-1: none) and runs the dispatches only
  // when `execute`. nullptr where the device cannot (Metal, counting).
  virtual std::unique_ptr<Encoder> new_checking_encoder(int64_t skip_barrier, bool execute) { return nullptr; }
  // Devices that time dispatches on the GPU (cuda): an encoder whose commit() runs the encoded work
  // under the timings of TimingOptions (many times: the state it updates is garbage after) and whose
  // wait() fills *out; nullptr elsewhere.
  virtual std::unique_ptr<Encoder> new_timing_encoder(const TimingOptions& /*options*/, StepTiming* /*out*/) {
    return nullptr;
  }
};

}  // namespace lily::gpu
