// Element types that cross the host/kernel boundary (activations, scales, outputs).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lily::gpu {

enum class DType : uint8_t { f32, bf16 };

constexpr size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

constexpr std::string_view dtype_name(DType t) {
  return t == DType::f32 ? "float32" : "bfloat16";
}

// Parses "float32" / "bfloat16"; throws std::invalid_argument naming `what` otherwise.
DType parse_dtype(std::string_view name, std::string_view what);

}  // namespace lily::gpu
