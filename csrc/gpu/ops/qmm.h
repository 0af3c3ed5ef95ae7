// Quantized matmul y = x @ dequant(w)^T (MLX affine layout), routed by the number of rows M.
// Kernels: shaders/qmm.metal. Route and tile constants: shaders/common/args.h.
#pragma once
#include <cstdint>
#include <vector>

#include "gpu/dtype.h"
#include "gpu/encoder.h"

namespace lily::gpu::ops {

enum class QmmRoute : uint8_t {
  qmv1, // M == 1: single-token matrix-vector (optionally with an RMSNorm fused in front)
  qmv,  // 2 <= M <= kQmvMaxRows: matrix-vector, every weight byte read once for all M rows
  qmm,  // M >  kQmvMaxRows: 32x32 output tiles, weights dequantized per tile into threadgroup memory
  qmm_m5,  // M > kQmvMaxRows on a device with Metal 4 tensor ops (qmm_m5_allowed): 64x64 tiles, matmul2d
  qmm_bf16,  // M >= kQmmBf16MinRows otherwise (M1-M4 prefill): 64x64 bf16 simdgroup tiles
};

// tensor_ops: the encoder's device runs the M5 kernels (Encoder::tensor_ops()). bf16_tiles: the
// operands may be rounded to bf16 - x is bf16 (or the caller allows rounding fp32 x), x's rows and
// the w binding start on 16-byte boundaries (qmm_bf16 loads 16 bytes at a time) and the caller
// did not ask for fp32 operands (qmm_bf16_allowed); else qmm.
// Widths other than 4 and 8 (2, 3, 5, 6) take qmm's fp32 tiles for M > kQmvMaxRows: the bf16 and
// tensor-op tiles are built for 4 and 8 bits only.
QmmRoute qmm_route(uint32_t M, uint32_t bits = 4, bool tensor_ops = false, bool bf16_tiles = true);
// log2 of a group size (32, 64, 128: a power of two), the kernels' group_shift (no division).
constexpr uint32_t qmm_group_shift(uint32_t group_size) {
  uint32_t shift = 0;
  while ((1u << shift) < group_size) ++shift;
  return shift;
}
// Whether the kernels take this weight width (2, 3, 4, 5, 6, 8: MLX's affine widths; not 7).
constexpr bool qmm_width_supported(uint32_t bits) { return bits >= 2 && bits <= 8 && bits != 7; }
// Codes per lane of one qmv1 / MoE-matvec block (common/quant.h Qmv1Codes::V): one 16-byte load
// at 4 and 8 bits, 32 codes (`bits` words) at the other widths.
constexpr uint32_t qmv1_lane_codes(uint32_t bits) { return bits == 4 || bits == 8 ? 128 / bits : 32; }
// Simdgroups per threadgroup of the qmv1 route (they split K): min(kQmv1MaxSplits, ceil(K / block)),
// or 1 where ceil(N / 8) >= kQmv1OneSplitGroups (N > 40,952: lm_head).
uint32_t qmv1_splits(uint32_t N, uint32_t K, uint32_t bits);
// Rows per threadgroup of the qmv1 route: kQmv1Rows (8) when ceil(N / 8) * qmv1_splits(N, K, bits)
// >= kQmv1MinSimdgroups (1024: 25.6 simdgroups per core on a 40-core GPU), else 1 (the *_r1
// kernels: up to 8x the threadgroups; each re-reads x (+ residual, norm_w) and recomputes the
// norm's sum of squares). Real config: every projection keeps 8 (out_proj / o_proj, 2048 x 4096:
// 256 x 4 = 1024 simdgroups) except the 8-bit router + shared gate (N = 257, K = 2048: 33 x 4 =
// 132 simdgroups at 8 rows, 257 x 4 = 1028 at 1 row) and lm_head: where K is not split
// (qmv1_splits) at 4 and 8 bits, kQmv1WideRows (16, the *_r16 kernels: 15,520 threadgroups).
uint32_t qmv1_rows(uint32_t N, uint32_t K, uint32_t bits);
// Simdgroups per threadgroup of the qmv route (K split in blocks of 32 lanes x kQmvLaneCodes):
// min(kQmv1MaxSplits, ceil(K / 256)), 1 where ceil(N / 8) >= kQmv1OneSplitGroups (as qmv1).
uint32_t qmv_splits(uint32_t N, uint32_t K);
const char* qmm_route_name(QmmRoute r);

// FLOPs (2 per multiply-add) of y = x @ w^T: useful 2 M N K; executed includes the tile padding
// of the route (encode_quantized_matmul adds both to the encoder's counters).
struct QmmFlops {
  uint64_t executed = 0, useful = 0;
};
QmmFlops qmm_flops(uint32_t M, uint32_t N, uint32_t K, uint32_t bits = 4, bool tensor_ops = false,
                   bool bf16_tiles = true);

// One row block of a weight whose blocks differ in quantization: a projection fused at load from
// parts that a mixed-bit checkpoint quantized differently (QmmOperands::blocks).
struct QmmBlock {
  Binding w, scales, biases;  // this block's rows, MLX affine layout
  DType scale_dtype = DType::f32;
  uint32_t bits = 4, group_size = 64;
  uint32_t rows = 0;          // output features (columns of y) of this block
};

struct QmmOperands {
  Binding x;        // [M, x_stride] of x_dtype
  Binding w;        // uint32 [N, K * bits / 32]
  Binding scales;   // [N, K / group_size] of scale_dtype
  Binding biases;   // [N, K / group_size] of scale_dtype
  Binding y;        // [M, y_stride] of x_dtype (float32 with y_f32)
  DType x_dtype = DType::f32;
  bool y_f32 = false;  // y in float32 whatever x_dtype (lm_head: fp32 logits from bf16 activations;
                       // qmv1 / qmv / qmm / qmm_m5 routes; qmm_bf16 has none: such y takes qmm)
  DType scale_dtype = DType::f32;
  uint32_t M = 0, N = 0, K = 0;
  uint32_t bits = 4, group_size = 64;
  uint32_t x_stride = 0, y_stride = 0;  // 0 means packed (K, N)
  // Keep fp32 operands (qmm, never qmm_bf16): the MoE router, whose logits choose the experts
  // (a bf16-rounded operand moves near-tied logits, so the chosen experts would differ from the
  // fp32 reference's; the router is ~1.5% of a prefill chunk's projection FLOPs). On a tensor-ops
  // device bf16 x still takes qmm_m5 (half weights; see qmm_m5_allowed), fp32 x keeps qmm.
  bool fp32_operands = false;
  // The int8 activation scratch (qmm_i8_scratch_bytes(M, K) bytes, 16-byte aligned). Bound on a
  // tensor_int8 device: where int8 is allowed (qmm_int8_allowed) x is quantized into it
  // (quantize_i8, then a barrier) and qmm_m5i8 reads the codes. Unbound: no int8.
  Binding x_i8;
  // fp32 x may take qmm_bf16 (x rounded to bf16 at the tile load). Off by default: the fp32
  // engine's precision policy keeps fp32 operands (docs/kernels-matmul.md, qmm_bf16); bf16 x always may.
  bool f32_x_bf16_tiles = false;
  // RMSNorm fused in front (qmv1 route only, M == 1): y = w . (rmsnorm(h) * norm_weight) with
  // h = x (+ residual); optionally h and the normalized row are also written (h_out, xn_out).
  Binding norm_weight;  // float32 [K]; unbound: no norm
  Binding residual;     // [K] of x_dtype; unbound: h = x
  Binding h_out, xn_out;  // [K] of x_dtype; both bound or both unbound
  float eps = 1e-6f;
  // qmv1: what the h_out / xn_out slots bind when those are unbound (never read or written there);
  // unbound: x. A block of a split projection binds its own y (qmm_block): blocks side by side
  // then share no writable binding (the plan check counts every `device` binding as written).
  Binding unused_out;
  // Optional: the weight as row blocks of different quantization (their rows add up to N); w,
  // scales, biases, scale_dtype, bits and group_size are then ignored. encode_quantized_matmul
  // encodes one product per block into y's columns [first row of the block, + rows), each on the
  // route its own bits choose: side by side for M == 1 (the blocks' y ranges are disjoint; only
  // the first writes h_out / xn_out, every block normalizes x itself), with a barrier between
  // blocks for M > 1 (their y ranges interleave by row: the hazard check binds whole ranges).
  // x_i8 is used with one block only (the blocks would share the scratch).
  std::vector<QmmBlock> blocks;
};

// The operands of block `i` of op.blocks as a plain product (x, the y columns of the block).
QmmOperands qmm_block(const QmmOperands& op, size_t i);

// The kernel a route uses for these bits / dtypes; throws std::invalid_argument when unsupported.
// rows: the qmv1 route's rows per threadgroup (qmv1_rows(N, K, bits); 8, 1 or 16), ignored by the others.
// int8: the qmm_m5 route takes qmm_m5i8 (int8 activations) where it has it: bf16 x, 4-bit weights,
// bf16 y (Encoder::tensor_int8(); qmm_int8_allowed).
KernelId qmm_kernel(QmmRoute route, uint32_t bits, DType x_dtype, DType scale_dtype, bool y_f32 = false,
                    uint32_t rows = kQmv1Rows, bool int8 = false);

// Whether these operands may take int8 activations on the qmm_m5 route (with a tensor_int8 device):
// x_i8 bound; bf16 x, 4-bit weights with group_size % 64 == 0 (one weight group per K step of
// qmm_m5i8), K % 64 == 0, bf16 y; not fp32_operands (the router: the logits choose the experts).
bool qmm_int8_allowed(const QmmOperands& op);
// Whether encode_quantized_matmul takes the int8 route (quantize_i8 + qmm_m5i8) for these operands
// on `route` with this encoder: qmm_m5, a tensor_int8 device, qmm_int8_allowed.
bool qmm_takes_int8(const Encoder& enc, const QmmOperands& op, QmmRoute route);
// Bytes of the int8 activation scratch of `rows` rows of K values (layout: common/args.h, QuantI8Args).
uint64_t qmm_i8_scratch_bytes(uint32_t rows, uint32_t K);
// Encodes quantize_i8: x[rows, K] (x_stride apart; bf16, or fp32: the MoE's h) into `out`
// (qmm_i8_scratch_bytes(rows, K)). No barrier: the caller orders it before the consumers of `out`.
void encode_quantize_i8(Encoder& enc, const Binding& x, uint32_t rows, uint32_t K, uint32_t x_stride,
                        const Binding& out, DType x_dtype = DType::bf16);

// Whether a tensor-ops device may take qmm_m5 for these operands (qmm_route's tensor_ops is
// enc.tensor_ops() && this): not for bf16 x with fp32 y (no such variant), nor for fp32 x with
// fp32_operands (the router of the fp32 engine: qmm_m5 would round x to half). The router with bf16
// x takes it: x is exact in half, the 8-bit weights are rounded to half (<= 2^-11 relative).
bool qmm_m5_allowed(const QmmOperands& op);

// qmm_route's bf16_tiles for these operands: x bf16 (or f32_x_bf16_tiles), !fp32_operands, x's
// rows and the w binding on 16-byte boundaries.
bool qmm_bf16_allowed(const QmmOperands& op);

// Throws std::invalid_argument naming the bad operand (shape, size, group, bits).
void validate(const QmmOperands& op);

// Encodes one dispatch (no barrier: the caller orders it against its producers/consumers); on the
// int8 route two, quantize_i8 and qmm_m5i8, with a barrier between them.
void encode_quantized_matmul(Encoder& enc, const QmmOperands& op);

// A DeltaNet layer's out_proj at one token with its gated RMSNorm folded in front (qmv1_gated,
// shaders/qmm.metal): y = dequant(w) @ x with x_j = round(o_j * rsqrt(|o_h|^2 / Dv + eps) *
// norm_weight[j % Dv] * silu(z_j)), h = j / Dv: gd_chunk_norm's row (up to the order of the |o_h|^2
// sum), without its level.
struct Qmv1GatedOperands {
  QmmOperands mm;       // the product (M = 1): w, scales, biases, y [N], N, K = Hv * Dv, bits,
                        // group_size, x_dtype (the activations': z and y); its x is not read (o is)
  Binding o;            // float32 [K]: the delta rule's raw output (gated_delta_decode's o_raw)
  Binding z;            // [K] of mm.x_dtype: the gate
  Binding norm_weight;  // float32 [Dv]
  uint32_t Dv = 0;
  float eps = 1e-6f;
};
// Whether qmv1_gated is built for this shape: 4 or 8 bits; Dv a power of two that is a multiple of
// a lane's codes (qmv1_lane_codes) and at most 32 of them (a head on 1..32 lanes of a block);
// K a multiple of Dv; the rows rule (qmv1_rows) giving 8 or 1 rows. The group size and the
// bindings' 16-byte alignment are qmv1_gated_allowed's.
bool qmv1_gated_supported(uint32_t N, uint32_t K, uint32_t Dv, uint32_t bits);
// Whether these operands take qmv1_gated: qmv1_gated_supported and o, z, norm_weight bound on
// 16-byte boundaries (its 16-byte loads). Otherwise the caller runs the norm as its own level.
bool qmv1_gated_allowed(const Qmv1GatedOperands& op);
KernelId qmv1_gated_kernel(uint32_t bits, DType x_dtype, DType scale_dtype, uint32_t rows);
// One dispatch, no barrier (the caller orders it after o's writer). Throws std::invalid_argument
// on operands qmv1_gated_allowed refuses or bindings too small.
void encode_qmv1_gated(Encoder& enc, const Qmv1GatedOperands& op);

}  // namespace lily::gpu::ops
