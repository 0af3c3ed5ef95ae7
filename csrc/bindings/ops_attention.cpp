// lily_py._core.ops: the attention family (rope, qk_norm_rope, attention decode/prefill, the whole
// attention mixer) over NumPy arrays. Wrapped by lily_py._ops_attention; encoding lives in
// csrc/gpu/ops/attention.cpp.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/op_run.h"
#include "bindings/device.h"
#include "emu/emulator.h"
#include "gpu/dtype.h"
#include "gpu/ops/attention.h"
#include "gpu/ops/qmm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::bindings {


namespace {

using AttnRun = OpRun;

void check_dims(const InArray& a, const char* fn, const char* what, std::vector<size_t> shape, size_t bits) {
  std::string want = "[";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
  want += "]";
  bool ok = a.ndim() == shape.size() && a.dtype().bits == bits;
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = a.shape(i) == shape[i];
  LILY_REQUIRE(ok, std::string(fn) + ": " + what + " must be " + want + " of " + std::to_string(bits) + "-bit elements");
}

uint32_t u32(size_t v) { return static_cast<uint32_t>(v); }

gpu::ops::QmmOperands qmm_weights(AttnRun& r, const InArray& w, const InArray& s, const InArray& b, uint32_t bits,
                             uint32_t group_size, gpu::DType st) {
  gpu::ops::QmmOperands p;
  p.w = r.input(w);
  p.scales = r.input(s);
  p.biases = r.input(b);
  p.bits = bits;
  p.group_size = group_size;
  p.scale_dtype = st;
  return p;
}

// The paged cache of an op: pools [pool_blocks, Hkv, B, D] (checked by the caller) and the block
// table uint32 [n], every entry < pool_blocks.
// An int8 pool (common/kv_blocks.h) comes as an 8-bit array [P, Hkv, B, D + 4]: each block's bytes
// (codes, then scales) in that many bytes; lily_py.ops.attention._page packs one. A float32 pool is
// a 32-bit array [P, Hkv, B, D], a bf16 one a 16-bit array.
gpu::ops::KvPaging kv_paging(AttnRun& r, const InArray& table, const char* fn, size_t pool_blocks, size_t B,
                             gpu::KvFormat format = gpu::KvFormat::bf16) {
  LILY_REQUIRE(table.ndim() == 1 && table.dtype().bits == 32 && table.shape(0) >= 1,
               std::string(fn) + ": block_table must be a 1-D uint32 array");
  const uint32_t* t = static_cast<const uint32_t*>(table.data());
  for (size_t i = 0; i < table.shape(0); ++i)
    LILY_REQUIRE(t[i] < pool_blocks, std::string(fn) + ": block_table[" + std::to_string(i) + "] = " +
                                         std::to_string(t[i]) + " is not a block of the pool (" +
                                         std::to_string(pool_blocks) + " blocks)");
  gpu::ops::KvPaging kv;
  kv.table = r.input(table);
  kv.block_tokens = u32(B);
  kv.pool_blocks = u32(pool_blocks);
  kv.format = format;
  return kv;
}

// The cache format of a pool array by its element width: 8 bits int8 (codes and scales), 32 float32,
// else bf16 (16 bits, checked by the caller).
gpu::KvFormat pool_format(const InArray& pool) {
  const size_t bits = pool.dtype().bits;
  return bits == 8 ? gpu::KvFormat::q8 : bits == 32 ? gpu::KvFormat::f32 : gpu::KvFormat::bf16;
}
size_t pool_bits(gpu::KvFormat f) { return f == gpu::KvFormat::q8 ? 8 : f == gpu::KvFormat::f32 ? 32 : 16; }
size_t pool_row(gpu::KvFormat f, size_t D) { return f == gpu::KvFormat::q8 ? D + 4 : D; }

}  // namespace

void init_ops_attention(nb::module_& parent) {
  nb::module_ m = nb::borrow<nb::module_>(parent.attr("ops"));

  m.attr("ATTN_SPLIT_KEYS") = static_cast<uint32_t>(kAttnSplitKeys);
  m.attr("ATTN_MAX_SPLITS") = static_cast<uint32_t>(kAttnMaxSplits);
  m.attr("ATTN_VEC_SIMDS") = static_cast<uint32_t>(kAttnVecSimds);
  m.attr("ATTN_VEC_MAX_BLOCKS") = static_cast<uint32_t>(kAttnVecMaxBlocks);
  m.attr("ATTN_BLOCK_KEYS") = static_cast<uint32_t>(kAttnBlockKeys);
  m.attr("ATTN_PREFILL_TOKENS") = static_cast<uint32_t>(kAttnPrefillTokens);
  m.attr("ATTN_MAX_HEAD_DIM") = static_cast<uint32_t>(kAttnMaxHeadDim);
  m.attr("ATTN_MAX_GROUP") = static_cast<uint32_t>(kAttnMaxGroup);
  m.attr("ATTN_KV_MIN_BLOCK") = static_cast<uint32_t>(kAttnKvMinBlock);

  m.def("rope_inv_freq", [](uint32_t rotary_dim, double theta) {
    std::vector<float> f = gpu::ops::rope_inv_freq(rotary_dim, theta);
    return bindings::download<float>(f.data(), {f.size()});
  }, "rotary_dim"_a, "theta"_a, "float32 [rotary_dim / 2] inverse frequencies the RoPE kernels use.");

  m.def("attention_prefill_route", [](uint32_t head_dim, bool tensor_ops, bool bf16, const std::string& kv_dtype) {
    const gpu::DType dt = bf16 ? gpu::DType::bf16 : gpu::DType::f32;
    const gpu::KvFormat kv = gpu::parse_kv_format(kv_dtype, "attention_prefill_route: kv_dtype");
    return std::string(gpu::ops::prefill_route_name(gpu::ops::attention_prefill_route(head_dim, dt, kv, tensor_ops)));
  }, "head_dim"_a, "tensor_ops"_a = false, "bf16"_a = false, "kv_dtype"_a = "bfloat16",
     "Prefill attention route for this head_dim: 'm5' (Metal 4 tensor ops: head_dim 64, 128 or 256 on a device "
     "with tensor ops), 'tiles' (bf16 activations, head_dim 64, 128 or 256, no tensor ops), 'mma' (simdgroup "
     "matrices) or 'simd'; a float32 KV cache takes 'mma' or 'simd' on every device.");

  m.def("attention_decode_route", [](uint32_t length, uint32_t head_dim, uint32_t block_tokens) {
    const gpu::ops::AttnRoute r = gpu::ops::attention_decode_route(length, head_dim, block_tokens);
    nb::dict d;
    d["route"] = r.vec ? "vec" : r.split ? "split" : "single";
    d["splits"] = r.splits;
    d["split_keys"] = r.split_keys;
    return d;
  }, "length"_a, "head_dim"_a, "block_tokens"_a,
     "Decode attention route for a context of `length` keys, head_dim and KV cache blocks of block_tokens: "
     "{route, splits, split_keys}.");

  m.def(
      "rope",
      [](InArray x, uint32_t rotary_dim, uint32_t position, double theta, const std::string& dtype,
         const std::string& device, const std::string& order, uint64_t seed, bool fp_traps) {
        const char* fn = "rope";
        gpu::ops::RopeOperands op;
        op.dtype = gpu::parse_dtype(dtype, "rope: x");
        LILY_REQUIRE(x.ndim() == 3, "rope: x must be [tokens, heads, head_dim]");
        check_dims(x, fn, "x", {x.shape(0), x.shape(1), x.shape(2)}, gpu::dtype_size(op.dtype) * 8);
        op.tokens = u32(x.shape(0));
        op.heads = u32(x.shape(1));
        op.head_dim = u32(x.shape(2));
        op.rotary_dim = rotary_dim;
        op.position = position;
        AttnRun r(device, order, seed, fp_traps);
        op.x = r.input(x);
        op.inv_freq = r.input(gpu::ops::rope_inv_freq(rotary_dim, theta));
        op.y = r.output(x.nbytes());
        nb::dict stats = r.run([&](gpu::Encoder& e) { gpu::ops::encode_rope(e, op); });
        stats["kernels"] = nb::make_tuple(std::string(gpu::kernel_info(gpu::ops::rope_kernel(op.dtype)).name));
        return nb::make_tuple(r.download(op.y, op.dtype, {op.tokens, op.heads, op.head_dim}), stats);
      },
      "x"_a, nb::kw_only(), "rotary_dim"_a, "position"_a, "theta"_a, "dtype"_a, "device"_a = "emu",
      "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "Partial RoPE of x [tokens, heads, head_dim]; returns (y, stats). Use lily_py.ops.rope.");

  m.def(
      "qk_norm_rope",
      [](InArray qg, InArray k, InArray v, InArray q_norm, InArray k_norm, InArray k_cache, InArray v_cache,
         InArray block_table, uint32_t position, uint32_t rotary_dim, double theta, float eps, float weight_offset,
         const std::string& x_dtype, const std::string& w_dtype, const std::string& device,
         const std::string& order, uint64_t seed, bool fp_traps) {
        const char* fn = "qk_norm_rope";
        gpu::ops::QkNormRopeOperands op;
        op.x_dtype = gpu::parse_dtype(x_dtype, "qk_norm_rope: qg");
        op.w_dtype = gpu::parse_dtype(w_dtype, "qk_norm_rope: q_norm");
        const size_t xb = gpu::dtype_size(op.x_dtype) * 8, wb = gpu::dtype_size(op.w_dtype) * 8;
        LILY_REQUIRE(qg.ndim() == 3 && k.ndim() == 3 && k_cache.ndim() == 4,
                     "qk_norm_rope: qg and k must be 3-D, the pools 4-D");
        const size_t T = qg.shape(0), Hq = qg.shape(1), D = qg.shape(2) / 2, Hkv = k.shape(1), P = k_cache.shape(0),
                     B = k_cache.shape(2);
        check_dims(qg, fn, "qg", {T, Hq, 2 * D}, xb);
        check_dims(k, fn, "k", {T, Hkv, D}, xb);
        check_dims(v, fn, "v", {T, Hkv, D}, xb);
        check_dims(q_norm, fn, "q_norm", {D}, wb);
        check_dims(k_norm, fn, "k_norm", {D}, wb);
        const gpu::KvFormat kvf = pool_format(k_cache);
        const bool q8 = kvf == gpu::KvFormat::q8;
        const size_t row = pool_row(kvf, D);
        check_dims(k_cache, fn, "k_cache", {P, Hkv, B, row}, pool_bits(kvf));
        check_dims(v_cache, fn, "v_cache", {P, Hkv, B, row}, pool_bits(kvf));
        op.tokens = u32(T);
        op.q_heads = u32(Hq);
        op.kv_heads = u32(Hkv);
        op.head_dim = u32(D);
        op.rotary_dim = rotary_dim;
        op.position = position;
        op.eps = eps;
        op.weight_offset = weight_offset;
        AttnRun r(device, order, seed, fp_traps);
        op.kv = kv_paging(r, block_table, fn, P, B, kvf);
        op.qg = r.input(qg);
        op.k = r.input(k);
        op.v = r.input(v);
        op.q_norm = r.input(q_norm);
        op.k_norm = r.input(k_norm);
        op.inv_freq = r.input(gpu::ops::rope_inv_freq(rotary_dim, theta));
        op.q_out = r.output(T * Hq * D * gpu::dtype_size(op.x_dtype));
        op.k_cache = r.input(k_cache);
        op.v_cache = r.input(v_cache);
        nb::dict stats = r.run([&](gpu::Encoder& e) { gpu::ops::encode_qk_norm_rope(e, op); });
        stats["kernels"] = nb::make_tuple(
            std::string(gpu::kernel_info(gpu::ops::qk_norm_rope_kernel(op.x_dtype, op.w_dtype, kvf)).name));
        auto pool = [&](const gpu::Binding& b) {
          return q8 ? nb::cast(bindings::download<uint8_t>(*b.buffer, b.offset, {P, Hkv, B, row}))
                    : r.download(b, kvf == gpu::KvFormat::f32 ? gpu::DType::f32 : gpu::DType::bf16, {P, Hkv, B, D});
        };
        return nb::make_tuple(r.download(op.q_out, op.x_dtype, {T, Hq, D}), pool(op.k_cache), pool(op.v_cache), stats);
      },
      "qg"_a, "k"_a, "v"_a, "q_norm"_a, "k_norm"_a, "k_cache"_a, "v_cache"_a, "block_table"_a, nb::kw_only(), "position"_a,
      "rotary_dim"_a, "theta"_a, "eps"_a, "weight_offset"_a, "x_dtype"_a, "w_dtype"_a, "device"_a = "emu",
      "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "q/k RMSNorm + partial RoPE + KV append into the paged pools [blocks, Hkv, B, D] (bf16 as uint16, float32, "
      "or int8: uint8 [blocks, Hkv, B, D + 4]) through block_table; "
      "returns (q, k_cache, v_cache, stats). Use "
      "lily_py.ops.qk_norm_rope_append.");

  m.def(
      "attention",
      [](InArray q, InArray k_cache, InArray v_cache, InArray block_table, std::optional<InArray> gate,
         uint32_t position, bool decode,
         const std::string& dtype, const std::string& device, const std::string& order, uint64_t seed,
         bool fp_traps) {
        const char* fn = decode ? "attention_decode" : "attention_prefill";
        gpu::ops::AttentionOperands op;
        op.dtype = gpu::parse_dtype(dtype, std::string(fn) + ": q");
        const size_t xb = gpu::dtype_size(op.dtype) * 8;
        LILY_REQUIRE(q.ndim() == 3 && k_cache.ndim() == 4, std::string(fn) + ": q must be 3-D and the pools 4-D");
        const size_t T = q.shape(0), Hq = q.shape(1), D = q.shape(2), P = k_cache.shape(0), Hkv = k_cache.shape(1),
                     B = k_cache.shape(2);
        check_dims(q, fn, "q", {T, Hq, D}, xb);
        const gpu::KvFormat kvf = pool_format(k_cache);
        check_dims(k_cache, fn, "k_cache", {P, Hkv, B, pool_row(kvf, D)}, pool_bits(kvf));
        check_dims(v_cache, fn, "v_cache", {P, Hkv, B, pool_row(kvf, D)}, pool_bits(kvf));
        op.tokens = u32(T);
        op.q_heads = u32(Hq);
        op.kv_heads = u32(Hkv);
        op.head_dim = u32(D);
        op.position = position;
        AttnRun r(device, order, seed, fp_traps);
        op.kv = kv_paging(r, block_table, fn, P, B, kvf);
        op.q = r.input(q);
        op.k_cache = r.input(k_cache);
        op.v_cache = r.input(v_cache);
        if (gate) {
          check_dims(*gate, fn, "gate", {T, Hq, D}, xb);
          op.gate = r.input(*gate);
        }
        op.out = r.output(T * Hq * D * gpu::dtype_size(op.dtype));
        nb::list kernels;
        const bool bf = op.dtype == gpu::DType::bf16;
        auto name = [](gpu::KernelId k) { return std::string(gpu::kernel_info(k).name); };
        if (decode) {
          const gpu::ops::AttnRoute route = gpu::ops::attention_decode_route(position + 1, op.head_dim, u32(B));
          kernels.append(name(gpu::ops::attention_decode_kernel(route, op.head_dim, op.dtype, kvf)));
          if (route.split) {
            op.scratch = r.output(gpu::ops::attention_scratch_bytes(op.q_heads, op.head_dim, position + 1, u32(B)));
            const std::string sfx = bf ? "bf16" : "f32", e = std::to_string(op.head_dim / 32);
            kernels.append(route.vec ? "attn_vec_combine_e" + e + "_" + sfx : "attn_combine_" + sfx);
          }
        }
        std::string prefill_kernel;  // named inside run (the encoder's tensor_ops), listed after it:
        nb::dict stats = r.run([&](gpu::Encoder& e) {  // run releases the GIL, so no Python here
          if (decode) {
            gpu::ops::encode_attention_decode(e, op);
            return;
          }
          // the op's buffers are fresh (offset 0) and q packed: aligned for the tiles
          prefill_kernel = name(gpu::ops::attention_prefill_kernel(op.head_dim, op.dtype, kvf, e.tensor_ops(), true));
          gpu::ops::encode_attention_prefill(e, op);
        });
        if (!prefill_kernel.empty()) kernels.append(prefill_kernel);
        stats["kernels"] = kernels;
        return nb::make_tuple(r.download(op.out, op.dtype, {T, Hq, D}), stats);
      },
      "q"_a, "k_cache"_a, "v_cache"_a, "block_table"_a, "gate"_a.none(), nb::kw_only(), "position"_a, "decode"_a, "dtype"_a,
      "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "Causal attention of q [tokens, q_heads, D] (positions position..) over the paged bf16 (or int8: uint8 "
      "[P, Hkv, B, D + 4]; or float32) pools; returns "
      "(out, stats). Use lily_py.ops.attention_decode / attention_prefill.");

  m.def(
      "attention_mixer",
      [](InArray x, std::vector<InArray> proj, uint32_t bits, uint32_t group_size, const std::string& scale_dtype,
         InArray q_norm, InArray k_norm, InArray k_cache, InArray v_cache, InArray block_table, uint32_t q_heads,
         uint32_t rotary_dim,
         double theta, float eps, float weight_offset, uint32_t position, const std::string& dtype,
         const std::string& w_dtype, const std::string& device, const std::string& order, uint64_t seed,
         bool fp_traps) {
        const char* fn = "attention_mixer";
        gpu::ops::AttentionMixerOperands op;
        op.dtype = gpu::parse_dtype(dtype, "attention_mixer: x");
        op.w_dtype = gpu::parse_dtype(w_dtype, "attention_mixer: q_norm");
        const gpu::DType st = gpu::parse_dtype(scale_dtype, "attention_mixer: scales");
        LILY_REQUIRE(proj.size() == 12 || proj.size() == 6,
                "attention_mixer: proj must be 12 arrays (w, scales, biases) x (q, k, v, o) or 6 (qkv, o)");
        const bool fused = proj.size() == 6;
        LILY_REQUIRE(x.ndim() == 2 && k_cache.ndim() == 4, "attention_mixer: x must be 2-D and the pools 4-D");
        const size_t T = x.shape(0), H = x.shape(1), P = k_cache.shape(0), Hkv = k_cache.shape(1), B = k_cache.shape(2),
                     D = k_cache.shape(3);
        check_dims(x, fn, "x", {T, H}, gpu::dtype_size(op.dtype) * 8);
        check_dims(v_cache, fn, "v_cache", {P, Hkv, B, D}, 16);
        check_dims(k_cache, fn, "k_cache", {P, Hkv, B, D}, 16);
        check_dims(q_norm, fn, "q_norm", {D}, gpu::dtype_size(op.w_dtype) * 8);
        check_dims(k_norm, fn, "k_norm", {D}, gpu::dtype_size(op.w_dtype) * 8);
        op.tokens = u32(T);
        op.hidden = u32(H);
        op.q_heads = q_heads;
        op.kv_heads = u32(Hkv);
        op.head_dim = u32(D);
        op.rotary_dim = rotary_dim;
        op.position = position;
        op.eps = eps;
        op.weight_offset = weight_offset;
        AttnRun r(device, order, seed, fp_traps);
        op.kv = kv_paging(r, block_table, fn, P, B);
        const size_t xs = gpu::dtype_size(op.dtype);
        op.x = r.input(x);
        if (fused) {
          op.qkv_proj = qmm_weights(r, proj[0], proj[1], proj[2], bits, group_size, st);
          op.o_proj = qmm_weights(r, proj[3], proj[4], proj[5], bits, group_size, st);
          op.qkv = r.output(T * (q_heads * 2 * D + 2 * Hkv * D) * xs);
        } else {
          op.q_proj = qmm_weights(r, proj[0], proj[1], proj[2], bits, group_size, st);
          op.k_proj = qmm_weights(r, proj[3], proj[4], proj[5], bits, group_size, st);
          op.v_proj = qmm_weights(r, proj[6], proj[7], proj[8], bits, group_size, st);
          op.o_proj = qmm_weights(r, proj[9], proj[10], proj[11], bits, group_size, st);
        }
        op.q_norm = r.input(q_norm);
        op.k_norm = r.input(k_norm);
        op.inv_freq = r.input(gpu::ops::rope_inv_freq(rotary_dim, theta));
        op.k_cache = r.input(k_cache);
        op.v_cache = r.input(v_cache);
        if (!fused) {
          op.qg = r.output(T * q_heads * 2 * D * xs);
          op.k = r.output(T * Hkv * D * xs);
          op.v = r.output(T * Hkv * D * xs);
        }
        op.q = r.output(T * q_heads * D * xs);
        op.attn = r.output(T * q_heads * D * xs);
        if (T == 1) op.scratch = r.output(gpu::ops::attention_scratch_bytes(q_heads, u32(D), position + 1, u32(B)));
        op.out = r.output(T * H * xs);
        nb::dict stats = r.run([&](gpu::Encoder& e) { gpu::ops::encode_attention_mixer(e, op); });
        return nb::make_tuple(r.download(op.out, op.dtype, {T, H}), r.download(op.k_cache, gpu::DType::bf16, {P, Hkv, B, D}),
                              r.download(op.v_cache, gpu::DType::bf16, {P, Hkv, B, D}), stats);
      },
      "x"_a, "proj"_a, nb::kw_only(), "bits"_a, "group_size"_a, "scale_dtype"_a, "q_norm"_a, "k_norm"_a,
      "k_cache"_a, "v_cache"_a, "block_table"_a, "q_heads"_a, "rotary_dim"_a, "theta"_a, "eps"_a, "weight_offset"_a, "position"_a,
      "dtype"_a, "w_dtype"_a, "device"_a = "emu", "order"_a = "shuffle", "seed"_a = 0, "fp_traps"_a = true,
      "The gated-attention mixer of one layer (projections, q/k norm, RoPE, KV append, attention, gate, "
      "o_proj) in one encoder; returns (out, k_cache, v_cache, stats). Use lily_py.ops.attention_mixer.");
}

}  // namespace lily::bindings
