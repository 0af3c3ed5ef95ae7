// Fiber context switching. x86-64 System V (Linux): a 14-instruction switch that saves only the
// callee-saved registers (the FP control words are shared by all fibers of an OS thread).
// Elsewhere: POSIX ucontext (slower: it saves the signal mask on every switch).
#include "emu/platform.h"

#if !defined(LILY_EMU_ASM_FIBERS)
#define _XOPEN_SOURCE 600  // macOS exposes the (deprecated) ucontext calls only with this
#if defined(__APPLE__)
#define _DARWIN_C_SOURCE 1
#endif
#include <ucontext.h>
#endif

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>

#include "emu/fiber.h"

#if !defined(MAP_ANONYMOUS) && defined(MAP_ANON)
#define MAP_ANONYMOUS MAP_ANON
#endif

#if defined(LILY_EMU_ASM_FIBERS)
extern "C" {
__attribute__((visibility("hidden"))) void lily_emu_switch(void** save_sp, void* to_sp);
__attribute__((visibility("hidden"))) void lily_emu_fiber_start();
}
// lily_emu_switch(save_sp, to_sp): push callee-saved registers, store rsp in *save_sp, load
// to_sp, pop the registers saved there, return into the other context.
// lily_emu_fiber_start: first return target of a fresh fiber; r12 = arg, r13 = fn.
asm(R"(
    .text
    .globl lily_emu_switch
    .hidden lily_emu_switch
    .type lily_emu_switch,@function
lily_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size lily_emu_switch, .-lily_emu_switch

    .globl lily_emu_fiber_start
    .hidden lily_emu_fiber_start
    .type lily_emu_fiber_start,@function
lily_emu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size lily_emu_fiber_start, .-lily_emu_fiber_start
    .section .note.GNU-stack,"",@progbits
    .text
)");
#endif

namespace lily::emu {

#if defined(LILY_EMU_ASM_FIBERS)
struct Fiber::Context {
  void* sp = nullptr;        // saved stack pointer of the fiber
  void* sched_sp = nullptr;  // saved stack pointer of the scheduler that resumed it
};

void Fiber::reset(void (*fn)(void*), void* arg) {
  // Frame popped by lily_emu_switch: r15 r14 r13 r12 rbx rbp, then the return address.
  // After `ret` rsp = top - 16 (16-byte aligned), so `call` enters fn with the ABI alignment.
  auto top = reinterpret_cast<uintptr_t>(stack_hi_) & ~uintptr_t(15);
  auto* frame = reinterpret_cast<void**>(top - 72);
  frame[0] = nullptr;                                         // r15
  frame[1] = nullptr;                                         // r14
  frame[2] = reinterpret_cast<void*>(fn);                     // r13
  frame[3] = arg;                                             // r12
  frame[4] = nullptr;                                         // rbx
  frame[5] = nullptr;                                         // rbp
  frame[6] = reinterpret_cast<void*>(&lily_emu_fiber_start);  // return address
  ctx_->sp = frame;
}

void Fiber::resume() { lily_emu_switch(&ctx_->sched_sp, ctx_->sp); }
void Fiber::yield() { lily_emu_switch(&ctx_->sp, ctx_->sched_sp); }
const char* Fiber::implementation() { return "x86-64 assembly context switch"; }

#else
struct Fiber::Context {
  ucontext_t fiber;
  ucontext_t sched;
  void (*fn)(void*) = nullptr;
  void* arg = nullptr;
};

static void ucontext_entry(int hi, int lo) {
  auto* c = reinterpret_cast<Fiber::Context*>(
      (static_cast<uintptr_t>(static_cast<unsigned>(hi)) << 32) | static_cast<unsigned>(lo));
  c->fn(c->arg);
  std::abort();  // fn never returns
}

void Fiber::reset(void (*fn)(void*), void* arg) {
  ctx_->fn = fn;
  ctx_->arg = arg;
  getcontext(&ctx_->fiber);
  ctx_->fiber.uc_stack.ss_sp = stack_lo_;
  ctx_->fiber.uc_stack.ss_size = static_cast<size_t>(stack_hi_ - stack_lo_);
  ctx_->fiber.uc_link = nullptr;
  auto p = reinterpret_cast<uintptr_t>(ctx_);
  makecontext(&ctx_->fiber, reinterpret_cast<void (*)()>(&ucontext_entry), 2,
              static_cast<int>(p >> 32), static_cast<int>(p & 0xffffffffu));
}

void Fiber::resume() { swapcontext(&ctx_->sched, &ctx_->fiber); }
void Fiber::yield() { swapcontext(&ctx_->fiber, &ctx_->sched); }
const char* Fiber::implementation() { return "POSIX ucontext"; }
#endif

Fiber::Fiber(size_t stack_bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes = (stack_bytes + page - 1) / page * page;
  map_len_ = stack_bytes + page;
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#if defined(MAP_NORESERVE)
  flags |= MAP_NORESERVE;
#endif
  void* m = mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  map_ = static_cast<char*>(m);
  mprotect(map_, page, PROT_NONE);  // stack overflow faults instead of corrupting memory
  stack_lo_ = map_ + page;
  stack_hi_ = map_ + map_len_;
  ctx_ = new Context();
}

Fiber::~Fiber() {
  delete ctx_;
  if (map_) munmap(map_, map_len_);
}

}  // namespace lily::emu
