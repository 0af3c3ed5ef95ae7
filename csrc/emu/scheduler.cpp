// The emulator's scheduler: a threadgroup's GPU threads as fibers, run until each reaches a sync
// point; a simdgroup released when its live lanes wait at one collective, the threadgroup at one
// barrier, anything else reported; the thread orders of a run; threadgroup memory (red zones,
// the writes a barrier publishes, for the race detector).
#include "emu/runtime_internal.h"

namespace lily::emu::rt {

static thread_local std::unique_ptr<Worker> t_worker_owner;   // frees it when the OS thread ends

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

// After a pass over the threads: true when the group is finished (every thread done) or failed;
// otherwise a collective or the barrier is released for the next pass.
static bool pass_ends_group(Group& g) {
  bool all_done = true;
  for (const Thread& t : g.threads) all_done &= t.state == St::done;
  if (all_done) return true;
  if (release_simdgroups(g)) return false;
  if (!g.error.empty()) return true;
  release_barrier(g);
  return !g.error.empty();
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
    if (pass_ends_group(g)) return;
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
    if (pass_ends_group(g)) return;
  }
}

}  // namespace lily::emu::rt
