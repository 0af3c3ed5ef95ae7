// The emulator's memory-ordering model (runtime.h): which device stores of other threadgroups of a
// dispatch a thread may read. Pages another threadgroup stored to are watched (no access); a
// fault on one is judged by the model (faults.cpp) against the fences and atomics that publish
// a store. MSL 3.1: a barrier orders its own threadgroup only.
#include "emu/runtime_internal.h"

namespace lily::emu::rt {

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

}  // namespace lily::emu::rt
