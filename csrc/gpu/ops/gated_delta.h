// Gated DeltaNet: causal conv1d with state, the fused gated delta rule (+ gated RMSNorm), and the
// whole DeltaNet token mixer of one layer (projections through the quantized matmul).
// Kernels: shaders/gated_delta.metal (+ shaders/qmm.metal). Constants: shaders/common/args_gated_delta.h.
#pragma once
#include <array>
#include <cstdint>

#include "gpu/dtype.h"
#include "gpu/encoder.h"
#include "gpu/ops/qmm.h"

namespace lily::gpu::ops {

struct Conv1dOperands {
  Binding x;          // [T, x_stride] of x_dtype (the conv channels are the first C of each row)
  Binding weight;     // [C, K] of w_dtype (MLX stores [C, K, 1]: the same bytes)
  Binding state_in;   // [K-1, C] of x_dtype: the K-1 inputs before x
  Binding y;          // [T, y_stride] of x_dtype
  Binding state_out;  // [K-1, C] of x_dtype; a different buffer from state_in unless T == 1
  DType x_dtype = DType::f32;
  DType w_dtype = DType::f32;
  uint32_t T = 0, C = 0, K = 4;
  uint32_t x_stride = 0, y_stride = 0;  // 0 means packed (C)
};

KernelId conv1d_kernel(DType x_dtype, DType w_dtype);
// One dispatch, grid (ceil(C / kConvThreads), T); no barrier. Throws std::invalid_argument.
void encode_conv1d(Encoder& enc, const Conv1dOperands& op);

struct GatedDeltaOperands {
  Binding qkv;          // [T, qkv_stride] of x_dtype: q [Hk*Dk] | k [Hk*Dk] | v [Hv*Dv] after the conv
  Binding z;            // [T, z_stride] of x_dtype: output gate [Hv*Dv]
  Binding a;            // [T, ab_stride] of x_dtype: decay input [Hv]
  Binding b;            // [T, ab_stride] of x_dtype: beta input [Hv]
  Binding A_log;        // [Hv] float32
  Binding dt_bias;      // [Hv] of w_dtype
  Binding norm_weight;  // [Dv] of w_dtype (plain multiplier)
  Binding state;        // [Hv, Dv, Dk] float32, updated in place
  Binding y;            // [T, Hv*Dv] of x_dtype
  DType x_dtype = DType::f32;
  DType w_dtype = DType::f32;
  uint32_t T = 0, Hk = 0, Hv = 0, Dk = 0, Dv = 0;
  uint32_t qkv_stride = 0, z_stride = 0, ab_stride = 0;  // 0 means packed
  float eps = 1e-6f;
  Binding chunk_scratch;  // chunked route only: gated_delta_chunk_scratch_bytes() bytes (float32)
  // Chunked route only, optional: the causal conv1d + SiLU fused into the prep
  // (gd_chunk_prep_conv). qkv then holds the conv's input (the in_proj output's qkv columns, row
  // stride qkv_stride); conv_weight [C, conv_k] of w_dtype; conv_state_in / conv_state_out
  // [conv_k - 1, C] of x_dtype, distinct (the window before / after these T tokens).
  Binding conv_weight, conv_state_in, conv_state_out;
  uint32_t conv_k = 0;
};

// Two routes for the delta rule over T tokens:
//   scan     one dispatch, a threadgroup per value head walks the tokens in order (decode, short)
//   chunked  T >= kGdChunkMinTokens and Dk, Dv multiples of 8: the WY form over chunks of 64
//            tokens on simdgroup matrices (shaders/gated_delta_chunk.metal), 4 dispatches; on a
//            device with tensor ops the prep writes q as half and the wy and state kernels are
//            gd_chunk_wy_m5 / gd_chunk_state_m5 (the Gram products and the output O on matmul2d,
//            shaders/m5/gated_delta_chunk_m5.metal)
enum class GdRoute : uint8_t { scan, chunked };
GdRoute gated_delta_route(uint32_t T, uint32_t Dk, uint32_t Dv);
const char* gated_delta_route_name(GdRoute r);
// Bytes of the chunked route's float32 scratch (layout in common/args_gated_delta.h).
uint64_t gated_delta_chunk_scratch_bytes(uint32_t T, uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv);
// FLOPs (2 per multiply-add) the chunked route's matrix products execute, split by unit: `tensor`
// on matmul2d (with tensor ops: gd_chunk_wy_m5's K K^T and Q K^T as full 64 x 64 squares over Dk
// rounded up to 32, and all of gd_chunk_state_m5: W S, Q S, P U (k = 128) and K^T U per 32 value
// columns; else 0),
// `alu` on 8x8 fp32 simdgroup matrices and the forward substitution.
struct GdChunkFlops {
  uint64_t tensor = 0, alu = 0;  // by unit
  uint64_t wy = 0, state = 0;    // by dispatch: gd_chunk_wy* and gd_chunk_state* (same total)
  uint64_t feedback = 0;         // of state: U = u + W S (and the tail scaling, fp32) and S += K^T U
  uint64_t total() const { return tensor + alu; }
};
// The chunked route's four kernels in dispatch order: prep (conv fused or not; q as half with
// tensor ops), wy, state, norm.
std::array<KernelId, 4> gd_chunk_kernels(bool conv, bool m5, DType x, DType w);
GdChunkFlops gated_delta_chunk_flops(uint32_t T, uint32_t Hv, uint32_t Dk, uint32_t Dv, bool tensor_ops);
// The chunked route: prep, barrier, wy, barrier, state, barrier, norm (4 dispatches, 3 barriers);
// with conv_weight bound the prep is gd_chunk_prep_conv (the mixer's prefill: no conv1d dispatch).
// Needs op.chunk_scratch. Throws std::invalid_argument.
void encode_gated_delta_chunked(Encoder& enc, const GatedDeltaOperands& op);

KernelId gated_delta_kernel(DType x_dtype, DType w_dtype);
// FLOPs the delta rule needs for T tokens: 3 products of Dk x Dv per token and value head
// (S^T k, k u^T, S^T q), 2 FLOPs per multiply-add (the decay scaling is not counted).
uint64_t gated_delta_useful_flops(uint32_t T, uint32_t Hv, uint32_t Dk, uint32_t Dv);
uint32_t gated_delta_threads(uint32_t Dv);  // threads per threadgroup (one threadgroup per value head)
// One dispatch, Hv threadgroups; no barrier. Throws std::invalid_argument.
void encode_gated_delta(Encoder& enc, const GatedDeltaOperands& op);

// One decode token of the DeltaNet core with conv1d fused (shaders/gated_delta.metal
// `gated_delta_decode`): conv of the token's q | k | v against the window conv_in, new window to
// conv_out, the gated delta rule (each value head split over gated_delta_decode_blocks()
// threadgroups by value columns, raw outputs to o_raw), then, after a barrier, the gated RMSNorm
// (gd_chunk_norm of one token: a norm over a head's columns needs them all, and MSL 3.1 orders no
// device memory between the threadgroups of one dispatch).
struct GdDecodeOperands {
  Binding x;            // [>= C] of x_dtype: the token's conv input q | k | v (before the conv)
  Binding z, a, b;      // [Hv*Dv], [Hv], [Hv] of x_dtype
  Binding conv_weight;  // [C, K] of w_dtype
  Binding conv_in;      // [K-1, C] of x_dtype: the window (read only)
  Binding conv_out;     // [K-1, C] of x_dtype: the new window; must not overlap conv_in
  Binding A_log, dt_bias, norm_weight;  // as in GatedDeltaOperands
  Binding state;        // [Hv, Dv, Dk] float32, in place
  Binding o_raw;        // scratch float32 [Hv*Dv]
  Binding y;            // [Hv*Dv] of x_dtype
  DType x_dtype = DType::f32;
  DType w_dtype = DType::f32;
  uint32_t Hk = 0, Hv = 0, Dk = 0, Dv = 0, K = 4;
  float eps = 1e-6f;
};

KernelId gated_delta_decode_kernel(DType x_dtype, DType w_dtype);
// Threads per threadgroup of gated_delta_decode for value head dim Dv under a pipeline limit of
// `limit` threads: min(kGdDecodeThreads, limit rounded down to 32, 32 * ceil(Dv / 2)).
uint32_t gated_delta_decode_threads(uint32_t Dv, uint32_t limit);
// Threadgroups per value head (grid x) for `threads` threads per threadgroup.
uint32_t gated_delta_decode_blocks(uint32_t Dv, uint32_t threads);
// Two dispatches, the rule (grid (blocks, Hv), sized from enc.thread_limit()) and the norm (grid
// (1, Hv) of 32 threads), one barrier between them. Throws std::invalid_argument.
// phase rule / norm: only that dispatch, no barrier (batched decode: the rules of every sequence,
// one barrier, then their norms, so B sequences take the levels of one).
enum class GdDecodePhase : uint8_t { both, rule, norm };
void encode_gated_delta_decode(Encoder& enc, const GdDecodeOperands& op, GdDecodePhase phase = GdDecodePhase::both);

// A quantized linear layer (MLX affine layout), as bound for the quantized matmul.
struct QuantLinear {
  Binding w, scales, biases;
  DType scale_dtype = DType::f32;
  uint32_t bits = 4, group_size = 64;
  std::vector<QmmBlock> blocks;  // optional: row blocks of different quantization (QmmOperands::blocks)
};

// The Gated DeltaNet token mixer of one layer for T tokens (decode: T = 1), from the normed
// hidden states x to the mixer output (before the residual add):
//   proj = x @ in_proj^T        in_proj = rows in_proj_qkv | in_proj_z | in_proj_b | in_proj_a
//                               concatenated at load (blocks: runs of parts that agree in
//                               quantization, one dispatch each)
//   qkv  = conv1d(proj[:, :C])  conv state rolled from conv_state_in to conv_state_out
//   o    = gated_delta(qkv, z, a, b, ...)   recurrent state updated in place
//   out  = o @ out_proj^T
// Batched decode (seqs bound, T = seqs.size() > 1: token t belongs to sequence t, each with its own
// state and conv window): in_proj and out_proj over the T rows (every weight byte read once),
// between them one gated_delta_decode rule per sequence, a barrier, one norm per sequence: the
// levels of one token, 2 T + 2 dispatches.
// Dispatches: T = 1 (decode): 3 (in_proj, gated_delta_decode with the conv fused, out_proj with
// the gated norm folded in front: qmv1_gated), 2 barriers, where qmv1_gated_allowed and w_dtype is
// float32 and out_proj has no blocks; else 4 (the norm, gd_chunk_norm, its own level), 3 barriers;
// needs gd_o_raw. T > 1: 4 (in_proj, conv1d, gated_delta, out_proj),
// 3 barriers, one before each consumer; on the chunked route (gated_delta_route, chunk_scratch
// bound) the delta rule takes 4 dispatches instead of 1: 7 dispatches, 6 barriers.
// One sequence of a batched decode step: its recurrent state, conv windows and raw-output scratch.
struct GdSequence {
  Binding conv_state_in, conv_state_out;  // [K-1, C] of x_dtype each, distinct
  Binding state;                          // [Hv, Dv, Dk] float32, in place
  Binding o_raw;                          // scratch float32 [Hv*Dv], its own
};
struct GatedDeltaMixerOperands {
  Binding x;               // [T, hidden] of x_dtype
  QuantLinear in_proj;     // [C + Hv*Dv + 2*Hv, hidden]
  QuantLinear out_proj;    // [hidden, Hv*Dv]
  Binding conv_weight;     // [C, K] of w_dtype
  Binding A_log, dt_bias, norm_weight;  // as in GatedDeltaOperands
  Binding conv_state_in;   // [K-1, C] of x_dtype
  Binding conv_state_out;  // [K-1, C] of x_dtype, a different buffer from conv_state_in
  Binding state;           // [Hv, Dv, Dk] float32, in place
  Binding proj;            // scratch [T, C + Hv*Dv + 2*Hv] of x_dtype
  Binding conv_out;        // scratch [T, C] of x_dtype
  Binding o;               // scratch [T, Hv*Dv] of x_dtype
  Binding chunk_scratch;   // scratch of the chunked route (unbound: always the scan)
  Binding x_i8;            // int8 activation scratch (qmm_i8_scratch_bytes(T, max(hidden, Hv*Dv))) for
                           // in_proj and out_proj; unbound: no int8
  Binding gd_o_raw;        // T = 1: scratch float32 [Hv*Dv] (raw outputs before the gated norm)
  Binding out;             // [T, hidden] of x_dtype
  std::vector<GdSequence> seqs;  // batched decode: one per token (conv_state_*, state, gd_o_raw unused)
  Binding in_norm;         // optional float32 [hidden] (T == 1 only): in_proj normalizes x itself
                           // (RMSNorm with this weight and in_norm_eps fused in front, qmv1 route)
  float in_norm_eps = 1e-6f;
  DType x_dtype = DType::f32;
  DType w_dtype = DType::f32;
  uint32_t T = 0, hidden = 0, Hk = 0, Hv = 0, Dk = 0, Dv = 0, K = 4;
  float eps = 1e-6f;
};

uint32_t gated_delta_mixer_proj_rows(uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv);
// T = 1: out_proj with the gated norm folded in front (qmv1_gated; z = proj's columns after qkv).
Qmv1GatedOperands gated_delta_mixer_out_proj(const GatedDeltaMixerOperands& op);
// Whether one token's out_proj takes qmv1_gated (no gd_chunk_norm level): T = 1, not batched,
// gd_o_raw bound, out_proj in one block, float32 norm weight, qmv1_gated_allowed.
bool gated_delta_mixer_folds_norm(const GatedDeltaMixerOperands& op);
void encode_gated_delta_mixer(Encoder& enc, const GatedDeltaMixerOperands& op);

}  // namespace lily::gpu::ops
