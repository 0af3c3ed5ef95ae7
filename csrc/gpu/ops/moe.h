// Mixture-of-experts block on the device: router, routing plan, expert matmuls, combine.
// Kernels: shaders/moe_plan.metal, moe_decode.metal, moe_prefill.metal, moe_prefill_bf16.metal
// (+ the router logits through qmm.metal). Args and route constants:
// shaders/common/args_moe.h. Everything is encoded into the caller's encoder with barriers
// between dependent dispatches; no step reads device memory on the host or waits for the GPU:
// every buffer size and grid comes from bounds known on the host (tokens, top_k, experts).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpu/dtype.h"
#include "gpu/encoder.h"
#include "gpu/ops/qmm.h"

namespace lily::gpu::ops {

enum class MoeRoute : uint8_t {
  mv,     // tokens <= kMoeMvMaxTokens: gather matvec per (token, slot), fused down + combine
  tiled,  // grouped matmul with tiles sized by each expert's load on the device: 64-row tiles,
          // and for the remainder a 32-row tile or (<= MoeArgs::few_rows rows) a matvec-style tile
};

MoeRoute moe_route(uint32_t tokens, uint32_t top_k);

// Threadgroup shapes of the decode matvecs (mv route): moe_gate_up_mv runs 32 * (k + 1) *
// gate_up_splits threads (every slot of a token; K = H split over max(1, min(kMoeGateUpMaxSplits,
// ceil(H / B), kMoeGateUpMaxSimds / (k + 1))) simdgroups a slot, B = 32 lanes x 128 / bits codes)
// over moe_gate_up_rows(T) rows of every slot; moe_down_mv runs 32 * down_splits threads (the
// k + 1 slots' concatenated K' = k I + Is, in chunks of 128 / bits codes, over
// min(kMoeDownMaxSplits, ceil(chunks / 32)) simdgroups) over kMoeMvRows output rows.
struct MoeMvShape {
  uint32_t gate_up_splits = 1, down_splits = 1;
};
// Rows of every slot per moe_gate_up_mv threadgroup (MoeArgs::mv_rows): kMoeGateUpRowsOne at one
// token, kMoeGateUpRows otherwise. At one token 4 rows give ceil(512 / 4) = 128 threadgroups of
// the real config: one per SM of an H100 (132), where a threadgroup's selection has no other
// threadgroup's loads to hide behind; 2 rows give 256 (docs/gpu-decode-ab.md: the 40-layer step
// 2,887 -> 2,645 us on an H100). From two tokens on, 4 rows (fewer selections) are faster.
uint32_t moe_gate_up_rows(uint32_t tokens);
// Whether the mv route runs moe_route as a level of its own between the router and
// moe_gate_up_mv (MoeArgs::mv_routed: gate/up then reads the ids and selects nothing): 4
// dispatches and 3 barriers instead of 3 and 2. From kMoeMvRouteMinTokens tokens on: gate/up then
// has more threadgroups than one wave of an H100, and each wave would wait on its own selection
// (about 5 us of serial simdgroup work); below, one selection inside gate/up, hidden behind the
// shared slot's loads, costs less than the level (docs/gpu-decode-ab.md: the 40-layer step at
// B = 1 2,732 -> 2,791 us with the level, at B = 8 10,252 -> 9,670 us).
constexpr uint32_t kMoeMvRouteMinTokens = 3;
bool moe_mv_route_level(uint32_t tokens);
// shared_bits: the shared slot's width in moe_down_mv (its chunks hold Qmv1Codes<shared_bits>::V
// codes); 0: bits.
MoeMvShape moe_mv_shape(uint32_t H, uint32_t top_k, uint32_t I, uint32_t Is, uint32_t bits, uint32_t shared_bits = 0);
// Whether the expert kernels of every route are built for routed experts at `bits` and the shared
// expert at `shared_bits` (equal widths: every width the engine takes).
bool moe_shared_width_built(uint32_t bits, uint32_t shared_bits);
// Every (routed, shared) pair of unequal widths built, ascending; and the same as "2/6, 3/6, ..."
// (for messages).
std::vector<std::pair<uint32_t, uint32_t>> moe_shared_widths();
std::string moe_shared_widths_text();
const char* moe_route_name(MoeRoute r);
uint32_t moe_tile_rows(MoeRoute r);  // the largest tile: 0 for mv, 64 for tiled

// Entries of the three tile lists the tiled grids cover: upper bounds, for any routing, of the
// tiles the plan makes (G = E + 1 groups, R = T (k + 1) rows) with few-row threshold f: few-row
// tiles <= min(G, R), 32-row tiles <= min(G, R / (f + 1)) (a remainder of f + 1..32 rows each),
// 64-row tiles <= (R + 31 min(G, R / 33)) / 64 (a group of c rows takes <= (c + 31) / 64 of
// them, and only if c >= 33).
struct MoeTileBounds {
  uint32_t t64 = 0, t32 = 0, few = 0;
  uint32_t total() const { return t64 + t32 + few; }
};
MoeTileBounds moe_tile_bounds(uint32_t tokens, uint32_t top_k, uint32_t experts, uint32_t few_rows);
// The plan's few-row threshold (MoeArgs::few_rows): kMoeFewMaxRows, or kMoeFewMaxRowsM5 on a
// device with tensor ops (whose 32-row kind runs tiles of <= kMoeTile16MaxRows rows as 16 rows).
uint32_t moe_few_rows(bool tensor_ops);

// FLOPs of the expert matmuls (gate, up, down of the routed and shared experts; the router goes
// through quantized_matmul and counts there). useful: T k rows of the routed experts and T of the
// shared one. executed: the route's tiles; on the tiled route the plan (on the device) decides
// how many run and how much they pad, so this is a bound over every routing (exact on the mv
// route): a group's remainder pads at most 31 rows (33 in a 64-row tile) and at most 31 / 33 of
// its rows (15 / 17 in a 32-row tile; with tensor_ops 13 / 3: 3 in a 16-row tile); few-row tiles
// and full 64-row tiles pad none.
struct MoeFlops {
  uint64_t executed = 0, useful = 0;
  // The same split by stage: gate + up (4 FLOPs per row and weight pair) and down (2).
  uint64_t gate_up_executed = 0, gate_up_useful = 0, down_executed = 0, down_useful = 0;
};
MoeFlops moe_expert_flops(uint32_t tokens, uint32_t top_k, uint32_t experts, uint32_t H, uint32_t I, uint32_t Is,
                          bool tensor_ops);
// The tiled route's executed FLOPs exactly, from the tile_stats the plan wrote (after the step):
// 64- and 32-row tiles run whole (zero rows past the group; with tensor_ops the 32-row list's
// tiles of <= kMoeTile16MaxRows rows run 16), few-row tiles only their rows.
uint64_t moe_expert_flops_from_tiles(uint32_t tokens, uint32_t top_k, uint32_t H, uint32_t I, uint32_t Is,
                                     const uint32_t tile_stats[kMoeTileStats], bool tensor_ops);

// An MLX affine-quantized matrix (or stack of matrices).
struct QuantMatrix {
  Binding w;       // uint32 [..., N, K * bits / 32]
  Binding scales;  // [..., N, K / group_size] of scale_dtype
  Binding biases;
};

// Scratch buffers the block needs (device memory the caller owns; sizes: moe_scratch_bytes).
struct MoeScratch {
  Binding logits;      // float32 [T, E + 1]      router logits (+ shared-expert gate logit)
  Binding ids;         // uint32  [T, k]          chosen experts, descending probability
  Binding weights;     // float32 [T, k + 1]      routing weights (+ sigmoid shared gate)
  Binding plan;        // uint32  (tiled routes)  layout in shaders/common/args_moe.h
  Binding row_weight;  // float32 [R]             (tiled routes) R = T * (k + 1)
  Binding h;           // float32 [R, max(I, Is)] SwiGLU intermediate
  Binding y;           // float32 [R, H]          (tiled routes) weighted expert outputs
  Binding tile_stats;  // uint32  [kMoeTileStats] (tiled route) tiles the plan made: 64-row, 32-row,
                       //                         few-row, rows in few-row tiles, 32-row-list tiles of
                       //                         <= kMoeTile16MaxRows rows (read after the step)
  Binding x_i8;        // int8 scratch of x [T, H] (qmm_i8_scratch_bytes; the int8 64-row tiles only)
  Binding h_i8;        // int8 scratch of h [R, max(I, Is)] (the same)
};

struct MoeScratchBytes {
  size_t logits = 0, ids = 0, weights = 0, plan = 0, row_weight = 0, h = 0, y = 0, tile_stats = 0;
  size_t x_i8 = 0, h_i8 = 0;  // the int8 scratches, for a caller that binds them (tensor_int8 devices)
};

struct MoeOperands {
  Binding x;         // [T, H] of x_dtype
  Binding residual;  // [T, H] of x_dtype; buffer == nullptr: no residual add
  Binding out;       // [T, H] of x_dtype: residual + moe(x)
  QuantMatrix router;  // [E + 1, H] router_bits: rows 0..E-1 the router, row E the shared gate
  QuantMatrix gate, up, down;  // stacked experts [E, I, H], [E, I, H], [E, H, I]
  QuantMatrix shared_gate, shared_up, shared_down;  // [Is, H], [Is, H], [H, Is]
  MoeScratch scratch;
  DType x_dtype = DType::f32;
  DType scale_dtype = DType::bf16;         // expert scales / biases
  DType router_scale_dtype = DType::bf16;  // router scales / biases
  uint32_t tokens = 0, hidden = 0, experts = 0, top_k = 0, inter = 0, shared_inter = 0;
  uint32_t bits = 4, group_size = 64;               // every expert matrix (but see down_bits)
  uint32_t router_bits = 8, router_group_size = 64;
  // Mixed-bit checkpoints: the down stage's quantization (down and shared_down; one kernel reads
  // both), 0: bits / group_size. The gate/up stage (gate, up, shared_gate, shared_up) has one.
  uint32_t down_bits = 0, down_group_size = 0;
  // The shared expert at its own width (a mixed checkpoint whose routed experts are narrower):
  // shared_gate / shared_up at shared_bits, shared_down at shared_down_bits, 0: as the stage's
  // routed experts. Same group sizes as the stage's. Built pairs: moe_shared_width_built.
  uint32_t shared_bits = 0, shared_down_bits = 0;
  // Optional: the router's rows as blocks of different quantization (router | shared gate of a
  // mixed-bit checkpoint; QmmOperands::blocks); router.w and router_bits are then ignored.
  std::vector<QmmBlock> router_blocks;
  // Optional (tokens == 1): the post-mixer norm folded into the router. The router then reads
  // norm_x and norm_residual, normalizes h = norm_x + norm_residual with norm_weight (float32 [H])
  // itself, and its first threadgroup writes h to `residual` and the normalized row to `x` for the
  // expert kernels (one level fewer: no separate rms_norm_residual dispatch).
  Binding norm_weight, norm_x, norm_residual;
  float norm_eps = 1e-6f;
};

MoeScratchBytes moe_scratch_bytes(const MoeOperands& op);

// Throws std::invalid_argument naming the bad operand.
void validate(const MoeOperands& op);

// Encodes the whole block (3 dispatches and 2 barriers on the mv route, 4 and 3 from
// kMoeMvRouteMinTokens tokens on; 10 and 9 on the tiled
// route: the 64-row, 32-row and few-row kernels of one stage run side by side). Never commits, waits or reads device memory.
// The tiled route's 64- and 32-row kinds take the M1-M4 bf16 simdgroup tiles (moe_gate_up_bf16 /
// moe_down_bf16) when this holds and the device has no tensor ops: bf16 activations and 16-byte
// aligned bindings of x, h and every expert matrix's codes.
bool moe_bf16_tiles_allowed(const MoeOperands& op);
// Mixed expert widths (shared_bits / shared_down_bits unlike the routed experts') take the fp32
// tiles on every device: the bf16, tensor-op and int8 tiles are built for uniform 4-bit experts.
// Whether the 64-row tiles may take int8 activations on M5 (with Encoder::tensor_int8;
// moe_gate_up_m5i8 / moe_down_m5i8): bf16 activations, 4-bit experts with a group size that 64
// divides, H and I = Is multiples of 64 (h is quantized as [R, I] rows), scratch.x_i8 and
// scratch.h_i8 bound. encode_moe then adds quantize_i8 of x beside the router and quantize_i8 of h
// (and a barrier) between the gate/up and down kinds: 2 dispatches and 1 barrier more.
bool moe_int8_allowed(const MoeOperands& op);

void encode_moe(Encoder& enc, const MoeOperands& op);

// An encoder that forwards everything to another one and records what a block encoded: the
// kernel of every dispatch, and every commit() / wait() (host synchronisation) it was asked for.
class RecordingEncoder final : public Encoder {
 public:
  explicit RecordingEncoder(Encoder& inner) : inner_(inner) {}
  void commit() override { ++commits; inner_.commit(); }
  void wait() override { ++waits; inner_.wait(); }
  uint32_t thread_limit(KernelId k) const override { return inner_.thread_limit(k); }
  bool tensor_ops() const override { return inner_.tensor_ops(); }
  bool tensor_int8() const override { return inner_.tensor_int8(); }
  std::vector<std::string_view> kernels;  // kernel names (static storage), in dispatch order
  std::vector<Size3> groups, threads;      // grid and threadgroup of every dispatch, same order
  uint64_t commits = 0, waits = 0;

 protected:
  void encode_dispatch(const Dispatch& d) override;
  void encode_barrier() override { inner_.barrier(); }
  void forward_flops(uint64_t executed, uint64_t useful) override { inner_.add_flops(executed, useful); }

 private:
  Encoder& inner_;
};

}  // namespace lily::gpu::ops
