#include "gpu/encoder.h"

#include <cstring>

namespace lily::gpu {

namespace {
std::string kname(KernelId id) { return std::string(kernel_info(id).name); }
}  // namespace

void Buffer::check_range(size_t offset, size_t n, const char* what) const {
  if (offset > size() || n > size() - offset)
    throw EncodeError(std::string("buffer ") + what + ": bytes [" + std::to_string(offset) + ", " +
                      std::to_string(offset + n) + ") outside the buffer's " + std::to_string(size()));
}

char* Buffer::host_range(size_t offset, size_t n, const char* what) {
  check_range(offset, n, what);
  char* p = static_cast<char*>(contents());
  if (p == nullptr) throw EncodeError(std::string("buffer ") + what + ": the buffer has no host storage");
  return p + offset;
}

void Buffer::write(size_t offset, const void* src, size_t n) {
  char* p = host_range(offset, n, "write");
  if (n) std::memcpy(p, src, n);
}

void Buffer::read(size_t offset, void* dst, size_t n) {
  const char* p = host_range(offset, n, "read");
  if (n) std::memcpy(dst, p, n);
}

void Buffer::fill(size_t offset, int byte, size_t n) {
  char* p = host_range(offset, n, "fill");
  if (n) std::memset(p, byte, n);
}

void Buffer::copy_from(Buffer& src, size_t src_offset, size_t offset, size_t n) {
  src.check_range(src_offset, n, "copy_from (source)");
  check_range(offset, n, "copy_from");
  if (n == 0) return;
  if (contents() && src.contents()) {
    std::memmove(static_cast<char*>(contents()) + offset, static_cast<const char*>(src.contents()) + src_offset, n);
    return;
  }
  std::vector<char> tmp(n);
  src.read(src_offset, tmp.data(), n);
  write(offset, tmp.data(), n);
}

void Encoder::set_kernel(KernelId id) {
  if (static_cast<size_t>(id) >= kNumKernels) throw EncodeError("set_kernel: unknown kernel id");
  pending_.kernel = id;
  pending_.num_buffers = kernel_info(id).num_buffers;
  pending_.unit = kernel_default_unit(id);
  have_kernel_ = true;
}

void Encoder::set_args_bytes(const void* data, size_t size) {
  if (!have_kernel_) throw EncodeError("set_args before set_kernel");
  const KernelInfo& k = kernel_info(pending_.kernel);
  if (size != k.args_size) [[unlikely]]
    throw EncodeError("set_args for " + kname(pending_.kernel) + ": got " + std::to_string(size) +
                      " bytes, kernel expects " + std::string(k.args) + " (" +
                      std::to_string(k.args_size) + " bytes)");
  std::memcpy(pending_.args, data, size);
  pending_.args_size = size;
  have_args_ = true;
}

void Encoder::set_buffer(uint32_t index, Buffer& buffer, size_t offset, size_t bytes) {
  if (bytes == 0) {
    if (offset > buffer.size()) bytes = 0;
    else bytes = buffer.size() - offset;
  }
  set_buffer(index, Binding{&buffer, offset, bytes});
}

void Encoder::set_buffer(uint32_t index, const Binding& b) {
  if (!have_kernel_) throw EncodeError("set_buffer before set_kernel");
  // The checks are plain comparisons; the message is built only when one fails.
  const bool bad_index = index == 0 || index > pending_.num_buffers;
  if (bad_index || b.buffer == nullptr || b.bytes == 0 || b.offset > b.buffer->size() ||
      b.bytes > b.buffer->size() - b.offset)
    bad_binding(index, b);
  pending_.buffers[index] = b;
  pending_.touched[index] = b.bytes;
  bound_mask_ |= 1u << index;
}

void Encoder::set_touched(uint32_t index, uint64_t bytes) {
  if (!(bound_mask_ & (1u << index))) [[unlikely]]
    throw EncodeError("set_touched: buffer(" + std::to_string(index) + ") not bound");
  pending_.touched[index] = bytes;
}

void Encoder::set_unit(ExecUnit unit) {
  if (!have_kernel_) throw EncodeError("set_unit before set_kernel");
  pending_.unit = unit;
}

const char* exec_unit_name(ExecUnit u) {
  switch (u) {
    case ExecUnit::alu: return "alu";
    case ExecUnit::simdgroup_fp32: return "simdgroup_fp32";
    case ExecUnit::simdgroup_bf16: return "simdgroup_bf16";
    case ExecUnit::tensor: return "tensor";
  }
  return "?";
}

void forward_dispatch(Encoder& inner, const Dispatch& d) {
  inner.set_kernel(d.kernel);
  inner.set_unit(d.unit);
  inner.set_args_bytes(d.args, d.args_size);
  for (uint32_t i = 1; i <= d.num_buffers; ++i) {
    inner.set_buffer(i, d.buffers[i]);
    inner.set_touched(i, d.touched[i]);
  }
  inner.dispatch(d.groups, d.threads);
}

void Encoder::bad_binding(uint32_t index, const Binding& b) const {
  const std::string where = kname(pending_.kernel) + " buffer(" + std::to_string(index) + ")";
  if (index == 0 || index > pending_.num_buffers)
    throw EncodeError(where + ": index out of range 1.." + std::to_string(pending_.num_buffers));
  if (b.buffer == nullptr) throw EncodeError(where + ": null buffer");
  if (b.bytes == 0) throw EncodeError(where + ": empty range");
  throw EncodeError(where + ": range [" + std::to_string(b.offset) + ", +" + std::to_string(b.bytes) +
                    ") exceeds buffer of " + std::to_string(b.buffer->size()) + " bytes");
}

void Encoder::dispatch(Size3 groups, Size3 threads) {
  const uint32_t all = ((2u << pending_.num_buffers) - 1u) & ~1u;  // bits 1..num_buffers (<= 15)
  if (!have_kernel_ || !have_args_ || (bound_mask_ & all) != all || groups.count() == 0 ||
      threads.count() == 0 || threads.count() > 1024)
    bad_dispatch(groups, threads);
  pending_.groups = groups;
  pending_.threads = threads;
  encode_dispatch(pending_);
  counters_.dispatches += 1;
  counters_.threads += groups.count() * threads.count();
  uint64_t touched = 0;
  for (uint32_t i = 1; i <= pending_.num_buffers; ++i) {
    counters_.bytes_bound += pending_.buffers[i].bytes;
    touched += pending_.touched[i];
  }
  counters_.bytes_touched += touched;
  if (record) [[unlikely]] {
    uint64_t bound = 0;
    for (uint32_t i = 1; i <= pending_.num_buffers; ++i) bound += pending_.buffers[i].bytes;
    record->push_back({pending_.kernel, groups, threads, touched, bound, counters_.barriers, pending_.unit});
    last_record_ = record->size();
  } else {
    last_record_ = 0;
  }
  last_kernel_ = static_cast<int64_t>(pending_.kernel);
  KernelCounters& k = counters_.kernels[static_cast<size_t>(pending_.kernel)];
  k.dispatches += 1;
  k.bytes_touched += touched;
  k.threads += groups.count() * threads.count();
  k.groups += groups.count();
  for (auto& b : pending_.buffers) b = Binding{};
  bound_mask_ = 0;
  have_args_ = false;
  have_kernel_ = false;
}

void Encoder::bad_dispatch(Size3 groups, Size3 threads) const {
  if (!have_kernel_) throw EncodeError("dispatch without a kernel");
  const std::string name = kname(pending_.kernel);
  if (!have_args_) throw EncodeError("dispatch " + name + ": args struct not set");
  for (uint32_t i = 1; i <= pending_.num_buffers; ++i)
    if (!(bound_mask_ & (1u << i)))
      throw EncodeError("dispatch " + name + ": buffer(" + std::to_string(i) + ") not bound");
  if (groups.count() == 0 || threads.count() == 0) throw EncodeError("dispatch " + name + ": empty grid");
  throw EncodeError("dispatch " + name + ": " + std::to_string(threads.count()) +
                    " threads per threadgroup exceeds 1024");
}

void Encoder::add_flops(uint64_t executed, uint64_t useful) {
  counters_.flops_executed += executed;
  counters_.flops_useful += useful;
  if (last_kernel_ >= 0) {
    KernelCounters& k = counters_.kernels[static_cast<size_t>(last_kernel_)];
    k.flops_executed += executed;
    k.flops_useful += useful;
    if (record && last_record_ != 0 && last_record_ <= record->size()) {
      DispatchRecord& r = (*record)[last_record_ - 1];
      r.flops_executed += executed;
      r.flops_useful += useful;
    }
  }
  forward_flops(executed, useful);
}

void Encoder::barrier() {
  encode_barrier();
  counters_.barriers += 1;
}

}  // namespace lily::gpu

namespace lily::gpu {

uint32_t Encoder::thread_limit(KernelId) const { return kMaxThreadsPerGroup; }

}  // namespace lily::gpu
