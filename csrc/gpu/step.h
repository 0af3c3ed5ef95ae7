// One whole step of the model encoded into one encoder (one command buffer): a prefill chunk of
// T tokens or a decode step (T = 1). Plain C++: it decides which kernels, buffers, grids and
// barriers; the device (emu, metal, count) runs or counts them. Never commits or waits.
//
//   ids -> embedding -> x
//   per layer:  xn  = rms_norm(x, input_norm)
//               mix = DeltaNet mixer(xn)  or  gated attention mixer(xn)  (by layer type)
//               h   = x + mix;  xn = rms_norm(h, post_norm)        (one fused dispatch)
//               x   = h + moe(xn)                        (residual add fused into the MoE)
//   xn = rms_norm(x[rows], norm)   rows = all T (all_logits) or only the last position
//   logits[rows, V] = xn @ lm_head^T
//   (sampling on) token_slot[0] = sample(logits[last row])   the next step's embedding can read it
//
// Decode (T = 1) fuses every RMSNorm into the single-token matvec that consumes it (qmv1 route):
// the input norm into the mixer's first projection (which reads x), the post norm into the MoE
// router (which reads mix and x and writes h and xn for the experts), the final norm into
// lm_head. Chunks of several tokens keep the separate norm dispatches above (one row of logits:
// the final norm is fused there too).
//
// Barriers: one before every consumer of the previous dispatch's output, named below by the
// tensors they order; the ops (gated_delta, moe) place their internal ones the same way.
// `serialize` puts a barrier between every two dispatches (debugging switch).
#pragma once
#include <cstdint>
#include <vector>

#include "core/model_spec.h"
#include "gpu/encoder.h"
#include "gpu/ops/sampling.h"

namespace lily::gpu {

struct QuantWeight {
  Binding w, scales, biases;  // MLX affine: uint32 codes, [N, K / group] scales and biases
  core::QuantSpec q;          // its bits, group size and scale dtype (ModelSpec::quant)
  uint32_t rows = 0;          // N (of one matrix of a stack)
};
// A projection row-concatenated at load from parts (ModelSpec: kQkvParts, kInProjParts,
// kRouterParts): one weight when the parts agree in quantization (the fused route), else one
// block per run of agreeing parts, in row order (the split route: one dispatch per block).
using QuantBlocks = std::vector<QuantWeight>;

struct DeltaNetLayer {
  QuantBlocks in_proj;    // rows in_proj_qkv | in_proj_z | in_proj_b | in_proj_a, fused at load
  QuantWeight out_proj;   // [hidden, Hv * Dv]
  Binding conv;           // float32 [C, K]
  Binding A_log, dt_bias, norm;  // float32 [Hv], [Hv], [Dv]
  Binding conv_state[2];  // float32 [K-1, C] each: step parity p reads [p], writes [1 - p]
  Binding state;          // float32 [Hv, Dv, Dk], updated in place
};

struct AttentionLayer {
  QuantBlocks qkv_proj;   // rows q_proj (per head query | gate) | k_proj | v_proj, fused at load
  QuantWeight o_proj;     // [hidden, q_heads * head_dim]
  Binding q_norm, k_norm; // float32 [head_dim], effective multipliers
  Binding k_cache, v_cache;  // paged bf16 pools [kv_blocks, kv_heads, kv_block_tokens, head_dim]
};

struct MoeLayer {
  QuantBlocks router;  // rows router [E, H] | shared_expert_gate [1, H], fused at load
  QuantWeight gate, up, down;  // stacked experts
  QuantWeight shared_gate, shared_up, shared_down;
};

struct Layer {
  bool attention = false;
  Binding input_norm, post_norm;  // float32 [H], effective multipliers (folded 1 + w)
  DeltaNetLayer dn;      // when !attention
  AttentionLayer at;     // when attention
  MoeLayer moe;
};

// Activations and temporaries, sized for spec.prefill_chunk tokens (float32 throughout).
struct StepScratch {
  Binding ids;                  // uint32 [chunk]
  Binding x, h, xn, mix;        // [chunk, H]
  Binding proj, conv_out, o;    // DeltaNet: [chunk, P], [chunk, C], [chunk, Hv * Dv]
  Binding gd_chunk;             // DeltaNet chunked (WY) route scratch for chunk tokens (unbound: scan only)
  Binding x_i8;                 // int8 activation scratch of the projections (tensor_int8 devices only;
                                // unbound: no int8): ops::qmm_i8_scratch_bytes(chunk, widest K)
  Binding gd_o_raw;             // DeltaNet decode: float32 [Hv * Dv] raw outputs before the gated norm
  Binding qkv, q, attn;         // attention: [chunk, 2 Hq D + 2 Hkv D], [chunk, Hq D] x2
  Binding attn_partials;        // attention decode split-K partials (for context_length keys)
  Binding moe_logits, moe_ids, moe_weights, moe_plan, moe_row_weight, moe_h, moe_y;
  Binding moe_tile_stats;       // uint32 [2 slots, layers, kMoeTileStats]: tiles each layer's MoE plan made (read after the step)
  Binding moe_h_i8;             // int8 scratch of the MoE's h (with x_i8: the int8 64-row tiles; unbound: none)
  Binding logits;               // [max(logit_rows, 2), V]; one-token steps write row `slot`
  Binding token_slot;           // uint32 [2]: sampled token ids (device slots; steps alternate)
  Binding chosen_logit;         // float32 [2]: their raw logits
  Binding sample_state;         // SampleState [2] (one per slot: the host reads its status)
  Binding sample_partials, sample_hist;  // sampler scratch for one row of V
  // Batched steps that sample (bound with the batch scratch, Engine::add_sequence): 2 slots of
  // kBatchSlots entries each (entry kBatchSlots * slot + t: row t's token, its logit, its
  // SampleState), and the sampler scratch of kBatchSlots rows.
  Binding batch_tokens, batch_chosen, batch_sample_state;
  Binding batch_sample_partials, batch_sample_hist;
  Binding logprobs;             // uint32 [2, kSampleLogprobWords]: logprob records (one per slot)
  Binding token_mask;           // uint32 [2, ceil(V / 32)]: a constraint's allowed-token bitset per slot
};

struct ModelBuffers {
  QuantWeight embed, lm_head;
  Binding norm;      // float32 [H]
  Binding inv_freq;  // float32 [rotary_dim / 2] (RoPE, computed at construction)
  Binding kv_table;  // uint32 [kv_blocks] pool block of each logical KV block (written by the host)
  std::vector<Layer> layers;
  StepScratch s;
};

// One sequence of a batched decode step (StepParams::batch): its state, per layer in m.layers'
// order (DeltaNet layers: conv windows and recurrent state; attention layers: KV pools), its
// position and conv parity, and scratch of its own (the decode rule's raw outputs, the attention
// partials). The engine fills them from each sequence's buffers.
struct SeqLayerState {
  Binding conv_state[2], state;  // DeltaNet layers
  Binding k_cache, v_cache;      // attention layers
};
struct SeqState {
  uint32_t position = 0, conv_parity = 0, pool_blocks = 0;
  std::vector<SeqLayerState> layers;
  Binding gd_o_raw, attn_partials;
};

struct StepParams {
  uint32_t tokens = 1;       // T: 1..spec.prefill_chunk
  uint32_t position = 0;     // tokens already in the state
  bool all_logits = false;   // logits for every position (T <= spec.logit_rows) or the last only
  bool logits = true;        // false: stop after the last layer (a prefill chunk that is not the last)
  uint32_t conv_parity = 0;  // which conv_state buffer holds the current window
  bool serialize = false;
  uint32_t slot = 0;           // 0/1: this step's token slot and (one-token steps) logits row;
                               // two steps in flight never share them
  bool ids_from_slot = false;  // embedding reads token_slot[1 - slot] (the previous step's sample), T == 1
  bool sample = false;         // sample the last position's logits into token_slot
  ops::SampleParams sample_params;
  uint32_t valid_vocab = 0;    // ids >= valid_vocab are never sampled (0: vocab)
  bool masked = false;         // the sampler applies token_mask[slot] (the host wrote it before the commit)
  // Batched decode: token t (tokens = batch->size() >= 2) is the one token of sequence (*batch)[t];
  // position and conv_parity above are unused. Needs all_logits (row t: sequence t) and no mask.
  // With `sample`, row t is sampled with batch_sample[t] (sample_params is unused) into
  // batch_tokens[kBatchSlots * slot + t]; with ids_from_slot, token t is
  // batch_tokens[kBatchSlots * (1 - slot) + t] (the previous batched step's sample of row t).
  const std::vector<SeqState>* batch = nullptr;
  const std::vector<ops::SampleParams>* batch_sample = nullptr;
};

// Rows a batched step samples at most: the entries per slot of StepScratch::batch_tokens.
inline constexpr uint32_t kBatchSlots = 8;

// Dispatch and barrier counts of one step are whatever the encoder counts (Encoder::counters);
// tests compare them with a count derived from the config (tests/model/step_plan.py; asserted in
// tests/model/test_engine.py and tests/model/test_real_config_counts.py).
void encode_prefill_chunk(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const StepParams& p);
void encode_decode_step(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const StepParams& p);
// The sampler alone over logits row `logits_row`, into the slot p.slot (token, chosen logit,
// state, logprob record; with p.masked, token_mask[p.slot] applied first): what a step with
// p.sample encodes after its lm_head, for a step that left its logits for a later command buffer
// (constrained generation: the mask of token n + 1 needs token n).
void encode_step_sampler(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const StepParams& p,
                         uint32_t logits_row);

}  // namespace lily::gpu
