// Emulator runtime: kernel registry, the per-threadgroup fiber scheduler, fault handling.
// See runtime.h for the execution model. Kept out of the shader translation unit on purpose: the
// Metal shim's macros (`thread`, `constant`, ...) would break the standard headers used here.
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

namespace lily::emu {

// ============================== registry =====================================================

namespace {
std::deque<KernelEntry>& registry() {
  static std::deque<KernelEntry> r;
  return r;
}
}  // namespace

bool register_kernel(const KernelEntry& e) {
  for (const KernelEntry& k : registry())
    if (std::strcmp(k.name, e.name) == 0) {
      // Two instantiations with one host name: the Metal library would reject this too.
      std::fprintf(stderr, "lily emu: kernel '%s' instantiated twice (%s, %s)\n", e.name, k.file, e.file);
      std::abort();
    }
  registry().push_back(e);
  return true;
}

const KernelEntry* find_kernel(std::string_view name) {
  for (const KernelEntry& k : registry())
    if (name == k.name) return &k;
  return nullptr;
}

std::vector<const KernelEntry*> registered_kernels() {
  std::vector<const KernelEntry*> out;
  for (const KernelEntry& k : registry()) out.push_back(&k);
  return out;
}

// ============================== scheduler state ==============================================

namespace {

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

thread_local Worker* t_worker = nullptr;                 // read by the signal handler
thread_local std::unique_ptr<Worker> t_worker_owner;    // frees it when the OS thread ends

Worker& worker(size_t stack_bytes) {
  if (!t_worker) {  // one per OS thread, kept for reuse (fiber stacks, arena)
    t_worker_owner = std::make_unique<Worker>();
    t_worker = t_worker_owner.get();
  }
  Worker& w = *t_worker;
  if (w.stack_bytes != stack_bytes) {
    w.fibers.clear();
    w.stack_bytes = stack_bytes;
  }
  return w;
}

std::string short_file(const char* f) {
  if (!f) return "?";
  std::string s(f);
  for (const char* marker : {"/shaders/", "/csrc/"}) {
    size_t p = s.rfind(marker);
    if (p != std::string::npos) return s.substr(p + 1);
  }
  return s;
}

std::string site(const char* op, const char* file, int line) {
  return std::string(op ? op : "?") + " at " + short_file(file) + ":" + std::to_string(line);
}

std::string xyz(const uint32_t v[3]) {
  return "(" + std::to_string(v[0]) + "," + std::to_string(v[1]) + "," + std::to_string(v[2]) + ")";
}

std::string who(const Thread& t) {
  return "thread " + xyz(t.ids.thread_pos) + " [simdgroup " + std::to_string(t.ids.simd_id) +
         " lane " + std::to_string(t.ids.lane) + "]";
}

// The arena's poison, built once: the arena (and this copy) are 64-byte aligned, so a byte's
// parity is its offset's and a 64 KiB memcpy poisons the arena (a byte loop cost more than many
// small kernels' threadgroups).
const unsigned char* arena_poison() {
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


// ---- memory-ordering model ----

uint32_t ord_site(Ordering& o, const Thread& t) {
  for (size_t i = o.sites.size(); i-- > 0;)
    if (o.sites[i].op == t.seg_op && o.sites[i].file == t.seg_file && o.sites[i].line == t.seg_line)
      return static_cast<uint32_t>(i);
  o.sites.push_back({t.seg_op, t.seg_file, t.seg_line});
  return static_cast<uint32_t>(o.sites.size() - 1);
}

void ord_set_prot(Ordering& o, OrdBinding& b, size_t pi, uint8_t mode) {
  const int prot = mode == kRW ? PROT_READ | PROT_WRITE : mode == kRO ? PROT_READ : PROT_NONE;
  mprotect(reinterpret_cast<void*>(b.page_lo + pi * o.page), o.page, prot);
  b.prot[pi] = mode;
}

// The units of page `pi` of binding `bi` that thread t changed since the last diff: recorded as its
// stores (pending its next device-scope fence). Atomic words are not stores of this model.
void ord_diff_page(Worker& w, Ordering& o, uint32_t bi, size_t pi, const Thread& t) {
  OrdBinding& b = o.bind[bi];
  const uintptr_t plo = b.page_lo + pi * o.page;
  const uintptr_t lo = std::max(plo, reinterpret_cast<uintptr_t>(b.data));
  const uintptr_t hi = std::min(plo + o.page, reinterpret_cast<uintptr_t>(b.data + b.bytes));
  if (hi <= lo) return;
  const size_t base = lo - reinterpret_cast<uintptr_t>(b.data);
  unsigned char* snap = b.snap.data() + base;
  unsigned char* now = b.data + base;
  for_changed_chunks(now, snap, hi - lo, [&](size_t c, size_t c_end) {
    for (size_t off = c; off < c_end; off += 2) {
      const size_t len = std::min<size_t>(2, c_end - off);
      if (std::memcmp(now + off, snap + off, len) == 0) continue;
      const uintptr_t addr = reinterpret_cast<uintptr_t>(now + off) & ~uintptr_t(3);
      if (w.atomic_word(addr)) continue;
      const uint32_t u = static_cast<uint32_t>((base + off) / 2);
      OrdUnit& e = b.units[u];
      e.tg = o.tg;
      e.thread = static_cast<uint16_t>(t.index);
      e.state = kStored;
      e.site = ord_site(o, t);
      b.foreign[pi] = 1;
      o.pending[t.index].push_back({bi, u});
    }
    std::memcpy(snap + c, now + c, c_end - c);
    return true;
  });
}

// Thread t's stores since the last diff. A store to a kRO page faults and makes it writable for
// the rest of the threadgroup (the dirty list); every segment end (and fence, and atomic) compares
// the dirty pages with the snapshot, so each change belongs to the thread that just ran. Stores to
// watched pages are recorded when their instruction has run (ord_after_step).
void ord_record(Worker& w, const Thread& t) {
  Ordering& o = *w.ord;
  for (const auto& [bi, pi] : o.dirty) ord_diff_page(w, o, bi, pi, t);
}

void ord_move(Ordering& o, std::vector<UnitRef>& from, std::vector<UnitRef>& to) {
  for (const UnitRef& r : from) {
    OrdUnit& e = o.bind[r.first].units[r.second];
    if (e.tg == o.tg && e.state == kStored) {
      e.state = kFenced;
      to.push_back(r);
    }
  }
  from.clear();
}

void ord_move_words(std::vector<uintptr_t>& from, std::vector<uintptr_t>& to) {
  for (uintptr_t a : from)
    if (std::find(to.begin(), to.end(), a) == to.end()) to.push_back(a);
  from.clear();
}

void ord_publish(Ordering& o, std::vector<UnitRef>& fenced, uintptr_t word) {
  for (const UnitRef& r : fenced) {
    OrdUnit& e = o.bind[r.first].units[r.second];
    if (e.tg == o.tg && e.state == kFenced) {
      e.state = kPublished;
      e.word = word;
    }
  }
  fenced.clear();
}

bool ord_has(const std::vector<uintptr_t>& v, uintptr_t a) { return std::find(v.begin(), v.end(), a) != v.end(); }

// May `reader` read unit e now? Stores of its own threadgroup and of earlier dispatches: yes. Another
// threadgroup's store: only if published through an atomic word the reader has acquired (an atomic
// on that word, then a device-scope fence that covers the reader).
bool ord_readable(const Ordering& o, const OrdUnit& e, const Thread& r) {
  if (e.tg == 0 || e.tg == o.tg) return true;
  if (e.state != kPublished) return false;
  return ord_has(o.acq_thread[r.index], e.word);
}

// Threadgroup start: the tracked bindings become read-only (a thread's first store to a page
// faults and makes it dirty), and the pages holding other threadgroups' stores of this dispatch
// inaccessible, so each access to them is checked (and, if allowed, run as one instruction).
void ord_mprotect_range(Ordering& o, OrdBinding& b, size_t lo, size_t hi, uint8_t mode) {
  const int prot = mode == kRW ? PROT_READ | PROT_WRITE : mode == kRO ? PROT_READ : PROT_NONE;
  if (hi > lo) mprotect(reinterpret_cast<void*>(b.page_lo + lo * o.page), (hi - lo) * o.page, prot);
  std::fill(b.prot.begin() + static_cast<std::ptrdiff_t>(lo), b.prot.begin() + static_cast<std::ptrdiff_t>(hi), mode);
}

void ord_watch(Ordering& o) {
  o.dirty.clear();
  for (OrdBinding& b : o.bind) {
    ord_mprotect_range(o, b, 0, b.prot.size(), kRO);
    for (size_t pi = 0; pi < b.foreign.size();) {
      if (!b.foreign[pi]) {
        ++pi;
        continue;
      }
      size_t pj = pi;
      while (pj < b.foreign.size() && b.foreign[pj]) ++pj;
      ord_mprotect_range(o, b, pi, pj, kNone);
      pi = pj;
    }
  }
  o.watching = true;
}

void ord_unwatch(Ordering& o) {
  o.watching = false;
  o.dirty.clear();
  o.stepping.clear();
  for (OrdBinding& b : o.bind) ord_mprotect_range(o, b, 0, b.prot.size(), kRW);
}

std::string ord_thread(const uint32_t group_pos[3], const uint32_t thread_pos[3]) {
  return "threadgroup " + xyz(group_pos) + " thread " + xyz(thread_pos);
}

std::string ord_writer(const Ordering& o, const OrdUnit& e) {
  const uint64_t g = e.tg - 1, gx = o.groups[0], gy = o.groups[1], tx = o.threads[0], ty = o.threads[1];
  const uint32_t gp[3] = {uint32_t(g % gx), uint32_t((g / gx) % gy), uint32_t(g / (gx * gy))};
  const uint32_t tp[3] = {uint32_t(e.thread % tx), uint32_t((e.thread / tx) % ty), uint32_t(e.thread / (tx * ty))};
  return ord_thread(gp, tp);
}

// The KernelError text for a read the model forbids.
std::string ord_describe(const Ordering& o, const Thread& r) {
  const OrdBinding& b = o.bind[static_cast<size_t>(o.bad_binding)];
  const OrdUnit& e = b.units[o.bad_unit];
  const OrdSite& ws = o.sites[e.site];
  const std::string after = ws.file ? "after " + site(ws.op, ws.file, ws.line) : std::string("before its first sync point");
  std::string why;
  if (e.state == kStored)
    why = "no device-scope fence of the writer (atomic_thread_fence(mem_flags::mem_device, .., thread_scope_device), "
          "MSL 3.2) follows the store before an atomic; a threadgroup_barrier / simdgroup_barrier with mem_device "
          "orders its own threadgroup only";
  else if (e.state == kFenced)
    why = "the writer's device-scope fence after the store comes after its atomic (no atomic follows the fence, "
          "so nothing publishes the store)";
  else
    why = "the reader has not acquired it: no atomic on the word it was published through, followed by a "
          "device-scope fence (atomic_thread_fence(mem_device, .., thread_scope_device)) of the reader, before the read";
  return "device memory ordering: " + ord_thread(r.ids.group_pos, r.ids.thread_pos) + " [simdgroup " +
         std::to_string(r.ids.simd_id) + " lane " + std::to_string(r.ids.lane) + "] (after " +
         (r.file ? site(r.op, r.file, r.line) : std::string("the kernel start")) + ") read byte offset " +
         std::to_string(size_t(o.bad_unit) * 2) + " of " + b.b->name() + ", stored in this dispatch by " +
         ord_writer(o, e) + " " + after + ", and the store is not visible to it: " + why +
         " (Metal atomics are relaxed: on a GPU the reader may see the old value)";
}

}  // namespace

// ============================== calls from GPU threads =======================================

LaneView& lane_view() { return t_worker->running->view; }

namespace {
std::mutex g_ignored_mu;
std::string g_ignored_fence;
std::atomic<bool> g_any_ignored{false};
// mem without kMemDevice where the fence at file:line is ignored (set_ignored_fence).
unsigned fence_flags(unsigned mem, const char* file, int line) {
  if (!(mem & kMemDevice) || !g_any_ignored.load(std::memory_order_relaxed)) return mem;
  std::lock_guard<std::mutex> lock(g_ignored_mu);
  return short_file(file) + ":" + std::to_string(line) == g_ignored_fence ? mem & ~kMemDevice : mem;
}
}  // namespace

void set_ignored_fence(const std::string& site) {
  std::lock_guard<std::mutex> lock(g_ignored_mu);
  g_ignored_fence = site;
  g_any_ignored.store(!site.empty());
}

void simd_sync(const char* op, const char* file, int line, unsigned mem) {
  Thread* t = t_worker->running;
  t->op = op;
  t->file = file;
  t->line = line;
  t->mem = fence_flags(mem, file, line);
  t->state = St::at_simd;
  t->fiber->yield();
  t->view.simd_seq += 1;
}

void threadgroup_sync(const char* file, int line, unsigned mem) {
  t_worker->running->mem = fence_flags(mem, file, line);
  threadgroup_collective("threadgroup_barrier", file, line);
}

void device_fence(const char* file, int line) {
  Worker* w = t_worker;
  if (!w || !w->ord || !(fence_flags(kMemDevice, file, line) & kMemDevice)) return;
  Thread* t = w->running;
  ord_record(*w, *t);  // its stores so far precede the fence
  Ordering& o = *w->ord;
  ord_move(o, o.pending[t->index], o.thread_fenced[t->index]);
  ord_move_words(o.acq_pending[t->index], o.acq_thread[t->index]);
}

uint32_t thread_index_in_group() { return t_worker->running->index; }
uint32_t threads_in_group() { return t_worker->running->group->n; }

void threadgroup_collective(const char* op, const char* file, int line) {
  Thread* t = t_worker->running;
  t->op = op;
  t->file = file;
  t->line = line;
  if (std::strcmp(op, "threadgroup_barrier") != 0) t->mem = 0;
  t->state = St::at_barrier;
  t->fiber->yield();
  t->barrier_seq += 1;
}

void* threadgroup_alloc(size_t bytes, size_t align, const char* file, int line) {
  Thread* t = t_worker->running;
  Group* g = t->group;
  const uint32_t k = t->n_allocs++;
  if (k < g->allocs.size()) {
    const Alloc& a = g->allocs[k];
    if (a.bytes != bytes || a.line != line)
      kernel_fail("threadgroup array #" + std::to_string(k) + " declared differently by threads (" +
                      std::to_string(a.bytes) + " bytes at line " + std::to_string(a.line) + " vs " +
                      std::to_string(bytes) + " bytes); declare threadgroup arrays unconditionally",
                  file, line);
    return g->arena + a.offset;
  }
  if (align < 16) align = 16;
  const size_t metal_off = (g->metal_used + align - 1) / align * align;
  if (metal_off + bytes > kThreadgroupMemory)
    kernel_fail("threadgroup memory exceeds Metal's " + std::to_string(kThreadgroupMemory) +
                    "-byte limit (" + std::to_string(metal_off + bytes) + " bytes requested)",
                file, line);
  g->metal_used = metal_off + bytes;
  // In the emulator every array follows a red zone of poison (checked after the threadgroup ran).
  const size_t off = (g->arena_used + kRedZoneBytes + align - 1) / align * align;
  if (off + bytes + kRedZoneBytes > kArenaBytes) kernel_fail("emulator threadgroup arena exhausted", file, line);
  g->allocs.push_back({off, bytes, file, line});
  g->arena_used = off + bytes;
  return g->arena + off;
}

void note_atomic(const void* addr) {
  Worker* w = t_worker;
  if (w && w->races) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(addr) & ~uintptr_t(3);
    if (!w->atomic_word(a)) w->atomics.push_back(a);
    const auto* arena = reinterpret_cast<const unsigned char*>(w->arena);
    const auto* p = static_cast<const unsigned char*>(addr);
    if (!(p >= arena && p < arena + kArenaBytes)) w->device_atomics = true;
    if (w->ord && w->running && !(p >= arena && p < arena + kArenaBytes)) {
      // A device atomic: the stores of the thread so far precede it; it releases what the thread's
      // device-scope fences ordered before it, and it may acquire for later reads.
      Thread& t = *w->running;
      ord_record(*w, t);
      Ordering& o = *w->ord;
      ord_publish(o, o.thread_fenced[t.index], a);
      if (!ord_has(o.acq_pending[t.index], a)) o.acq_pending[t.index].push_back(a);
    }
  }
}

void kernel_fail(const std::string& what, const char* file, int line) {
  throw KernelError(what + " (" + short_file(file) + ":" + std::to_string(line) + ")");
}

// ============================== fault handling ===============================================

namespace {

[[noreturn]] void fault_landing();

#if defined(LILY_EMU_SIGNALS)
std::mutex g_sig_mu;
int g_sig_users = 0;
constexpr int kNumSignals = 4;
struct sigaction g_old[kNumSignals];
const int kSignals[kNumSignals] = {SIGSEGV, SIGBUS, SIGFPE, SIGTRAP};
constexpr greg_t kTrapFlag = 0x100;  // EFLAGS.TF: trap after the next instruction

// Memory-ordering model: a fault on a watched page (another threadgroup's stores of this
// dispatch). A read the model forbids lands like a fault; anything else runs as one instruction
// on the page made accessible (trap flag), and ord_after_step watches it again.
bool ord_on_fault(Worker* w, siginfo_t* si, ucontext_t* uc) {
  Ordering* o = w->ord;
  if (!o || !o->watching || w->running == nullptr) return false;
  const uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
  for (uint32_t bi = 0; bi < o->bind.size(); ++bi) {
    OrdBinding& b = o->bind[bi];
    if (a < b.page_lo || a >= b.page_lo + b.prot.size() * o->page) continue;
    const size_t pi = (a - b.page_lo) / o->page;
    if (b.prot[pi] == kRW) return false;
    if (b.prot[pi] == kRO) {  // the threadgroup's first store to the page: diffed from now on
      ord_set_prot(*o, b, pi, kRW);
      o->dirty.push_back({bi, pi});
      return true;
    }
    const bool write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
    const uintptr_t d = reinterpret_cast<uintptr_t>(b.data);
    if (!write && a >= d && a < d + b.bytes) {
      const uint32_t u = static_cast<uint32_t>((a - d) / 2);
      if (!ord_readable(*o, b.units[u], *w->running)) {
        o->bad_binding = static_cast<int>(bi);
        o->bad_unit = u;
        return false;  // lands as a fault
      }
    }
    ord_set_prot(*o, b, pi, kRW);
    o->stepping.push_back({bi, pi});
    uc->uc_mcontext.gregs[REG_EFL] |= kTrapFlag;
    return true;
  }
  return false;
}

// After the one instruction: what it stored on the watched pages it needed, which are watched again.
bool ord_after_step(Worker* w, ucontext_t* uc) {
  Ordering* o = w ? w->ord : nullptr;
  if (!o || o->stepping.empty()) return false;
  for (const auto& [bi, pi] : o->stepping) {
    if (w->running) ord_diff_page(*w, *o, bi, pi, *w->running);
    ord_set_prot(*o, o->bind[bi], pi, kNone);
  }
  o->stepping.clear();
  uc->uc_mcontext.gregs[REG_EFL] &= ~kTrapFlag;
  return true;
}

void on_fault(int sig, siginfo_t* si, void* uctx_raw) {
  Worker* w = t_worker;
  auto* uc = static_cast<ucontext_t*>(uctx_raw);
  if (sig == SIGTRAP && ord_after_step(w, uc)) return;
  if (sig == SIGSEGV && w != nullptr && w->fault_sig == 0 && ord_on_fault(w, si, uc)) return;
  if (sig == SIGTRAP || w == nullptr || w->running == nullptr || w->fault_sig != 0) {
    // Not a kernel fault (or a fault while landing): give the signal to whoever had it before.
    for (int i = 0; i < kNumSignals; ++i)
      if (kSignals[i] == sig) sigaction(sig, &g_old[i], nullptr);
    if (sig == SIGTRAP) raise(SIGTRAP);  // a trap does not re-execute
    return;  // the instruction re-executes and faults into the previous handler
  }
  w->fault_sig = sig;
  w->fault_addr = si->si_addr;
  w->fault_code = si->si_code;
  w->fault_write = (sig == SIGSEGV) ? ((uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0) : -1;
  w->fault_stack_lo = w->running->fiber->stack_lo();
  // Resume at fault_landing on the top of the faulting fiber's stack (the fiber is abandoned).
  auto top = reinterpret_cast<uintptr_t>(w->running->fiber->stack_hi());
  uintptr_t sp = ((top - 256) & ~uintptr_t(15)) - 8;  // as if just called
  uc->uc_mcontext.gregs[REG_RSP] = static_cast<greg_t>(sp);
  uc->uc_mcontext.gregs[REG_RIP] = static_cast<greg_t>(reinterpret_cast<uintptr_t>(&fault_landing));
}

void install_handlers() {
  std::lock_guard<std::mutex> lock(g_sig_mu);
  if (g_sig_users++ > 0) return;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = &on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < kNumSignals; ++i) sigaction(kSignals[i], &sa, &g_old[i]);
}

void remove_handlers() {
  std::lock_guard<std::mutex> lock(g_sig_mu);
  if (--g_sig_users > 0) return;
  for (int i = 0; i < kNumSignals; ++i) {
    struct sigaction cur;
    sigaction(kSignals[i], nullptr, &cur);
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == &on_fault)  // still ours: restore
      sigaction(kSignals[i], &g_old[i], nullptr);
  }
}

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

std::string describe_fault(Worker& w, const Thread& t) {
  std::string s;
#if defined(LILY_EMU_SIGNALS)
  if (w.ord && w.ord->bad_binding >= 0) return ord_describe(*w.ord, t);
  if (w.fault_sig == SIGFPE) {
    s = "floating-point invalid operation (arithmetic on NaN: a read of poisoned memory - "
        "threadgroup memory not written before this read (missing barrier?) or an unwritten "
        "output/slack byte - or an invalid operation such as inf - inf)";
  } else {
    const void* a = w.fault_addr;
    const char* rw = w.fault_write == 1 ? "write" : w.fault_write == 0 ? "read" : "access";
    s = std::string("out-of-bounds ") + rw + " at address " +
        std::to_string(reinterpret_cast<uintptr_t>(a)) + " (not within " +
        std::to_string(GuardedBuffer::kGuardBytes) + " bytes of any bound buffer; an index read from "
        "never-written memory? poison reads as 0xFFA0FFA0 = 4288741280 as a uint)";
    for (size_t i = 0; i < w.n_bound; ++i) {
      const BoundBuffer& b = w.bound[i];
      auto where = b.buffer->classify(a);
      if (where == GuardedBuffer::Where::outside) continue;
      const std::string buf = b.name();
      const std::string off = "byte offset " + std::to_string(b.buffer->offset_of(a)) +
                              (b.original ? " of the bound range" : "");
      if (where == GuardedBuffer::Where::guard_after || where == GuardedBuffer::Where::slack_after)
        s = std::string("out-of-bounds ") + rw + " past the end of " + buf + " at " + off;
      else if (where == GuardedBuffer::Where::guard_before || where == GuardedBuffer::Where::slack_before)
        s = std::string("out-of-bounds ") + rw + " before the start of " + buf + " at " + off;
      else if (b.read_only)
        s = "write to " + buf + ", which the kernel declares `const device` (read-only), at " + off;
      break;
    }
    const char* a_c = static_cast<const char*>(a);
    if (w.fault_stack_lo && a_c < w.fault_stack_lo && a_c >= w.fault_stack_lo - 65536)
      s = "GPU thread stack overflow (emulator stack " + std::to_string(t_worker->stack_bytes) +
          " bytes): too many or too large thread-local arrays";
  }
#else
  (void)w;
#endif
  s += " in " + who(t);
  if (t.file)  // the kernel source line is not known; the last rendezvous narrows it down
    s += ", after " + site(t.op, t.file, t.line);
  else
    s += ", before its first barrier or simd collective";
  return s;
}

[[noreturn]] void fault_landing() {
  Worker* w = t_worker;
  Thread* t = w->running;
  std::feclearexcept(FE_ALL_EXCEPT);
  t->group->fail(describe_fault(*w, *t));
  t->state = St::done;
  w->fault_sig = 0;
  t->fiber->yield();
  std::abort();  // never resumed
}

// ============================== running a threadgroup ========================================

void fiber_main(void* p) {
  Thread* t = static_cast<Thread*>(p);
  Group* g = t->group;
  try {
    g->kernel->entry(g->args, g->buffers, t->ids);
  } catch (const std::exception& e) {
    g->fail(std::string(e.what()) + " in " + who(*t));
  } catch (...) {
    g->fail("unknown C++ exception in " + who(*t));
  }
  t->state = St::done;
  t->fiber->yield();
  std::abort();  // never resumed
}

bool same_site(const Thread& a, const Thread& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0) &&
         (a.op == b.op || std::strcmp(a.op, b.op) == 0);
}

void fill_order(std::vector<uint32_t>& order, Order policy, std::mt19937_64& rng) {
  const uint32_t n = static_cast<uint32_t>(order.size());
  for (uint32_t i = 0; i < n; ++i) order[i] = policy == Order::reverse ? n - 1 - i : i;
  if (policy == Order::shuffle) std::shuffle(order.begin(), order.end(), rng);
}

// Resolves every simdgroup whose live lanes all wait at a collective; false if none could be.
bool release_simdgroups(Group& g) {
  bool progressed = false;
  for (uint32_t s = 0; s < g.nsimd; ++s) {
    const uint32_t lo = s * kSimdWidth, hi = std::min(g.n, lo + kSimdWidth);
    Thread* first = nullptr;
    const Thread* exited = nullptr;
    bool at_barrier = false;
    for (uint32_t i = lo; i < hi; ++i) {
      Thread& t = g.threads[i];
      if (t.state == St::at_simd && !first) first = &t;
      if (t.state == St::done && !exited) exited = &t;
      if (t.state == St::at_barrier) at_barrier = true;
    }
    if (!first || at_barrier) continue;
    if (exited) {
      g.fail("divergent simdgroup: " + who(*first) + " waits at " +
             site(first->op, first->file, first->line) + " but " + who(*exited) +
             " already returned (every lane must reach each simd_* collective)");
      return false;
    }
    for (uint32_t i = lo; i < hi; ++i) {
      Thread& t = g.threads[i];
      if (!same_site(t, *first) || t.view.simd_seq != first->view.simd_seq) {
        g.fail("divergent simdgroup: " + who(*first) + " is at " +
               site(first->op, first->file, first->line) + " (collective #" +
               std::to_string(first->view.simd_seq) + ") but " + who(t) + " is at " +
               site(t.op, t.file, t.line) + " (collective #" + std::to_string(t.view.simd_seq) + ")");
        return false;
      }
    }
    for (uint32_t i = lo; i < hi; ++i) g.threads[i].state = St::runnable;
    progressed = true;
  }
  return progressed;
}

// All live threads must wait at the same barrier; then they are released.
void release_barrier(Group& g) {
  const Thread* first = nullptr;
  const Thread* exited = nullptr;
  for (const Thread& t : g.threads) {
    if (t.state == St::at_barrier && !first) first = &t;
    if (t.state == St::done && !exited) exited = &t;
  }
  for (const Thread& t : g.threads)
    if (t.state == St::at_simd) {
      g.fail("divergent simdgroup: " + who(t) + " waits at " + site(t.op, t.file, t.line) +
             " while other lanes of its simdgroup wait at a barrier or returned");
      return;
    }
  if (!first) {
    g.fail("scheduler found no runnable thread (emulator bug)");
    return;
  }
  if (exited) {
    g.fail(who(*exited) + " returned while " + who(*first) + " (and others) wait at " +
           site(first->op, first->file, first->line) +
           " (a GPU would hang or misbehave: no early return before a barrier)");
    return;
  }
  for (const Thread& t : g.threads)
    if (t.state == St::at_barrier && (!same_site(t, *first) || t.barrier_seq != first->barrier_seq)) {
      g.fail("threads wait at different barriers: " + who(*first) + " at " +
             site(first->op, first->file, first->line) + " (barrier #" +
             std::to_string(first->barrier_seq) + "), " + who(t) + " at " +
             site(t.op, t.file, t.line) + " (barrier #" + std::to_string(t.barrier_seq) + ")");
      return;
    }
  // A barrier's mem_device orders device memory among this threadgroup's threads only (MSL 3.1,
  // section 6.9.1): it is no device-scope fence of the memory-ordering model.
  for (Thread& t : g.threads) t.state = St::runnable;
  // Only a barrier orders threadgroup memory: the rendezvous of a threadgroup-wide tensor op
  // (threadgroup_collective, e.g. matmul2d::run) checks uniformity but is not a barrier on a GPU,
  // so writes on either side of it stay in one race-detector epoch.
  if (std::strcmp(first->op, "threadgroup_barrier") == 0) g.epoch += 1;
}

// Where arena byte `off` lies: "array #k (declared at file:line, N bytes) element byte b", or the
// red zone before array #k, or past the last array.
std::string arena_place(const Group& g, size_t off) {
  for (size_t k = 0; k < g.allocs.size(); ++k) {
    const Alloc& a = g.allocs[k];
    const std::string decl = "threadgroup array #" + std::to_string(k) + " (" + short_file(a.file) + ":" +
                             std::to_string(a.line) + ", " + std::to_string(a.bytes) + " bytes)";
    if (off < a.offset)
      return "the red zone before " + decl + (k ? ", past the end of the array before it" : "");
    if (off < a.offset + a.bytes) return decl + " at byte " + std::to_string(off - a.offset);
  }
  if (g.allocs.empty()) return "threadgroup memory no array was declared in";
  const Alloc& a = g.allocs.back();
  return "unallocated threadgroup memory " + std::to_string(off - a.offset - a.bytes) +
         " bytes past the end of the last threadgroup array #" + std::to_string(g.allocs.size() - 1) + " (" +
         short_file(a.file) + ":" + std::to_string(a.line) + ", " + std::to_string(a.bytes) + " bytes)";
}

bool in_array(const Group& g, size_t off) {
  for (const Alloc& a : g.allocs)
    if (off >= a.offset && off < a.offset + a.bytes) return true;
  return false;
}

// Bytes after the arena in use that the race detector and the red-zone check look at.
constexpr size_t kSpareChecked = 1024;

// Red zones and the spare arena must still hold poison after the threadgroup ran. The bytes in
// no array are the gaps before, between and after the arrays (laid out in increasing offsets):
// each gap is compared with the poison copy at once, byte by byte only where it differs.
void check_red_zones(Group& g) {
  const size_t end = std::min(kArenaBytes, g.arena_used + kSpareChecked);
  const unsigned char* ref = arena_poison();
  size_t lo = 0;
  for (size_t k = 0; k <= g.allocs.size(); ++k) {
    const size_t hi = k < g.allocs.size() ? g.allocs[k].offset : end;
    if (hi > lo && std::memcmp(g.arena + lo, ref + lo, hi - lo) != 0)
      for (size_t off = lo; off < hi; ++off)
        if (g.arena[off] != ref[off]) {
          g.fail("threadgroup memory overflow: a write landed in " + arena_place(g, off) +
                 " (red zones of poison surround every threadgroup array in the emulator; an index past "
                 "the end of an array overwrote the next array or the spare memory on the GPU)");
          return;
        }
    if (k < g.allocs.size()) lo = g.allocs[k].offset + g.allocs[k].bytes;
  }
}

// Race detector: the words the running thread changed in the segment it just ran. g.tg_snap is
// the arena as the segment found it: poison at the threadgroup's start, then brought up to date
// here, 64-byte chunk by chunk, with what each segment changed (so no copy before a segment, and
// unchanged chunks cost one comparison).
void tg_record_writes(Group& g, const Thread& t) {
  const size_t end = std::min(kArenaBytes, g.arena_used + kSpareChecked) / 2 * 2;
  if (g.tg_writes.size() < end / 2) g.tg_writes.resize(end / 2);  // new entries: not written
  unsigned char* snap = g.tg_snap.data();
  for_changed_chunks(g.arena, snap, end, [&](size_t chunk, size_t chunk_end) {
    for (size_t off = chunk; off < chunk_end; off += 2) {
      const unsigned char* now = g.arena + off;
      if (now[0] == snap[off] && now[1] == snap[off + 1]) continue;
      if (!in_array(g, off) && !in_array(g, off + 1)) {
        g.fail("threadgroup memory overflow: " + who(t) + " wrote " + arena_place(g, off) + " in its code after " +
               (t.file ? site(t.op, t.file, t.line) : std::string("the kernel start")));
        return false;
      }
      TgWrite& s = g.tg_writes[off / 2];
      const uintptr_t addr = reinterpret_cast<uintptr_t>(now) & ~uintptr_t(3);
      if (s.writer && s.writer - 1 != t.index && s.epoch == g.epoch &&
          !t_worker->atomic_word(addr)) {
        const Thread& o = g.threads[s.writer - 1];
        const bool ordered = o.ids.simd_id == t.ids.simd_id && s.simd_seq != t.view.simd_seq;
        if (!ordered) {
          auto code = [](const char* op, const char* file, int line) {
            return file ? "in its code after " + site(op, file, line) : std::string("before its first sync point");
          };
          g.fail("threadgroup memory race: " + who(t) + " " + code(t.op, t.file, t.line) + " and " + who(o) + " " +
                 code(s.op, s.file, s.line) + " both wrote " + arena_place(g, off) +
                 " with no threadgroup_barrier between them" +
                 (o.ids.simd_id == t.ids.simd_id ? " (same simdgroup, no simd collective or simdgroup_barrier between)" : "") +
                 "; on a GPU one write is lost (a non-atomic read-modify-write such as += from several threads, "
                 "or two threads given one slot)");
          return false;
        }
      }
      s = {t.index + 1, g.epoch, t.view.simd_seq, t.op, t.file, t.line};
      g.tg_writes_end = std::max(g.tg_writes_end, off / 2 + 1);
    }
    std::memcpy(snap + chunk, g.arena + chunk, chunk_end - chunk);
    return true;
  });
}

// Runs one fiber to its next sync point (and, with the race detector, records its writes).
void resume(Worker& w, Group& g, Thread& t) {
  w.running = &t;
  t.seg_op = t.op;
  t.seg_file = t.file;
  t.seg_line = t.line;
  t.fiber->resume();
  if (w.ord && g.error.empty()) ord_record(w, t);
  w.running = nullptr;
  if (g.races && g.error.empty()) tg_record_writes(g, t);
}

// Order::ahead: each simdgroup in turn runs until none of its lanes can move (all at a threadgroup
// barrier, returned, or stuck at a divergent collective), then the barrier is released.
void run_group_ahead(Worker& w, Group& g, std::mt19937_64& rng) {
  std::vector<uint32_t> sorder(g.nsimd);
  for (;;) {
    fill_order(sorder, Order::shuffle, rng);
    for (uint32_t s : sorder) {
      const uint32_t lo = s * kSimdWidth, hi = std::min(g.n, lo + kSimdWidth);
      for (bool ran = true; ran;) {
        ran = false;
        for (uint32_t i = lo; i < hi; ++i) {
          Thread& t = g.threads[i];
          if (t.state != St::runnable) continue;
          resume(w, g, t);
          ran = true;
          if (!g.error.empty()) return;
        }
        release_simdgroups(g);
        if (!g.error.empty()) return;
      }
    }
    bool all_done = true;
    for (const Thread& t : g.threads) all_done &= t.state == St::done;
    if (all_done) return;
    if (release_simdgroups(g)) continue;
    if (!g.error.empty()) return;
    release_barrier(g);
    if (!g.error.empty()) return;
  }
}

void run_group(Worker& w, Group& g, Order policy, std::mt19937_64& rng) {
  if (policy == Order::ahead) return run_group_ahead(w, g, rng);
  std::vector<uint32_t> order(g.n);
  for (;;) {
    fill_order(order, policy, rng);
    for (uint32_t idx : order) {
      Thread& t = g.threads[idx];
      if (t.state != St::runnable) continue;
      resume(w, g, t);
      if (!g.error.empty()) return;
    }
    bool all_done = true;
    for (const Thread& t : g.threads) all_done &= t.state == St::done;
    if (all_done) return;
    if (release_simdgroups(g)) continue;
    if (!g.error.empty()) return;
    release_barrier(g);
    if (!g.error.empty()) return;
  }
}

}  // namespace

// ============================== launches =====================================================

namespace {
// Kernels seen doing device atomics (their buffers need not be declared atomic: casts).
std::mutex g_atomics_mu;
std::vector<const KernelEntry*> g_atomics_kernels;
bool known_atomics_kernel(const KernelEntry* k) {
  std::lock_guard<std::mutex> lock(g_atomics_mu);
  return std::find(g_atomics_kernels.begin(), g_atomics_kernels.end(), k) != g_atomics_kernels.end();
}
void learn_atomics_kernel(const KernelEntry* k) {
  std::lock_guard<std::mutex> lock(g_atomics_mu);
  if (std::find(g_atomics_kernels.begin(), g_atomics_kernels.end(), k) == g_atomics_kernels.end())
    g_atomics_kernels.push_back(k);
}
}  // namespace

void run(const Launch& L, const RunOptions& opt) {
  const KernelEntry* k = L.kernel;
  if (!k) throw KernelError("emulator launch without a kernel");
  const std::string kname = k->name;
  if (L.args_size != k->args_size)
    throw KernelError(kname + ": args struct of " + std::to_string(L.args_size) +
                      " bytes, kernel expects " + std::to_string(k->args_size));
  if (L.buffers.size() != k->num_buffers)
    throw KernelError(kname + ": " + std::to_string(L.buffers.size()) + " buffers bound, kernel takes " +
                      std::to_string(k->num_buffers));
  const uint32_t n = L.threads.x * L.threads.y * L.threads.z;
  if (n == 0 || n > 1024 || L.groups.count() == 0)
    throw KernelError(kname + ": bad grid (" + std::to_string(L.groups.count()) + " threadgroups of " +
                      std::to_string(n) + " threads; at most 1024 per threadgroup)");

  // Buffers: pointers, read-only protection, fault classification table.
  std::vector<BoundBuffer> bound;
  std::vector<std::unique_ptr<GuardedBuffer>> shadows;
  std::vector<void*> ptrs(k->num_buffers);
  for (uint32_t i = 0; i < k->num_buffers; ++i) {
    const gpu::Binding& b = L.buffers[i];
    auto* gb = dynamic_cast<GuardedBuffer*>(b.buffer);
    if (!gb) throw KernelError(kname + ": buffer(" + std::to_string(i + 1) + ") is not an emulator buffer");
    if (b.offset > gb->size())
      throw KernelError(kname + ": buffer(" + std::to_string(i + 1) + ") offset past its end");
    if (k->buffers[i].elem_size && b.offset % k->buffers[i].elem_size)
      throw KernelError(kname + ": buffer(" + std::to_string(i + 1) + ") offset " + std::to_string(b.offset) +
                        " is not a multiple of its element size " + std::to_string(k->buffers[i].elem_size));
    // Bounds at the binding: a range narrower than its buffer is run on a guarded copy of just
    // that range (copied back after), so an access outside [offset, offset + bytes) faults or
    // damages poison like one outside a whole buffer. Not when another binding of the launch
    // overlaps the range (the two must alias).
    bool shadow = opt.binding_bounds && (b.offset != 0 || b.bytes != gb->size());
    for (uint32_t j = 0; j < k->num_buffers && shadow; ++j) {
      const gpu::Binding& o = L.buffers[j];
      if (j != i && o.buffer == b.buffer && o.offset < b.offset + b.bytes && b.offset < o.offset + o.bytes)
        shadow = false;
    }
    if (shadow) {
      shadows.push_back(std::make_unique<GuardedBuffer>(b.bytes));
      GuardedBuffer* sb = shadows.back().get();
      std::memcpy(sb->contents(), static_cast<char*>(gb->contents()) + b.offset, b.bytes);
      ptrs[i] = sb->contents();
      bound.push_back({sb, i + 1, k->buffers[i].read_only, gb, b.offset, b.bytes});
    } else {
      ptrs[i] = static_cast<char*>(gb->contents()) + b.offset;
      bound.push_back({gb, i + 1, k->buffers[i].read_only});
    }
  }
  for (BoundBuffer& b : bound)  // a buffer also bound writable elsewhere stays writable
    for (const BoundBuffer& o : bound)
      if (o.buffer == b.buffer && !o.read_only) b.read_only = false;

  Worker& w = worker(opt.stack_bytes);
  while (w.fibers.size() < n) w.fibers.push_back(std::make_unique<Fiber>(opt.stack_bytes));
  const uint32_t nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  w.slot_store.assign(size_t(nsimd) * 2 * kSimdWidth * kSlotBytes + 64, 0);
  unsigned char* slots = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(w.slot_store.data()) + 63) & ~uintptr_t(63));

  Group g;
  g.kernel = k;
  g.args = L.args;
  g.buffers = ptrs.data();
  g.n = n;
  g.nsimd = nsimd;
  g.slots = slots;
  g.arena = w.arena;
  g.threads.resize(n);
  g.races = opt.races;
  w.races = opt.races;
  w.atomics.clear();
  if (g.races) g.tg_snap.resize(kArenaBytes);

  // Race detector, device memory: which threadgroup changed each word of a writable binding.
  struct DeviceWrites {
    const BoundBuffer* b;
    unsigned char* data;
    size_t bytes;
    std::vector<unsigned char> snap;  // the binding as the running threadgroup found it
    std::vector<uint64_t> writer;  // per 2-byte unit (bfloat is the smallest store): threadgroup + 1
  };
  std::vector<DeviceWrites> dev_writes;
  if (opt.races)
    for (uint32_t i = 0; i < k->num_buffers; ++i)
      if (!k->buffers[i].read_only)
        dev_writes.push_back({&bound[i], static_cast<unsigned char*>(ptrs[i]), L.buffers[i].bytes, {}, {}});
  for (DeviceWrites& d : dev_writes) {
    d.writer.assign((d.bytes + 1) / 2, 0);
    d.snap.assign(d.data, d.data + d.bytes);  // kept up to date chunk by chunk after each threadgroup
  }

  // Memory-ordering model: kernels that declare an atomic buffer or did a device atomic before.
  std::unique_ptr<Ordering> ord;
#if defined(LILY_EMU_SIGNALS)
  bool atomics_kernel = known_atomics_kernel(k);
  for (uint32_t i = 0; i < k->num_buffers; ++i) atomics_kernel |= k->buffers[i].atomic;
  if (opt.races && atomics_kernel) {
    ord = std::make_unique<Ordering>();
    Ordering& o = *ord;
    o.page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    o.groups[0] = L.groups.x;
    o.groups[1] = L.groups.y;
    o.threads[0] = L.threads.x;
    o.threads[1] = L.threads.y;
    for (uint32_t i = 0; i < k->num_buffers; ++i) {
      if (k->buffers[i].read_only || L.buffers[i].bytes == 0) continue;
      OrdBinding b;
      b.b = &bound[i];
      b.data = static_cast<unsigned char*>(ptrs[i]);
      b.bytes = L.buffers[i].bytes;
      b.snap.assign(b.data, b.data + b.bytes);
      b.units.assign((b.bytes + 1) / 2, OrdUnit{});
      b.page_lo = reinterpret_cast<uintptr_t>(b.data) & ~uintptr_t(o.page - 1);
      const size_t npages = (reinterpret_cast<uintptr_t>(b.data) + b.bytes - b.page_lo + o.page - 1) / o.page;
      b.foreign.assign(npages, 0);
      b.prot.assign(npages, 0);
      o.bind.push_back(std::move(b));
    }
    for (size_t i = 0; i < o.bind.size() && ord; ++i)  // bindings sharing a page: not modelled
      for (size_t j = i + 1; j < o.bind.size(); ++j) {
        const OrdBinding &a = o.bind[i], &c = o.bind[j];
        if (a.page_lo < c.page_lo + c.prot.size() * o.page && c.page_lo < a.page_lo + a.prot.size() * o.page) {
          ord.reset();
          break;
        }
      }
  }
  if (ord) {
    ord->pending.assign(n, {});
    ord->thread_fenced.assign(n, {});
    ord->acq_pending.assign(n, {});
    ord->acq_thread.assign(n, {});
  }
#endif
  w.ord = ord.get();
  w.device_atomics = false;

  // Threadgroup order.
  const uint64_t ngroups = L.groups.count();
  std::vector<uint64_t> gorder(ngroups);
  for (uint64_t i = 0; i < ngroups; ++i) gorder[i] = opt.order == Order::reverse ? ngroups - 1 - i : i;
  std::mt19937_64 rng(opt.seed * 0x9E3779B97F4A7C15ull + 1);
  if (opt.order == Order::shuffle || opt.order == Order::ahead) std::shuffle(gorder.begin(), gorder.end(), rng);

  // Enter the kernel environment (undone in every exit path below).
  w.bound = bound.data();
  w.n_bound = bound.size();
  for (BoundBuffer& b : bound)
    if (b.read_only) b.buffer->set_read_only(true);
#if defined(LILY_EMU_SIGNALS)
  install_handlers();
  AltStack alt;
  alt.install();
#endif
  std::fenv_t saved_env;
  std::feholdexcept(&saved_env);  // saves the environment, clears flags, masks traps
#if defined(LILY_EMU_FP_TRAPS)
  if (opt.fp_traps) feenableexcept(FE_INVALID);
#endif
  w.fault_sig = 0;

  std::string error;
  uint32_t err_group[3] = {0, 0, 0};
  try {
    for (uint64_t gi : gorder) {
      g.group_pos[0] = static_cast<uint32_t>(gi % L.groups.x);
      g.group_pos[1] = static_cast<uint32_t>((gi / L.groups.x) % L.groups.y);
      g.group_pos[2] = static_cast<uint32_t>(gi / (uint64_t(L.groups.x) * L.groups.y));
      g.allocs.clear();
      g.arena_used = 0;
      g.metal_used = 0;
      g.epoch = 0;
      g.error.clear();
      std::memcpy(w.arena, arena_poison(), kArenaBytes);
      if (g.races) {
        std::fill(g.tg_writes.begin(), g.tg_writes.begin() + g.tg_writes_end, TgWrite{});
        g.tg_writes_end = 0;
        std::memcpy(g.tg_snap.data(), arena_poison(), kArenaBytes);
      }
      for (uint32_t i = 0; i < n; ++i) {
        Thread& t = g.threads[i];
        t = Thread{};
        t.index = i;
        t.group = &g;
        t.fiber = w.fibers[i].get();
        const uint32_t tp[3] = {i % L.threads.x, (i / L.threads.x) % L.threads.y,
                                i / (L.threads.x * L.threads.y)};
        const uint32_t ts[3] = {L.threads.x, L.threads.y, L.threads.z};
        for (int d = 0; d < 3; ++d) {
          t.ids.group_pos[d] = g.group_pos[d];
          t.ids.thread_pos[d] = tp[d];
          t.ids.group_size[d] = ts[d];
          t.ids.grid_pos[d] = g.group_pos[d] * ts[d] + tp[d];
        }
        t.ids.lane = i % kSimdWidth;
        t.ids.simd_id = i / kSimdWidth;
        t.view.lane = t.ids.lane;
        t.view.simd_width = std::min(kSimdWidth, n - t.ids.simd_id * kSimdWidth);
        t.view.simd_seq = 0;
        t.view.slots = slots + size_t(t.ids.simd_id) * 2 * kSimdWidth * kSlotBytes;
        t.fiber->reset(&fiber_main, &t);
      }
      w.group = &g;
      if (Ordering* o = w.ord) {
        o->tg = static_cast<uint32_t>(gi + 1);
        for (auto* v : {&o->pending, &o->thread_fenced}) for (auto& x : *v) x.clear();
        for (auto* v : {&o->acq_pending, &o->acq_thread}) for (auto& x : *v) x.clear();
        ord_watch(*o);
      }
      run_group(w, g, opt.order, rng);
      if (w.ord) ord_unwatch(*w.ord);
      w.group = nullptr;
      if (g.error.empty()) check_red_zones(g);
      for (DeviceWrites& d : dev_writes) {
        if (!g.error.empty()) break;
        for_changed_chunks(d.data, d.snap.data(), d.bytes, [&](size_t chunk, size_t chunk_end) {
          for (size_t off = chunk; off < chunk_end; off += 2) {
            const size_t len = std::min<size_t>(2, d.bytes - off);
            if (std::memcmp(d.data + off, d.snap.data() + off, len) == 0) continue;
            uint64_t& wr = d.writer[off / 2];
            const uintptr_t addr = reinterpret_cast<uintptr_t>(d.data + off) & ~uintptr_t(3);
            if (wr && wr != gi + 1 && !w.atomic_word(addr)) {
              const uint64_t og = wr - 1;
              const uint32_t op[3] = {uint32_t(og % L.groups.x), uint32_t((og / L.groups.x) % L.groups.y),
                                      uint32_t(og / (uint64_t(L.groups.x) * L.groups.y))};
              g.fail("device memory race: threadgroups " + xyz(op) + " and " + xyz(g.group_pos) +
                     " both wrote byte offset " + std::to_string(off) + " of " + d.b->name() +
                     " (threadgroups are not ordered: non-atomic writes to one word from two of them race - "
                     "e.g. two tokens or heads sharing one scratch slot)");
              return false;
            }
            wr = gi + 1;
          }
          std::memcpy(d.snap.data() + chunk, d.data + chunk, chunk_end - chunk);
          return true;
        });
      }
      if (!g.error.empty()) {
        error = g.error;
        std::memcpy(err_group, g.group_pos, sizeof err_group);
        break;
      }
    }
  } catch (const std::exception& e) {
    error = std::string("emulator failure: ") + e.what();
  }

  if (w.ord) ord_unwatch(*w.ord);
  w.ord = nullptr;
  if (w.device_atomics) learn_atomics_kernel(k);
  std::fesetenv(&saved_env);
#if defined(LILY_EMU_SIGNALS)
  alt.restore();
  remove_handlers();
#endif
  for (BoundBuffer& b : bound)
    if (b.read_only) b.buffer->set_read_only(false);
  for (const BoundBuffer& b : bound)  // shadowed writable ranges back into their buffers
    if (b.original && !b.read_only)
      std::memcpy(static_cast<char*>(b.original->contents()) + b.offset, b.buffer->contents(), b.bytes);
  w.bound = nullptr;
  w.n_bound = 0;
  w.running = nullptr;
  w.group = nullptr;

  if (!error.empty())
    throw KernelError(kname + " (threadgroup " + xyz(err_group) + "): " + error);
  for (const BoundBuffer& b : bound) {
    std::string damage = b.buffer->check_slack();
    if (!damage.empty())
      throw KernelError(kname + ": out-of-bounds write to " + b.name() + ": " + damage +
                        (b.original ? " (offsets relative to the bound range)" : ""));
  }
}

namespace {
std::atomic<int> g_races_override{-1};
}  // namespace

void set_races_default(int on) { g_races_override.store(on < 0 ? -1 : on != 0); }

bool races_default() {
  static const bool env = [] {
    const char* v = std::getenv("LILY_EMU_RACES");
    return v != nullptr && v[0] == '1';
  }();
  const int o = g_races_override.load();
  return o >= 0 ? o == 1 : env;
}

Features features() {
  Features f{};
  f.fibers = Fiber::implementation();
#if defined(LILY_EMU_SIGNALS)
  f.guard_pages = true;
#endif
#if defined(LILY_EMU_FP_TRAPS)
  f.fp_traps = true;
#endif
  return f;
}

}  // namespace lily::emu
