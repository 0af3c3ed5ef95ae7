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

// The KV cache's element format (shaders/common/kv_blocks.h; lily_py's kv_dtype): bf16 rows, int8
// codes with a float32 scale per row (q8), or float32 rows (f32).
enum class KvFormat : uint8_t { bf16, q8, f32 };

// Bytes of one cache row (one position of one KV head) of a K or V pool: 2 head_dim (bf16),
// head_dim + 4 (int8 codes and a float scale) or 4 head_dim (f32).
constexpr uint64_t kv_row_bytes(KvFormat f, uint32_t head_dim) {
  return f == KvFormat::q8 ? uint64_t(head_dim) + 4 : (f == KvFormat::f32 ? 4ull : 2ull) * head_dim;
}

// kv_dtype names: "bfloat16", "int8", "float32".
constexpr std::string_view kv_format_name(KvFormat f) {
  return f == KvFormat::q8 ? "int8" : f == KvFormat::f32 ? "float32" : "bfloat16";
}

// Parses a kv_dtype name; throws std::invalid_argument naming `what` otherwise.
KvFormat parse_kv_format(std::string_view name, std::string_view what);

}  // namespace lily::gpu
