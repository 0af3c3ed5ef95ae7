// The emulator's fault handling: guard pages and the SIGSEGV / SIGBUS / SIGFPE / SIGTRAP handler
// that turns a fault inside a kernel into a KernelError naming the thread and its last sync point
// (fault_landing resumes on the faulting fiber), the memory-ordering model's faults and single
// steps, and the report of a fault.
#include "emu/runtime_internal.h"

namespace lily::emu::rt {

[[noreturn]] void fault_landing();

#if defined(LILY_EMU_SIGNALS)
namespace {
std::mutex g_sig_mu;
int g_sig_users = 0;
constexpr int kNumSignals = 4;
struct sigaction g_old[kNumSignals];
const int kSignals[kNumSignals] = {SIGSEGV, SIGBUS, SIGFPE, SIGTRAP};
constexpr greg_t kTrapFlag = 0x100;  // EFLAGS.TF: trap after the next instruction
}  // namespace

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

}  // namespace lily::emu::rt
