// Kernel identity on the host: one enum, one name table, generated from the single list below.
//
// Each row: X(id, ArgsStruct, buffers)
//   id         - enum name AND the kernel's [[host_name]] (the shader's LILY_INSTANTIATE string must
//                be exactly this; tests/kernels/test_kernel_table.py checks every id is registered in
//                the emulator with the same args size and buffer count, and on macOS in the metallib)
//   ArgsStruct - the struct bound at [[buffer(0)]] (shaders/common/args.h)
//   buffers    - number of device buffers bound at [[buffer(1)]] .. [[buffer(buffers)]]
//
// Adding a kernel: write it in shaders/<family>.metal with LILY_INSTANTIATE("<id>", ...), add one
// row here, encode it from csrc/gpu/ops/<family>.cpp, test it in tests/kernels/.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "common/args.h"

// clang-format off
#define LILY_KERNEL_LIST(X)                                                   \
  /* quantized matrix-vector, small M (shaders/qmm.metal): x, w, scales, biases, out */ \
  X(qmv_b4_xf32_sf32,   QmmArgs, 5)                                           \
  X(qmv_b4_xf32_sbf16,  QmmArgs, 5)                                           \
  X(qmv_b4_xbf16_sf32,  QmmArgs, 5)                                           \
  X(qmv_b4_xbf16_sbf16, QmmArgs, 5)                                           \
  X(qmv_b8_xf32_sf32,   QmmArgs, 5)                                           \
  X(qmv_b8_xf32_sbf16,  QmmArgs, 5)                                           \
  X(qmv_b8_xbf16_sf32,  QmmArgs, 5)                                           \
  X(qmv_b8_xbf16_sbf16, QmmArgs, 5)                                           \
  /* the same with float32 y (lm_head: fp32 logits from bf16 activations) */ \
  X(qmv_b4_xbf16_sf32_yf32, QmmArgs, 5) \
  X(qmv_b4_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmv_b8_xbf16_sf32_yf32, QmmArgs, 5) \
  X(qmv_b8_xbf16_sbf16_yf32, QmmArgs, 5) \
  /* single-token qmv (shaders/qmm.metal): x, w, scales, biases, y, residual, norm_w, h_out, xn_out */ \
  X(qmv1_b4_xf32_sf32, Qmv1Args, 9)                                       \
  X(qmv1_b4_xf32_sbf16, Qmv1Args, 9)                                       \
  X(qmv1_b4_xbf16_sf32, Qmv1Args, 9)                                       \
  X(qmv1_b4_xbf16_sbf16, Qmv1Args, 9)                                       \
  X(qmv1_b8_xf32_sf32, Qmv1Args, 9)                                       \
  X(qmv1_b8_xf32_sbf16, Qmv1Args, 9)                                       \
  X(qmv1_b8_xbf16_sf32, Qmv1Args, 9)                                       \
  X(qmv1_b8_xbf16_sbf16, Qmv1Args, 9)                                       \
  X(qmv1_b4_xbf16_sf32_yf32, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sbf16_yf32, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sf32_yf32, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sbf16_yf32, Qmv1Args, 9) \
  /* the same with 1 row per threadgroup (qmv1_rows: small N, e.g. the router) */ \
  X(qmv1_b4_xf32_sf32_r1, Qmv1Args, 9) \
  X(qmv1_b4_xf32_sbf16_r1, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sf32_r1, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sbf16_r1, Qmv1Args, 9) \
  X(qmv1_b8_xf32_sf32_r1, Qmv1Args, 9) \
  X(qmv1_b8_xf32_sbf16_r1, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sf32_r1, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sbf16_r1, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sf32_yf32_r1, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sbf16_yf32_r1, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sf32_yf32_r1, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sbf16_yf32_r1, Qmv1Args, 9) \
  /* qmv1 with the DeltaNet's gated RMSNorm in front (out_proj at one token): o, w, scales, biases, y, z, norm_w */ \
  X(qmv1_gated_b4_sf32_yf32, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b4_sf32_ybf16, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b4_sbf16_yf32, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b4_sbf16_ybf16, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b8_sf32_yf32, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b8_sf32_ybf16, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b8_sbf16_yf32, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b8_sbf16_ybf16, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b4_sf32_yf32_r1, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b4_sf32_ybf16_r1, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b4_sbf16_yf32_r1, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b4_sbf16_ybf16_r1, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b8_sf32_yf32_r1, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b8_sf32_ybf16_r1, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b8_sbf16_yf32_r1, Qmv1GatedArgs, 7) \
  X(qmv1_gated_b8_sbf16_ybf16_r1, Qmv1GatedArgs, 7) \
  /* the same with 16 rows per threadgroup (qmv1_rows: K not split, 4 and 8 bits: lm_head) */ \
  X(qmv1_b4_xf32_sf32_r16, Qmv1Args, 9) \
  X(qmv1_b4_xf32_sbf16_r16, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sf32_r16, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sbf16_r16, Qmv1Args, 9) \
  X(qmv1_b8_xf32_sf32_r16, Qmv1Args, 9) \
  X(qmv1_b8_xf32_sbf16_r16, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sf32_r16, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sbf16_r16, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sf32_yf32_r16, Qmv1Args, 9) \
  X(qmv1_b4_xbf16_sbf16_yf32_r16, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sf32_yf32_r16, Qmv1Args, 9) \
  X(qmv1_b8_xbf16_sbf16_yf32_r16, Qmv1Args, 9) \
  /* quantized matrix-matrix, tiled (shaders/qmm.metal): x, w, scales, biases, out */ \
  X(qmm_b4_xf32_sf32,   QmmArgs, 5)                                           \
  X(qmm_b4_xf32_sbf16,  QmmArgs, 5)                                           \
  X(qmm_b4_xbf16_sf32,  QmmArgs, 5)                                           \
  X(qmm_b4_xbf16_sbf16, QmmArgs, 5)                                           \
  X(qmm_b8_xf32_sf32,   QmmArgs, 5)                                           \
  X(qmm_b8_xf32_sbf16,  QmmArgs, 5)                                           \
  X(qmm_b8_xbf16_sf32,  QmmArgs, 5)                                           \
  X(qmm_b8_xbf16_sbf16, QmmArgs, 5)                                           \
  X(qmm_b4_xbf16_sf32_yf32, QmmArgs, 5) \
  X(qmm_b4_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmm_b8_xbf16_sf32_yf32, QmmArgs, 5) \
  X(qmm_b8_xbf16_sbf16_yf32, QmmArgs, 5) \
  /* quantized matrix-matrix, bf16 simdgroup tiles, M1-M4 prefill (shaders/qmm.metal): same buffers */ \
  X(qmm_bf16_b4_xf32_sf32,   QmmArgs, 5)                                      \
  X(qmm_bf16_b4_xf32_sbf16,  QmmArgs, 5)                                      \
  X(qmm_bf16_b4_xbf16_sf32,  QmmArgs, 5)                                      \
  X(qmm_bf16_b4_xbf16_sbf16, QmmArgs, 5)                                      \
  X(qmm_bf16_b8_xf32_sf32,   QmmArgs, 5)                                      \
  X(qmm_bf16_b8_xf32_sbf16,  QmmArgs, 5)                                      \
  X(qmm_bf16_b8_xbf16_sf32,  QmmArgs, 5)                                      \
  X(qmm_bf16_b8_xbf16_sbf16, QmmArgs, 5)                                      \
  /* quantized matmul on Metal 4 tensor ops, M5 (shaders/m5/qmm_m5.metal, lily_m5.metallib; */ \
  /* only on devices that report tensor_ops, see kernel_needs_tensor_ops): same buffers as qmm */ \
  X(qmm_m5_b4_xf32_sf32,   QmmArgs, 5)                                        \
  X(qmm_m5_b4_xf32_sbf16,  QmmArgs, 5)                                        \
  X(qmm_m5_b4_xbf16_sf32,  QmmArgs, 5)                                        \
  X(qmm_m5_b4_xbf16_sbf16, QmmArgs, 5)                                        \
  X(qmm_m5_b4_xbf16_sf32_yf32,  QmmArgs, 5) /* bf16 x, fp32 y (lm_head logits) */ \
  X(qmm_m5_b4_xbf16_sbf16_yf32, QmmArgs, 5)                                   \
  X(qmm_m5_b8_xf32_sf32,   QmmArgs, 5) /* 8-bit: the MoE router + shared gate */ \
  X(qmm_m5_b8_xf32_sbf16,  QmmArgs, 5)                                        \
  X(qmm_m5_b8_xbf16_sf32,  QmmArgs, 5)                                        \
  X(qmm_m5_b8_xbf16_sbf16, QmmArgs, 5)                                        \
  X(qmm_m5i8_b4_xbf16_sf32,  QmmArgs, 5) /* int8 x on the int8 rows of matmul2d */ \
  X(qmm_m5i8_b4_xbf16_sbf16, QmmArgs, 5)                                      \
  X(quantize_i8_xbf16, QuantI8Args, 2) /* bf16 x -> the int8 activation scratch */ \
  X(quantize_i8_xf32,  QuantI8Args, 2) /* fp32 (the MoE's h) -> the same */        \
  /* MoE grouped 64- and 32-row tiles on tensor ops, M5 (shaders/m5/moe_m5.metal): same  */ \
  /* buffers as moe_gate_up_mm / moe_down_mm */                               \
  X(moe_gate_up_m5_64_b4_xf32_sbf16, MoeArgs, 15)                             \
  X(moe_gate_up_m5_32_b4_xf32_sbf16, MoeArgs, 15)                             \
  X(moe_gate_up_m5_64_b4_xbf16_sbf16, MoeArgs, 15)                            \
  X(moe_gate_up_m5_32_b4_xbf16_sbf16, MoeArgs, 15)                            \
  X(moe_down_m5_64_b4_sbf16,         MoeArgs, 10)                             \
  X(moe_down_m5_32_b4_sbf16,         MoeArgs, 10)                             \
  X(moe_gate_up_m5i8_64_b4_xbf16_sbf16, MoeArgs, 15) /* 64-row tiles, int8 x */ \
  X(moe_down_m5i8_64_b4_sbf16,          MoeArgs, 10) /* ... and int8 h */        \
  /* causal prefill attention on tensor ops, M5 (shaders/m5/attention_m5.metal): same */ \
  /* buffers as attn_prefill_mma; one id per head_dim */                      \
  X(attn_prefill_m5_d64_f32,   AttnArgs, 6)                                   \
  X(attn_prefill_m5_d64_bf16,  AttnArgs, 6)                                   \
  X(attn_prefill_m5_d128_f32,  AttnArgs, 6)                                   \
  X(attn_prefill_m5_d128_bf16, AttnArgs, 6)                                   \
  X(attn_prefill_m5_d256_f32,  AttnArgs, 6)                                   \
  X(attn_prefill_m5_d256_bf16, AttnArgs, 6)                                   \
  X(attn_prefill_m5_q8_d64_f32,   AttnArgs, 6)  /* int8 KV pools */            \
  X(attn_prefill_m5_q8_d128_f32,  AttnArgs, 6)                                \
  X(attn_prefill_m5_q8_d256_f32,  AttnArgs, 6)                                \
  X(attn_prefill_m5i8_q8_d64_bf16,  AttnArgs, 6) /* int8 pools, bf16: S on int8 */ \
  X(attn_prefill_m5i8_q8_d128_bf16, AttnArgs, 6)                              \
  X(attn_prefill_m5i8_q8_d256_bf16, AttnArgs, 6)                              \
  /* the chunked delta rule's wy kernel with its Gram products on tensor ops, M5 */ \
  /* (shaders/m5/gated_delta_chunk_m5.metal): same buffers as gd_chunk_wy_f32 */ \
  X(gd_chunk_wy_m5_f32,        GdChunkArgs, 8)                                \
  X(gd_chunk_state_m5_f32,     GdChunkArgs, 8)                                \
  /* RMSNorm (shaders/norm.metal): x, weight, y */                            \
  X(rms_norm_xf32_wf32,   RmsNormArgs, 3)                                     \
  X(rms_norm_xf32_wbf16,  RmsNormArgs, 3)                                     \
  X(rms_norm_xbf16_wf32,  RmsNormArgs, 3)                                     \
  X(rms_norm_xbf16_wbf16, RmsNormArgs, 3)                                     \
  /* RMSNorm with the residual add fused in: x, residual, weight, h_out, y */ \
  X(rms_norm_residual_xf32_wf32,   RmsNormArgs, 5)                            \
  X(rms_norm_residual_xf32_wbf16,  RmsNormArgs, 5)                            \
  X(rms_norm_residual_xbf16_wf32,  RmsNormArgs, 5)                            \
  X(rms_norm_residual_xbf16_wbf16, RmsNormArgs, 5)                            \
  /* quantized embedding lookup (shaders/embedding.metal): ids, table, scales, biases, out */ \
  X(embedding_b4_xf32_sf32,   EmbeddingArgs, 5)                               \
  X(embedding_b4_xf32_sbf16,  EmbeddingArgs, 5)                               \
  X(embedding_b4_xbf16_sf32,  EmbeddingArgs, 5)                               \
  X(embedding_b4_xbf16_sbf16, EmbeddingArgs, 5)                               \
  X(embedding_b8_xf32_sf32,   EmbeddingArgs, 5)                               \
  X(embedding_b8_xf32_sbf16,  EmbeddingArgs, 5)                               \
  X(embedding_b8_xbf16_sf32,  EmbeddingArgs, 5)                               \
  X(embedding_b8_xbf16_sbf16, EmbeddingArgs, 5)                               \
  /* elementwise (shaders/elementwise.metal): a, b, y */                      \
  X(swiglu_f32,       ElementwiseArgs, 3)                                     \
  X(swiglu_bf16,      ElementwiseArgs, 3)                                     \
  X(sigmoid_mul_f32,  ElementwiseArgs, 3)                                     \
  X(sigmoid_mul_bf16, ElementwiseArgs, 3)                                     \
  /* causal conv1d + SiLU with state (shaders/gated_delta.metal): x, weight, state_in, y, state_out */ \
  X(conv1d_xf32_wf32,   Conv1dArgs, 5)                                        \
  X(conv1d_xf32_wbf16,  Conv1dArgs, 5)                                        \
  X(conv1d_xbf16_wf32,  Conv1dArgs, 5)                                        \
  X(conv1d_xbf16_wbf16, Conv1dArgs, 5)                                        \
  /* fused gated delta rule + gated RMSNorm: qkv, z, a, b, A_log, dt_bias, norm_weight, state, y */ \
  X(gated_delta_xf32_wf32,   GatedDeltaArgs, 9)                               \
  X(gated_delta_xf32_wbf16,  GatedDeltaArgs, 9)                               \
  X(gated_delta_xbf16_wf32,  GatedDeltaArgs, 9)                               \
  X(gated_delta_xbf16_wbf16, GatedDeltaArgs, 9)                               \
  /* one decode token, conv1d fused, heads split by value columns (the gated norm follows as */ \
  /* gd_chunk_norm): x, a, b, conv weight, conv_in, conv_out, A_log, dt_bias, state, o_raw */ \
  X(gated_delta_decode_xf32_wf32,   GdDecodeArgs, 10)                         \
  X(gated_delta_decode_xf32_wbf16,  GdDecodeArgs, 10)                         \
  X(gated_delta_decode_xbf16_wf32,  GdDecodeArgs, 10)                         \
  X(gated_delta_decode_xbf16_wbf16, GdDecodeArgs, 10)                         \
  /* chunked (WY) delta rule prefill (shaders/gated_delta_chunk.metal; buffers listed there) */ \
  X(gd_chunk_prep_xf32_wf32,  GdChunkArgs, 10)                                \
  X(gd_chunk_prep_xf32_wbf16, GdChunkArgs, 10)                                \
  X(gd_chunk_prep_xbf16_wf32, GdChunkArgs, 10) \
  X(gd_chunk_prep_xbf16_wbf16, GdChunkArgs, 10) \
  X(gd_chunk_wy_f32,          GdChunkArgs, 8)                                 \
  X(gd_chunk_state_f32,       GdChunkArgs, 8)                                 \
  X(gd_chunk_norm_xf32_wf32,  GdChunkArgs, 4)                                 \
  X(gd_chunk_norm_xf32_wbf16, GdChunkArgs, 4)                                 \
  X(gd_chunk_norm_xbf16_wf32, GdChunkArgs, 4) \
  X(gd_chunk_norm_xbf16_wbf16, GdChunkArgs, 4) \
  /* the prep of the M5 route: q normalised to half (the operand of gd_chunk_*_m5's matmul2d) */ \
  X(gd_chunk_prep_q16_xf32_wf32,   GdChunkArgs, 10) \
  X(gd_chunk_prep_q16_xf32_wbf16,  GdChunkArgs, 10) \
  X(gd_chunk_prep_q16_xbf16_wf32,  GdChunkArgs, 10) \
  X(gd_chunk_prep_q16_xbf16_wbf16, GdChunkArgs, 10) \
  /* the engine's prefill prep: conv1d + SiLU fused (+ conv_weight, conv_in, conv_out), both routes */ \
  X(gd_chunk_prep_conv_xf32_wf32,   GdChunkArgs, 13) \
  X(gd_chunk_prep_conv_xf32_wbf16,  GdChunkArgs, 13) \
  X(gd_chunk_prep_conv_xbf16_wf32,  GdChunkArgs, 13) \
  X(gd_chunk_prep_conv_xbf16_wbf16, GdChunkArgs, 13) \
  X(gd_chunk_prep_conv_q16_xf32_wf32,   GdChunkArgs, 13) \
  X(gd_chunk_prep_conv_q16_xf32_wbf16,  GdChunkArgs, 13) \
  X(gd_chunk_prep_conv_q16_xbf16_wf32,  GdChunkArgs, 13) \
  X(gd_chunk_prep_conv_q16_xbf16_wbf16, GdChunkArgs, 13) \
  /* mixture of experts (shaders/moe_*.metal; buffers listed in the shader) */ \
  X(moe_route,                       MoeArgs, 3)                              \
  X(moe_plan,                        MoeArgs, 5)                              \
  X(moe_gate_up_mv_b4_xf32_sbf16, MoeArgs, 17)                             \
  X(moe_down_mv_b4_xf32_sbf16, MoeArgs, 11)                             \
  X(moe_gate_up_mm32_b4_xf32_sbf16,  MoeArgs, 15)                             \
  X(moe_gate_up_mm64_b4_xf32_sbf16,  MoeArgs, 15)                             \
  X(moe_down_mm32_b4_sbf16,          MoeArgs, 10)                             \
  X(moe_down_mm64_b4_sbf16,          MoeArgs, 10)                             \
  X(moe_gate_up_few_b4_xf32_sbf16,   MoeArgs, 15)                             \
  X(moe_down_few_b4_sbf16,           MoeArgs, 10)                             \
  X(moe_combine_xf32,                MoeArgs, 4)                              \
  X(moe_route_xbf16, MoeArgs, 3) \
  X(moe_gate_up_mv_b4_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b4_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b4_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b4_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b4_xbf16_sbf16, MoeArgs, 15) \
  X(moe_combine_xbf16, MoeArgs, 4) \
  /* MoE 64- and 32-row tiles, M1-M4 bf16 simdgroup design (bf16 activations) */ \
  X(moe_gate_up_bf16_64_b4_xbf16_sbf16, MoeArgs, 15)                          \
  X(moe_gate_up_bf16_32_b4_xbf16_sbf16, MoeArgs, 15)                          \
  X(moe_down_bf16_64_b4_sbf16,       MoeArgs, 10)                             \
  X(moe_down_bf16_32_b4_sbf16,       MoeArgs, 10)                             \
  /* attention (shaders/attention*.metal): rope: x, inv_freq, y */            \
  X(rope_f32,  RopeArgs, 3)                                                   \
  X(rope_bf16, RopeArgs, 3)                                                   \
  /* qg, k, v, q_norm, k_norm, inv_freq, q_out, k_cache, v_cache */          \
  X(qk_norm_rope_xf32_wf32, QkNormRopeArgs, 10)                              \
  X(qk_norm_rope_xf32_wbf16, QkNormRopeArgs, 10)                              \
  X(qk_norm_rope_xbf16_wf32, QkNormRopeArgs, 10)                              \
  X(qk_norm_rope_xbf16_wbf16, QkNormRopeArgs, 10)                              \
  X(qk_norm_rope_q8_xf32_wf32, QkNormRopeArgs, 10) /* int8 KV pools */          \
  X(qk_norm_rope_q8_xf32_wbf16, QkNormRopeArgs, 10) /* int8 KV pools */          \
  X(qk_norm_rope_q8_xbf16_wf32, QkNormRopeArgs, 10) /* int8 KV pools */          \
  X(qk_norm_rope_q8_xbf16_wbf16, QkNormRopeArgs, 10) /* int8 KV pools */          \
  X(qk_norm_rope_kvf32_xf32_wf32, QkNormRopeArgs, 10) /* float32 KV pools */    \
  X(qk_norm_rope_kvf32_xf32_wbf16, QkNormRopeArgs, 10) /* float32 KV pools */   \
  X(qk_norm_rope_kvf32_xbf16_wf32, QkNormRopeArgs, 10) /* float32 KV pools */   \
  X(qk_norm_rope_kvf32_xbf16_wbf16, QkNormRopeArgs, 10) /* float32 KV pools */  \
  /* q, k_cache, v_cache, gate, out */                                        \
  X(attn_decode_f32,  AttnArgs, 6)                                            \
  X(attn_decode_bf16, AttnArgs, 6)                                            \
  X(attn_decode_kvf32_f32,  AttnArgs, 6)  /* float32 KV pools */              \
  X(attn_decode_kvf32_bf16, AttnArgs, 6)                                      \
  X(attn_prefill_f32,  AttnArgs, 6)                                           \
  X(attn_prefill_bf16, AttnArgs, 6)                                           \
  X(attn_prefill_kvf32_f32,  AttnArgs, 6)  /* float32 KV pools */             \
  X(attn_prefill_kvf32_bf16, AttnArgs, 6)                                     \
  X(attn_prefill_mma_f32,  AttnArgs, 6)                                       \
  X(attn_prefill_mma_bf16, AttnArgs, 6)                                       \
  X(attn_prefill_mma_q8_f32,  AttnArgs, 6)  /* int8 KV pools */             \
  X(attn_prefill_mma_q8_bf16, AttnArgs, 6)                                    \
  X(attn_prefill_mma_kvf32_f32,  AttnArgs, 6)  /* float32 KV pools */         \
  X(attn_prefill_mma_kvf32_bf16, AttnArgs, 6)                                 \
  X(attn_prefill_tiles_d64_bf16,  AttnArgs, 6)                                \
  X(attn_prefill_tiles_d128_bf16, AttnArgs, 6)                                \
  X(attn_prefill_tiles_d256_bf16, AttnArgs, 6)                                \
  X(attn_prefill_tiles_q8_d64_bf16,  AttnArgs, 6)  /* int8 KV pools */        \
  X(attn_prefill_tiles_q8_d128_bf16, AttnArgs, 6)                             \
  X(attn_prefill_tiles_q8_d256_bf16, AttnArgs, 6)                             \
  /* split-K decode: q, k_cache, v_cache, partial_o, partial_ml */            \
  X(attn_decode_split_f32,  AttnArgs, 6)                                      \
  X(attn_decode_split_bf16, AttnArgs, 6)                                      \
  X(attn_decode_split_kvf32_f32,  AttnArgs, 6)  /* float32 KV pools */        \
  X(attn_decode_split_kvf32_bf16, AttnArgs, 6)                                \
  /* partial_o, partial_ml, gate, out */                                      \
  X(attn_combine_f32,  AttnArgs, 4)                                           \
  X(attn_combine_bf16, AttnArgs, 4)                                          \
  /* vec decode (head_dim 32 E): q, k_cache, v_cache, partial_o, partial_ml */ \
  X(attn_decode_vec_e2_f32, AttnArgs, 6)                                  \
  X(attn_decode_vec_e2_bf16, AttnArgs, 6)                                  \
  X(attn_decode_vec_e4_f32, AttnArgs, 6)                                  \
  X(attn_decode_vec_e4_bf16, AttnArgs, 6)                                  \
  X(attn_decode_vec_e8_f32, AttnArgs, 6)                                  \
  X(attn_decode_vec_e8_bf16, AttnArgs, 6)                                  \
  X(attn_decode_vec_q8_e2_f32, AttnArgs, 6) /* int8 KV pools */            \
  X(attn_decode_vec_q8_e2_bf16, AttnArgs, 6) /* int8 KV pools */            \
  X(attn_decode_vec_q8_e4_f32, AttnArgs, 6) /* int8 KV pools */            \
  X(attn_decode_vec_q8_e4_bf16, AttnArgs, 6) /* int8 KV pools */            \
  X(attn_decode_vec_q8_e8_f32, AttnArgs, 6) /* int8 KV pools */            \
  X(attn_decode_vec_q8_e8_bf16, AttnArgs, 6) /* int8 KV pools */            \
  X(attn_decode_vec_kvf32_e2_f32, AttnArgs, 6) /* float32 KV pools */       \
  X(attn_decode_vec_kvf32_e2_bf16, AttnArgs, 6) /* float32 KV pools */      \
  X(attn_decode_vec_kvf32_e4_f32, AttnArgs, 6) /* float32 KV pools */       \
  X(attn_decode_vec_kvf32_e4_bf16, AttnArgs, 6) /* float32 KV pools */      \
  X(attn_decode_vec_kvf32_e8_f32, AttnArgs, 6) /* float32 KV pools */       \
  X(attn_decode_vec_kvf32_e8_bf16, AttnArgs, 6) /* float32 KV pools */      \
  /* vec combine: partial_o, partial_ml, gate, out */                          \
  X(attn_vec_combine_e2_f32, AttnArgs, 4)                                \
  X(attn_vec_combine_e2_bf16, AttnArgs, 4)                                \
  X(attn_vec_combine_e4_f32, AttnArgs, 4)                                \
  X(attn_vec_combine_e4_bf16, AttnArgs, 4)                                \
  X(attn_vec_combine_e8_f32, AttnArgs, 4)                                \
  X(attn_vec_combine_e8_bf16, AttnArgs, 4)                                \
  /* argmax / sampling (shaders/sampling*.metal; host csrc/gpu/ops/sampling.cpp) */ \
  X(sample_max_partial_f32,    SampleArgs, 3) /* logits (masked in place), partials, mask */ \
  X(sample_max_final,          SampleArgs, 4) /* partials, state, ids, chosen_logit */ \
  X(sample_max_final_buckets,  SampleArgs, 3) /* partials, state, hist (zeroed) */ \
  X(sample_gumbel_partial_f32, SampleArgs, 3) /* logits, state, partials */   \
  X(sample_gumbel_final,       SampleArgs, 4) /* partials, state, ids, chosen_logit */ \
  X(sample_topk_partial_f32,  SampleArgs, 3) /* logits, state, candidates */ \
  X(sample_topk_merge_f32,    SampleArgs, 5) /* logits, state, candidates, ids, chosen_logit */ \
  X(sample_hist_partial_f32,   SampleArgs, 3) /* logits, state, hist */       \
  X(sample_select,             SampleArgs, 2) /* state, hist */               \
  X(sample_collect_f32,        SampleArgs, 4) /* logits, state, hist, partials */ \
  X(sample_resolve_f32,        SampleArgs, 6) /* logits, state, hist, partials, ids, chosen_logit */ \
  X(sample_lse_partial_f32,    SampleArgs, 3) /* logits, state, sums */      \
  X(sample_logprobs,           SampleArgs, 5) /* state, candidates, sums, chosen_logit, logprobs */ \
  X(sample_noise,              SampleArgs, 1) /* out */ \
  /* 2, 3, 5 and 6 bits (bfloat16 scales): the dense matvecs, qmm's fp32 tiles and the embedding
     (shaders/qmm.metal, embedding.metal); 2, 3, 5, 6 and 8 bits: the MoE matvec, fp32 tile and
     few-row kernels (moe_prefill.metal). 4 bits: the rows above; the bf16 and tensor-op tiles are 4/8-bit. */ \
  X(qmv_b2_xf32_sbf16, QmmArgs, 5) \
  X(qmv1_b2_xf32_sbf16, Qmv1Args, 9) \
  X(qmv1_b2_xf32_sbf16_r1, Qmv1Args, 9) \
  X(qmm_b2_xf32_sbf16, QmmArgs, 5) \
  X(embedding_b2_xf32_sbf16, EmbeddingArgs, 5) \
  X(qmv_b2_xbf16_sbf16, QmmArgs, 5) \
  X(qmv1_b2_xbf16_sbf16, Qmv1Args, 9) \
  X(qmv1_b2_xbf16_sbf16_r1, Qmv1Args, 9) \
  X(qmm_b2_xbf16_sbf16, QmmArgs, 5) \
  X(embedding_b2_xbf16_sbf16, EmbeddingArgs, 5) \
  X(qmv_b2_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmv1_b2_xbf16_sbf16_yf32, Qmv1Args, 9) \
  X(qmv1_b2_xbf16_sbf16_yf32_r1, Qmv1Args, 9) \
  X(qmm_b2_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmv_b3_xf32_sbf16, QmmArgs, 5) \
  X(qmv1_b3_xf32_sbf16, Qmv1Args, 9) \
  X(qmv1_b3_xf32_sbf16_r1, Qmv1Args, 9) \
  X(qmm_b3_xf32_sbf16, QmmArgs, 5) \
  X(embedding_b3_xf32_sbf16, EmbeddingArgs, 5) \
  X(qmv_b3_xbf16_sbf16, QmmArgs, 5) \
  X(qmv1_b3_xbf16_sbf16, Qmv1Args, 9) \
  X(qmv1_b3_xbf16_sbf16_r1, Qmv1Args, 9) \
  X(qmm_b3_xbf16_sbf16, QmmArgs, 5) \
  X(embedding_b3_xbf16_sbf16, EmbeddingArgs, 5) \
  X(qmv_b3_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmv1_b3_xbf16_sbf16_yf32, Qmv1Args, 9) \
  X(qmv1_b3_xbf16_sbf16_yf32_r1, Qmv1Args, 9) \
  X(qmm_b3_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmv_b5_xf32_sbf16, QmmArgs, 5) \
  X(qmv1_b5_xf32_sbf16, Qmv1Args, 9) \
  X(qmv1_b5_xf32_sbf16_r1, Qmv1Args, 9) \
  X(qmm_b5_xf32_sbf16, QmmArgs, 5) \
  X(embedding_b5_xf32_sbf16, EmbeddingArgs, 5) \
  X(qmv_b5_xbf16_sbf16, QmmArgs, 5) \
  X(qmv1_b5_xbf16_sbf16, Qmv1Args, 9) \
  X(qmv1_b5_xbf16_sbf16_r1, Qmv1Args, 9) \
  X(qmm_b5_xbf16_sbf16, QmmArgs, 5) \
  X(embedding_b5_xbf16_sbf16, EmbeddingArgs, 5) \
  X(qmv_b5_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmv1_b5_xbf16_sbf16_yf32, Qmv1Args, 9) \
  X(qmv1_b5_xbf16_sbf16_yf32_r1, Qmv1Args, 9) \
  X(qmm_b5_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmv_b6_xf32_sbf16, QmmArgs, 5) \
  X(qmv1_b6_xf32_sbf16, Qmv1Args, 9) \
  X(qmv1_b6_xf32_sbf16_r1, Qmv1Args, 9) \
  X(qmm_b6_xf32_sbf16, QmmArgs, 5) \
  X(embedding_b6_xf32_sbf16, EmbeddingArgs, 5) \
  X(qmv_b6_xbf16_sbf16, QmmArgs, 5) \
  X(qmv1_b6_xbf16_sbf16, Qmv1Args, 9) \
  X(qmv1_b6_xbf16_sbf16_r1, Qmv1Args, 9) \
  X(qmm_b6_xbf16_sbf16, QmmArgs, 5) \
  X(embedding_b6_xbf16_sbf16, EmbeddingArgs, 5) \
  X(qmv_b6_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(qmv1_b6_xbf16_sbf16_yf32, Qmv1Args, 9) \
  X(qmv1_b6_xbf16_sbf16_yf32_r1, Qmv1Args, 9) \
  X(qmm_b6_xbf16_sbf16_yf32, QmmArgs, 5) \
  X(moe_gate_up_mv_b2_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b2_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b2_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b2_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b2_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b2_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b2_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b2_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b2_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b2_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b2_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b2_sbf16, MoeArgs, 10) \
  X(moe_down_few_b2_sbf16, MoeArgs, 10) \
  X(moe_gate_up_mv_b3_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b3_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b3_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b3_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b3_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b3_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b3_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b3_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b3_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b3_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b3_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b3_sbf16, MoeArgs, 10) \
  X(moe_down_few_b3_sbf16, MoeArgs, 10) \
  X(moe_gate_up_mv_b5_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b5_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b5_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b5_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b5_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b5_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b5_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b5_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b5_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b5_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b5_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b5_sbf16, MoeArgs, 10) \
  X(moe_down_few_b5_sbf16, MoeArgs, 10) \
  X(moe_gate_up_mv_b6_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b6_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b6_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b6_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b6_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b6_sbf16, MoeArgs, 10) \
  X(moe_down_few_b6_sbf16, MoeArgs, 10) \
  X(moe_gate_up_mv_b8_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b8_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b8_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b8_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b8_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b8_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b8_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b8_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b8_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b8_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b8_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b8_sbf16, MoeArgs, 10) \
  X(moe_down_few_b8_sbf16, MoeArgs, 10) \
  /* The MoE kernels of mixed checkpoints: routed experts at b bits, the shared expert at s   */ \
  /* (moe_decode.metal, moe_prefill.metal; width_kernel(family, b, s)) */ \
  X(moe_gate_up_mv_b2s6_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b2s6_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b2s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b2s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b2s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b2s6_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b2s6_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b2s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b2s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b2s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b2s6_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b2s6_sbf16, MoeArgs, 10) \
  X(moe_down_few_b2s6_sbf16, MoeArgs, 10) \
  X(moe_gate_up_mv_b3s6_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b3s6_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b3s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b3s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b3s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b3s6_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b3s6_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b3s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b3s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b3s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b3s6_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b3s6_sbf16, MoeArgs, 10) \
  X(moe_down_few_b3s6_sbf16, MoeArgs, 10) \
  X(moe_gate_up_mv_b4s6_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b4s6_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b4s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b4s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b4s6_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b4s6_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b4s6_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b4s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b4s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b4s6_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b4s6_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b4s6_sbf16, MoeArgs, 10) \
  X(moe_down_few_b4s6_sbf16, MoeArgs, 10) \
  X(moe_gate_up_mv_b4s8_xf32_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b4s8_xf32_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b4s8_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b4s8_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b4s8_xf32_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mv_b4s8_xbf16_sbf16, MoeArgs, 17) \
  X(moe_down_mv_b4s8_xbf16_sbf16, MoeArgs, 11) \
  X(moe_gate_up_mm32_b4s8_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_mm64_b4s8_xbf16_sbf16, MoeArgs, 15) \
  X(moe_gate_up_few_b4s8_xbf16_sbf16, MoeArgs, 15) \
  X(moe_down_mm32_b4s8_sbf16, MoeArgs, 10) \
  X(moe_down_mm64_b4s8_sbf16, MoeArgs, 10) \
  X(moe_down_few_b4s8_sbf16, MoeArgs, 10)
// clang-format on

namespace lily::gpu {

enum class KernelId : uint16_t {
#define LILY_KERNEL_ENUM(id, args, buffers) id,
  LILY_KERNEL_LIST(LILY_KERNEL_ENUM)
#undef LILY_KERNEL_ENUM
};

struct KernelInfo {
  KernelId id;
  std::string_view name;   // [[host_name]] of the kernel
  std::string_view args;   // name of its args struct
  size_t args_size;        // sizeof(args struct)
  uint32_t num_buffers;    // device buffers at indices 1..num_buffers
};

inline constexpr KernelInfo kKernelTable[] = {
#define LILY_KERNEL_INFO(id, args, buffers) \
  {KernelId::id, #id, #args, sizeof(::lily::args), buffers},
    LILY_KERNEL_LIST(LILY_KERNEL_INFO)
#undef LILY_KERNEL_INFO
};

inline constexpr size_t kNumKernels = sizeof(kKernelTable) / sizeof(kKernelTable[0]);

constexpr const KernelInfo& kernel_info(KernelId id) {
  return kKernelTable[static_cast<size_t>(id)];
}

std::optional<KernelId> find_kernel(std::string_view name);

// Kernels built at several weight widths under one name pattern: `<head>_b<bits><tail>`
// (e.g. qmv1_b3_xbf16_sbf16_r1); the MoE expert kernels of a mixed checkpoint, whose shared
// expert has its own width, `<head>_b<bits>s<shared_bits><tail>` (moe_gate_up_mv_b3s6_xbf16_sbf16;
// shared_bits 0 or == bits: the uniform kernel). width_kernel looks each up once (a table filled
// on first use) and throws std::invalid_argument naming the kernel and the widths it is built for
// when there is none (2..8).
enum class WidthFamily : uint8_t {
  qmv_xf32, qmv_xbf16, qmv_xbf16_yf32,
  qmv1_xf32, qmv1_xbf16, qmv1_xbf16_yf32, qmv1_xf32_r1, qmv1_xbf16_r1, qmv1_xbf16_yf32_r1,
  qmm_xf32, qmm_xbf16, qmm_xbf16_yf32,
  embedding_xf32, embedding_xbf16,
  moe_gate_up_mv_xf32, moe_gate_up_mv_xbf16, moe_down_mv_xf32, moe_down_mv_xbf16,
  moe_gate_up_mm32_xf32, moe_gate_up_mm32_xbf16, moe_gate_up_mm64_xf32, moe_gate_up_mm64_xbf16,
  moe_gate_up_few_xf32, moe_gate_up_few_xbf16, moe_down_mm32, moe_down_mm64, moe_down_few,
  count
};
KernelId width_kernel(WidthFamily family, uint32_t bits, uint32_t shared_bits = 0);
bool width_kernel_built(WidthFamily family, uint32_t bits, uint32_t shared_bits = 0);

// Kernels built from shaders/m5/ (Metal 4 tensor ops, lily_m5.metallib): a device has their
// pipelines only when its DeviceInfo::tensor_ops is true; loops over kKernelTable skip them
// elsewhere.
constexpr bool kernel_needs_tensor_ops(KernelId id) {
  return id == KernelId::qmm_m5_b4_xf32_sf32 || id == KernelId::qmm_m5_b4_xf32_sbf16 ||
         id == KernelId::qmm_m5_b4_xbf16_sf32 || id == KernelId::qmm_m5_b4_xbf16_sbf16 ||
         id == KernelId::qmm_m5_b4_xbf16_sf32_yf32 || id == KernelId::qmm_m5_b4_xbf16_sbf16_yf32 ||
         id == KernelId::moe_gate_up_m5_64_b4_xf32_sbf16 || id == KernelId::moe_gate_up_m5_32_b4_xf32_sbf16 ||
         id == KernelId::moe_gate_up_m5_64_b4_xbf16_sbf16 || id == KernelId::moe_gate_up_m5_32_b4_xbf16_sbf16 ||
         id == KernelId::moe_down_m5_64_b4_sbf16 || id == KernelId::moe_down_m5_32_b4_sbf16 ||
         id == KernelId::moe_gate_up_m5i8_64_b4_xbf16_sbf16 || id == KernelId::moe_down_m5i8_64_b4_sbf16 ||
         id == KernelId::qmm_m5_b8_xf32_sf32 || id == KernelId::qmm_m5_b8_xf32_sbf16 ||
         id == KernelId::qmm_m5_b8_xbf16_sf32 || id == KernelId::qmm_m5_b8_xbf16_sbf16 ||
         id == KernelId::qmm_m5i8_b4_xbf16_sf32 || id == KernelId::qmm_m5i8_b4_xbf16_sbf16 ||
         id == KernelId::quantize_i8_xbf16 || id == KernelId::quantize_i8_xf32 ||
         id == KernelId::attn_prefill_m5_d64_f32 || id == KernelId::attn_prefill_m5_d64_bf16 ||
         id == KernelId::attn_prefill_m5_d128_f32 || id == KernelId::attn_prefill_m5_d128_bf16 ||
         id == KernelId::attn_prefill_m5_d256_f32 || id == KernelId::attn_prefill_m5_d256_bf16 ||
         id == KernelId::attn_prefill_m5_q8_d64_f32 || id == KernelId::attn_prefill_m5_q8_d128_f32 ||
         id == KernelId::attn_prefill_m5_q8_d256_f32 ||
         id == KernelId::attn_prefill_m5i8_q8_d64_bf16 || id == KernelId::attn_prefill_m5i8_q8_d128_bf16 ||
         id == KernelId::attn_prefill_m5i8_q8_d256_bf16 || id == KernelId::gd_chunk_wy_m5_f32 || id == KernelId::gd_chunk_state_m5_f32;
}

}  // namespace lily::gpu
