#include "gpu/step.h"

#include <stdexcept>
#include <string>

#include "gpu/ops/attention.h"
#include "gpu/ops/embedding.h"
#include "gpu/ops/gated_delta.h"
#include "gpu/ops/moe.h"
#include "gpu/ops/norm.h"
#include "gpu/ops/qmm.h"

namespace lily::gpu {

namespace {

// Rows [first, first + count) of a row-major binding with `row_bytes` per row.
Binding rows(const Binding& b, uint64_t first, uint64_t count, uint64_t row_bytes) {
  return Binding{b.buffer, b.offset + first * row_bytes, count * row_bytes};
}

// Forwards everything to `inner`, with a barrier between every two dispatches (the
// serialize-everything switch); barriers the step asks for are merged with those.
class SerialEncoder final : public Encoder {
 public:
  explicit SerialEncoder(Encoder& inner) : inner_(inner) {}
  void commit() override { inner_.commit(); }
  void wait() override { inner_.wait(); }
  uint32_t thread_limit(KernelId k) const override { return inner_.thread_limit(k); }
  bool tensor_ops() const override { return inner_.tensor_ops(); }
  bool tensor_int8() const override { return inner_.tensor_int8(); }

 protected:
  void encode_dispatch(const Dispatch& d) override {
    if (dispatched_since_barrier_) inner_.barrier();
    forward_dispatch(inner_, d);
    dispatched_since_barrier_ = true;
  }
  void encode_barrier() override {
    if (dispatched_since_barrier_) inner_.barrier();
    dispatched_since_barrier_ = false;
  }
  void forward_flops(uint64_t executed, uint64_t useful) override { inner_.add_flops(executed, useful); }

 private:
  Encoder& inner_;
  bool dispatched_since_barrier_ = false;
};

// The split route of a fused projection (more than one block): the blocks' weights and rows.
std::vector<ops::QmmBlock> qmm_blocks(const QuantBlocks& b) {
  std::vector<ops::QmmBlock> out;
  if (b.size() > 1)
    for (const QuantWeight& w : b)
      out.push_back({w.w, w.scales, w.biases, w.q.scale_dtype, w.q.bits, w.q.group_size, w.rows});
  return out;
}

ops::QuantLinear quant_linear(const QuantWeight& w) {
  return ops::QuantLinear{w.w, w.scales, w.biases, w.q.scale_dtype, w.q.bits, w.q.group_size, {}};
}

ops::QuantLinear quant_linear(const QuantBlocks& b) {
  ops::QuantLinear l = quant_linear(b.front());
  l.blocks = qmm_blocks(b);
  return l;
}

ops::QuantMatrix quant_matrix(const QuantWeight& w) { return ops::QuantMatrix{w.w, w.scales, w.biases}; }

// fold_norm: the layer's input norm is fused into the mixer's first projection (decode), which
// then reads x (not xn).
void encode_deltanet(Encoder& enc, const core::ModelSpec& spec, const Layer& L, const StepScratch& s,
                     const StepParams& p, bool fold_norm, uint32_t layer) {
  const uint32_t T = p.tokens;
  ops::GatedDeltaMixerOperands g;
  g.x = fold_norm ? s.x : s.xn;
  if (fold_norm) {
    g.in_norm = L.input_norm;
    g.in_norm_eps = spec.eps;
  }
  g.in_proj = quant_linear(L.dn.in_proj);
  g.out_proj = quant_linear(L.dn.out_proj);
  g.conv_weight = L.dn.conv;
  g.A_log = L.dn.A_log;
  g.dt_bias = L.dn.dt_bias;
  g.norm_weight = L.dn.norm;
  g.conv_state_in = L.dn.conv_state[p.conv_parity];
  g.conv_state_out = L.dn.conv_state[1 - p.conv_parity];
  g.state = L.dn.state;
  g.proj = s.proj;
  g.conv_out = s.conv_out;
  g.o = s.o;
  g.chunk_scratch = s.gd_chunk;
  g.x_i8 = s.x_i8;
  g.gd_o_raw = s.gd_o_raw;
  g.out = s.mix;
  if (p.batch)
    for (const SeqState& sq : *p.batch) {
      const SeqLayerState& ls = sq.layers.at(layer);
      g.seqs.push_back({ls.conv_state[sq.conv_parity], ls.conv_state[1 - sq.conv_parity], ls.state, sq.gd_o_raw});
    }
  g.x_dtype = spec.activations;
  g.w_dtype = DType::f32;
  g.T = T;
  g.hidden = spec.hidden;
  g.Hk = spec.lin_k_heads;
  g.Hv = spec.lin_v_heads;
  g.Dk = spec.lin_k_dim;
  g.Dv = spec.lin_v_dim;
  g.K = spec.conv_kernel;
  g.eps = spec.eps;
  ops::encode_gated_delta_mixer(enc, g);
}

void encode_attention(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const Layer& L,
                      const StepScratch& s, const StepParams& p, bool fold_norm, uint32_t layer) {
  auto weights = [&](const QuantWeight& w) {
    ops::QmmOperands q;
    q.w = w.w;
    q.scales = w.scales;
    q.biases = w.biases;
    q.scale_dtype = w.q.scale_dtype;
    q.bits = w.q.bits;
    q.group_size = w.q.group_size;
    return q;
  };
  ops::AttentionMixerOperands a;
  a.x = fold_norm ? s.x : s.xn;
  if (fold_norm) {
    a.in_norm = L.input_norm;
    a.in_norm_eps = spec.eps;
  }
  a.qkv_proj = weights(L.at.qkv_proj.front());
  a.qkv_proj.blocks = qmm_blocks(L.at.qkv_proj);
  a.o_proj = weights(L.at.o_proj);
  a.qkv = s.qkv;
  a.q_norm = L.at.q_norm;
  a.k_norm = L.at.k_norm;
  a.inv_freq = m.inv_freq;
  a.k_cache = L.at.k_cache;
  a.v_cache = L.at.v_cache;
  a.q = s.q;
  a.attn = s.attn;
  a.scratch = s.attn_partials;
  a.x_i8 = s.x_i8;
  a.out = s.mix;
  a.dtype = spec.activations;
  a.w_dtype = DType::f32;
  a.tokens = p.tokens;
  a.hidden = spec.hidden;
  a.q_heads = spec.q_heads;
  a.kv_heads = spec.kv_heads;
  a.head_dim = spec.head_dim;
  a.rotary_dim = spec.rotary_dim;
  a.position = p.position;
  a.kv.table = m.kv_table;
  a.kv.block_tokens = spec.kv_block_tokens;
  a.kv.pool_blocks = spec.kv_pool();
  a.kv.format = spec.kv_format;
  a.eps = spec.eps;
  if (p.batch)
    for (const SeqState& sq : *p.batch) {
      const SeqLayerState& ls = sq.layers.at(layer);
      a.seqs.push_back({ls.k_cache, ls.v_cache, sq.pool_blocks, sq.position, sq.attn_partials});
    }
  ops::encode_attention_mixer(enc, a);
}

// fold_norm: the post norm (h = x + mix; xn = rms_norm(h)) is fused into the router, which writes
// h and xn for the expert kernels.
void encode_moe_block(Encoder& enc, const core::ModelSpec& spec, const Layer& L, const StepScratch& s,
                      const StepParams& p, uint32_t layer, bool fold_norm) {
  ops::MoeOperands m;
  if (fold_norm) {
    m.norm_weight = L.post_norm;
    m.norm_x = s.mix;
    m.norm_residual = s.x;
    m.norm_eps = spec.eps;
  }
  m.x = s.xn;
  m.residual = s.h;
  m.out = s.x;
  m.router = quant_matrix(L.moe.router.front());
  m.router_blocks = qmm_blocks(L.moe.router);
  m.gate = quant_matrix(L.moe.gate);
  m.up = quant_matrix(L.moe.up);
  m.down = quant_matrix(L.moe.down);
  m.shared_gate = quant_matrix(L.moe.shared_gate);
  m.shared_up = quant_matrix(L.moe.shared_up);
  m.shared_down = quant_matrix(L.moe.shared_down);
  m.scratch = ops::MoeScratch{s.moe_logits, s.moe_ids, s.moe_weights, s.moe_plan, s.moe_row_weight, s.moe_h, s.moe_y,
                              rows(s.moe_tile_stats, uint64_t(p.slot) * spec.layers + layer, 1, kMoeTileStats * 4),
                              s.x_i8, s.moe_h_i8};
  m.x_dtype = spec.activations;
  m.scale_dtype = L.moe.gate.q.scale_dtype;
  m.router_scale_dtype = L.moe.router.front().q.scale_dtype;
  m.tokens = p.tokens;
  m.hidden = spec.hidden;
  m.experts = spec.experts;
  m.top_k = spec.top_k;
  m.inter = spec.moe_inter;
  m.shared_inter = spec.shared_inter;
  m.bits = L.moe.gate.q.bits;  // the gate/up stage (ModelSpec::validate: gate and up agree, shared gate
  m.group_size = L.moe.gate.q.group_size;  // and up too, in the same group size)
  m.shared_bits = L.moe.shared_gate.q.bits;
  m.down_bits = L.moe.down.q.bits;  // the down stage
  m.down_group_size = L.moe.down.q.group_size;
  m.shared_down_bits = L.moe.shared_down.q.bits;
  m.router_bits = L.moe.router.front().q.bits;
  m.router_group_size = L.moe.router.front().q.group_size;
  ops::encode_moe(enc, m);
}

// A batched step's samplers: row t of the logits with (*p.batch_sample)[t] into
// batch_tokens[kBatchSlots * slot + t], each row on its own state entry and scratch rows, all rows'
// passes in the levels of the deepest (ops::encode_samples).
void encode_batch_sampler(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const StepParams& p) {
  const StepScratch& s = m.s;
  const uint32_t V = spec.vocab;
  const uint64_t state_bytes = ops::sample_state_bytes(1);
  const uint64_t part_bytes = ops::sample_partials_bytes(1, p.valid_vocab ? p.valid_vocab : V);
  const uint64_t hist_bytes = ops::sample_hist_bytes(1, p.valid_vocab ? p.valid_vocab : V);
  std::vector<ops::SampleOperands> rows;
  for (uint32_t t = 0; t < p.tokens; ++t) {
    const uint32_t entry = kBatchSlots * p.slot + t;
    ops::SampleOperands so;
    so.logits = Binding{s.logits.buffer, s.logits.offset + uint64_t(t) * V * 4, uint64_t(V) * 4};
    // Each row binds its own entries (slot 0 of the binding), so no two rows' ranges overlap.
    so.ids = Binding{s.batch_tokens.buffer, s.batch_tokens.offset + entry * 4, 4};
    so.chosen_logit = Binding{s.batch_chosen.buffer, s.batch_chosen.offset + entry * 4, 4};
    so.state = Binding{s.batch_sample_state.buffer, s.batch_sample_state.offset + entry * state_bytes, state_bytes};
    so.partials = Binding{s.batch_sample_partials.buffer, s.batch_sample_partials.offset + t * part_bytes, part_bytes};
    so.hist = Binding{s.batch_sample_hist.buffer, s.batch_sample_hist.offset + t * hist_bytes, hist_bytes};
    so.logprobs = Binding{};
    so.rows = 1;
    so.stride = V;
    so.valid_vocab = p.valid_vocab ? p.valid_vocab : V;
    so.slot = 0;
    so.params = (*p.batch_sample)[t];
    rows.push_back(so);
  }
  ops::encode_samples(enc, rows);
}

void encode_step(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const StepParams& p) {
  const uint32_t T = p.tokens, H = spec.hidden;
  if (T == 0 || T > spec.prefill_chunk)
    throw std::invalid_argument("engine step: tokens=" + std::to_string(T) + " outside [1, prefill_chunk=" +
                                std::to_string(spec.prefill_chunk) + "]");
  if (p.all_logits && T > spec.logit_rows)
    throw std::invalid_argument("engine step: all_logits for " + std::to_string(T) + " tokens exceeds logit_rows=" +
                                std::to_string(spec.logit_rows));
  if (uint64_t(p.position) + T > spec.context_length)
    throw std::invalid_argument("engine step: position " + std::to_string(p.position) + " + " + std::to_string(T) +
                                " tokens exceeds context_length " + std::to_string(spec.context_length));
  const StepScratch& s = m.s;
  const DType act = spec.activations;
  const uint64_t xe = dtype_size(act);
  const uint64_t row = uint64_t(H) * xe;
  StepScratch t = s;  // the activations narrowed to T rows (ops bind exactly what they touch)
  if (p.ids_from_slot && T != 1 && !p.batch) throw std::invalid_argument("engine step: ids_from_slot needs exactly one token");
  if (p.batch && (p.batch->size() != T || T < 2 || T > kBatchSlots || !p.all_logits || p.masked))
    throw std::invalid_argument("engine step: a batched decode step feeds one token to each of 2.." +
                                std::to_string(kBatchSlots) + " sequences, with all_logits and no token mask");
  if (p.batch && p.sample && (!p.batch_sample || p.batch_sample->size() != T || !s.batch_tokens.buffer))
    throw std::invalid_argument("engine step: a sampling batched step needs one SampleParams per sequence "
                                "and the batch sampler's buffers");
  if (p.batch && p.ids_from_slot && !s.batch_tokens.buffer)
    throw std::invalid_argument("engine step: no batched step sampled before this one");
  if (p.slot > 1) throw std::invalid_argument("engine step: slot must be 0 or 1");
  if (p.batch && p.ids_from_slot)
    t.ids = Binding{s.batch_tokens.buffer, s.batch_tokens.offset + uint64_t(kBatchSlots) * (1 - p.slot) * 4, uint64_t(T) * 4};
  else if (p.ids_from_slot)
    t.ids = Binding{s.token_slot.buffer, s.token_slot.offset + (1 - p.slot) * 4, 4};
  else
    t.ids = Binding{s.ids.buffer, s.ids.offset, uint64_t(T) * 4};
  t.x = rows(s.x, 0, T, row);
  t.h = rows(s.h, 0, T, row);
  t.xn = rows(s.xn, 0, T, row);
  t.mix = rows(s.mix, 0, T, row);
  const uint64_t qkv_row = uint64_t(spec.attn_qkv_rows()) * xe, q_row = uint64_t(spec.q_heads) * spec.head_dim * xe;
  if (s.qkv.buffer) {
    t.qkv = rows(s.qkv, 0, T, qkv_row);
    t.q = rows(s.q, 0, T, q_row);
    t.attn = rows(s.attn, 0, T, q_row);
  }

  ops::EmbeddingOperands e;
  e.ids = t.ids;
  e.table = m.embed.w;
  e.scales = m.embed.scales;
  e.biases = m.embed.biases;
  e.out = t.x;
  e.out_dtype = act;
  e.scale_dtype = m.embed.q.scale_dtype;
  e.tokens = T;
  e.vocab = spec.vocab;
  e.D = H;
  e.bits = m.embed.q.bits;
  e.group_size = m.embed.q.group_size;
  ops::encode_embedding(enc, e);
  enc.barrier();  // x (embedding) -> input norm of layer 0

  if (!p.logits && (p.sample || p.all_logits))
    throw std::invalid_argument("engine step: sampling / all_logits need the logits");
  // Decode (one token): every RMSNorm is fused into the matvec that consumes it (qmv1 route):
  // the input norm into the mixer's first projection, the post norm into the router, the final
  // norm into lm_head: two levels fewer per layer and one at the head. A chunk of several
  // tokens keeps separate norm dispatches (tiled matmuls).
  const bool fold = T == 1;
  for (size_t li = 0; li < m.layers.size(); ++li) {
    const Layer& L = m.layers[li];
    if (!fold) {
      ops::RmsNormOperands in;
      in.x = t.x;
      in.weight = L.input_norm;
      in.y = t.xn;
      in.x_dtype = act;
      in.rows = T;
      in.D = H;
      in.eps = spec.eps;
      ops::encode_rms_norm(enc, in);
      enc.barrier();  // xn -> mixer projections
    }

    if (L.attention) encode_attention(enc, spec, m, L, t, p, fold, uint32_t(li));
    else encode_deltanet(enc, spec, L, t, p, fold, uint32_t(li));
    enc.barrier();  // mix (out_proj) -> residual + post norm (fold: -> router, which reads mix and x)

    if (!fold) {
      ops::RmsNormOperands post;
      post.x = t.mix;
      post.residual = t.x;
      post.h_out = t.h;
      post.weight = L.post_norm;
      post.y = t.xn;
      post.x_dtype = act;
      post.rows = T;
      post.D = H;
      post.eps = spec.eps;
      ops::encode_rms_norm(enc, post);
      enc.barrier();  // h, xn -> MoE (router reads xn; combine reads h)
    }

    encode_moe_block(enc, spec, L, t, p, uint32_t(li), fold);
    if (li + 1 == m.layers.size() && !p.logits) return;  // the state is complete: no head
    enc.barrier();  // x (h + moe) -> next layer's input norm (fold: its first projection) / the final norm
  }

  const uint32_t out_rows = p.all_logits ? T : 1;
  const uint32_t first = T - out_rows;
  const uint32_t logits_row = out_rows == 1 ? p.slot : 0;  // one row: alternate between steps
  // One output row: the final norm is fused into lm_head (qmv1 route). Several: rms_norm, lm_head.
  const bool fold_final = out_rows == 1;
  ops::QmmOperands head;
  if (fold_final) {
    head.x = rows(s.x, first, 1, row);
    head.norm_weight = m.norm;
    head.eps = spec.eps;
  } else {
    ops::RmsNormOperands fin;
    fin.x = rows(s.x, first, out_rows, row);
    fin.weight = m.norm;
    fin.y = rows(s.xn, 0, out_rows, row);
    fin.x_dtype = act;
    fin.rows = out_rows;
    fin.D = H;
    fin.eps = spec.eps;
    ops::encode_rms_norm(enc, fin);
    enc.barrier();  // xn (final norm) -> lm_head
    head.x = fin.y;
  }
  head.w = m.lm_head.w;
  head.scales = m.lm_head.scales;
  head.biases = m.lm_head.biases;
  head.y = rows(s.logits, logits_row, out_rows, uint64_t(spec.vocab) * 4);
  head.x_dtype = act;
  head.y_f32 = true;  // fp32 logits whatever the activations
  head.scale_dtype = m.lm_head.q.scale_dtype;
  head.M = out_rows;
  head.N = spec.vocab;
  head.K = H;
  head.bits = m.lm_head.q.bits;
  head.group_size = m.lm_head.q.group_size;
  ops::encode_quantized_matmul(enc, head);
  if (!p.sample) return;
  enc.barrier();  // logits -> sampler
  if (p.batch) encode_batch_sampler(enc, spec, m, p);
  else encode_step_sampler(enc, spec, m, p, logits_row + out_rows - 1);
}

}  // namespace

void encode_prefill_chunk(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const StepParams& p) {
  if (p.serialize) {
    SerialEncoder ser(enc);
    encode_step(ser, spec, m, p);
  } else {
    encode_step(enc, spec, m, p);
  }
}

void encode_step_sampler(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const StepParams& p,
                         uint32_t logits_row) {
  if (p.slot > 1) throw std::invalid_argument("engine sampler: slot must be 0 or 1");
  const StepScratch& s = m.s;
  ops::SampleOperands so;
  so.logits = Binding{s.logits.buffer, s.logits.offset + uint64_t(logits_row) * spec.vocab * 4, uint64_t(spec.vocab) * 4};
  so.ids = s.token_slot;
  so.chosen_logit = s.chosen_logit;
  const uint64_t state_bytes = ops::sample_state_bytes(1);  // one SampleState per slot
  so.state = Binding{s.sample_state.buffer, s.sample_state.offset + p.slot * state_bytes, state_bytes};
  so.partials = s.sample_partials;
  so.hist = s.sample_hist;
  so.logprobs = s.logprobs;
  so.rows = 1;
  so.stride = spec.vocab;
  so.valid_vocab = p.valid_vocab ? p.valid_vocab : spec.vocab;
  so.slot = p.slot;
  so.params = p.sample_params;
  if (p.masked) {
    // The slot's bitset: ceil(V / 32) words per slot, the first ceil(valid_vocab / 32) read.
    const uint64_t stride = uint64_t(ops::mask_words(spec.vocab)) * 4;
    so.mask = Binding{s.token_mask.buffer, s.token_mask.offset + p.slot * stride,
                      uint64_t(ops::mask_words(so.valid_vocab)) * 4};
  }
  ops::encode_sample(enc, so);
}

void encode_decode_step(Encoder& enc, const core::ModelSpec& spec, const ModelBuffers& m, const StepParams& p) {
  if (p.tokens != 1) throw std::invalid_argument("encode_decode_step: a decode step feeds exactly one token");
  encode_prefill_chunk(enc, spec, m, p);
}

}  // namespace lily::gpu
