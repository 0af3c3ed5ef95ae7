// The engine: one model on one device. Owns the weights (device buffers filled once from the
// checkpoint's memory-mapped tensors; row-concatenated projections fused at load), the
// conversation state (DeltaNet recurrent state and conv windows in fp32; bf16 KV cache sized to
// the context length) and the scratch of one step, all allocated once at construction.
// forward() encodes one whole step into one encoder, commits it and waits once at the end (the
// only host wait: to read the logits).
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <stdexcept>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/model_spec.h"
#include "gpu/encoder.h"
#include "gpu/step.h"

namespace lily::core {

// Per-step counters (one forward = one step = one command buffer).
struct StepStats {
  uint64_t tokens = 0;
  uint64_t dispatches = 0, barriers = 0, bytes_bound = 0, threads = 0;
  uint64_t flops_executed = 0, flops_useful = 0;  // matrix work (gpu::Counters)
  uint64_t bytes_touched = 0;   // bytes the kernels read plus write (routed experts only, KV up to the position)
  uint64_t commits = 0;         // command buffers submitted
  uint64_t waits_in_step = 0;   // host waits requested while the step was encoded (must be 0)
  uint64_t host_waits = 0;      // host waits for the whole forward (1: to read the logits)
  bool ids_from_slot = false;   // the embedding read the previous step's sampled token on the device
  uint32_t in_flight = 0;       // steps already in flight when this one was submitted (1: overlapped)
  uint64_t encode_ns = 0;       // host time spent encoding the step (steady clock; a timing, not a counter)
  uint32_t token = 0xFFFFFFFFu; // the sampled token (sampling steps), read from the device slot
  float token_logit = 0.0f;
};

// The sampler saw a NaN / +inf logit (or only -inf) below valid_vocab.
class SampleError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Sampling fused into a step (the device sampler, shaders/sampling*.metal).
struct StepSampling {
  bool enabled = false;
  gpu::ops::SampleParams params;
  uint32_t valid_vocab = 0;  // 0: the whole vocabulary
  bool ids_from_slot = false;  // feed the previous step's sampled token (device slot), not `ids`
  // A constraint's allowed-token bitset (host memory, uint32 [ceil(valid_vocab / 32)], bit i % 32
  // of word i / 32: token i allowed); null: every token. Copied into the step's mask slot at submit.
  const uint32_t* mask = nullptr;
};

// Engine totals since construction (exact counts; tests assert them).
struct EngineCounters {
  uint64_t commits = 0;       // command buffers committed (steps, samplers, sample_row)
  uint64_t idle_commits = 0;  // ... of them committed with nothing in flight: the device waited for the host
  uint64_t host_waits = 0;    // times the host blocked on the device (complete(), sample_row())
  uint64_t masks_written = 0; // allowed-token bitsets copied into a mask slot
};

// The quantization the engine's kernels take (ModelSpec::validate refuses others; lily_py checks
// every tensor against these first, naming the tensor): kEngineBits for the quantized matmuls and
// the embedding, kEngineExpertBits for the MoE expert kernels (shaders/moe_*.metal).
inline constexpr uint32_t kEngineBits[] = {2, 3, 4, 5, 6, 8};
inline constexpr uint32_t kEngineExpertBits[] = {2, 3, 4, 5, 6, 8};
inline constexpr uint32_t kEngineGroupSizes[] = {32, 64, 128};

// Device memory the engine needs for a spec (computed before anything is allocated).
struct MemoryPlan {
  uint64_t weight_bytes = 0, state_bytes = 0, scratch_bytes = 0;  // state: KV caches, DeltaNet state, conv windows
  uint64_t largest_buffer_bytes = 0;
  std::string largest_buffer;     // what the largest buffer holds
  uint64_t working_set_bytes = 0;  // the device's recommendedMaxWorkingSetSize (0: unlimited)
  uint64_t max_buffer_bytes = 0;   // the device's maxBufferLength (0: unlimited)
  uint64_t total() const { return weight_bytes + state_bytes + scratch_bytes; }
};
// int8: the device takes int8 activations (DeviceInfo::tensor_int8): the int8 scratches too.
MemoryPlan plan_memory(const ModelSpec& spec, bool int8 = false);

// The model does not fit the device's memory (Python: MemoryError).
class DeviceMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A kernel's pipeline on this device cannot take what the engine dispatches (Python: RuntimeError).
class DeviceLimitError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One kernel the engine's steps use, checked at load.
struct PlannedKernel {
  gpu::KernelId kernel;
  uint32_t threads = 0;  // most threads per threadgroup any step dispatches
  gpu::PipelineInfo pipeline;
};

// A copy of the conversation state (host memory), for Model's multi-turn rollback.
struct Snapshot {
  uint32_t position = 0, conv_parity = 0;
  std::vector<std::vector<char>> buffers;  // in Engine::state_buffers() order
};

// Weights served from the checkpoint's pages (zero copy): the checkpoint files the engine maps
// (read-only, whole file, page-aligned) and, per engine weight, where its bytes lie in them. A
// weight is bound at its file offset when the device wraps host memory (Device::wrap_host_memory)
// and the offset is a multiple of kMappedAlignment; every other weight gets its own buffer and is
// uploaded (copied) as before.
struct WeightSource {
  uint32_t file = 0;    // index into WeightMapping::files
  uint64_t offset = 0;  // absolute byte offset of the weight's first byte in that file
};
struct WeightMapping {
  std::vector<std::string> files;
  std::map<std::string, WeightSource> weights;
};
// Metal binds a `device` buffer at an offset aligned to its element type, at most 16 bytes
// (setBuffer:offset:atIndex:); the kernels also read codes and scales through 16-byte vectors
// (uint4 / float4) relative to the binding. A mapped weight's offset must be a multiple of 16.
inline constexpr uint64_t kMappedAlignment = 16;

// Where one engine weight lives (weight_sources()).
struct WeightPlacement {
  std::string name;
  uint64_t bytes = 0;
  int64_t file = -1;       // -1: its own buffer (copied at upload)
  uint64_t offset = 0;     // file offset (mapped) or 0
  std::string why_copied;  // "" when mapped
};

class Engine {
 public:
  // Checks the memory the spec needs against the device (DeviceMemoryError) before allocating;
  // after allocating, creates every pipeline a step uses and checks its limits (DeviceLimitError).
  // `mapping`: weights bound to the checkpoint's pages instead of copied (see WeightMapping).
  Engine(ModelSpec spec, std::unique_ptr<gpu::Device> device, const WeightMapping& mapping = {});

  const ModelSpec& spec() const { return spec_; }
  std::string_view device_name() const { return device_->name(); }

  // Every weight the engine expects: (name, bytes), in load order.
  std::vector<std::pair<std::string, size_t>> weight_list() const;
  // Copies `parts` back to back into weight `name` (row concatenation of C-contiguous blocks);
  // their sizes must add up to the weight's bytes exactly. Throws std::invalid_argument.
  void upload(const std::string& name, const std::vector<std::pair<const void*, size_t>>& parts);
  // Throws std::invalid_argument naming the first weight never uploaded.
  void check_loaded() const;
  size_t weight_bytes() const;
  // Zero copy: bytes of weights bound to the mapped files, bytes copied into weight buffers by
  // upload() since construction, bytes of the files mapped, and every weight's placement.
  size_t mapped_weight_bytes() const;
  uint64_t copied_weight_bytes() const { return copied_bytes_; }
  uint64_t mapped_file_bytes() const;
  std::vector<WeightPlacement> weight_sources() const;
  size_t state_bytes() const;
  size_t scratch_bytes() const;

  // Feeds ids [T] (T <= prefill_chunk) after the state; writes float32 logits [T or 1, vocab] to
  // `logits` (may be null on the counting device). Validation failures throw before anything is
  // encoded; a device error mid-step leaves the state invalid (valid() false until reset/restore).
  // want_logits false: a prefill chunk that is not the last one (no final norm, no lm_head; the
  // step ends with the last layer, `logits` is not written).
  StepStats forward(const uint32_t* ids, uint32_t T, bool all_logits, float* logits,
                    const StepSampling& sampling = {}, bool want_logits = true);
  // Two steps in flight: submit() encodes and commits a step without waiting (the state's
  // bookkeeping advances at once); complete() waits for the oldest step in flight and returns
  // its stats, logits and sampled token. While one step is in flight, only a one-token step fed
  // from the device slot (ids_from_slot) may be submitted: step N+1 is committed before the host
  // waits on step N, and the token never needs the host. Token slot, logits row and sampler
  // status alternate between the two steps, so neither overwrites what the host reads.
  StepStats submit(const uint32_t* ids, uint32_t T, bool all_logits, const StepSampling& sampling = {},
                   bool want_logits = true);
  StepStats complete(float* logits);
  // Constrained generation: the sampler of the newest step in flight, in a command buffer of its
  // own. That step was submitted without sampling (its logits row stays on the device); the host
  // commits its sampler once it knows the allowed set (`sampling.mask`, or none), which depends
  // on the token the step before sampled. complete() of that step then waits for both and
  // returns the token; the next step may be submitted fed from the slot right after this call.
  // With nothing in flight, samples the last completed step's row instead (a new entry).
  void submit_sampler(const StepSampling& sampling);
  const EngineCounters& counters() const { return counters_; }
  // Copies the last position's float32 logits [vocab] of the last completed step (the device
  // buffer keeps them until the next step is submitted); needs no step in flight and a last step
  // that computed logits. Generation never copies logits per token: this is the "asked for" path.
  void last_logits(float* out) const;
  // The logprob record (kSampleLogprobWords words, shaders/common/args_sampling.h) of the last
  // completed sampling step or sample_row; meaningful when its sampling asked for logprobs.
  std::vector<uint32_t> logprob_record() const;  // the last sampled token's record (kSampleLogprobWords)
  bool has_last_logits() const { return inflight_.empty() && last_rows_ != 0; }
  // Samples one token on the device from a logits row the host holds (float32 [vocab]; the
  // prompt cache's row when a whole prompt is restored and nothing is prefilled): copies it into
  // the logits buffer and runs the sampler alone (one command buffer, one wait). Needs no step
  // in flight and enabled sampling; the state is untouched; the device logits no longer hold the
  // last step's row afterwards (has_last_logits() false). Throws SampleError on a non-finite
  // logit, std::invalid_argument on bad parameters.
  uint32_t sample_row(const float* logits, const StepSampling& sampling);
  // Bytes of logits copied from the device to the host since construction (complete(logits)
  // and last_logits()): what "logits leave the device only when asked for" is tested with.
  uint64_t logit_bytes_copied() const { return logit_bytes_copied_; }
  size_t in_flight() const { return inflight_.size(); }
  // Encodes a step at `position` without touching state or reading results (the counting
  // device: counters for any config without weights).
  StepStats count(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling = {},
                  bool want_logits = true);
  // Emulator only: encodes a step at `position` on an encoder that runs nothing and checks the
  // plan for hazards between dispatches (throws emu::KernelError naming them), ignoring barrier
  // number `skip_barrier` (-1: none). The state is untouched. Counters as for count().
  StepStats check(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling = {},
                  bool want_logits = true, int64_t skip_barrier = -1);
  // Devices that time dispatches (cuda): one step of T tokens at `position`, encoded as forward()
  // would and run under gpu::TimingOptions (the whole step, each dispatch alone, an empty graph of
  // the same levels, copy and read references). It runs the step many times over the state, so the
  // engine is reset after. Fails on devices without timing.
  gpu::StepTiming time_step(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling,
                            const gpu::TimingOptions& options);
  // Per-kernel totals of the last count() (indexed by KernelId).
  const std::vector<gpu::KernelCounters>& counted_kernels() const { return counted_kernels_; }
  // Every dispatch of the last count(), in order.
  const std::vector<gpu::DispatchRecord>& counted_dispatches() const { return counted_dispatches_; }

  // Sequences: independent conversations over the same weights and scratch (engine_batch.cpp).
  // The engine starts with sequence 0 active; forward(), submit(), snapshot(), restore(), reset()
  // and position() act on the active sequence. Each sequence owns its DeltaNet state, conv windows
  // and KV pools (grown as its own conversation grows).
  static constexpr uint32_t kMaxBatch = 8;
  // A new empty sequence (state zeroed, KV pools at one block); returns its id. DeviceMemoryError
  // when its state does not fit beside what is allocated.
  uint32_t add_sequence();
  // Makes `id` the active sequence (its buffers swap in: nothing is copied). Needs no step in
  // flight; the last step's logits and device token belong to the old one (has_last_logits false).
  void select_sequence(uint32_t id);
  void drop_sequence(uint32_t id);  // frees its buffers; not the active one
  uint32_t active_sequence() const { return active_; }
  std::vector<uint32_t> sequences() const;  // ascending
  uint32_t sequence_position(uint32_t id) const;
  bool sequence_valid(uint32_t id) const;
  // The most sequences one batched step feeds: min(kMaxBatch, prefill_chunk, logit_rows).
  uint32_t max_batch() const;
  // One token for each of B distinct sequences in one step (one command buffer, one host wait):
  // ids[t] is fed to sequence seqs[t]; float32 logits [B, vocab], row t for seqs[t] (may be null
  // on the counting device). Every weight byte is read once for the B tokens; the DeltaNet rule
  // and attention run per sequence on its own state, in the levels of one token. B == 1 is
  // forward() of that sequence (today's single-stream step). Leaves the last sequence of the
  // batch active. Validation failures throw before anything is encoded; a device error marks
  // every sequence of the batch invalid.
  StepStats decode_batch(const uint32_t* seqs, const uint32_t* ids, uint32_t B, float* logits);
  // Batched decode with the device sampler, two steps in flight (as submit() / complete() for one
  // sequence): submit_batch() encodes and commits the step of decode_batch() plus one sampler per
  // row (sampling[t] for sequence seqs[t]: its own parameters, seed and step) without waiting; the
  // sequences' positions advance at once. ids (host token ids) feed the step when from_slot is
  // false; with from_slot, each row reads the token the previous batched step sampled for it on
  // the device, which needs that step to have been a submit_batch() of the same sequences in the
  // same order. While a step is in flight only a from_slot step may be submitted. B == 1 is the
  // single-stream submit() of that sequence. complete_batch() waits for the oldest step in flight
  // and returns its B sampled tokens in `tokens` (no logits leave the device). SampleError names the first row
  // whose logits were not finite; a device error leaves every sequence of the step invalid.
  StepStats submit_batch(const uint32_t* seqs, const uint32_t* ids, uint32_t B, const std::vector<StepSampling>& sampling,
                         bool from_slot);
  StepStats complete_batch(std::vector<uint32_t>& tokens);
  // count() / check() / time_step() of a batched step of B sequences each at `position` (B - 1
  // temporary sequences, dropped after; time_batch resets the active one as time_step does).
  StepStats count_batch(uint32_t B, uint32_t position);
  // check_batch with `sampling` (one per row, as submit_batch takes): the step with its samplers.
  StepStats check_batch(uint32_t B, uint32_t position, int64_t skip_barrier = -1,
                        const std::vector<StepSampling>& sampling = {});
  gpu::StepTiming time_batch(uint32_t B, uint32_t position, const gpu::TimingOptions& options);

  void reset();
  Snapshot snapshot() const;
  void restore(const Snapshot& snap);
  uint32_t position() const { return position_; }
  bool valid() const { return valid_; }
  bool serialize = false;  // barrier between every two dispatches
  // Emulator, debugging / tests: every step's encoder ignores its barrier #skip_barrier (-1: none),
  // so the emulator's hazard check reports what that barrier ordered.
  int64_t skip_barrier = -1;
  // Most bytes the KV pools may take (0: what the device's working set leaves beside the other
  // buffers, unlimited where the device reports none). Tests set it to reach the full-cache error.
  uint64_t kv_limit_bytes = 0;
  uint64_t kv_bytes() const;         // bytes of the KV pools allocated now (every attention layer, K and V)
  uint64_t kv_bytes_in_use() const;  // bytes of the blocks that hold positions [0, position)
  const StepStats& last_stats() const { return last_; }
  const MemoryPlan& memory() const { return memory_; }
  const std::string& memory_warning() const { return memory_warning_; }  // above ~85% of the working set
  const std::vector<PlannedKernel>& pipelines() const { return plan_; }
  gpu::DeviceInfo device_info() const { return device_->info(); }

 private:
  class DeviceAllocator;
  void check_memory(const MemoryPlan& p);
  void check_pipelines();
  std::vector<gpu::Binding> state_buffers() const;
  bool is_kv(size_t state_index) const;
  struct InFlight {
    std::unique_ptr<gpu::Encoder> enc;
    StepStats st;
    std::unique_ptr<gpu::Encoder> sampler;  // submit_sampler's command buffer (after enc)
    uint32_t slot = 0, rows = 0;
    bool sampled = false, masked = false;
    std::vector<uint32_t> seqs;  // submit_batch(): the step's sequences, in row order (else empty)
  };
  InFlight encode(uint32_t T, uint32_t position, bool all_logits, const StepSampling& sampling, bool want_logits,
                  std::unique_ptr<gpu::Encoder> enc = nullptr, const std::vector<gpu::SeqState>* batch = nullptr,
                  const std::vector<gpu::ops::SampleParams>* batch_sample = nullptr);
  // Run encode_step on the counting device with the recorder on; keep its kernels and stats.
  StepStats record_counted(const std::function<InFlight()>& encode_step);
  // Sequences that are not active: their state buffers (Engine::state_ order), position, conv
  // parity, KV pool blocks and validity.
  struct Parked {
    std::vector<std::unique_ptr<gpu::Buffer>> state;
    uint32_t position = 0, conv_parity = 0, pool_blocks = 1;
    bool valid = true;
  };
  std::map<uint32_t, Parked> parked_;
  uint32_t active_ = 0, next_sequence_ = 1;
  void swap_state(Parked& p);   // exchanges the active sequence's state members with p's, rebinds m_
  void swap_active(Parked& p);  // swap_state, and the device slot / logits rows no longer hold its
  void ensure_kv_of(uint32_t id, uint64_t rows);  // ensure_kv() of any sequence, active or parked
  void set_sequence_valid(uint32_t id, bool v);
  void advance_sequence(uint32_t id);  // position + 1, conv parity flipped
  // The batched sampler's buffers (add_sequence, with the batch scratch) and their bindings in m_.s.
  std::vector<uint64_t> batch_sampler_sizes() const;
  uint64_t batch_sampler_bytes() const;
  void bind_batch_sampler();
  std::vector<std::unique_ptr<gpu::Buffer>> batch_sampler_;
  bool have_batch_token_ = false;     // the last submitted step was a sampling submit_batch() ...
  std::vector<uint32_t> batch_seqs_;  // ... of these sequences
  void rebind_state();          // points m_'s state bindings at state_ (build_buffers' order)
  // The batched step's bindings of sequence `id` (its scratch: row `index` of the batch scratch).
  gpu::SeqState seq_state(uint32_t id, uint32_t index, uint32_t position) const;
  uint64_t sequence_state_bytes(uint32_t pool_blocks) const;
  // decode_batch / submit_batch's checks of seqs (distinct, existing, valid when check_valid,
  // room for a token) and ids (< vocab; null: fed from the device); fail() naming `what`.
  void check_batch_rows(const char* what, const uint32_t* seqs, const uint32_t* ids, uint32_t B, bool check_valid) const;
  std::unique_ptr<gpu::Buffer> batch_o_raw_, batch_partials_;  // batched decode scratch (first extra sequence)
  uint64_t batch_partials_bytes_ = 0;  // per sequence
  // Runs `fn` on a batch of B sequences at `position` (B - 1 temporary ones), then drops them.
  template <class Fn>
  auto with_temporary_batch(uint32_t B, uint32_t position, Fn fn);
  // After the wait: the MoE tiled route's flops_executed from the tiles each plan made.
  void correct_moe_flops(StepStats& st, uint32_t slot) const;
  void require_idle(const char* what) const;

  ModelSpec spec_;
  std::unique_ptr<gpu::Device> device_;
  // Zero copy: the mapped checkpoint files and the device buffers over them (destroyed before the
  // mappings: declared after them).
  struct MappedFile {
    void* data = nullptr;
    size_t length = 0;  // mapped bytes (the file size rounded up to whole pages)
    uint64_t file_bytes = 0;
    std::string path;
    MappedFile() = default;
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;
    ~MappedFile();
  };
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::vector<std::unique_ptr<gpu::Buffer>> file_buffers_;  // [file]; nullptr: the device does not wrap it
  WeightMapping mapping_;
  uint64_t copied_bytes_ = 0;
  struct Weight {
    std::unique_ptr<gpu::Buffer> buffer;  // null when mapped
    gpu::Binding binding;
    bool loaded = false;
    int64_t file = -1;
    uint64_t offset = 0;
    std::string why_copied;
  };
  std::map<std::string, Weight> weights_;
  std::vector<std::string> weight_order_;
  std::vector<std::unique_ptr<gpu::Buffer>> state_, scratch_;
  std::vector<size_t> kv_cache_;  // indices into state_ of the KV caches
  // Bytes of one KV pool's blocks that hold positions [0, position) (the table is the identity).
  size_t kv_filled_bytes(uint32_t position) const;
  uint64_t kv_block_bytes() const;  // one block of every pool
  // Grows the KV pools to hold positions [0, rows) (doubling, at most the context); throws
  // DeviceMemoryError (saying how many tokens fit) before changing anything when they cannot.
  void ensure_kv(uint64_t rows);
  // Reallocates every pool at `blocks` blocks, keeping the blocks of positions [0, keep_rows).
  void resize_kv(uint32_t blocks, uint32_t keep_rows);
  gpu::ModelBuffers m_;
  uint32_t position_ = 0, conv_parity_ = 0;
  bool valid_ = true;
  bool failed_ = false;  // a step failed while others were in flight: invalid until reset/restore
  void discard_inflight();  // wait out (ignoring errors) and drop every step in flight
  bool have_token_ = false;  // the last submitted step samples into token_slot[1 - next_slot_]
  uint32_t next_slot_ = 0;
  std::deque<InFlight> inflight_;
  StepStats last_;
  MemoryPlan memory_;
  std::string memory_warning_;
  std::vector<PlannedKernel> plan_;
  uint32_t lp_slot_ = 0;  // slot of the last completed sampling step's logprob record
  uint32_t last_rows_ = 0, last_slot_ = 0;  // logits rows / slot of the last completed step
  mutable uint64_t logit_bytes_copied_ = 0;
  std::vector<gpu::KernelCounters> counted_kernels_;
  std::vector<gpu::DispatchRecord> counted_dispatches_;
  bool recording_ = false;
  EngineCounters counters_;
  void write_mask(const StepSampling& sampling, uint32_t slot);
};

}  // namespace lily::core
