// Emulator runtime: the kernel registry, the calls GPU threads make into the runtime (sync points,
// fences, threadgroup memory, atomics, failures) and launches (run: bindings, guards, the race
// detector's checks, the thread orders). See runtime.h for the execution model; the shared state
// is runtime_internal.h, the scheduler scheduler.cpp, the memory-ordering model memory_order.cpp,
// fault handling faults.cpp. Kept out of the shader translation unit on purpose: the Metal shim's
// macros (`thread`, `constant`, ...) would break the standard headers used here.
#include "emu/runtime_internal.h"

namespace lily::emu {

using namespace rt;

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
