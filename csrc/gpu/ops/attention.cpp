#include "gpu/ops/attention.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace lily::gpu::ops {

namespace {

[[noreturn]] void fail(const char* fn, const std::string& m) {
  throw std::invalid_argument(std::string(fn) + ": " + m);
}

// The binding restricted to exactly `bytes` (counters report exact ranges); fails when too short.
Binding need(const char* fn, const Binding& b, uint64_t bytes, const char* what) {
  if (b.buffer == nullptr) fail(fn, std::string(what) + " not bound");
  if (b.bytes < bytes)
    fail(fn, std::string(what) + " range has " + std::to_string(b.bytes) + " bytes, needs " + std::to_string(bytes));
  Binding r = b;
  r.bytes = bytes;
  return r;
}

void check_rotary(const char* fn, uint32_t head_dim, uint32_t rotary_dim) {
  if (rotary_dim % 2 != 0 || rotary_dim > head_dim)
    fail(fn, "rotary_dim must be even and <= head_dim, got " + std::to_string(rotary_dim) + " (head_dim " +
                 std::to_string(head_dim) + ")");
}

}  // namespace

uint32_t check_kv_paging(const char* fn, const KvPaging& kv, uint32_t kv_heads, uint32_t head_dim, uint64_t rows) {
  const uint32_t B = kv.block_tokens;
  if (B < kAttnKvMinBlock || (B & (B - 1)) != 0)
    fail(fn, "block_tokens must be a power of two >= " + std::to_string(kAttnKvMinBlock) + ", got " + std::to_string(B));
  if (kv.pool_blocks == 0) fail(fn, "the KV pool has no blocks");
  if (uint64_t(kv.pool_blocks) * kv_heads * B * kv_row_bytes(kv.format, head_dim) >= (uint64_t(1) << 32))
    fail(fn, "KV pool of 2^32 bytes or more per tensor");
  if (kv.format == KvFormat::q8 && !kv_q8_supported(head_dim))
    fail(fn, "an int8 KV cache needs head_dim 64, 128 or 256, got " + std::to_string(head_dim));
  const uint64_t blocks = (rows + B - 1) / B;
  if (kv.table.buffer == nullptr) fail(fn, "block_table not bound");
  if (kv.table.bytes < blocks * 4)
    fail(fn, "positions up to " + std::to_string(rows - 1) + " need " + std::to_string(blocks) +
                 " block table entries, the table has " + std::to_string(kv.table.bytes / 4));
  uint32_t shift = 0;
  while ((1u << shift) < B) ++shift;
  return shift;
}

bool kv_q8_supported(uint32_t head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

std::vector<float> rope_inv_freq(uint32_t rotary_dim, double theta) {
  std::vector<float> f(rotary_dim / 2);
  for (uint32_t i = 0; i < rotary_dim / 2; ++i)
    f[i] = static_cast<float>(1.0 / std::pow(theta, double(2 * i) / double(rotary_dim)));
  return f;
}

KernelId rope_kernel(DType t) { return t == DType::bf16 ? KernelId::rope_bf16 : KernelId::rope_f32; }

void encode_rope(Encoder& enc, const RopeOperands& op) {
  const char* fn = "rope";
  if (op.tokens == 0 || op.heads == 0 || op.head_dim == 0) fail(fn, "empty shape");
  check_rotary(fn, op.head_dim, op.rotary_dim);
  const uint64_t bytes = uint64_t(op.tokens) * op.heads * op.head_dim * dtype_size(op.dtype);
  const uint32_t stride = op.heads * op.head_dim;
  RopeArgs args{op.tokens, op.heads, op.head_dim, op.rotary_dim, op.position, stride, stride};
  enc.set_kernel(rope_kernel(op.dtype));
  enc.set_args(args);
  enc.set_buffer(1, need(fn, op.x, bytes, "x"));
  enc.set_buffer(2, need(fn, op.inv_freq, uint64_t(op.rotary_dim / 2) * 4, "inv_freq"));
  enc.set_buffer(3, need(fn, op.y, bytes, "y"));
  enc.dispatch({op.heads, op.tokens, 1}, {kRopeThreads, 1, 1});
}

KernelId qk_norm_rope_kernel(DType x, DType w, KvFormat kv) {
  const bool xb = x == DType::bf16, wb = w == DType::bf16;
  if (kv == KvFormat::f32)
    return xb ? (wb ? KernelId::qk_norm_rope_kvf32_xbf16_wbf16 : KernelId::qk_norm_rope_kvf32_xbf16_wf32)
              : (wb ? KernelId::qk_norm_rope_kvf32_xf32_wbf16 : KernelId::qk_norm_rope_kvf32_xf32_wf32);
  if (kv == KvFormat::q8)
    return xb ? (wb ? KernelId::qk_norm_rope_q8_xbf16_wbf16 : KernelId::qk_norm_rope_q8_xbf16_wf32)
              : (wb ? KernelId::qk_norm_rope_q8_xf32_wbf16 : KernelId::qk_norm_rope_q8_xf32_wf32);
  return xb ? (wb ? KernelId::qk_norm_rope_xbf16_wbf16 : KernelId::qk_norm_rope_xbf16_wf32)
            : (wb ? KernelId::qk_norm_rope_xf32_wbf16 : KernelId::qk_norm_rope_xf32_wf32);
}

void encode_qk_norm_rope(Encoder& enc, const QkNormRopeOperands& op) {
  const char* fn = "qk_norm_rope";
  if (op.tokens == 0 || op.q_heads == 0 || op.kv_heads == 0 || op.head_dim == 0) fail(fn, "empty shape");
  check_rotary(fn, op.head_dim, op.rotary_dim);
  if (!(op.eps > 0.0f)) fail(fn, "eps must be > 0");
  const uint64_t rows_end = uint64_t(op.position) + op.tokens;
  const uint32_t shift = check_kv_paging(fn, op.kv, op.kv_heads, op.head_dim, rows_end);
  const uint64_t xs = dtype_size(op.x_dtype), D = op.head_dim;
  const uint64_t row_bytes = kv_row_bytes(op.kv.format, op.head_dim);
  const uint64_t cache_bytes = uint64_t(op.kv.pool_blocks) * op.kv_heads * op.kv.block_tokens * row_bytes;
  const uint64_t table_bytes = (rows_end + op.kv.block_tokens - 1) / op.kv.block_tokens * 4;
  const uint32_t qg_row = op.q_heads * 2 * op.head_dim, kv_row = op.kv_heads * op.head_dim;
  const uint32_t qg_stride = op.qg_stride ? op.qg_stride : qg_row;
  const uint32_t k_stride = op.k_stride ? op.k_stride : kv_row;
  const uint32_t v_stride = op.v_stride ? op.v_stride : kv_row;
  if (qg_stride < qg_row || k_stride < kv_row || v_stride < kv_row) fail(fn, "a token stride is shorter than its row");
  QkNormRopeArgs args{op.tokens, op.q_heads, op.kv_heads, op.head_dim, op.rotary_dim, op.position,
                      shift,     qg_stride,  k_stride,    v_stride,    op.eps,        op.weight_offset};
  const uint64_t rows = op.tokens - 1;
  enc.set_kernel(qk_norm_rope_kernel(op.x_dtype, op.w_dtype, op.kv.format));
  enc.set_args(args);
  enc.set_buffer(1, need(fn, op.qg, (rows * qg_stride + qg_row) * xs, "qg"));
  enc.set_buffer(2, need(fn, op.k, (rows * k_stride + kv_row) * xs, "k"));
  enc.set_buffer(3, need(fn, op.v, (rows * v_stride + kv_row) * xs, "v"));
  enc.set_buffer(4, need(fn, op.q_norm, D * dtype_size(op.w_dtype), "q_norm"));
  enc.set_buffer(5, need(fn, op.k_norm, D * dtype_size(op.w_dtype), "k_norm"));
  enc.set_buffer(6, need(fn, op.inv_freq, uint64_t(op.rotary_dim / 2) * 4, "inv_freq"));
  enc.set_buffer(7, need(fn, op.q_out, uint64_t(op.tokens) * op.q_heads * D * xs, "q_out"));
  enc.set_buffer(8, need(fn, op.k_cache, cache_bytes, "k_cache"));
  enc.set_buffer(9, need(fn, op.v_cache, cache_bytes, "v_cache"));
  enc.set_buffer(10, need(fn, op.kv.table, table_bytes, "block_table"));
  enc.set_touched(10, ((rows_end - 1) / op.kv.block_tokens - op.position / op.kv.block_tokens + 1) * 4);
  enc.set_touched(8, uint64_t(op.tokens) * op.kv_heads * row_bytes);  // written: the new rows only
  enc.set_touched(9, uint64_t(op.tokens) * op.kv_heads * row_bytes);
  enc.dispatch({op.q_heads + op.kv_heads, op.tokens, 1}, {kRopeThreads, 1, 1});
}

bool attention_decode_uses_vec(uint32_t head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

AttnRoute attention_decode_route(uint32_t length, uint32_t head_dim, uint32_t block_tokens) {
  AttnRoute r;
  if (length == 0) return r;
  if (attention_decode_uses_vec(head_dim)) {
    r.split = r.vec = true;
    const uint32_t want = std::min<uint32_t>(kAttnVecMaxBlocks, (length + kAttnVecSimds - 1) / kAttnVecSimds);
    const uint32_t share = (length + want - 1) / want;
    uint32_t keys = kAttnVecSimds;  // the share rounded down to a power of two, within one cache block
    while (keys * 2 <= share && keys * 2 <= block_tokens) keys *= 2;
    r.split_keys = keys;
    r.splits = (length + r.split_keys - 1) / r.split_keys;  // every block non-empty
    return r;
  }
  if (length <= kAttnSplitKeys) return r;
  r.split = true;
  const uint32_t want = std::min<uint32_t>(kAttnMaxSplits, (length + kAttnSplitKeys - 1) / kAttnSplitKeys);
  const uint32_t per = (length + want - 1) / want;
  r.split_keys = (per + kAttnBlockKeys - 1) / kAttnBlockKeys * kAttnBlockKeys;
  r.splits = (length + r.split_keys - 1) / r.split_keys;  // every split non-empty
  return r;
}

uint64_t attention_scratch_bytes(uint32_t q_heads, uint32_t head_dim, uint32_t length, uint32_t block_tokens) {
  // splits never exceed the number of blocks wanted (which grows with length); on the vec route
  // twice that (split_keys rounded down to a power of two), or the context's cache blocks where
  // split_keys is capped at a cache block.
  uint32_t splits = 0;
  if (attention_decode_uses_vec(head_dim)) {
    const uint32_t want = std::min<uint32_t>(kAttnVecMaxBlocks, (length + kAttnVecSimds - 1) / kAttnVecSimds);
    const uint32_t cache_blocks = block_tokens == 0 ? 0 : (length + block_tokens - 1) / block_tokens;
    splits = std::max(2 * want, cache_blocks);
  }
  else if (length > kAttnSplitKeys) splits = std::min<uint32_t>(kAttnMaxSplits, (length + kAttnSplitKeys - 1) / kAttnSplitKeys);
  return uint64_t(q_heads) * splits * (uint64_t(head_dim) + 2) * 4;
}

namespace {

struct Checked {
  AttnArgs args;
  Binding q, k, v, gate, out, table;
};

Checked check_attention(const char* fn, const AttentionOperands& op) {
  if (op.tokens == 0 || op.q_heads == 0 || op.kv_heads == 0 || op.head_dim == 0) fail(fn, "empty shape");
  if (op.head_dim > kAttnMaxHeadDim)
    fail(fn, "head_dim " + std::to_string(op.head_dim) + " > " + std::to_string(kAttnMaxHeadDim));
  if (op.q_heads % op.kv_heads != 0 || op.q_heads / op.kv_heads > kAttnMaxGroup)
    fail(fn, "q_heads must be a multiple of kv_heads with at most " + std::to_string(kAttnMaxGroup) +
                 " query heads per KV head, got " + std::to_string(op.q_heads) + " / " + std::to_string(op.kv_heads));
  const uint64_t rows_end = uint64_t(op.position) + op.tokens;
  const uint32_t shift = check_kv_paging(fn, op.kv, op.kv_heads, op.head_dim, rows_end);
  const uint64_t xs = dtype_size(op.dtype), D = op.head_dim;
  Checked c{};
  AttnArgs& a = c.args;
  a.tokens = op.tokens;
  a.q_heads = op.q_heads;
  a.kv_heads = op.kv_heads;
  a.head_dim = op.head_dim;
  a.position = op.position;
  a.block_shift = shift;
  a.q_stride = op.q_stride ? op.q_stride : op.q_heads * op.head_dim;
  a.gate_head_stride = op.gate_head_stride ? op.gate_head_stride : op.head_dim;
  a.gate_stride = op.gate_stride ? op.gate_stride : op.q_heads * a.gate_head_stride;
  a.use_gate = op.gate.buffer != nullptr ? 1u : 0u;
  a.splits = 1;
  a.split_keys = 0;
  a.scale = static_cast<float>(1.0 / std::sqrt(double(op.head_dim)));
  const uint64_t rows = uint64_t(op.tokens - 1);
  c.q = need(fn, op.q, (rows * a.q_stride + uint64_t(op.q_heads) * D) * xs, "q");
  const uint64_t cache_bytes = uint64_t(op.kv.pool_blocks) * op.kv_heads * op.kv.block_tokens * kv_row_bytes(op.kv.format, op.head_dim);
  c.k = need(fn, op.k_cache, cache_bytes, "k_cache");
  c.v = need(fn, op.v_cache, cache_bytes, "v_cache");
  c.table = need(fn, op.kv.table, (rows_end + op.kv.block_tokens - 1) / op.kv.block_tokens * 4, "block_table");
  // Without a gate the kernel never reads buffer 4: bind q there (4 bytes) so every slot is bound.
  c.gate = a.use_gate ? need(fn, op.gate, (rows * a.gate_stride + (op.q_heads - 1) * uint64_t(a.gate_head_stride) + D) * xs, "gate")
                      : Binding{op.q.buffer, op.q.offset, 4};
  c.out = need(fn, op.out, uint64_t(op.tokens) * op.q_heads * D * xs, "out");
  return c;
}

// 2 FLOPs per multiply-add of q.k and p.v for every (token, query head) and its visible keys.
uint64_t attention_useful_flops(const AttentionOperands& op) {
  const uint64_t T = op.tokens, keys = T * op.position + T * (T + 1) / 2;
  return 4ull * op.head_dim * op.q_heads * keys;
}

// Decode (one token): every lane scores one key of each whole 32-key block (split ranges are
// multiples of 32 keys), then accumulates p v over the block.
uint64_t attention_decode_executed_flops(const AttentionOperands& op) {
  const uint64_t keys = (uint64_t(op.position) + 1 + kAttnBlockKeys - 1) / kAttnBlockKeys * kAttnBlockKeys;
  return 4ull * op.head_dim * op.q_heads * keys;
}

// Buffers 2 and 3 (K and V pools, bound whole): rows [0, length) of every KV head are read, and
// buffer 6 (the block table): the entries of their blocks.
void touch_cache_rows(Encoder& enc, const AttentionOperands& op, uint64_t length) {
  const uint64_t bytes = length * op.kv_heads * kv_row_bytes(op.kv.format, op.head_dim);
  enc.set_touched(2, bytes);
  enc.set_touched(3, bytes);
  enc.set_touched(6, (length + op.kv.block_tokens - 1) / op.kv.block_tokens * 4);
}

// The bindings of a decode pass over the cache: q, k, v, the block table, and buffers 4 and 5
// (the gate and the output unsplit; the split's partials otherwise).
void bind_first_pass(Encoder& enc, KernelId kernel, const Checked& c, const Binding& out4, const Binding& out5,
                     const AttentionOperands& op, uint64_t length) {
  enc.set_kernel(kernel);
  enc.set_args(c.args);
  enc.set_buffer(1, c.q);
  enc.set_buffer(2, c.k);
  enc.set_buffer(3, c.v);
  enc.set_buffer(4, out4);
  enc.set_buffer(5, out5);
  enc.set_buffer(6, c.table);
  touch_cache_rows(enc, op, length);
}

}  // namespace

void encode_attention_decode(Encoder& enc, const AttentionOperands& op, AttnDecodePhase phase) {
  const char* fn = "attention_decode";
  if (op.tokens != 1) fail(fn, "decode attends one query token, got " + std::to_string(op.tokens));
  Checked c = check_attention(fn, op);
  const uint32_t group = op.q_heads / op.kv_heads;
  const uint32_t length = op.position + 1;
  const AttnRoute route = attention_decode_route(length, op.head_dim, op.kv.block_tokens);
  const bool bf = op.dtype == DType::bf16;
  const KernelId pass1 = attention_decode_kernel(route, op.head_dim, op.dtype, op.kv.format);
  const bool first = phase != AttnDecodePhase::combine, second = phase != AttnDecodePhase::first;
  if (!route.split) {
    if (!first) return;
    bind_first_pass(enc, pass1, c, c.gate, c.out, op, length);
    enc.dispatch({op.kv_heads, 1, 1}, {32 * group, 1, 1});
    enc.add_flops(attention_decode_executed_flops(op), attention_useful_flops(op));
    return;
  }
  c.args.splits = route.splits;
  c.args.split_keys = route.split_keys;
  const uint64_t o_bytes = uint64_t(op.q_heads) * route.splits * op.head_dim * 4;
  const uint64_t ml_bytes = uint64_t(op.q_heads) * route.splits * 2 * 4;
  const Binding scratch = need(fn, op.scratch, o_bytes + ml_bytes, "scratch");
  const Binding partial_o{scratch.buffer, scratch.offset, o_bytes};
  const Binding partial_ml{scratch.buffer, scratch.offset + o_bytes, ml_bytes};
  if (route.vec) {
    const uint32_t e = op.head_dim / 32;  // 2, 4 or 8
    const KernelId pass2 = e == 2   ? (bf ? KernelId::attn_vec_combine_e2_bf16 : KernelId::attn_vec_combine_e2_f32)
                           : e == 4 ? (bf ? KernelId::attn_vec_combine_e4_bf16 : KernelId::attn_vec_combine_e4_f32)
                                    : (bf ? KernelId::attn_vec_combine_e8_bf16 : KernelId::attn_vec_combine_e8_f32);
    if (first) {
      bind_first_pass(enc, pass1, c, partial_o, partial_ml, op, length);
      enc.dispatch({op.kv_heads, route.splits, 1}, {32 * kAttnVecSimds, 1, 1});
      // Every simdgroup scores exactly the keys of its block: no padding.
      enc.add_flops(attention_useful_flops(op), attention_useful_flops(op));
    }
    if (!second) return;
    if (first) enc.barrier();  // partial_o, partial_ml -> combine
    enc.set_kernel(pass2);
    enc.set_args(c.args);
    enc.set_buffer(1, partial_o);
    enc.set_buffer(2, partial_ml);
    enc.set_buffer(3, c.gate);
    enc.set_buffer(4, c.out);
    enc.dispatch({op.q_heads, e, 1}, {32 * kAttnVecSimds, 1, 1});
    return;
  }
  if (first) {
    bind_first_pass(enc, pass1, c, partial_o, partial_ml, op, length);
    enc.dispatch({op.kv_heads, 1, route.splits}, {32 * group, 1, 1});
    enc.add_flops(attention_decode_executed_flops(op), attention_useful_flops(op));
  }
  if (!second) return;
  if (first) enc.barrier();  // partial_o, partial_ml -> combine
  enc.set_kernel(bf ? KernelId::attn_combine_bf16 : KernelId::attn_combine_f32);
  enc.set_args(c.args);
  enc.set_buffer(1, partial_o);
  enc.set_buffer(2, partial_ml);
  enc.set_buffer(3, c.gate);
  enc.set_buffer(4, c.out);
  enc.dispatch({op.q_heads, 1, 1}, {32, 1, 1});
}

bool attention_prefill_uses_mma(uint32_t head_dim) {
  return head_dim % 32 == 0 && head_dim <= 2 * kAttnMmaMaxVCols && (head_dim <= kAttnMmaMaxVCols || head_dim % 64 == 0);
}

bool attention_prefill_uses_m5(uint32_t head_dim, bool tensor_ops) {
  return tensor_ops && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

bool attention_prefill_uses_tiles(uint32_t head_dim, DType dtype, bool tensor_ops) {
  return !tensor_ops && dtype == DType::bf16 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

// A prefill kernel whose threadgroup runs `rows` (token, head) rows (qt tokens) of one KV head
// against every `block_keys`-key block up to its last token's keys (the M5, bf16 tile and fp32
// mma routes): binds q, k, v, gate, out, counts the cache rows once and the executed FLOPs
// (S = Q K^T and O += P V: 2 * rows * block_keys * head_dim multiply-adds per block).
static void encode_blocked_prefill(Encoder& enc, const AttentionOperands& op, const Checked& c, KernelId id, uint32_t qt,
                                   uint32_t threads, uint32_t rows, uint32_t block_keys) {
  enc.set_kernel(id);
  enc.set_args(c.args);
  enc.set_buffer(1, c.q);
  enc.set_buffer(2, c.k);
  enc.set_buffer(3, c.v);
  enc.set_buffer(4, c.gate);
  enc.set_buffer(5, c.out);
  enc.set_buffer(6, c.table);
  touch_cache_rows(enc, op, uint64_t(op.position) + op.tokens);  // each row counted once
  enc.dispatch({op.kv_heads, (op.tokens + qt - 1) / qt, 1}, {threads, 1, 1});
  uint64_t executed = 0;
  for (uint32_t t0 = 0; t0 < op.tokens; t0 += qt) {
    const uint64_t key_end = uint64_t(op.position) + std::min(t0 + qt, op.tokens);
    executed += (key_end + block_keys - 1) / block_keys * 4ull * rows * block_keys * op.head_dim;
  }
  enc.add_flops(executed * op.kv_heads, attention_useful_flops(op));
}

PrefillRoute attention_prefill_route(uint32_t head_dim, DType dtype, KvFormat kv, bool tensor_ops, bool aligned) {
  // f32 pools: fp32 K / V tiles (mma) or rows (simd); the m5 and tiles routes stage K / V in half
  // and bf16, and in fp32 their stages alone pass 32 KiB (m5: 32 x 256 x 4 bytes of K / V; tiles:
  // 2 x 2 x BK x (D + 8) x 4 = 33,792-36,864 bytes)
  if (kv != KvFormat::f32 && attention_prefill_uses_m5(head_dim, tensor_ops)) return PrefillRoute::m5;
  if (kv != KvFormat::f32 && attention_prefill_uses_tiles(head_dim, dtype, tensor_ops) && aligned)
    return PrefillRoute::tiles;
  // int8 pools need head_dim 64, 128 or 256 (check_kv_paging), which the mma route takes
  if (kv == KvFormat::q8 || attention_prefill_uses_mma(head_dim)) return PrefillRoute::mma;
  return PrefillRoute::simd;
}

const char* prefill_route_name(PrefillRoute r) {
  return r == PrefillRoute::m5 ? "m5" : r == PrefillRoute::tiles ? "tiles" : r == PrefillRoute::mma ? "mma" : "simd";
}

KernelId attention_prefill_kernel(uint32_t head_dim, DType dtype, KvFormat kv, bool tensor_ops, bool aligned) {
  const bool bf = dtype == DType::bf16, q8 = kv == KvFormat::q8, f32 = kv == KvFormat::f32;
  const uint32_t D = head_dim;
  switch (attention_prefill_route(D, dtype, kv, tensor_ops, aligned)) {
    case PrefillRoute::m5:
      if (q8 && bf)  // the int8 cache with bf16 activations: S on int8 operands
        return D == 64 ? KernelId::attn_prefill_m5i8_q8_d64_bf16
                       : D == 128 ? KernelId::attn_prefill_m5i8_q8_d128_bf16 : KernelId::attn_prefill_m5i8_q8_d256_bf16;
      return q8 ? (D == 64    ? KernelId::attn_prefill_m5_q8_d64_f32
                   : D == 128 ? KernelId::attn_prefill_m5_q8_d128_f32
                              : KernelId::attn_prefill_m5_q8_d256_f32)
             : D == 64  ? (bf ? KernelId::attn_prefill_m5_d64_bf16 : KernelId::attn_prefill_m5_d64_f32)
             : D == 128 ? (bf ? KernelId::attn_prefill_m5_d128_bf16 : KernelId::attn_prefill_m5_d128_f32)
                        : (bf ? KernelId::attn_prefill_m5_d256_bf16 : KernelId::attn_prefill_m5_d256_f32);
    case PrefillRoute::tiles:
      return q8 ? (D == 64    ? KernelId::attn_prefill_tiles_q8_d64_bf16
                   : D == 128 ? KernelId::attn_prefill_tiles_q8_d128_bf16
                              : KernelId::attn_prefill_tiles_q8_d256_bf16)
             : D == 64  ? KernelId::attn_prefill_tiles_d64_bf16
             : D == 128 ? KernelId::attn_prefill_tiles_d128_bf16
                        : KernelId::attn_prefill_tiles_d256_bf16;
    case PrefillRoute::mma:
      if (q8) return bf ? KernelId::attn_prefill_mma_q8_bf16 : KernelId::attn_prefill_mma_q8_f32;
      if (f32) return bf ? KernelId::attn_prefill_mma_kvf32_bf16 : KernelId::attn_prefill_mma_kvf32_f32;
      return bf ? KernelId::attn_prefill_mma_bf16 : KernelId::attn_prefill_mma_f32;
    case PrefillRoute::simd:
      break;
  }
  if (f32) return bf ? KernelId::attn_prefill_kvf32_bf16 : KernelId::attn_prefill_kvf32_f32;
  return bf ? KernelId::attn_prefill_bf16 : KernelId::attn_prefill_f32;
}

KernelId attention_vec_kernel(uint32_t head_dim, DType dtype, KvFormat kv) {
  const bool bf = dtype == DType::bf16;
  const uint32_t e = head_dim / 32;  // 2, 4 or 8
  if (kv == KvFormat::q8)
    return e == 2   ? (bf ? KernelId::attn_decode_vec_q8_e2_bf16 : KernelId::attn_decode_vec_q8_e2_f32)
           : e == 4 ? (bf ? KernelId::attn_decode_vec_q8_e4_bf16 : KernelId::attn_decode_vec_q8_e4_f32)
                    : (bf ? KernelId::attn_decode_vec_q8_e8_bf16 : KernelId::attn_decode_vec_q8_e8_f32);
  if (kv == KvFormat::f32)
    return e == 2   ? (bf ? KernelId::attn_decode_vec_kvf32_e2_bf16 : KernelId::attn_decode_vec_kvf32_e2_f32)
           : e == 4 ? (bf ? KernelId::attn_decode_vec_kvf32_e4_bf16 : KernelId::attn_decode_vec_kvf32_e4_f32)
                    : (bf ? KernelId::attn_decode_vec_kvf32_e8_bf16 : KernelId::attn_decode_vec_kvf32_e8_f32);
  return e == 2   ? (bf ? KernelId::attn_decode_vec_e2_bf16 : KernelId::attn_decode_vec_e2_f32)
         : e == 4 ? (bf ? KernelId::attn_decode_vec_e4_bf16 : KernelId::attn_decode_vec_e4_f32)
                  : (bf ? KernelId::attn_decode_vec_e8_bf16 : KernelId::attn_decode_vec_e8_f32);
}

KernelId attention_decode_kernel(const AttnRoute& route, uint32_t head_dim, DType dtype, KvFormat kv) {
  const bool bf = dtype == DType::bf16, f32 = kv == KvFormat::f32;
  if (route.vec) return attention_vec_kernel(head_dim, dtype, kv);
  // int8 pools take the vec route only (check_kv_paging: head_dim 64, 128 or 256)
  if (route.split)
    return f32 ? (bf ? KernelId::attn_decode_split_kvf32_bf16 : KernelId::attn_decode_split_kvf32_f32)
               : (bf ? KernelId::attn_decode_split_bf16 : KernelId::attn_decode_split_f32);
  return f32 ? (bf ? KernelId::attn_decode_kvf32_bf16 : KernelId::attn_decode_kvf32_f32)
             : (bf ? KernelId::attn_decode_bf16 : KernelId::attn_decode_f32);
}

void encode_attention_prefill(Encoder& enc, const AttentionOperands& op) {
  const char* fn = "attention_prefill";
  Checked c = check_attention(fn, op);
  const uint32_t group = op.q_heads / op.kv_heads;
  // bf16 tiles (M1-M4): 16-byte loads of q and of the caches need 16-byte aligned bindings and
  // q rows (the engine's buffers always are); otherwise the mma route.
  const bool aligned = c.q.offset % 16 == 0 && c.k.offset % 16 == 0 && c.v.offset % 16 == 0 && c.args.q_stride % 8 == 0;
  const PrefillRoute route = attention_prefill_route(op.head_dim, op.dtype, op.kv.format, enc.tensor_ops(), aligned);
  const KernelId id = attention_prefill_kernel(op.head_dim, op.dtype, op.kv.format, enc.tensor_ops(), aligned);
  if (route == PrefillRoute::m5) {
    // M5 (Metal 4 tensor ops, shaders/m5/attention_m5.metal): 16 rows x 32-key blocks.
    encode_blocked_prefill(enc, op, c, id, kAttnM5Rows / group, kAttnM5Threads, kAttnM5Rows, kAttnM5BlockKeys);
    return;
  }
  if (route == PrefillRoute::tiles) {
    encode_blocked_prefill(enc, op, c, id, kAttnMmaRows / group, kAttnTilesThreads, kAttnMmaRows,
                           kAttnTilesKeyDims / op.head_dim);
    return;
  }
  if (route == PrefillRoute::mma) {
    // 32 rows (qt * group live) against every 32-key block up to the threadgroup's last token's keys
    encode_blocked_prefill(enc, op, c, id, kAttnMmaRows / group, kAttnMmaThreads, kAttnMmaRows, kAttnBlockKeys);
    return;
  }
  enc.set_kernel(id);
  enc.set_args(c.args);
  enc.set_buffer(1, c.q);
  enc.set_buffer(2, c.k);
  enc.set_buffer(3, c.v);
  enc.set_buffer(4, c.gate);
  enc.set_buffer(5, c.out);
  enc.set_buffer(6, c.table);
  touch_cache_rows(enc, op, uint64_t(op.position) + op.tokens);  // each row counted once
  enc.dispatch({op.kv_heads, (op.tokens + kAttnPrefillTokens - 1) / kAttnPrefillTokens, 1}, {32 * group, 1, 1});
  // Each threadgroup runs kAttnPrefillTokens query tokens (the last clamped) x group heads against
  // whole 32-key blocks up to its last token's keys (masked keys are computed, then dropped).
  uint64_t executed = 0;
  for (uint32_t t0 = 0; t0 < op.tokens; t0 += kAttnPrefillTokens) {
    const uint64_t key_end = uint64_t(op.position) + std::min(t0 + kAttnPrefillTokens, op.tokens);
    executed += (key_end + kAttnBlockKeys - 1) / kAttnBlockKeys * 4ull * kAttnPrefillTokens * group *
                kAttnBlockKeys * op.head_dim;
  }
  enc.add_flops(executed * op.kv_heads, attention_useful_flops(op));
}

namespace {

// What a layer's q/k norm + RoPE and its attention take from the mixer's operands, the same for
// one sequence or a batch; the callers add the bindings, position and paging.
QkNormRopeOperands shared_qk_norm_rope(const AttentionMixerOperands& op) {
  QkNormRopeOperands n;
  n.q_norm = op.q_norm;
  n.k_norm = op.k_norm;
  n.inv_freq = op.inv_freq;
  n.x_dtype = op.dtype;
  n.w_dtype = op.w_dtype;
  n.q_heads = op.q_heads;
  n.kv_heads = op.kv_heads;
  n.head_dim = op.head_dim;
  n.rotary_dim = op.rotary_dim;
  n.eps = op.eps;
  n.weight_offset = op.weight_offset;
  return n;
}

AttentionOperands shared_attention(const AttentionMixerOperands& op) {
  AttentionOperands a;
  a.gate_head_stride = 2 * op.head_dim;  // the gate: the second half of each head's row
  a.dtype = op.dtype;
  a.q_heads = op.q_heads;
  a.kv_heads = op.kv_heads;
  a.head_dim = op.head_dim;
  return a;
}

// Batched decode: token t of qg / k / v (rows `stride` / `kv_stride` elements apart) is sequence
// t's one token. Every sequence's q/k norm + RoPE + KV append, a barrier, every first pass, a
// barrier (where any route splits), every combine: the levels of one token.
void encode_batched_attention(Encoder& enc, const AttentionMixerOperands& op, const Binding& qg, const Binding& k,
                              const Binding& v, uint32_t stride, uint32_t kv_stride) {
  const char* fn = "attention_mixer";
  const uint32_t T = op.tokens, D = op.head_dim;
  if (op.seqs.size() != T)
    fail(fn, std::to_string(op.seqs.size()) + " sequences for " + std::to_string(T) + " tokens (one token each)");
  const uint64_t xs = dtype_size(op.dtype), qd = uint64_t(op.q_heads) * D;
  auto from = [&](const Binding& b, uint64_t elems) {  // b from element `elems` on
    if (b.bytes < elems * xs) fail(fn, "temporary too small for the batch");
    return Binding{b.buffer, b.offset + elems * xs, b.bytes - elems * xs};
  };
  auto q_row = [&](uint32_t t) { return Binding{op.q.buffer, op.q.offset + t * qd * xs, qd * xs}; };
  auto paging = [&](const AttnSequence& sq) {
    KvPaging kv = op.kv;
    kv.pool_blocks = sq.pool_blocks;
    return kv;
  };
  for (uint32_t t = 0; t < T; ++t) {
    const AttnSequence& sq = op.seqs[t];
    QkNormRopeOperands n = shared_qk_norm_rope(op);
    n.qg = from(qg, uint64_t(t) * stride);
    n.k = from(k, uint64_t(t) * kv_stride);
    n.v = from(v, uint64_t(t) * kv_stride);
    n.q_out = q_row(t);
    n.k_cache = sq.k_cache;
    n.v_cache = sq.v_cache;
    n.tokens = 1;
    n.position = sq.position;
    n.kv = paging(sq);
    encode_qk_norm_rope(enc, n);
  }
  enc.barrier();  // q, k_cache, v_cache of every sequence -> attention
  auto attn = [&](uint32_t t) {
    const AttnSequence& sq = op.seqs[t];
    AttentionOperands a = shared_attention(op);
    a.q = q_row(t);
    a.k_cache = sq.k_cache;
    a.v_cache = sq.v_cache;
    const Binding g = from(qg, uint64_t(t) * stride + D);
    a.gate = Binding{g.buffer, g.offset, std::min<uint64_t>(g.bytes, (2 * qd - D) * xs)};
    a.out = Binding{op.attn.buffer, op.attn.offset + t * qd * xs, qd * xs};
    a.scratch = sq.scratch;
    a.tokens = 1;
    a.position = sq.position;
    a.kv = paging(sq);
    return a;
  };
  bool split = false;
  for (uint32_t t = 0; t < T; ++t) {
    encode_attention_decode(enc, attn(t), AttnDecodePhase::first);
    split = split || attention_decode_route(op.seqs[t].position + 1, D, op.kv.block_tokens).split;
  }
  if (!split) return;
  enc.barrier();  // partials of every sequence -> its combine
  for (uint32_t t = 0; t < T; ++t) encode_attention_decode(enc, attn(t), AttnDecodePhase::combine);
}

}  // namespace

void encode_attention_mixer(Encoder& enc, const AttentionMixerOperands& op) {
  const char* fn = "attention_mixer";
  if (op.tokens == 0 || op.hidden == 0) fail(fn, "empty shape");
  const uint32_t T = op.tokens, D = op.head_dim;
  const uint64_t xs = dtype_size(op.dtype);
  const bool fused = op.qkv_proj.w.buffer != nullptr || !op.qkv_proj.blocks.empty();
  auto proj = [&](QmmOperands p, const Binding& x, const Binding& y, uint32_t K, uint32_t N, const char* what,
                  bool first = false) {
    p.x = x;
    p.x_i8 = fused ? op.x_i8 : Binding{};  // one projection a level: the scratch is never shared in one
    if (first) {
      p.norm_weight = op.in_norm;
      p.eps = op.in_norm_eps;
    }
    p.y = y;
    p.x_dtype = op.dtype;
    p.M = T;
    p.K = K;
    p.N = N;
    p.x_stride = 0;
    p.y_stride = 0;
    try {
      validate(p);
    } catch (const std::invalid_argument& e) {
      fail(fn, std::string(what) + ": " + e.what());
    }
    encode_quantized_matmul(enc, p);
  };
  const uint32_t nq = op.q_heads * 2 * D, nkv = op.kv_heads * D;
  Binding qg = op.qg, k = op.k, v = op.v;
  uint32_t qg_stride = 0, kv_stride = 0;
  if (fused) {
    const uint32_t ntot = nq + 2 * nkv;
    proj(op.qkv_proj, op.x, op.qkv, op.hidden, ntot, "qkv_proj", true);
    auto part = [&](uint64_t col) {  // the qkv temporary from column col on
      if (op.qkv.bytes < col * xs) fail(fn, "qkv temporary too small");
      return Binding{op.qkv.buffer, op.qkv.offset + col * xs, op.qkv.bytes - col * xs};
    };
    qg = part(0);
    k = part(nq);
    v = part(uint64_t(nq) + nkv);
    qg_stride = kv_stride = ntot;
  } else {
    proj(op.q_proj, op.x, op.qg, op.hidden, nq, "q_proj", true);
    proj(op.k_proj, op.x, op.k, op.hidden, nkv, "k_proj", true);
    proj(op.v_proj, op.x, op.v, op.hidden, nkv, "v_proj", true);
  }
  enc.barrier();  // qg, k, v -> qk_norm_rope
  if (!op.seqs.empty()) {
    encode_batched_attention(enc, op, qg, k, v, fused ? qg_stride : nq, fused ? kv_stride : nkv);
    enc.barrier();  // gated attention output of every sequence -> o_proj
    proj(op.o_proj, op.attn, op.out, op.q_heads * D, op.hidden, "o_proj");
    return;
  }

  QkNormRopeOperands n = shared_qk_norm_rope(op);
  n.qg = qg;
  n.k = k;
  n.v = v;
  n.qg_stride = qg_stride;
  n.k_stride = kv_stride;
  n.v_stride = kv_stride;
  n.q_out = op.q;
  n.k_cache = op.k_cache;
  n.v_cache = op.v_cache;
  n.tokens = T;
  n.position = op.position;
  n.kv = op.kv;
  encode_qk_norm_rope(enc, n);
  enc.barrier();  // q, k_cache, v_cache -> attention

  AttentionOperands a = shared_attention(op);
  a.q = op.q;
  a.k_cache = op.k_cache;
  a.v_cache = op.v_cache;
  // The gate is the second half of each head's row of q_proj's output.
  a.gate = Binding{qg.buffer, qg.offset + D * xs, qg.bytes > D * xs ? qg.bytes - D * xs : 0};
  a.gate_stride = fused ? qg_stride : nq;
  a.out = op.attn;
  a.scratch = op.scratch;
  a.tokens = T;
  a.position = op.position;
  a.kv = op.kv;
  if (T == 1) encode_attention_decode(enc, a);
  else encode_attention_prefill(enc, a);
  enc.barrier();  // gated attention output -> o_proj

  proj(op.o_proj, op.attn, op.out, op.q_heads * D, op.hidden, "o_proj");
}

}  // namespace lily::gpu::ops
