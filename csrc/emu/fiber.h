// One GPU thread of the emulator = one fiber: a private stack (with a guard page below it) and a
// saved context. The scheduler of an OS thread resumes a fiber; the fiber yields back to it.
#pragma once
#include <cstddef>

namespace lily::emu {

class Fiber {
 public:
  explicit Fiber(size_t stack_bytes);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // Prepare a fresh start: the next resume() calls fn(arg) at the top of the stack. fn never returns.
  void reset(void (*fn)(void*), void* arg);
  // From the scheduler: run this fiber until it yields.
  void resume();
  // From inside this fiber: return to the scheduler that resumed it.
  void yield();

  char* stack_lo() const { return stack_lo_; }  // lowest usable byte (guard page is below)
  char* stack_hi() const { return stack_hi_; }  // one past the highest byte
  static const char* implementation();

  struct Context;  // implementation-specific saved state

 private:
  Context* ctx_ = nullptr;
  char* map_ = nullptr;
  size_t map_len_ = 0;
  char* stack_lo_ = nullptr;
  char* stack_hi_ = nullptr;
};

}  // namespace lily::emu
