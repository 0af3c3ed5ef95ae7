// The emulator device: host-side API (buffers, launches, the gpu::Device implementation).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "emu/runtime.h"
#include "gpu/encoder.h"

namespace lily::emu {

enum class Order : uint8_t {
  forward,  // threads (and threadgroups) resumed in index order
  reverse,  // reverse index order
  shuffle,  // a fresh random order every scheduling round, from `seed` (default)
  // Adversarial: one simdgroup at a time runs ahead to its next threadgroup barrier (its simd
  // collectives resolved as its lanes arrive) before the next simdgroup starts, in a fresh random
  // simdgroup order for every barrier phase; threadgroups shuffled. What lockstep hides shows up:
  // a simdgroup that overwrites shared memory another one still has to read (a barrier missing
  // at the end of a loop) corrupts the slower simdgroup's reads.
  ahead,
};

// LILY_EMU_RACES=1 in the environment: the race detector is on by default. set_races_default
// overrides that for RunOptions made afterwards in this process (1 on, 0 off, -1 back to the
// environment's): the CI run turns it on for the kernel tests only (tests/conftest.py).
bool races_default();
void set_races_default(int on);

// Tests of the memory-ordering model: the device-scope fence at `site` ("shaders/x.metal:LINE", a
// threadgroup_barrier / simdgroup_barrier / atomic_thread_fence) loses its mem_device, as if the
// source said mem_threadgroup (or had no fence); "" restores every fence. Process-wide.
void set_ignored_fence(const std::string& site);

struct RunOptions {
  Order order = Order::shuffle;
  uint64_t seed = 0;
  bool fp_traps = true;              // trap arithmetic on NaN (poison) where supported
  size_t stack_bytes = 128 * 1024;   // per GPU thread
  // Race detector (own instrumentation, see docs/testing.md): the threadgroup-memory words each
  // thread changes between two of its sync points, and the device words each threadgroup
  // changes; two writers that no barrier (or atomic) orders are a KernelError. Costly: on for the
  // emulator's self-tests, where LILY_EMU_RACES=1, and for the kernel tests in CI
  // (LILY_CI_KERNEL_RACES=1: set_races_default around each one, tests/conftest.py). It includes
  // the memory-ordering model for kernels with device atomics (docs/emulator.md): a read of another
  // threadgroup's store that no device-scope fence + atomic publishes to the reader is a KernelError.
  bool races = races_default();
  // Bounds at the binding: a binding narrower than its buffer runs on a guarded copy of its range.
  bool binding_bounds = true;
  // Encoders of the device: report two dispatches that no barrier orders and whose byte ranges
  // overlap with a write on either side (DispatchHazards). On by default.
  bool hazards = true;
  // Debugging / tests: the encoder ignores its barrier number `skip_barrier` (0-based, -1: none),
  // as if the host code had not encoded it; with hazards on, a needed barrier is then reported.
  int64_t skip_barrier = -1;
  // false: the encoder validates and checks hazards but runs nothing (plans checked fast).
  bool execute = true;
};

// A buffer whose bytes end flush against an inaccessible region of kGuardBytes (and start
// kGuardBytes after another, where LILY_EMU_SIGNALS), with the slack before it and the alignment
// tail after it filled with poison. New buffers are poisoned. An access up to kGuardBytes outside
// the buffer faults at once; farther ones fault only if they hit unmapped memory.
class GuardedBuffer final : public gpu::Buffer {
 public:
  static constexpr size_t kGuardBytes = 64 * 1024;

  explicit GuardedBuffer(size_t bytes);
  // Over `bytes` of host memory the caller owns (a read-only file mapping: weights served from the
  // checkpoint's pages), without copying: no guard pages or poison around it, never made writable.
  GuardedBuffer(const void* external, size_t bytes);
  ~GuardedBuffer() override;
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  void* contents() override { return data_; }
  size_t size() const override { return size_; }

  // While a kernel runs, buffers bound only to `const device T*` parameters are read-only.
  void set_read_only(bool read_only);
  // After a dispatch: "" if the poison around the data is intact, else what was overwritten
  // (and the poison is restored).
  std::string check_slack();

  // For fault reports: where `addr` lies relative to this buffer.
  enum class Where { outside, guard_before, guard_after, slack_before, slack_after, data };
  Where classify(const void* addr) const;
  long long offset_of(const void* addr) const;  // addr - data start

 private:
  char* map_ = nullptr;
  size_t map_len_ = 0;
  char* lo_ = nullptr;    // first accessible byte (after the leading guard page)
  char* hi_ = nullptr;    // one past the last accessible byte (trailing guard page starts here)
  char* data_ = nullptr;  // hi_ - round_up(size_, 16)
  size_t size_ = 0;
  size_t guard_ = 0;
  bool external_ = false;  // memory not ours (wrap_host_memory): not unmapped, protected or poisoned
};

// One kernel launch on the emulator.
struct Launch {
  const KernelEntry* kernel = nullptr;
  const void* args = nullptr;
  size_t args_size = 0;
  std::vector<gpu::Binding> buffers;  // buffers[i] is [[buffer(i + 1)]]; must be GuardedBuffers
  gpu::Size3 groups, threads;
};

// Runs every threadgroup of the launch; throws KernelError (with the kernel name, the
// threadgroup, the thread and the shader call site) on anything a GPU would hide.
void run(const Launch& launch, const RunOptions& options);

struct Features {
  const char* fibers;  // context-switch implementation
  bool guard_pages;    // out-of-bounds access faults immediately (else: canary check after)
  bool fp_traps;       // arithmetic on poisoned memory raises immediately (else: NaN results)
};
Features features();

// Hazards between dispatches of a concurrent encoder. On the GPU (csrc/metal: a concurrent
// compute encoder) dispatches with no barrier between them run in any order or at once; the
// emulator runs them one after another, so a missing barrier would go unseen. This records, for
// every dispatch since the last barrier, what it may read (the byte range of every binding; bounds
// at the binding are enforced by run()) and what it wrote: the bytes it changed when it ran
// (`written`), else the range of every `device` (non-const) binding. A dispatch that writes bytes
// another one of the same stretch reads or writes is a KernelError naming both dispatches (kernel,
// index in the encoder, buffer index), the buffer, the bytes and the barrier they follow. Without
// `written` the check is conservative: no report means no order of the stretch changes a result.
class DispatchHazards {
 public:
  using Intervals = std::vector<std::pair<uint64_t, uint64_t>>;  // sorted, disjoint [lo, hi)

  explicit DispatchHazards(int64_t skip_barrier = -1) : skip_(skip_barrier) {}
  // written[i]: bytes of the buffer bound at [[buffer(i + 1)]] the dispatch changed (absolute
  // offsets); null: every writable binding counts as written.
  void dispatch(const gpu::Dispatch& d, const KernelEntry& k, const std::vector<Intervals>* written = nullptr);
  void barrier();
  uint64_t dispatches() const { return seq_; }
  uint64_t barriers() const { return barriers_; }

 private:
  struct Use {
    const gpu::Buffer* buffer;
    uint64_t lo, hi;  // the binding: may be read
    uint32_t index;   // [[buffer(index)]]
    Intervals writes;
  };
  struct Rec {
    const char* kernel;
    uint64_t seq;
    std::vector<Use> uses;
  };
  std::vector<Rec> stretch_;
  int64_t skip_;
  int64_t stretch_barrier_ = -1;  // the barrier the stretch follows (-1: none)
  uint64_t seq_ = 0, barriers_ = 0;
};

// gpu::Device for the emulator: dispatches execute immediately, in encoding order.
class EmuDevice final : public gpu::Device {
 public:
  explicit EmuDevice(RunOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "emu"; }
  std::unique_ptr<gpu::Buffer> new_buffer(size_t bytes) override;
  std::unique_ptr<gpu::Buffer> wrap_host_memory(const void* ptr, size_t bytes) override;
  std::unique_ptr<gpu::Encoder> new_encoder() override;
  gpu::DeviceInfo info() const override;
  // The kernel's registry entry must exist; limits are Apple's (tests simulate lower ones through
  // the device registry). Static threadgroup memory is unknown before a run (-1): the emulator
  // checks each threadgroup's allocations against kThreadgroupMemory as it runs.
  gpu::PipelineInfo pipeline_info(gpu::KernelId kernel) override;
  // An encoder with these options instead of the device's (e.g. execute = false, skip_barrier).
  std::unique_ptr<gpu::Encoder> new_encoder(const RunOptions& options);
  std::unique_ptr<gpu::Encoder> new_checking_encoder(int64_t skip_barrier, bool execute) override;
  const RunOptions& options() const { return options_; }

 private:
  RunOptions options_;
};

}  // namespace lily::emu
