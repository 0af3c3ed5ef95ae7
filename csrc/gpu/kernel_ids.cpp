#include "gpu/kernel_ids.h"

namespace lily::gpu {

std::optional<KernelId> find_kernel(std::string_view name) {
  for (const KernelInfo& k : kKernelTable)
    if (k.name == name) return k.id;
  return std::nullopt;
}

}  // namespace lily::gpu
