// Emulator runtime interface shared by the shader translation unit (csrc/emu/shaders_emu.cpp,
// through the Metal shim csrc/emu/metal_emu.h) and the runtime itself (csrc/emu/runtime.cpp).
//
// Plain C++, no Metal macros: it is included before the shim defines `device`, `thread`, ...
//
// Execution model: one dispatch runs its threadgroups one after another on the calling OS
// thread; inside a threadgroup every GPU thread is a fiber. A fiber runs until it reaches a
// synchronisation point (threadgroup_barrier, simdgroup_barrier, a simd_* collective or
// simdgroup_multiply_accumulate), then yields. The scheduler releases a simdgroup when all of its live lanes wait at the same
// collective, and the threadgroup when all of its threads wait at the same barrier; anything else
// (a lane that skipped a collective, a thread that returned while others wait at a barrier,
// threads at different barriers) is reported as a KernelError naming the call sites.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lily::emu {

// ---- kernel registry (filled by LILY_INSTANTIATE in the shader TU) ----------------------------

struct ThreadIds {
  uint32_t group_pos[3];   // [[threadgroup_position_in_grid]]
  uint32_t thread_pos[3];  // [[thread_position_in_threadgroup]]
  uint32_t group_size[3];  // [[threads_per_threadgroup]]
  uint32_t grid_pos[3];    // [[thread_position_in_grid]]
  uint32_t lane;           // [[thread_index_in_simdgroup]]
  uint32_t simd_id;        // [[simdgroup_index_in_threadgroup]]
};

inline constexpr uint32_t kMaxKernelBuffers = 17;

struct BufferParam {
  bool read_only;      // declared as pointer to const (e.g. `const device float*`)
  uint32_t elem_size;  // sizeof(pointee)
  bool atomic = false;  // declared as pointer to an atomic type (`device atomic_uint*`)
};

using ThreadEntry = void (*)(const void* args, void* const* buffers, const ThreadIds& ids);

struct KernelEntry {
  const char* name = nullptr;  // [[host_name]]
  const char* file = nullptr;  // shader source that instantiated it
  ThreadEntry entry = nullptr;
  size_t args_size = 0;
  uint32_t num_buffers = 0;  // buffers at indices 1..num_buffers; entry gets buffers[0..n-1]
  BufferParam buffers[kMaxKernelBuffers] = {};
};

bool register_kernel(const KernelEntry& e);
const KernelEntry* find_kernel(std::string_view name);
std::vector<const KernelEntry*> registered_kernels();

// ---- what a running GPU thread sees (used by the shim) --------------------------------------

inline constexpr uint32_t kSimdWidth = 32;
inline constexpr size_t kSlotBytes = 64;           // largest value a simd_* collective exchanges
inline constexpr size_t kThreadgroupMemory = 32768; // Metal's threadgroup memory limit
inline constexpr size_t kRedZoneBytes = 64;         // poisoned gap before every threadgroup array
inline constexpr size_t kArenaBytes = 2 * kThreadgroupMemory;  // the emulator's arena (red zones included)

struct ThreadState;

struct LaneView {
  uint32_t lane;         // index in the simdgroup
  uint32_t simd_width;   // lanes that exist in this simdgroup (32 unless the group is partial)
  uint32_t simd_seq;     // simd collectives this lane has passed
  unsigned char* slots;  // simdgroup exchange area [2][kSimdWidth][kSlotBytes], parity = simd_seq & 1
};

// The calling GPU thread (valid only inside a kernel).
LaneView& lane_view();

// Collective rendezvous: returns when every live lane of the simdgroup reached the same call site.
// `mem`: the mem_flags bits of a simdgroup_barrier (kMemDevice: also a device-scope fence).
void simd_sync(const char* op, const char* file, int line, unsigned mem = 0);
// threadgroup_barrier: returns when every thread of the threadgroup reached the same barrier.
void threadgroup_sync(const char* file, int line, unsigned mem = 0);
// Memory-ordering model (RunOptions::races, kernels that use device atomics; docs/emulator.md): a
// device-scope fence of the calling thread (atomic_thread_fence with mem_device). A barrier with
// kMemDevice is one for every thread it syncs.
inline constexpr unsigned kMemDevice = 1;  // mem_flags::mem_device
void device_fence(const char* file, int line);
// A threadgroup-wide collective other than a barrier (a tensor op whose execution scope is every
// simdgroup of the threadgroup): the same rendezvous and checks as threadgroup_sync, reported as `op`.
void threadgroup_collective(const char* op, const char* file, int line);
// The calling GPU thread's linear index in its threadgroup, and the threadgroup's thread count.
uint32_t thread_index_in_group();
uint32_t threads_in_group();
// Storage for a threadgroup array declared with LILY_TG_ARRAY. Every thread of the group makes the
// same sequence of calls and gets the same address; the memory starts poisoned (signalling NaN).
void* threadgroup_alloc(size_t bytes, size_t align, const char* file, int line);
// The race detector ignores words accessed through atomic_* functions (they may be updated by
// several threads or threadgroups at once).
void note_atomic(const void* addr);
// Raises a KernelError from inside a GPU thread (bad shuffle lane, ...).
[[noreturn]] void kernel_fail(const std::string& what, const char* file, int line);

// Byte pattern of poisoned memory: as float 0xFFA0FFA0 and as bfloat 0xFFA0 are signalling NaNs,
// so arithmetic on a poisoned value traps when fp traps are on (Linux), and shows as NaN otherwise.
inline constexpr uint32_t kPoisonWord = 0xFFA0FFA0u;

// ---- errors ----------------------------------------------------------------------------------

// A kernel did something a GPU would hide or corrupt: raised to Python as lily_py._core.EmulatorError.
class KernelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace lily::emu
