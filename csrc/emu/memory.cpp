// Guarded buffers for the emulator (see GuardedBuffer in emulator.h).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <string>

#include "emu/emulator.h"
#include "emu/platform.h"

#if !defined(MAP_ANONYMOUS) && defined(MAP_ANON)
#define MAP_ANONYMOUS MAP_ANON
#endif

namespace lily::emu {

namespace {

constexpr uint64_t kPoison8 = 0xFFA0FFA0FFA0FFA0ull;  // 8 poison bytes from an even address

bool poison_at(const char* p) {
  return static_cast<unsigned char>(*p) == ((reinterpret_cast<uintptr_t>(p) & 1) ? 0xFF : 0xA0);
}

void poison(char* p, size_t n) {
  // Word-aligned poison pattern, independent of where p starts (bytes FF A0 repeating by address);
  // written 8 bytes at a time between an unaligned head and tail.
  size_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(p + i) & 7); ++i) p[i] = static_cast<char>((reinterpret_cast<uintptr_t>(p + i) & 1) ? 0xFF : 0xA0);
  for (; i + 8 <= n; i += 8) std::memcpy(p + i, &kPoison8, 8);
  for (; i < n; ++i) p[i] = static_cast<char>((reinterpret_cast<uintptr_t>(p + i) & 1) ? 0xFF : 0xA0);
}

// First byte that differs from the poison pattern in [p, p + n), or n.
size_t first_damage(const char* p, size_t n) {
  size_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(p + i) & 7); ++i)
    if (!poison_at(p + i)) return i;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    if (v != kPoison8) break;
  }
  for (; i < n; ++i)
    if (!poison_at(p + i)) return i;
  return n;
}

}  // namespace

GuardedBuffer::GuardedBuffer(size_t bytes) : size_(bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  guard_ = (kGuardBytes + page - 1) / page * page;  // inaccessible bytes on each side
  const size_t padded = ((bytes ? bytes : 1) + 15) / 16 * 16;
  const size_t body = (padded + page - 1) / page * page;
  map_len_ = body + 2 * guard_;
  void* m = mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  map_ = static_cast<char*>(m);
  lo_ = map_ + guard_;
  hi_ = lo_ + body;
  data_ = hi_ - padded;
#if defined(LILY_EMU_SIGNALS)
  mprotect(map_, guard_, PROT_NONE);
  mprotect(hi_, guard_, PROT_NONE);
#endif
  poison(lo_, body);
}

GuardedBuffer::GuardedBuffer(const void* external, size_t bytes) : size_(bytes), external_(true) {
  map_ = lo_ = data_ = static_cast<char*>(const_cast<void*>(external));
  hi_ = data_ + bytes;
  map_len_ = bytes;
}

GuardedBuffer::~GuardedBuffer() {
  if (map_ && !external_) munmap(map_, map_len_);
}

void GuardedBuffer::set_read_only(bool ro) {
  if (external_) return;  // read-only pages of the caller's
#if defined(LILY_EMU_SIGNALS)
  mprotect(lo_, static_cast<size_t>(hi_ - lo_), ro ? PROT_READ : PROT_READ | PROT_WRITE);
#else
  (void)ro;  // without a fault handler a write would crash the process: keep it writable
#endif
}

std::string GuardedBuffer::check_slack() {
  if (external_) return "";
  std::string what;
  const size_t before = static_cast<size_t>(data_ - lo_);
  size_t d = first_damage(lo_, before);
  if (d < before) {
    what = "bytes before the start were overwritten (first at offset " +
           std::to_string(static_cast<long long>(d) - static_cast<long long>(before)) + ")";
    poison(lo_, before);
  }
  char* tail = data_ + size_;
  const size_t after = static_cast<size_t>(hi_ - tail);
  d = first_damage(tail, after);
  if (d < after) {
    if (!what.empty()) what += "; ";
    what += "bytes past the end were overwritten (first at offset " + std::to_string(size_ + d) +
            " of a " + std::to_string(size_) + "-byte buffer)";
    poison(tail, after);
  }
  return what;
}

GuardedBuffer::Where GuardedBuffer::classify(const void* addr) const {
  const char* a = static_cast<const char*>(addr);
  if (a < map_ || a >= map_ + map_len_) return Where::outside;
  if (a < lo_) return Where::guard_before;
  if (a >= hi_) return Where::guard_after;
  if (a < data_) return Where::slack_before;
  if (a >= data_ + size_) return Where::slack_after;
  return Where::data;
}

long long GuardedBuffer::offset_of(const void* addr) const {
  return static_cast<const char*>(addr) - data_;
}

}  // namespace lily::emu
