// What the emulator can do on this platform (reported by lily_py._core.emu.features()).
//
//   LILY_EMU_ASM_FIBERS - hand-written context switch (x86-64 System V); else POSIX ucontext.
//   LILY_EMU_SIGNALS    - guard pages + a SIGSEGV/SIGBUS/SIGFPE handler that turns a fault inside
//                         a kernel into a KernelError (needs the signal context layout; Linux x86-64).
//                         Without it, out-of-bounds writes are still caught after the dispatch by
//                         the canary bytes around every buffer.
//   LILY_EMU_FP_TRAPS   - trap on FE_INVALID while kernels run (glibc feenableexcept), so
//                         arithmetic on poisoned (signalling NaN) memory raises at once.
#pragma once

#if defined(__linux__) && defined(__x86_64__)
#if !defined(LILY_EMU_FORCE_UCONTEXT)  // (to test the portable fallback on Linux)
#define LILY_EMU_ASM_FIBERS 1
#endif
#define LILY_EMU_SIGNALS 1
#define LILY_EMU_FP_TRAPS 1
#endif
