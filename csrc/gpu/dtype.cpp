#include "gpu/dtype.h"

#include <stdexcept>
#include <string>

namespace lily::gpu {

DType parse_dtype(std::string_view name, std::string_view what) {
  if (name == "float32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  throw std::invalid_argument(std::string(what) + ": unsupported dtype '" + std::string(name) +
                              "' (expected float32 or bfloat16)");
}

KvFormat parse_kv_format(std::string_view name, std::string_view what) {
  if (name == "bfloat16") return KvFormat::bf16;
  if (name == "int8") return KvFormat::q8;
  if (name == "float32") return KvFormat::f32;
  throw std::invalid_argument(std::string(what) + ": unsupported KV cache dtype '" + std::string(name) +
                              "' (expected bfloat16, int8 or float32)");
}

}  // namespace lily::gpu
