// What the engine's source files share, private to them (csrc/core/engine*.cpp): the error and
// number helpers of their messages, and the Allocator that build_buffers() places every buffer with.
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "core/engine.h"

namespace lily::core::detail {

[[noreturn]] inline void fail(const std::string& m) { throw std::invalid_argument("engine: " + m); }

inline std::string num(uint64_t v) { return std::to_string(v); }

// A SampleError for a sampler state in error, `where` saying which row (" in ...").
inline SampleError sample_error(const ::lily::SampleState& st, const std::string& where) {
  return SampleError("engine: the sampler found a non-finite logit" +
                     (st.bad_id != 0xFFFFFFFFu ? " at token id " + num(st.bad_id) : std::string(" (all -inf)")) + where);
}

inline std::string gib(uint64_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(1ull << 30));
  return buf;
}

// Where build_buffers() puts each buffer: the engine's device (Engine), or nowhere, only adding
// up the sizes (MemoryPlan: the memory check before anything is allocated).
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual gpu::Binding weight(const std::string& name, uint64_t bytes) = 0;
  virtual gpu::Binding state(uint64_t bytes, bool kv_cache) = 0;
  virtual gpu::Binding scratch(uint64_t bytes) = 0;
};

// Every buffer of the model (weights, state, scratch) through the allocator: engine_buffers.cpp.
void build_buffers(const ModelSpec& s, Allocator& a, gpu::ModelBuffers& m_, bool int8 = false);

}  // namespace lily::core::detail
