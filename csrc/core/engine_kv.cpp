// The engine's state: the DeltaNet state and the KV pool (blocks that grow with the conversation,
// resize_kv / ensure_kv), reset(), and snapshots (snapshot() copies the state and the filled KV
// rows to the host, restore() puts them back).
#include "core/engine.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/engine_internal.h"

namespace lily::core {

using detail::fail;
using detail::num;

size_t Engine::state_bytes() const {
  size_t n = 0;
  for (const auto& b : state_) n += b->size();
  return n;
}
size_t Engine::scratch_bytes() const {
  size_t n = 0;
  for (const auto& b : scratch_) n += b->size();
  return n;
}

std::vector<gpu::Binding> Engine::state_buffers() const {
  std::vector<gpu::Binding> out;
  for (const auto& b : state_) out.push_back({b.get(), 0, b->size()});
  return out;
}

size_t Engine::kv_filled_bytes(uint32_t position) const {
  const size_t B = spec_.kv_block_tokens, blocks = (size_t(position) + B - 1) / B;
  return blocks * spec_.kv_heads * B * spec_.kv_row_bytes();
}

bool Engine::is_kv(size_t i) const { return std::find(kv_cache_.begin(), kv_cache_.end(), i) != kv_cache_.end(); }

uint64_t Engine::kv_block_bytes() const {
  return uint64_t(spec_.kv_heads) * spec_.kv_block_tokens * spec_.kv_row_bytes() * kv_cache_.size();
}

uint64_t Engine::kv_bytes() const { return uint64_t(spec_.kv_pool()) * kv_block_bytes(); }

uint64_t Engine::kv_bytes_in_use() const {
  const uint64_t B = spec_.kv_block_tokens;
  return (uint64_t(position_) + B - 1) / B * kv_block_bytes();
}

void Engine::resize_kv(uint32_t blocks, uint32_t keep_rows) {
  const uint64_t B = spec_.kv_block_tokens;
  const uint64_t pool = uint64_t(blocks) * spec_.kv_heads * B * spec_.kv_row_bytes();
  const size_t keep = std::min<size_t>(kv_filled_bytes(keep_rows), pool);
  // Every new buffer first: an allocation failure leaves the engine as it was.
  std::vector<std::unique_ptr<gpu::Buffer>> fresh;
  try {
    for (size_t n = 0; n < kv_cache_.size(); ++n) fresh.push_back(device_->new_buffer(pool));
  } catch (const std::exception& e) {
    throw DeviceMemoryError("engine: the KV cache cannot grow to " + num(uint64_t(blocks) * B) + " tokens (" +
                            num(pool * kv_cache_.size()) + " bytes): " + e.what() + "; " +
                            num(uint64_t(spec_.kv_pool()) * B) + " tokens fit");
  }
  for (size_t n = 0; n < kv_cache_.size(); ++n) {
    gpu::Buffer& old = *state_[kv_cache_[n]];
    // The filled blocks (the table is the identity), on the device where it can (cuda: not
    // through host memory; a 32K cache's 660 MB took a decode token ~100 ms that way).
    if (keep && old.has_storage() && fresh[n]->has_storage()) fresh[n]->copy_from(old, 0, 0, keep);
    gpu::Buffer* before = state_[kv_cache_[n]].get();
    for (gpu::Layer& L : m_.layers) {
      if (L.at.k_cache.buffer == before) L.at.k_cache = gpu::Binding{fresh[n].get(), 0, pool};
      if (L.at.v_cache.buffer == before) L.at.v_cache = gpu::Binding{fresh[n].get(), 0, pool};
    }
    state_[kv_cache_[n]] = std::move(fresh[n]);
  }
  memory_.state_bytes = memory_.state_bytes - kv_bytes() + pool * kv_cache_.size();
  spec_.kv_pool_blocks = blocks;
}

void Engine::ensure_kv(uint64_t rows) {
  const uint64_t B = spec_.kv_block_tokens;
  const uint32_t need = uint32_t((rows + B - 1) / B), have = spec_.kv_pool();
  if (need <= have || kv_cache_.empty()) return;
  // Doubling keeps the copies linear in the context; never past the context, nor past the limit.
  uint32_t want = std::min(spec_.kv_blocks(), std::max(need, 2 * have));
  uint64_t limit = kv_limit_bytes;
  const uint64_t others = memory_.total() - kv_bytes();
  if (limit == 0 && memory_.working_set_bytes)  // what the device has left beside the other buffers
    limit = memory_.working_set_bytes > others ? memory_.working_set_bytes - others : 1;
  if (limit) {
    const uint64_t fit = limit / kv_block_bytes();
    if (fit < need)
      throw DeviceMemoryError("engine: " + num(rows) + " tokens need " + num(need) + " KV cache blocks of " +
                              num(B) + " tokens (" + num(uint64_t(need) * kv_block_bytes()) + " bytes), but " +
                              num(fit) + " fit in " + num(limit) + " bytes: " + num(fit * B) +
                              " tokens fit (reset() or a restore to a shorter snapshot frees blocks)");
    want = uint32_t(std::min<uint64_t>(want, fit));
  }
  for (InFlight& f : inflight_) f.enc->wait();  // their rows are copied (complete() reads them later)
  resize_kv(want, position_);
}

void Engine::reset() {
  discard_inflight();
  if (spec_.kv_pool() > 1) resize_kv(1, 0);  // the blocks go back to the device
  // The KV caches need no clearing: attention reads rows [0, position) only.
  for (size_t i = 0; i < state_.size(); ++i)
    if (!is_kv(i) && state_[i]->has_storage()) state_[i]->fill(0, 0, state_[i]->size());
  position_ = 0;
  conv_parity_ = 0;
  valid_ = true;
  failed_ = false;
  have_token_ = false;
  have_batch_token_ = false;
  last_rows_ = 0;
}

Snapshot Engine::snapshot() const {
  require_idle("snapshot");
  if (!valid_) fail("the engine state is invalid after a failed step: call Model.reset() (or restore a snapshot)");
  Snapshot s;
  s.position = position_;
  s.conv_parity = conv_parity_;
  for (size_t i = 0; i < state_.size(); ++i) {
    gpu::Buffer& b = *state_[i];
    if (!b.has_storage()) {
      s.buffers.emplace_back();
    } else if (is_kv(i)) {  // the filled blocks (pool blocks 0 .. ceil(position / B) - 1)
      std::vector<char> v(kv_filled_bytes(position_));
      b.read(0, v.data(), v.size());
      s.buffers.push_back(std::move(v));
    } else {
      std::vector<char> v(b.size());
      b.read(0, v.data(), v.size());
      s.buffers.push_back(std::move(v));
    }
  }
  return s;
}

void Engine::restore(const Snapshot& s) {
  discard_inflight();
  if (s.buffers.size() != state_.size() || s.position > spec_.context_length || s.conv_parity > 1)
    fail("snapshot is from a different engine");
  for (size_t i = 0; i < state_.size(); ++i) {
    const bool has = state_[i]->has_storage();
    const size_t want = !has ? 0 : is_kv(i) ? kv_filled_bytes(s.position) : state_[i]->size();
    if (s.buffers[i].size() != want) fail("snapshot is from a different engine");
  }
  {  // the pools take the snapshot's blocks: a shorter one releases blocks, a longer one takes them
    const uint32_t B = spec_.kv_block_tokens, blocks = std::max<uint32_t>(1, (s.position + B - 1) / B);
    if (blocks > spec_.kv_pool()) ensure_kv(uint64_t(blocks) * B);
    else if (blocks < spec_.kv_pool()) resize_kv(blocks, 0);
  }
  for (size_t i = 0; i < state_.size(); ++i) {
    gpu::Buffer& b = *state_[i];
    const bool has = b.has_storage();
    const size_t want = !has ? 0 : is_kv(i) ? kv_filled_bytes(s.position) : b.size();
    if (s.buffers[i].size() != want) fail("snapshot is from a different engine");
    if (!has) continue;
    b.write(0, s.buffers[i].data(), want);
  }
  position_ = s.position;
  conv_parity_ = s.conv_parity;
  valid_ = true;
  failed_ = false;
  have_token_ = false;
  have_batch_token_ = false;
  last_rows_ = 0;
}

}  // namespace lily::core
