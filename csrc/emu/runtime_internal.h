// What the emulator runtime's source files share, private to them: runtime.cpp (the registry,
// the calls from GPU threads, launches), scheduler.cpp (threadgroups of fibers), memory_order.cpp
// (the model of what a threadgroup may read of another's stores) and faults.cpp (signals, guard
// pages, fault reports). The state of a launch: its threads, threadgroup, bound buffers and the
// per-OS-thread Worker; message helpers. Plain C++ like runtime.h: no Metal macros here.
#pragma once

#include "emu/platform.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(LILY_EMU_SIGNALS)
#include <ucontext.h>
#endif
#include <cfenv>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "emu/emulator.h"
#include "emu/fiber.h"
#include "emu/runtime.h"

namespace lily::emu::rt {

enum class St : uint8_t { runnable, at_simd, at_barrier, done };

struct Group;

struct Thread {
  LaneView view{};
  ThreadIds ids{};
  uint32_t index = 0;  // linear index in the threadgroup
  St state = St::runnable;
  uint32_t barrier_seq = 0;
  const char* op = nullptr;  // last synchronisation point reached
  const char* file = nullptr;
  int line = 0;
  unsigned mem = 0;  // mem_flags of the barrier it waits at
  const char* seg_op = nullptr;  // the sync point its running segment follows (memory-ordering model)
  const char* seg_file = nullptr;
  int seg_line = 0;
  uint32_t n_allocs = 0;  // threadgroup_alloc calls made so far
  Fiber* fiber = nullptr;
  Group* group = nullptr;
};

struct Alloc {
  size_t offset, bytes;
  const char* file;
  int line;
};

// Race detector (RunOptions::races), threadgroup memory: per 2-byte unit (bfloat is the smallest store), the last thread that
// changed it and when (threadgroup barrier epoch, its simdgroup's collective count, the sync
// point its code ran after).
struct TgWrite {
  uint32_t writer = 0;  // thread index + 1; 0: not written in this threadgroup
  uint32_t epoch = 0;
  uint32_t simd_seq = 0;
  const char* op = nullptr;
  const char* file = nullptr;
  int line = 0;
};

struct Group {
  const KernelEntry* kernel = nullptr;
  const void* args = nullptr;
  void* const* buffers = nullptr;
  uint32_t group_pos[3] = {0, 0, 0};
  std::vector<Thread> threads;
  uint32_t n = 0, nsimd = 0;
  unsigned char* slots = nullptr;
  unsigned char* arena = nullptr;
  std::vector<Alloc> allocs;
  size_t arena_used = 0;  // in the emulator's arena (red zones included)
  size_t metal_used = 0;  // as Metal lays the arrays out (the limit applies to this)
  uint32_t epoch = 0;     // threadgroup barriers passed
  bool races = false;
  std::vector<TgWrite> tg_writes;       // per arena word (races)
  std::vector<unsigned char> tg_snap;   // arena before the running fiber's segment (races)
  size_t tg_writes_end = 0;             // tg_writes[0, tg_writes_end) may be set (races)
  std::string error;  // first error; non-empty aborts the threadgroup
  void fail(const std::string& e) {
    if (error.empty()) error = e;
  }
};

// What a fault handler needs to classify an address (set per launch, read in the handler).
struct BoundBuffer {
  GuardedBuffer* buffer;  // what the kernel sees: the buffer, or a shadow of the bound range
  uint32_t index;
  bool read_only;
  GuardedBuffer* original = nullptr;  // shadowed: the buffer the range belongs to
  size_t offset = 0, bytes = 0;       // shadowed: the bound range [offset, offset + bytes)

  std::string name() const {
    std::string s = "buffer(" + std::to_string(index) + ")";
    if (original)
      s += " (bound to bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) + ") of a " +
           std::to_string(original->size()) + "-byte buffer)";
    else
      s += " of " + std::to_string(buffer->size()) + " bytes";
    return s;
  }
};

// Memory-ordering model (RunOptions::races, kernels that use device atomics; docs/emulator.md).
// Every 2-byte unit of a writable binding that a thread of this dispatch stored: who stored it and
// whether the store is published (a device-scope fence of the writer, then an atomic after it).
struct OrdUnit {
  uint32_t tg = 0;      // linear threadgroup + 1; 0: not stored in this dispatch
  uint16_t thread = 0;  // linear index in its threadgroup
  uint8_t state = 0;    // kStored, kFenced, kPublished
  uint32_t site = 0;    // Ordering::sites: the writer's last sync point before the store
  uintptr_t word = 0;   // kPublished: the atomic word it was released through
};
struct OrdSite {
  const char* op;
  const char* file;
  int line;
};
enum : uint32_t { kStored = 0, kFenced = 1, kPublished = 2 };
enum : uint8_t { kRW = 0, kRO = 1, kNone = 2 };

struct OrdBinding {
  const BoundBuffer* b = nullptr;
  unsigned char* data = nullptr;
  size_t bytes = 0;
  std::vector<unsigned char> snap;   // the binding after the last diff
  std::vector<OrdUnit> units;        // per 2-byte unit
  uintptr_t page_lo = 0;             // first page holding data
  std::vector<uint8_t> foreign;      // per page: holds a unit stored in this dispatch
  std::vector<uint8_t> prot;         // per page: kRW, kRO (stores fault: dirty tracking), kNone (watched)
};

using UnitRef = std::pair<uint32_t, uint32_t>;  // binding, unit

struct Ordering {
  size_t page = 4096;
  uint32_t groups[2] = {1, 1}, threads[2] = {1, 1};  // grid and threadgroup shape (x, y)
  std::vector<OrdSite> sites;
  std::vector<OrdBinding> bind;
  uint32_t tg = 0;  // running threadgroup + 1
  std::vector<std::vector<UnitRef>> pending, thread_fenced;           // per thread
  std::vector<std::vector<uintptr_t>> acq_pending, acq_thread;  // per thread: atomic words acquired
  bool watching = false;
  std::vector<std::pair<uint32_t, size_t>> stepping;  // watched pages made accessible for one instruction
  std::vector<std::pair<uint32_t, size_t>> dirty;     // pages the threadgroup stored to (made kRW)
  // A read the model forbids (set by the fault handler): binding, unit, reader.
  int bad_binding = -1;
  uint32_t bad_unit = 0;
};

struct Worker {
  std::vector<std::unique_ptr<Fiber>> fibers;
  size_t stack_bytes = 0;
  std::vector<unsigned char> slot_store;
  alignas(64) unsigned char arena[kArenaBytes];
  bool races = false;
  std::vector<uintptr_t> atomics;  // words accessed atomically in this launch (races; few)
  bool atomic_word(uintptr_t a) const { return std::find(atomics.begin(), atomics.end(), a) != atomics.end(); }
  Group* group = nullptr;
  Thread* running = nullptr;
  struct Ordering* ord = nullptr;  // memory-ordering model of the running launch (null: off)
  bool device_atomics = false;     // the running launch did an atomic on device memory
  const BoundBuffer* bound = nullptr;
  size_t n_bound = 0;
  // Filled by the signal handler:
  volatile sig_atomic_t fault_sig = 0;
  void* fault_addr = nullptr;
  int fault_code = 0;
  int fault_write = -1;  // 1 write, 0 read, -1 unknown
  char* fault_stack_lo = nullptr;
};

inline thread_local Worker* t_worker = nullptr;  // read by the signal handler

// The calling OS thread's Worker, its fiber stacks sized stack_bytes (scheduler.cpp).
Worker& worker(size_t stack_bytes);

inline std::string short_file(const char* f) {
  if (!f) return "?";
  std::string s(f);
  for (const char* marker : {"/shaders/", "/csrc/"}) {
    size_t p = s.rfind(marker);
    if (p != std::string::npos) return s.substr(p + 1);
  }
  return s;
}

inline std::string site(const char* op, const char* file, int line) {
  return std::string(op ? op : "?") + " at " + short_file(file) + ":" + std::to_string(line);
}

inline std::string xyz(const uint32_t v[3]) {
  return "(" + std::to_string(v[0]) + "," + std::to_string(v[1]) + "," + std::to_string(v[2]) + ")";
}

inline std::string who(const Thread& t) {
  return "thread " + xyz(t.ids.thread_pos) + " [simdgroup " + std::to_string(t.ids.simd_id) +
         " lane " + std::to_string(t.ids.lane) + "]";
}

// The arena's poison, built once: the arena (and this copy) are 64-byte aligned, so a byte's
// parity is its offset's and a 64 KiB memcpy poisons the arena (a byte loop cost more than many
// small kernels' threadgroups).
inline const unsigned char* arena_poison() {
  alignas(64) static unsigned char t[kArenaBytes];
  static const bool filled = [] {
    for (size_t i = 0; i < kArenaBytes; ++i) t[i] = (i & 1) ? 0xFF : 0xA0;
    return true;
  }();
  (void)filled;
  return t;
}

// Calls f(c, c_end) for each 64-byte chunk [c, c_end) of [0, n) where a and b differ, in
// increasing order, until f returns false. 1 KiB blocks are compared first: the race detector's
// snapshots mostly match, and one long memcmp is cheaper than sixteen short ones.
template <class F>
void for_changed_chunks(const unsigned char* a, const unsigned char* b, size_t n, F&& f) {
  constexpr size_t kBlock = 1024, kChunk = 64;
  for (size_t blk = 0; blk < n; blk += kBlock) {
    const size_t blk_end = std::min(n, blk + kBlock);
    if (std::memcmp(a + blk, b + blk, blk_end - blk) == 0) continue;
    for (size_t c = blk; c < blk_end; c += kChunk) {
      const size_t c_end = std::min(blk_end, c + kChunk);
      if (std::memcmp(a + c, b + c, c_end - c) != 0 && !f(c, c_end)) return;
    }
  }
}

// ---- the memory-ordering model (memory_order.cpp) ----
uint32_t ord_site(Ordering& o, const Thread& t);
void ord_set_prot(Ordering& o, OrdBinding& b, size_t pi, uint8_t mode);
void ord_diff_page(Worker& w, Ordering& o, uint32_t bi, size_t pi, const Thread& t);
void ord_record(Worker& w, const Thread& t);
void ord_move(Ordering& o, std::vector<UnitRef>& from, std::vector<UnitRef>& to);
void ord_move_words(std::vector<uintptr_t>& from, std::vector<uintptr_t>& to);
void ord_publish(Ordering& o, std::vector<UnitRef>& fenced, uintptr_t word);
bool ord_has(const std::vector<uintptr_t>& v, uintptr_t a);
bool ord_readable(const Ordering& o, const OrdUnit& e, const Thread& r);
void ord_mprotect_range(Ordering& o, OrdBinding& b, size_t lo, size_t hi, uint8_t mode);
void ord_watch(Ordering& o);
void ord_unwatch(Ordering& o);
std::string ord_thread(const uint32_t group_pos[3], const uint32_t thread_pos[3]);
std::string ord_writer(const Ordering& o, const OrdUnit& e);
std::string ord_describe(const Ordering& o, const Thread& r);

// ---- fault handling (faults.cpp) ----
std::string describe_fault(Worker& w, const Thread& t);
#if defined(LILY_EMU_SIGNALS)
void install_handlers();
void remove_handlers();

// Alternate signal stack for the running OS thread (a fiber stack overflow leaves no stack).
struct AltStack {
  stack_t old{};
  bool installed = false;
  std::vector<char> mem;
  void install() {
    if (mem.empty()) mem.resize(64 * 1024);
    stack_t ss{};
    ss.ss_sp = mem.data();
    ss.ss_size = mem.size();
    ss.ss_flags = 0;
    installed = sigaltstack(&ss, &old) == 0;
  }
  void restore() {
    if (installed) sigaltstack(&old, nullptr);
    installed = false;
  }
};
#endif

// ---- running a threadgroup (scheduler.cpp) ----
void fiber_main(void* p);
bool same_site(const Thread& a, const Thread& b);
void fill_order(std::vector<uint32_t>& order, Order policy, std::mt19937_64& rng);
bool release_simdgroups(Group& g);
void release_barrier(Group& g);
std::string arena_place(const Group& g, size_t off);
bool in_array(const Group& g, size_t off);
void check_red_zones(Group& g);
void tg_record_writes(Group& g, const Thread& t);
void resume(Worker& w, Group& g, Thread& t);
void run_group_ahead(Worker& w, Group& g, std::mt19937_64& rng);
void run_group(Worker& w, Group& g, Order policy, std::mt19937_64& rng);

}  // namespace lily::emu::rt
