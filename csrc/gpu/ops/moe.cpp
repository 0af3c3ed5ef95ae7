#include "gpu/ops/moe.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>

#include "gpu/ops/qmm.h"

namespace lily::gpu::ops {

namespace {

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument("moe: " + m); }

// The exact byte range a kernel reads or writes; fails when the caller's binding is smaller.
// `what` + `part` names the operand (the message is built only on failure).
Binding range(const Binding& b, uint64_t bytes, const char* what, const char* part = "") {
  if (b.buffer == nullptr) fail(std::string(what) + part + " not bound");
  if (b.bytes < bytes)
    fail(std::string(what) + part + " range has " + std::to_string(b.bytes) + " bytes, needs " + std::to_string(bytes));
  Binding r = b;
  r.bytes = bytes;
  return r;
}

struct QuantBytes {
  uint64_t w, s;
};

// Bytes of a quantized [count, N, K] stack.
QuantBytes quant_bytes(uint64_t count, uint64_t N, uint64_t K, uint32_t bits, uint32_t gs, DType st) {
  return {count * N * K * bits / 8, count * N * (K / gs) * dtype_size(st)};
}

// `used` of the stack's `count` matrices are read (the routed experts; all of them by default).
void bind_quant(Encoder& enc, uint32_t first, const QuantMatrix& m, QuantBytes b, const char* what,
                uint64_t used = 0, uint64_t count = 1) {
  enc.set_buffer(first, range(m.w, b.w, what, ".w"));
  enc.set_buffer(first + 1, range(m.scales, b.s, what, ".scales"));
  enc.set_buffer(first + 2, range(m.biases, b.s, what, ".biases"));
  if (used != 0 && used < count) {
    enc.set_touched(first, b.w / count * used);
    enc.set_touched(first + 1, b.s / count * used);
    enc.set_touched(first + 2, b.s / count * used);
  }
}

uint32_t down_bits(const MoeOperands& op) { return op.down_bits ? op.down_bits : op.bits; }
uint32_t down_group(const MoeOperands& op) { return op.down_group_size ? op.down_group_size : op.group_size; }
uint32_t shared_bits(const MoeOperands& op) { return op.shared_bits ? op.shared_bits : op.bits; }
uint32_t shared_down_bits(const MoeOperands& op) { return op.shared_down_bits ? op.shared_down_bits : down_bits(op); }
// The shared expert at its own width in either stage: the fp32 tiles only (see moe.h).
bool mixed_widths(const MoeOperands& op) { return shared_bits(op) != op.bits || shared_down_bits(op) != down_bits(op); }

// The down stage's args: its own group size (mixed-bit checkpoints).
MoeArgs down_args(MoeArgs a, const MoeOperands& op) {
  a.group_size = down_group(op);
  a.group_shift = qmm_group_shift(a.group_size);
  return a;
}

MoeArgs make_args(const MoeOperands& op, MoeRoute route, bool tensor_ops) {
  const uint32_t bm = moe_tile_rows(route);
  const uint32_t few = moe_few_rows(tensor_ops);
  const MoeTileBounds tb = bm ? moe_tile_bounds(op.tokens, op.top_k, op.experts, few) : MoeTileBounds{};
  MoeArgs a{};
  a.tokens = op.tokens;
  a.hidden = op.hidden;
  a.experts = op.experts;
  a.top_k = op.top_k;
  a.inter = op.inter;
  a.shared_inter = op.shared_inter;
  a.h_stride = std::max(op.inter, op.shared_inter);
  a.group_size = op.group_size;
  a.tile_rows = bm;
  a.max_tiles = tb.total();
  a.has_residual = op.residual.buffer != nullptr ? 1u : 0u;
  a.max_tiles32 = tb.t32;
  a.max_few = tb.few;
  a.group_shift = qmm_group_shift(op.group_size);  // 32, 64 or 128 (validated)
  a.few_rows = few;
  a.mv_rows = moe_gate_up_rows(op.tokens);
  a.mv_routed = route == MoeRoute::mv && moe_mv_route_level(op.tokens) ? 1u : 0u;
  return a;
}

}  // namespace

MoeRoute moe_route(uint32_t tokens, uint32_t /*top_k*/) {
  return tokens <= kMoeMvMaxTokens ? MoeRoute::mv : MoeRoute::tiled;
}

uint32_t moe_gate_up_rows(uint32_t tokens) { return tokens == 1 ? kMoeGateUpRowsOne : kMoeGateUpRows; }

MoeMvShape moe_mv_shape(uint32_t H, uint32_t top_k, uint32_t I, uint32_t Is, uint32_t bits, uint32_t shared_bits) {
  const uint32_t V = qmv1_lane_codes(bits);  // codes per lane and row (Qmv1Codes::V)
  const uint32_t Vs = qmv1_lane_codes(shared_bits ? shared_bits : bits);
  MoeMvShape s;
  s.gate_up_splits = std::max(
      1u, std::min<uint32_t>({kMoeGateUpMaxSplits, ceil_div(H, 32 * V), kMoeGateUpMaxSimds / (top_k + 1)}));
  s.down_splits = std::max(1u, std::min<uint32_t>(kMoeDownMaxSplits, ceil_div(top_k * (I / V) + Is / Vs, 32)));
  return s;
}

bool moe_shared_width_built(uint32_t bits, uint32_t shared_bits) {
  for (WidthFamily f : {WidthFamily::moe_gate_up_mv_xf32, WidthFamily::moe_gate_up_mv_xbf16, WidthFamily::moe_down_mv_xf32,
                        WidthFamily::moe_down_mv_xbf16, WidthFamily::moe_gate_up_mm32_xf32,
                        WidthFamily::moe_gate_up_mm32_xbf16, WidthFamily::moe_gate_up_mm64_xf32,
                        WidthFamily::moe_gate_up_mm64_xbf16, WidthFamily::moe_gate_up_few_xf32,
                        WidthFamily::moe_gate_up_few_xbf16, WidthFamily::moe_down_mm32, WidthFamily::moe_down_mm64,
                        WidthFamily::moe_down_few})
    if (!width_kernel_built(f, bits, shared_bits)) return false;
  return true;
}

std::vector<std::pair<uint32_t, uint32_t>> moe_shared_widths() {
  std::vector<std::pair<uint32_t, uint32_t>> v;
  for (uint32_t b = 2; b <= 8; ++b)
    for (uint32_t s = 2; s <= 8; ++s)
      if (s != b && moe_shared_width_built(b, s)) v.emplace_back(b, s);
  return v;
}

std::string moe_shared_widths_text() {
  std::string t;
  for (auto [b, s] : moe_shared_widths()) t += (t.empty() ? "" : ", ") + std::to_string(b) + "/" + std::to_string(s);
  return t;
}

bool moe_mv_route_level(uint32_t tokens) { return tokens >= kMoeMvRouteMinTokens; }

const char* moe_route_name(MoeRoute r) { return r == MoeRoute::mv ? "mv" : "tiled"; }

uint32_t moe_tile_rows(MoeRoute r) { return r == MoeRoute::mv ? 0 : 64; }

static_assert(kMoeFewMaxRowsM5 <= kMoeFewMaxRows && kMoeFewMaxRowsM5 < kMoeTile16MaxRows &&
                  kMoeFewMaxRows <= 2 * kMoeFewBlockRows && kMoeFewMaxRows < kMoeTile32MaxRows,
              "the few-row kernels run a tile in <= 2 register blocks; the 32-row kind takes the rest");
static_assert(kMoeGateUpRowsOne <= kMoeGateUpRows, "moe_gate_up_mv: registers for kMoeGateUpRows rows");
static_assert(kMoeGateUpMaxSimds >= kMoeMaxTopK + 1 && kMoeGateUpRows * (kMoeMaxTopK + 1) <= 32 * kMoeGateUpMaxSimds,
              "moe_gate_up_mv: every slot of a token gets a simdgroup, and a thread per (slot, row) stores h");
uint32_t moe_few_rows(bool tensor_ops) { return tensor_ops ? kMoeFewMaxRowsM5 : kMoeFewMaxRows; }

MoeTileBounds moe_tile_bounds(uint32_t tokens, uint32_t top_k, uint32_t experts, uint32_t few_rows) {
  const uint64_t G = uint64_t(experts) + 1, R = uint64_t(tokens) * (top_k + 1);
  MoeTileBounds b;
  b.few = uint32_t(std::min(G, R));
  b.t32 = uint32_t(std::min(G, R / (few_rows + 1)));
  b.t64 = uint32_t((R + 31 * std::min(G, R / (kMoeTile32MaxRows + 1))) / 64);
  return b;
}

MoeFlops moe_expert_flops(uint32_t tokens, uint32_t top_k, uint32_t experts, uint32_t H, uint32_t I, uint32_t Is,
                          bool tensor_ops) {
  // Per row: gate and up (2 x N x H multiply-adds) and down (H x N): 3 H N, 2 FLOPs each.
  const uint64_t T = tokens, useful = 6ull * H * (T * top_k * I + T * Is);
  const MoeRoute route = moe_route(tokens, top_k);
  const uint64_t useful_gu = 4ull * H * (T * top_k * I + T * Is), useful_dn = useful - useful_gu;
  if (route == MoeRoute::mv)  // one matvec per (token, slot): no padding
    return {useful, useful, useful_gu, useful_gu, useful_dn, useful_dn};
  const uint64_t bn = kMoeTileN;
  auto pad = [bn](uint64_t n) { return (n + bn - 1) / bn * bn; };
  // Every live row costs its group's products over whole 32-wide column tiles; on top, the
  // padding rows of the 16-, 32- and 64-row tiles (bound: see moe_expert_flops in moe.h) at the
  // larger of the two expert widths.
  auto per_row = [&](uint64_t N) { return 2 * (2 * pad(N) * H + pad(H) * N); };
  const uint64_t G = uint64_t(experts) + 1, R = T * (top_k + 1);
  // a remainder of r rows pads at most 31 (r >= 33 in a 64-row tile: 31 r / 33), and in a 32-row
  // tile at most 15 r / 17 (M1-M4: r >= 17) or in a 16-row tile 13 r / 3 (M5: r >= 3)
  const uint64_t pad_rows = std::min(31 * G, tensor_ops ? 13 * R / 3 : 31 * R / 33);
  auto gu_row = [&](uint64_t N) { return 4 * pad(N) * H; };  // per_row's gate + up part
  const uint64_t executed = T * top_k * per_row(I) + T * per_row(Is) + pad_rows * per_row(std::max(I, Is));
  const uint64_t executed_gu = T * top_k * gu_row(I) + T * gu_row(Is) + pad_rows * gu_row(std::max(I, Is));
  return {executed, useful, executed_gu, useful_gu, executed - executed_gu, useful_dn};
}

uint64_t moe_expert_flops_from_tiles(uint32_t tokens, uint32_t top_k, uint32_t H, uint32_t I, uint32_t Is,
                                     const uint32_t st[kMoeTileStats], bool tensor_ops) {
  const uint64_t bn = kMoeTileN;
  auto pad = [bn](uint64_t n) { return (n + bn - 1) / bn * bn; };
  auto tile_row = [&](uint64_t N) { return 2 * (2 * pad(N) * H + pad(H) * N); };  // mm tiles: whole column tiles
  auto few_row = [&](uint64_t N) { return 6 * N * H; };                            // matvec: no padding
  // The shared group (every token, T rows) is cut by the same rule; the rest of each list is routed.
  // M5: the 32-row list's tiles of <= kMoeTile16MaxRows rows (st[4]) run 16 rows.
  const uint32_t few = moe_few_rows(tensor_ops), rem = tokens % 64;
  const uint64_t s64 = tokens / 64 + (rem > kMoeTile32MaxRows), s32 = rem > few && rem <= kMoeTile32MaxRows;
  const uint64_t s16 = tensor_ops && s32 && rem <= kMoeTile16MaxRows;
  const uint64_t sfew_rows = rem <= few ? rem : 0;
  const uint64_t n16 = tensor_ops ? st[4] : 0;  // 16-row tiles (shared one included)
  (void)top_k;
  return 64 * ((st[0] - s64) * tile_row(I) + s64 * tile_row(Is)) +
         32 * ((st[1] - n16 - (s32 - s16)) * tile_row(I) + (s32 - s16) * tile_row(Is)) +
         16 * ((n16 - s16) * tile_row(I) + s16 * tile_row(Is)) + (st[3] - sfew_rows) * few_row(I) +
         sfew_rows * few_row(Is);
}

MoeScratchBytes moe_scratch_bytes(const MoeOperands& op) {
  const MoeRoute route = moe_route(op.tokens, op.top_k);
  const uint64_t T = op.tokens, k = op.top_k, R = T * (k + 1);
  MoeScratchBytes b;
  b.logits = T * (op.experts + 1) * dtype_size(op.x_dtype);
  b.ids = T * k * 4;
  b.weights = R * 4;
  b.h = R * std::max(op.inter, op.shared_inter) * 4;
  b.x_i8 = qmm_i8_scratch_bytes(op.tokens, op.hidden);
  b.h_i8 = qmm_i8_scratch_bytes(uint32_t(R), std::max(op.inter, op.shared_inter));
  if (route != MoeRoute::mv) {
    // the bound over both paths' few-row thresholds (the M5 one, smaller, makes more 32-row tiles)
    const uint64_t tiles = moe_tile_bounds(op.tokens, op.top_k, op.experts, kMoeFewMaxRowsM5).total();
    b.plan = (kMoePlanTiles + 3 * tiles + 2 * R) * 4;
    b.row_weight = R * 4;
    b.y = R * op.hidden * 4;
    b.tile_stats = kMoeTileStats * 4;
  }
  return b;
}

void validate(const MoeOperands& op) {
  auto num = [](uint64_t v) { return std::to_string(v); };
  if (op.tokens == 0 || op.hidden == 0 || op.experts == 0 || op.inter == 0 || op.shared_inter == 0)
    fail("empty shape T=" + num(op.tokens) + " H=" + num(op.hidden) + " E=" + num(op.experts) +
         " I=" + num(op.inter) + " Is=" + num(op.shared_inter));
  if (op.experts > kMoeMaxExperts) fail("experts=" + num(op.experts) + " exceeds " + num(kMoeMaxExperts));
  if (op.top_k == 0 || op.top_k > op.experts || op.top_k > kMoeMaxTopK)
    fail("top_k=" + num(op.top_k) + " must be in [1, min(experts, " + num(kMoeMaxTopK) + ")]");
  const uint32_t dbits = down_bits(op), dgs = down_group(op);
  for (uint32_t b : {op.bits, dbits})
    if (!qmm_width_supported(b)) fail("expert bits=" + num(b) + " unsupported (2, 3, 4, 5, 6 or 8)");
  for (auto [b, s, what] : {std::tuple{op.bits, shared_bits(op), "gate/up"}, {dbits, shared_down_bits(op), "down"}})
    if (s != b && !moe_shared_width_built(b, s))
      fail(std::string("the ") + what + " stage's routed experts are " + num(b) + "-bit and its shared expert " +
           num(s) + "-bit: the shared expert at its own width is built for routed/shared bits " +
           moe_shared_widths_text());
  if (op.scale_dtype != DType::bf16) fail("expert scales/biases must be bfloat16");
  for (uint32_t gs : {op.group_size, dgs})
    if (gs != 32 && gs != 64 && gs != 128) fail("group_size=" + num(gs) + " unsupported (32, 64 or 128)");
  for (auto [v, gs, what] : {std::tuple{op.hidden, op.group_size, "hidden"}, {op.inter, dgs, "inter"},
                             {op.shared_inter, dgs, "shared_inter"}})
    if (v % gs) fail(std::string(what) + "=" + num(v) + " is not a multiple of group_size=" + num(gs));
  if (uint64_t(op.tokens) * (op.top_k + 1) * std::max(op.hidden, std::max(op.inter, op.shared_inter)) >= (1ull << 32))
    fail("tokens * (top_k + 1) * features exceeds 32-bit indexing: split the chunk");
  const MoeScratchBytes sb = moe_scratch_bytes(op);
  const uint64_t act = uint64_t(op.tokens) * op.hidden * dtype_size(op.x_dtype);
  range(op.x, act, "x");
  range(op.out, act, "out");
  if (op.residual.buffer) range(op.residual, act, "residual");
  range(op.scratch.logits, sb.logits, "scratch.logits");
  range(op.scratch.ids, sb.ids, "scratch.ids");
  range(op.scratch.weights, sb.weights, "scratch.weights");
  range(op.scratch.h, sb.h, "scratch.h");
  if (sb.plan) {
    range(op.scratch.plan, sb.plan, "scratch.plan");
    range(op.scratch.row_weight, sb.row_weight, "scratch.row_weight");
    range(op.scratch.y, sb.y, "scratch.y");
    range(op.scratch.tile_stats, sb.tile_stats, "scratch.tile_stats");
  }
  const uint32_t E = op.experts, H = op.hidden, I = op.inter, Is = op.shared_inter;
  auto check = [&](const QuantMatrix& m, QuantBytes b, const char* what) {
    range(m.w, b.w, what, ".w");
    range(m.scales, b.s, what, ".scales");
    range(m.biases, b.s, what, ".biases");
  };
  const auto q = [&](uint64_t c, uint64_t N, uint64_t K) {
    return quant_bytes(c, N, K, op.bits, op.group_size, op.scale_dtype);
  };
  const auto qd = [&](uint64_t c, uint64_t N, uint64_t K) {
    return quant_bytes(c, N, K, dbits, dgs, op.scale_dtype);
  };
  check(op.gate, q(E, I, H), "gate");
  check(op.up, q(E, I, H), "up");
  check(op.down, qd(E, H, I), "down");
  check(op.shared_gate, quant_bytes(1, Is, H, shared_bits(op), op.group_size, op.scale_dtype), "shared_gate");
  check(op.shared_up, quant_bytes(1, Is, H, shared_bits(op), op.group_size, op.scale_dtype), "shared_up");
  check(op.shared_down, quant_bytes(1, H, Is, shared_down_bits(op), dgs, op.scale_dtype), "shared_down");
  // The router goes through quantized_matmul, which validates bits / group size / bytes itself.
}

bool moe_bf16_tiles_allowed(const MoeOperands& op) {
  if (op.x_dtype != DType::bf16 || op.bits != 4 || down_bits(op) != 4 || mixed_widths(op)) return false;  // 4-bit
  for (const Binding& b : {op.x, op.scratch.h, op.gate.w, op.up.w, op.down.w, op.shared_gate.w, op.shared_up.w,
                           op.shared_down.w})
    if (b.offset % 16 != 0) return false;
  return true;
}

bool moe_int8_allowed(const MoeOperands& op) {
  // bf16 activations (the int8 route is an alternative to half operands for the bf16 engine);
  // one 64-column K step per weight group; h quantized as whole rows of I = Is columns.
  // Not with the folded post norm (the router writes x in the level x's codes are read in; the
  // norm is folded only for one token, which takes the mv route anyway). The scratches: bound,
  // 16-byte aligned (uint4 loads), large enough; else the half tiles, never an error.
  const MoeScratchBytes sb = moe_scratch_bytes(op);
  auto fits = [](const Binding& b, uint64_t bytes) { return b.buffer != nullptr && b.offset % 16 == 0 && b.bytes >= bytes; };
  return op.x_dtype == DType::bf16 && op.bits == 4 && down_bits(op) == 4 && !mixed_widths(op) &&
         op.group_size % kI8StepK == 0 &&
         down_group(op) % kI8StepK == 0 && op.hidden % kI8StepK == 0 &&
         op.inter == op.shared_inter && op.inter % kI8StepK == 0 && op.norm_weight.buffer == nullptr &&
         fits(op.scratch.x_i8, sb.x_i8) && fits(op.scratch.h_i8, sb.h_i8);
}

void encode_moe(Encoder& enc, const MoeOperands& op) {
  validate(op);
  const MoeRoute route = moe_route(op.tokens, op.top_k);
  // M5 plan and tile kernels (see step 4); the tensor-op tiles are 4-bit: other widths take the
  // M1-M4 plan and the fp32 tiles on every device
  const bool m5 = enc.tensor_ops() && op.bits == 4 && down_bits(op) == 4 && !mixed_widths(op);
  const MoeArgs a = make_args(op, route, m5);
  const MoeArgs ad = down_args(a, op);  // the down stage's group size
  const MoeScratchBytes sb = moe_scratch_bytes(op);
  const uint32_t T = op.tokens, H = op.hidden, E = op.experts, k = op.top_k;
  const uint32_t I = op.inter, Is = op.shared_inter;
  const uint64_t act = uint64_t(T) * H * dtype_size(op.x_dtype);
  const bool xb = op.x_dtype == DType::bf16;  // activations (x, logits, residual, out); h and y are fp32
  const auto q = [&](uint64_t c, uint64_t N, uint64_t K) {
    return quant_bytes(c, N, K, op.bits, op.group_size, op.scale_dtype);
  };
  const auto qd = [&](uint64_t c, uint64_t N, uint64_t K) {
    return quant_bytes(c, N, K, down_bits(op), down_group(op), op.scale_dtype);
  };
  const QuantBytes qsh = quant_bytes(1, Is, H, shared_bits(op), op.group_size, op.scale_dtype);  // shared gate, up
  const QuantBytes qshd = quant_bytes(1, H, Is, shared_down_bits(op), down_group(op), op.scale_dtype);
  const uint32_t sb_gu = shared_bits(op), sb_d = shared_down_bits(op);
  const Binding residual = range(op.residual.buffer ? op.residual : op.x, act, "residual");
  const MoeFlops flops = moe_expert_flops(T, k, E, H, I, Is, m5);
  // Experts the gathers read: top_k distinct per token, so exactly k at T = 1; for T > 1 the
  // host does not know the routes and counts min(E, T k), an upper bound.
  const uint64_t used = std::min<uint64_t>(E, uint64_t(T) * k);

  // 1. router + shared-gate logits [T, E + 1] (qmv for T <= 8, else qmm with fp32 operands)
  QmmOperands r;
  r.x = op.x;
  r.w = op.router.w;
  r.scales = op.router.scales;
  r.biases = op.router.biases;
  r.y = op.scratch.logits;
  r.x_dtype = op.x_dtype;
  r.scale_dtype = op.router_scale_dtype;
  r.M = T;
  r.N = E + 1;
  r.K = H;
  r.bits = op.router_bits;
  r.group_size = op.router_group_size;
  r.fp32_operands = true;  // the logits choose the experts: no bf16 operand rounding (qmm, not qmm_bf16)
  r.blocks = op.router_blocks;
  if (op.norm_weight.buffer) {
    if (T != 1) fail("the folded post norm needs tokens == 1");
    if (op.residual.buffer == nullptr) fail("the folded post norm writes h to `residual`: bind it");
    r.x = range(op.norm_x, act, "norm_x");
    r.residual = range(op.norm_residual, act, "norm_residual");
    r.norm_weight = op.norm_weight;
    r.eps = op.norm_eps;
    r.h_out = residual;
    r.xn_out = range(op.x, act, "x");
  }
  encode_quantized_matmul(enc, r);
  // M5 with int8 allowed (Encoder::tensor_int8, the opt-in of docs/int8.md): the 64-row
  // kind takes moe_gate_up_m5i8 / moe_down_m5i8 (int8 x and h on the int8 rows of matmul2d) when
  // moe_int8_allowed; the 32-row and few-row kinds keep theirs. x's codes beside the router.
  const bool i8 = route != MoeRoute::mv && m5 && enc.tensor_int8() && moe_int8_allowed(op);
  if (i8) encode_quantize_i8(enc, op.x, T, H, H, range(op.scratch.x_i8, sb.x_i8, "scratch.x_i8"));
  // logits -> the expert kernels (mv) / route (tiled); folded norm: also h -> down's residual,
  // xn -> the expert kernels; x's codes -> the int8 gate/up tiles
  enc.barrier();

  // Buffers 3..15 of every gate + up kernel (mv and the tiled kinds): the routed and shared
  // gate / up weights, and h.
  auto bind_gate_up = [&] {
    bind_quant(enc, 3, op.gate, q(E, I, H), "gate", used, E);
    bind_quant(enc, 6, op.up, q(E, I, H), "up", used, E);
    bind_quant(enc, 9, op.shared_gate, qsh, "shared_gate");
    bind_quant(enc, 12, op.shared_up, qsh, "shared_up");
    enc.set_buffer(15, range(op.scratch.h, sb.h, "scratch.h"));
  };

  // softmax, top-k, renormalise, shared gate: one simdgroup per token (tiled route; the mv route
  // when a.mv_routed)
  auto encode_route = [&] {
    enc.set_kernel(xb ? KernelId::moe_route_xbf16 : KernelId::moe_route);
    enc.set_args(a);
    enc.set_buffer(1, range(op.scratch.logits, sb.logits, "scratch.logits"));
    enc.set_buffer(2, range(op.scratch.ids, sb.ids, "scratch.ids"));
    enc.set_buffer(3, range(op.scratch.weights, sb.weights, "scratch.weights"));
    enc.dispatch({T, 1, 1}, {32, 1, 1});
    enc.barrier();  // ids, weights -> gate/up (mv) or the plan (tiled)
  };

  if (route == MoeRoute::mv) {
    // The mv kernels read x and h in 16-byte loads (moe_load_act): aligned bindings.
    if (op.x.offset % 16 != 0 || op.scratch.h.offset % 16 != 0)
      throw EncodeError("moe (mv route): x at byte offset " + std::to_string(op.x.offset) + " and scratch.h at " +
                        std::to_string(op.scratch.h.offset) + " must be multiples of 16 (16-byte loads)");
    if (a.mv_routed) encode_route();
    // 2. gate + up + SwiGLU of the selected experts and the shared expert, every slot of a token
    // in one threadgroup. Below kMoeMvRouteMinTokens each threadgroup selects its token's experts
    // from the logits itself and one simdgroup per token writes the routing (ids, weights) for
    // down; from there on the route level above wrote it and gate/up reads the ids
    enc.set_kernel(width_kernel(xb ? WidthFamily::moe_gate_up_mv_xbf16 : WidthFamily::moe_gate_up_mv_xf32, op.bits, sb_gu));
    enc.set_args(a);
    enc.set_buffer(1, range(op.x, act, "x"));
    enc.set_buffer(2, range(op.scratch.logits, sb.logits, "scratch.logits"));
    bind_gate_up();
    enc.set_buffer(16, range(op.scratch.ids, sb.ids, "scratch.ids"));
    enc.set_buffer(17, range(op.scratch.weights, sb.weights, "scratch.weights"));
    if (a.mv_routed) {  // moe_route read the logits and wrote the weights: gate/up reads the ids only
      enc.set_touched(2, 0);
      enc.set_touched(17, 0);
    }
    const MoeMvShape sh = moe_mv_shape(H, k, I, Is, op.bits);
    enc.dispatch({ceil_div(a.h_stride, a.mv_rows), T, 1}, {32 * (k + 1) * sh.gate_up_splits, 1, 1});
    enc.add_flops(flops.gate_up_executed, flops.gate_up_useful);
    enc.barrier();  // h (and, below kMoeMvRouteMinTokens, ids and weights) -> down
    // 3. down projection x routing weights, shared expert x gate, residual add (the routing as
    // gate/up or moe_route wrote it)
    enc.set_kernel(width_kernel(xb ? WidthFamily::moe_down_mv_xbf16 : WidthFamily::moe_down_mv_xf32, down_bits(op), sb_d));
    enc.set_args(ad);
    enc.set_buffer(1, range(op.scratch.ids, sb.ids, "scratch.ids"));
    enc.set_buffer(2, range(op.scratch.weights, sb.weights, "scratch.weights"));
    enc.set_buffer(3, range(op.scratch.h, sb.h, "scratch.h"));
    bind_quant(enc, 4, op.down, qd(E, H, I), "down", used, E);
    bind_quant(enc, 7, op.shared_down, qshd, "shared_down");
    enc.set_buffer(10, residual);
    enc.set_buffer(11, range(op.out, act, "out"));
    const MoeMvShape shd = moe_mv_shape(H, k, I, Is, down_bits(op), sb_d);
    enc.dispatch({ceil_div(H, kMoeMvRows), T, 1}, {32 * shd.down_splits, 1, 1});
    enc.add_flops(flops.down_executed, flops.down_useful);
    return;
  }

  // 2. the route
  encode_route();

  const MoeTileBounds tb = moe_tile_bounds(T, k, E, a.few_rows);
  // 3. plan: counts, offsets, tiles by load, permutation (one threadgroup)
  enc.set_kernel(KernelId::moe_plan);
  enc.set_args(a);
  enc.set_buffer(1, range(op.scratch.ids, sb.ids, "scratch.ids"));
  enc.set_buffer(2, range(op.scratch.weights, sb.weights, "scratch.weights"));
  enc.set_buffer(3, range(op.scratch.plan, sb.plan, "scratch.plan"));
  enc.set_buffer(4, range(op.scratch.row_weight, sb.row_weight, "scratch.row_weight"));
  enc.set_buffer(5, range(op.scratch.tile_stats, sb.tile_stats, "scratch.tile_stats"));
  enc.dispatch({1, 1, 1}, {kMoePlanThreads, 1, 1});
  enc.barrier();  // plan -> grouped gate/up
  // 4. grouped gate + up + SwiGLU (gather fused into the x loads): the 64-row, 32-row and
  //    few-row tiles, one dispatch each. They write disjoint rows of h, but which rows is decided
  //    on the device, so each binds the whole of h (and of y in step 5): the emulator's hazard
  //    check (docs/testing.md) cannot tell the rows apart and counts every writable binding as
  //    read too. A barrier between the kinds keeps the plan provably free of hazards; it costs
  //    two dependency levels per stage on prefill only (the decode route is "mv").
  // M5 (the device reports Metal 4 tensor ops): the 64- and 32-row kinds run shaders/m5/moe_m5.metal
  // (matmul2d; same buffers and grid), the few-row kind keeps its matvec kernels. The plan differs:
  // few-row tiles only up to kMoeFewMaxRowsM5 rows, and the 32-row kernel runs a tile of
  // <= kMoeTile16MaxRows rows as a 16-row matmul2d (docs/kernels-moe.md: the M5 MoE tile kinds).
  // M1-M4 with bf16 activations: the 64- and 32-row kinds take the bf16 simdgroup tiles
  // (moe_gate_up_bf16 / moe_down_bf16: qmm_bf16's design, same plan, grid, tiles and FLOPs) when
  // their 16-byte loads are aligned (x, h and every expert matrix binding; rows are multiples of
  // 16 bytes because H, I and Is are multiples of the group size); fp32 activations keep the
  // fp32 tiles.
  const bool bt = !m5 && moe_bf16_tiles_allowed(op);
  // (i8: the 64-row kind's int8 kernels, above)
  const struct {
    KernelId gate_up, down;
    uint32_t bound, cols;  // tiles in the list; output features per threadgroup
    bool few;
  } kinds[3] = {{i8   ? KernelId::moe_gate_up_m5i8_64_b4_xbf16_sbf16
                : m5 ? (xb ? KernelId::moe_gate_up_m5_64_b4_xbf16_sbf16 : KernelId::moe_gate_up_m5_64_b4_xf32_sbf16)
                : bt ? KernelId::moe_gate_up_bf16_64_b4_xbf16_sbf16
                    : width_kernel(xb ? WidthFamily::moe_gate_up_mm64_xbf16 : WidthFamily::moe_gate_up_mm64_xf32, op.bits, sb_gu),
                 i8   ? KernelId::moe_down_m5i8_64_b4_sbf16
                 : m5 ? KernelId::moe_down_m5_64_b4_sbf16
                 : bt ? KernelId::moe_down_bf16_64_b4_sbf16
                      : width_kernel(WidthFamily::moe_down_mm64, down_bits(op), sb_d),
                 tb.t64, kMoeTileN, false},
                {m5 ? (xb ? KernelId::moe_gate_up_m5_32_b4_xbf16_sbf16 : KernelId::moe_gate_up_m5_32_b4_xf32_sbf16)
                : bt ? KernelId::moe_gate_up_bf16_32_b4_xbf16_sbf16
                    : width_kernel(xb ? WidthFamily::moe_gate_up_mm32_xbf16 : WidthFamily::moe_gate_up_mm32_xf32, op.bits, sb_gu),
                 m5   ? KernelId::moe_down_m5_32_b4_sbf16
                 : bt ? KernelId::moe_down_bf16_32_b4_sbf16
                      : width_kernel(WidthFamily::moe_down_mm32, down_bits(op), sb_d),
                 tb.t32, kMoeTileN, false},
                {width_kernel(xb ? WidthFamily::moe_gate_up_few_xbf16 : WidthFamily::moe_gate_up_few_xf32, op.bits, sb_gu),
                 width_kernel(WidthFamily::moe_down_few, down_bits(op), sb_d), tb.few, kMoeMvRowsPerSimd * kMoeMvSimdsPerGroup, true}};
  // bytes_touched: each tile kind is counted as reading all `used` experts (an upper bound:
  // the kinds split the experts between them on the device).
  for (const auto& kd : kinds) {
    const bool few = kd.few;
    if (&kd != &kinds[0]) enc.barrier();  // h rows of the previous kind (see above)
    enc.set_kernel(kd.gate_up);
    enc.set_args(a);
    if (i8 && &kd == &kinds[0]) enc.set_buffer(1, range(op.scratch.x_i8, sb.x_i8, "scratch.x_i8"));
    else enc.set_buffer(1, range(op.x, act, "x"));
    enc.set_buffer(2, range(op.scratch.plan, sb.plan, "scratch.plan"));
    bind_gate_up();
    enc.dispatch({ceil_div(a.h_stride, kd.cols), std::max(kd.bound, 1u), 1},
                 {32 * (few ? kMoeMvSimdsPerGroup : kMoeTileSimds), 1, 1});
    // Which kind runs which rows is decided on the device: the bound (moe_expert_flops) is
    // attributed to the 64-row kind's dispatches (gate + up here, down below); devices that run
    // know the tiles made (Engine::correct_moe_flops), estimates split it by a routing model.
    if (&kd == &kinds[0]) enc.add_flops(flops.gate_up_executed, flops.gate_up_useful);
  }
  enc.barrier();  // h -> grouped down (int8: h -> its codes -> the int8 down tiles)
  if (i8) {
    const uint32_t hs = std::max(I, Is);
    encode_quantize_i8(enc, op.scratch.h, uint32_t(uint64_t(T) * (k + 1)), hs, hs,
                       range(op.scratch.h_i8, sb.h_i8, "scratch.h_i8"), DType::f32);
    enc.barrier();
  }
  // 5. grouped down projection x routing weight per row, the three tile kinds in turn
  for (const auto& kd : kinds) {
    const bool few = kd.few;
    if (&kd != &kinds[0]) enc.barrier();  // y rows of the previous kind (see step 4)
    enc.set_kernel(kd.down);
    enc.set_args(ad);
    enc.set_buffer(1, range(op.scratch.plan, sb.plan, "scratch.plan"));
    enc.set_buffer(2, range(op.scratch.row_weight, sb.row_weight, "scratch.row_weight"));
    if (i8 && &kd == &kinds[0]) enc.set_buffer(3, range(op.scratch.h_i8, sb.h_i8, "scratch.h_i8"));
    else enc.set_buffer(3, range(op.scratch.h, sb.h, "scratch.h"));
    bind_quant(enc, 4, op.down, qd(E, H, I), "down", used, E);
    bind_quant(enc, 7, op.shared_down, qshd, "shared_down");
    enc.set_buffer(10, range(op.scratch.y, sb.y, "scratch.y"));
    enc.dispatch({ceil_div(H, kd.cols), std::max(kd.bound, 1u), 1},
                 {32 * (few ? kMoeMvSimdsPerGroup : kMoeTileSimds), 1, 1});
    if (&kd == &kinds[0]) enc.add_flops(flops.down_executed, flops.down_useful);
  }
  enc.barrier();  // y -> combine
  // 6. scatter back: sum of each token's k + 1 weighted rows (+ residual)
  enc.set_kernel(xb ? KernelId::moe_combine_xbf16 : KernelId::moe_combine_xf32);
  enc.set_args(a);
  enc.set_buffer(1, range(op.scratch.plan, sb.plan, "scratch.plan"));
  enc.set_buffer(2, range(op.scratch.y, sb.y, "scratch.y"));
  enc.set_buffer(3, residual);
  enc.set_buffer(4, range(op.out, act, "out"));
  enc.dispatch({ceil_div(H, kMoeCombineThreads), T, 1}, {kMoeCombineThreads, 1, 1});
}

void RecordingEncoder::encode_dispatch(const Dispatch& d) {
  kernels.emplace_back(kernel_info(d.kernel).name);
  groups.push_back(d.groups);
  threads.push_back(d.threads);
  forward_dispatch(inner_, d);
}

}  // namespace lily::gpu::ops
