#include "gpu/ops/qmm.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace lily::gpu::ops {

namespace {

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

void need_bytes(const Binding& b, uint64_t bytes, const char* what) {
  if (b.buffer == nullptr) throw std::invalid_argument(std::string("quantized_matmul: ") + what + " not bound");
  if (b.bytes < bytes)
    throw std::invalid_argument(std::string("quantized_matmul: ") + what + " range has " +
                                std::to_string(b.bytes) + " bytes, needs " + std::to_string(bytes));
}

}  // namespace

QmmRoute qmm_route(uint32_t M, uint32_t bits, bool tensor_ops, bool bf16_tiles) {
  if (M == 1) return QmmRoute::qmv1;
  if (M <= kQmvMaxRows) return QmmRoute::qmv;
  if (bits != 4 && bits != 8) return QmmRoute::qmm;  // the bf16 and tensor-op tiles: 4 and 8 bits
  if (tensor_ops) return QmmRoute::qmm_m5;
  return M >= kQmmBf16MinRows && bf16_tiles ? QmmRoute::qmm_bf16 : QmmRoute::qmm;
}

const char* qmm_route_name(QmmRoute r) {
  switch (r) {
    case QmmRoute::qmv1: return "qmv1";
    case QmmRoute::qmv: return "qmv";
    case QmmRoute::qmm: return "qmm";
    case QmmRoute::qmm_m5: return "qmm_m5";
    case QmmRoute::qmm_bf16: return "qmm_bf16";
  }
  return "?";
}

uint32_t qmv1_splits(uint32_t N, uint32_t K, uint32_t bits) {
  if (ceil_div(N, kQmv1Rows) >= kQmv1OneSplitGroups) return 1;  // lm_head: rows give the parallelism
  const uint32_t block = 32 * qmv1_lane_codes(bits);  // codes per simdgroup per step
  return std::min<uint32_t>(kQmv1MaxSplits, (K + block - 1) / block);
}

uint32_t qmv_splits(uint32_t N, uint32_t K) {
  if (ceil_div(N, kQmv1Rows) >= kQmv1OneSplitGroups) return 1;  // lm_head: rows give the parallelism
  return std::min<uint32_t>(kQmv1MaxSplits, ceil_div(K, 32 * kQmvLaneCodes));
}

uint32_t qmv1_rows(uint32_t N, uint32_t K, uint32_t bits) {
  if (ceil_div(N, kQmv1Rows) >= kQmv1OneSplitGroups && (bits == 4 || bits == 8)) return kQmv1WideRows;
  const uint64_t simdgroups = uint64_t(ceil_div(N, kQmv1Rows)) * qmv1_splits(N, K, bits);
  return simdgroups >= kQmv1MinSimdgroups ? kQmv1Rows : 1;
}

namespace {

// A 4-bit or 8-bit qmv1 kernel and its twins of 1 and 16 rows per threadgroup (kernel_ids.h: the
// *_r1 and *_r16 rows).
struct Qmv1Twins {
  KernelId base, r1, r16;
};
#define LILY_QMV1_TWINS(n) {KernelId::n, KernelId::n##_r1, KernelId::n##_r16},
constexpr Qmv1Twins kQmv1Twins[] = {
    LILY_QMV1_TWINS(qmv1_b4_xf32_sf32)
    LILY_QMV1_TWINS(qmv1_b4_xf32_sbf16)
    LILY_QMV1_TWINS(qmv1_b4_xbf16_sf32)
    LILY_QMV1_TWINS(qmv1_b4_xbf16_sbf16)
    LILY_QMV1_TWINS(qmv1_b8_xf32_sf32)
    LILY_QMV1_TWINS(qmv1_b8_xf32_sbf16)
    LILY_QMV1_TWINS(qmv1_b8_xbf16_sf32)
    LILY_QMV1_TWINS(qmv1_b8_xbf16_sbf16)
    LILY_QMV1_TWINS(qmv1_b4_xbf16_sf32_yf32)
    LILY_QMV1_TWINS(qmv1_b4_xbf16_sbf16_yf32)
    LILY_QMV1_TWINS(qmv1_b8_xbf16_sf32_yf32)
    LILY_QMV1_TWINS(qmv1_b8_xbf16_sbf16_yf32)
};
#undef LILY_QMV1_TWINS

// The twin of qmv1 kernel k with `rows` (1 or kQmv1WideRows) rows per threadgroup.
KernelId qmv1_twin(KernelId k, uint32_t rows) {
  for (const Qmv1Twins& t : kQmv1Twins)
    if (t.base == k) return rows == 1 ? t.r1 : t.r16;
  throw std::logic_error("qmv1_twin: not a qmv1 kernel");
}

KernelId qmm_kernel4(QmmRoute route, uint32_t bits, DType x, DType s, bool y_f32, bool int8);

}  // namespace

// 2, 3, 5 and 6 bits: the kernels built with bfloat16 scales (kernel_ids.h, width_kernel).
static KernelId qmm_kernel_width(QmmRoute route, uint32_t bits, DType x, DType s, bool y_f32, bool r1) {
  auto no = [&](const std::string& why) {
    return std::invalid_argument("quantized_matmul: " + std::to_string(bits) + "-bit weights " + why);
  };
  if (s != DType::bf16) throw no("take bfloat16 scales and biases (the kernels at 2, 3, 5 and 6 bits are built for those)");
  const bool xb = x == DType::bf16;
  y_f32 = y_f32 && xb;  // float32 x writes float32 y anyway (as qmm_kernel4)
  using F = WidthFamily;
  switch (route) {
    case QmmRoute::qmv1:
      return width_kernel(y_f32 ? (r1 ? F::qmv1_xbf16_yf32_r1 : F::qmv1_xbf16_yf32)
                                : xb ? (r1 ? F::qmv1_xbf16_r1 : F::qmv1_xbf16) : (r1 ? F::qmv1_xf32_r1 : F::qmv1_xf32), bits);
    case QmmRoute::qmv: return width_kernel(y_f32 ? F::qmv_xbf16_yf32 : xb ? F::qmv_xbf16 : F::qmv_xf32, bits);
    case QmmRoute::qmm: return width_kernel(y_f32 ? F::qmm_xbf16_yf32 : xb ? F::qmm_xbf16 : F::qmm_xf32, bits);
    default: throw no(std::string("have no ") + qmm_route_name(route) + " kernel (4 and 8 bits only)");
  }
}

KernelId qmm_kernel(QmmRoute route, uint32_t bits, DType x, DType s, bool y_f32, uint32_t rows, bool int8) {
  if (route == QmmRoute::qmv1 && rows != kQmv1Rows && rows != 1 && rows != kQmv1WideRows)
    throw std::invalid_argument("quantized_matmul: qmv1 rows per threadgroup must be " + std::to_string(kQmv1Rows) +
                                ", 1 or " + std::to_string(kQmv1WideRows));
  if (bits != 4 && bits != 8) {
    if (route == QmmRoute::qmv1 && rows == kQmv1WideRows)
      throw std::invalid_argument("quantized_matmul: qmv1 takes " + std::to_string(kQmv1WideRows) +
                                  " rows per threadgroup at 4 and 8 bits only");
    if (!qmm_width_supported(bits))
      throw std::invalid_argument("quantized_matmul: bits=" + std::to_string(bits) + " unsupported (2, 3, 4, 5, 6 or 8)");
    return qmm_kernel_width(route, bits, x, s, y_f32, route == QmmRoute::qmv1 && rows == 1);
  }
  const KernelId k = qmm_kernel4(route, bits, x, s, y_f32, int8);
  if (route != QmmRoute::qmv1 || rows == kQmv1Rows) return k;
  return qmv1_twin(k, rows);
}

QmmFlops qmm_flops(uint32_t M, uint32_t N, uint32_t K, uint32_t bits, bool tensor_ops, bool bf16_tiles) {
  const uint64_t useful = 2ull * M * N * K;
  const QmmRoute route = qmm_route(M, bits, tensor_ops, bf16_tiles);
  if (route == QmmRoute::qmv || route == QmmRoute::qmv1) return {useful, useful};  // rows past N are skipped, not padded
  // Every threadgroup multiplies a whole tile over K (zeros or repeated rows past M and N):
  // 32 x 32 (qmm), or 64 x 64 (qmm_m5, qmm_bf16).
  const uint32_t tm = route == QmmRoute::qmm_m5 ? kQmmM5TileM : route == QmmRoute::qmm_bf16 ? kQmmBf16TileM : kQmmTileM;
  const uint32_t tn = route == QmmRoute::qmm_m5 ? kQmmM5TileN : route == QmmRoute::qmm_bf16 ? kQmmBf16TileN : kQmmTileN;
  const uint64_t Mp = uint64_t(ceil_div(M, tm)) * tm, Np = uint64_t(ceil_div(N, tn)) * tn;
  return {2 * Mp * Np * K, useful};
}

namespace {

KernelId qmm_kernel4(QmmRoute route, uint32_t bits, DType x, DType s, bool y_f32, bool int8) {
  // Index into the kernel list order: route, bits, x dtype, scale dtype (see kernel_ids.h).
  if (bits != 4 && bits != 8)
    throw std::invalid_argument("quantized_matmul: bits=" + std::to_string(bits) + " unsupported (4 or 8)");
  const bool xb = x == DType::bf16, sb = s == DType::bf16;
  if (xb && y_f32) {  // bf16 x, fp32 y: kernel_ids.h's *_yf32 rows
    using K = KernelId;
    if (route == QmmRoute::qmm_m5) {
      if (bits != 4) throw std::invalid_argument("quantized_matmul: the qmm_m5 route takes 4-bit weights only");
      return sb ? K::qmm_m5_b4_xbf16_sbf16_yf32 : K::qmm_m5_b4_xbf16_sf32_yf32;
    }
    if (route == QmmRoute::qmv1)
      return bits == 4 ? (sb ? K::qmv1_b4_xbf16_sbf16_yf32 : K::qmv1_b4_xbf16_sf32_yf32)
                       : (sb ? K::qmv1_b8_xbf16_sbf16_yf32 : K::qmv1_b8_xbf16_sf32_yf32);
    if (route == QmmRoute::qmv)
      return bits == 4 ? (sb ? K::qmv_b4_xbf16_sbf16_yf32 : K::qmv_b4_xbf16_sf32_yf32)
                       : (sb ? K::qmv_b8_xbf16_sbf16_yf32 : K::qmv_b8_xbf16_sf32_yf32);
    return bits == 4 ? (sb ? K::qmm_b4_xbf16_sbf16_yf32 : K::qmm_b4_xbf16_sf32_yf32)
                     : (sb ? K::qmm_b8_xbf16_sbf16_yf32 : K::qmm_b8_xbf16_sf32_yf32);
  }
  if (route == QmmRoute::qmv1) {
    if (bits == 4)
      return xb ? (sb ? KernelId::qmv1_b4_xbf16_sbf16 : KernelId::qmv1_b4_xbf16_sf32)
                : (sb ? KernelId::qmv1_b4_xf32_sbf16 : KernelId::qmv1_b4_xf32_sf32);
    return xb ? (sb ? KernelId::qmv1_b8_xbf16_sbf16 : KernelId::qmv1_b8_xbf16_sf32)
              : (sb ? KernelId::qmv1_b8_xf32_sbf16 : KernelId::qmv1_b8_xf32_sf32);
  }
  if (route == QmmRoute::qmm_m5) {
    if (bits == 4 && xb && int8)
      return sb ? KernelId::qmm_m5i8_b4_xbf16_sbf16 : KernelId::qmm_m5i8_b4_xbf16_sf32;
    if (bits == 4)
      return xb ? (sb ? KernelId::qmm_m5_b4_xbf16_sbf16 : KernelId::qmm_m5_b4_xbf16_sf32)
                : (sb ? KernelId::qmm_m5_b4_xf32_sbf16 : KernelId::qmm_m5_b4_xf32_sf32);
    return xb ? (sb ? KernelId::qmm_m5_b8_xbf16_sbf16 : KernelId::qmm_m5_b8_xbf16_sf32)
              : (sb ? KernelId::qmm_m5_b8_xf32_sbf16 : KernelId::qmm_m5_b8_xf32_sf32);
  }
  if (route == QmmRoute::qmm_bf16) {
    if (bits == 4)
      return xb ? (sb ? KernelId::qmm_bf16_b4_xbf16_sbf16 : KernelId::qmm_bf16_b4_xbf16_sf32)
                : (sb ? KernelId::qmm_bf16_b4_xf32_sbf16 : KernelId::qmm_bf16_b4_xf32_sf32);
    return xb ? (sb ? KernelId::qmm_bf16_b8_xbf16_sbf16 : KernelId::qmm_bf16_b8_xbf16_sf32)
              : (sb ? KernelId::qmm_bf16_b8_xf32_sbf16 : KernelId::qmm_bf16_b8_xf32_sf32);
  }
  if (route == QmmRoute::qmv) {
    if (bits == 4)
      return xb ? (sb ? KernelId::qmv_b4_xbf16_sbf16 : KernelId::qmv_b4_xbf16_sf32)
                : (sb ? KernelId::qmv_b4_xf32_sbf16 : KernelId::qmv_b4_xf32_sf32);
    return xb ? (sb ? KernelId::qmv_b8_xbf16_sbf16 : KernelId::qmv_b8_xbf16_sf32)
              : (sb ? KernelId::qmv_b8_xf32_sbf16 : KernelId::qmv_b8_xf32_sf32);
  }
  if (bits == 4)
    return xb ? (sb ? KernelId::qmm_b4_xbf16_sbf16 : KernelId::qmm_b4_xbf16_sf32)
              : (sb ? KernelId::qmm_b4_xf32_sbf16 : KernelId::qmm_b4_xf32_sf32);
  return xb ? (sb ? KernelId::qmm_b8_xbf16_sbf16 : KernelId::qmm_b8_xbf16_sf32)
            : (sb ? KernelId::qmm_b8_xf32_sbf16 : KernelId::qmm_b8_xf32_sf32);
}

}  // namespace

QmmOperands qmm_block(const QmmOperands& op, size_t i) {
  QmmOperands b = op;
  b.blocks.clear();
  uint32_t first = 0;
  for (size_t j = 0; j < i; ++j) first += op.blocks[j].rows;
  const QmmBlock& blk = op.blocks.at(i);
  b.w = blk.w;
  b.scales = blk.scales;
  b.biases = blk.biases;
  b.scale_dtype = blk.scale_dtype;
  b.bits = blk.bits;
  b.group_size = blk.group_size;
  b.N = blk.rows;
  b.y_stride = op.y_stride ? op.y_stride : op.N;
  const uint64_t col = uint64_t(first) * (op.y_f32 ? 4 : dtype_size(op.x_dtype));
  b.y = Binding{op.y.buffer, op.y.offset + col, op.y.bytes > col ? op.y.bytes - col : 0};
  if (i > 0) b.h_out = b.xn_out = Binding{};  // the first block writes them
  if (op.blocks.size() > 1) {
    b.x_i8 = Binding{};
    b.unused_out = b.y;
  }
  return b;
}

void validate(const QmmOperands& op) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("quantized_matmul: " + m); };
  if (!op.blocks.empty()) {
    uint64_t rows = 0;
    for (const QmmBlock& b : op.blocks) rows += b.rows;
    if (rows != op.N) fail("blocks have " + std::to_string(rows) + " rows, N=" + std::to_string(op.N));
    need_bytes(op.y, ((uint64_t(op.M) - 1) * (op.y_stride ? op.y_stride : op.N) + op.N) * (op.y_f32 ? 4 : dtype_size(op.x_dtype)), "y");
    for (size_t i = 0; i < op.blocks.size(); ++i) {
      try {
        validate(qmm_block(op, i));
      } catch (const std::invalid_argument& e) {
        fail("block " + std::to_string(i) + ": " + e.what());
      }
    }
    return;
  }
  if (!qmm_width_supported(op.bits)) fail("bits=" + std::to_string(op.bits) + " unsupported (2, 3, 4, 5, 6 or 8)");
  if (op.group_size != 32 && op.group_size != 64 && op.group_size != 128)
    fail("group_size=" + std::to_string(op.group_size) + " unsupported (32, 64 or 128)");
  if (op.M == 0 || op.N == 0 || op.K == 0)
    fail("empty shape M=" + std::to_string(op.M) + " N=" + std::to_string(op.N) + " K=" + std::to_string(op.K));
  if (op.K % op.group_size)
    fail("K=" + std::to_string(op.K) + " is not a multiple of group_size=" + std::to_string(op.group_size));
  const uint32_t xs = op.x_stride ? op.x_stride : op.K;
  const uint32_t ys = op.y_stride ? op.y_stride : op.N;
  if (xs < op.K) fail("x_stride " + std::to_string(xs) + " < K " + std::to_string(op.K));
  if (ys < op.N) fail("y_stride " + std::to_string(ys) + " < N " + std::to_string(op.N));
  const uint64_t xe = dtype_size(op.x_dtype), se = dtype_size(op.scale_dtype);
  need_bytes(op.x, ((uint64_t(op.M) - 1) * xs + op.K) * xe, "x");
  need_bytes(op.w, uint64_t(op.N) * op.K * op.bits / 8, "w");
  need_bytes(op.scales, uint64_t(op.N) * (op.K / op.group_size) * se, "scales");
  need_bytes(op.biases, uint64_t(op.N) * (op.K / op.group_size) * se, "biases");
  need_bytes(op.y, ((uint64_t(op.M) - 1) * ys + op.N) * (op.y_f32 ? 4 : xe), "y");
  const bool norm = op.norm_weight.buffer != nullptr;
  if ((op.residual.buffer || op.h_out.buffer || op.xn_out.buffer) && !norm)
    fail("residual / h_out / xn_out need the fused norm (norm_weight)");
  if (norm) {
    if (op.M != 1) fail("the fused RMSNorm needs M == 1 (qmv1 route), got M=" + std::to_string(op.M));
    if (!(op.eps > 0.0f)) fail("eps must be > 0");
    need_bytes(op.norm_weight, uint64_t(op.K) * 4, "norm_weight");
    if (op.residual.buffer) need_bytes(op.residual, uint64_t(op.K) * xe, "residual");
    if ((op.h_out.buffer == nullptr) != (op.xn_out.buffer == nullptr)) fail("h_out and xn_out go together");
    if (op.h_out.buffer) {
      need_bytes(op.h_out, uint64_t(op.K) * xe, "h_out");
      need_bytes(op.xn_out, uint64_t(op.K) * xe, "xn_out");
    }
  }
}

bool qmm_bf16_allowed(const QmmOperands& op) {
  const uint64_t xe = dtype_size(op.x_dtype);
  const uint64_t xs = op.x_stride ? op.x_stride : op.K;
  const bool aligned = op.x.offset % 16 == 0 && (xs * xe) % 16 == 0 && op.w.offset % 16 == 0;
  // no qmm_bf16 variant writes fp32 y (lm_head's logits from bf16 x take qmm's *_yf32)
  return aligned && !op.fp32_operands && !op.y_f32 && (op.x_dtype == DType::bf16 || op.f32_x_bf16_tiles);
}

bool qmm_int8_allowed(const QmmOperands& op) {
  // (K % 64 follows from group_size % 64; kept for the kernel's step count.) The scratch: bound,
  // 16-byte aligned (uint4 loads), large enough; else the half route, never an error.
  return op.x_i8.buffer != nullptr && op.x_i8.offset % 16 == 0 &&
         op.x_i8.bytes >= qmm_i8_scratch_bytes(op.M, op.K) && !op.fp32_operands && op.x_dtype == DType::bf16 &&
         op.bits == 4 && !op.y_f32 && op.group_size % kI8StepK == 0 && op.K % kI8StepK == 0;
}

bool qmm_takes_int8(const Encoder& enc, const QmmOperands& op, QmmRoute route) {
  return route == QmmRoute::qmm_m5 && enc.tensor_int8() && qmm_int8_allowed(op);
}

uint64_t qmm_i8_scratch_bytes(uint32_t rows, uint32_t K) {
  return uint64_t(rows) * K + 2ull * rows * (K / kI8Group) * 4;
}

void encode_quantize_i8(Encoder& enc, const Binding& x, uint32_t rows, uint32_t K, uint32_t x_stride,
                        const Binding& out, DType x_dtype) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("quantize_i8: " + m); };
  if (rows == 0 || K % kI8StepK != 0) fail("K=" + std::to_string(K) + " is not a multiple of 64 (or no rows)");
  if (x_stride < K) fail("x_stride < K");
  const uint64_t need = qmm_i8_scratch_bytes(rows, K);
  if (need > UINT32_MAX) fail(std::to_string(rows) + " x " + std::to_string(K) + " is too large");
  if (out.offset % 16 != 0) fail("the int8 scratch must start on a 16-byte boundary");
  need_bytes(out, need, "x_i8");
  QuantI8Args a{rows, K, x_stride};
  enc.set_kernel(x_dtype == DType::bf16 ? KernelId::quantize_i8_xbf16 : KernelId::quantize_i8_xf32);
  enc.set_args(a);
  Binding xb = x;
  xb.bytes = ((uint64_t(rows) - 1) * x_stride + K) * dtype_size(x_dtype);
  Binding ob = out;
  ob.bytes = need;
  enc.set_buffer(1, xb);
  enc.set_buffer(2, ob);
  const uint32_t threads = rows * (K / kI8Group);
  enc.dispatch({ceil_div(threads, 256u), 1, 1}, {256, 1, 1});
}

bool qmm_m5_allowed(const QmmOperands& op) {
  // The fp32-y variants (bf16 x: lm_head's logits) are 4-bit only.
  if (op.y_f32 && op.x_dtype == DType::bf16 && op.bits != 4) return false;
  // fp32_operands (the router): qmm_m5 rounds x and the weights to half. bf16 x is exact in half
  // (8 significand bits of 11; |x| within half's range), so only the weights are rounded, by
  // <= 2^-11 relative, 8x finer than the bf16 rounding of the logits it writes; fp32 x would be
  // rounded itself and keeps qmm.
  return !(op.fp32_operands && op.x_dtype == DType::f32);
}

void encode_quantized_matmul(Encoder& enc, const QmmOperands& op) {
  if (!op.blocks.empty()) {
    validate(op);
    for (size_t i = 0; i < op.blocks.size(); ++i) {
      if (i > 0 && op.M > 1) enc.barrier();  // y: the blocks' ranges interleave by row (see QmmOperands::blocks)
      encode_quantized_matmul(enc, qmm_block(op, i));
    }
    return;
  }
  validate(op);
  const bool bf16_tiles = qmm_bf16_allowed(op);
  // A bf16-x, fp32-y product (lm_head's logits) takes qmm_m5's *_yf32 variant (4-bit) on such a device.
  const bool tensor_ops = enc.tensor_ops() && qmm_m5_allowed(op);
  const QmmRoute route = qmm_route(op.M, op.bits, tensor_ops, bf16_tiles);
  const uint64_t xe = dtype_size(op.x_dtype), se = dtype_size(op.scale_dtype);
  const uint64_t ye = op.y_f32 ? 4 : xe;
  const uint64_t groups = op.K / op.group_size;
  auto range = [](Binding b, uint64_t bytes) { b.bytes = bytes; return b; };
  if (route == QmmRoute::qmv1) {
    uint32_t flags = 0;
    if (op.norm_weight.buffer) flags |= kQmv1Norm;
    if (op.residual.buffer) flags |= kQmv1Residual;
    if (op.h_out.buffer) flags |= kQmv1Side;
    Qmv1Args a{op.N, op.K, qmm_group_shift(op.group_size), flags, op.eps};
    // qmv1 reads x, residual and norm_w in 16-byte loads (load8): their bindings must be aligned.
    for (const auto& [b, what] : {std::pair{&op.x, "x"}, std::pair{&op.residual, "residual"},
                                  std::pair{&op.norm_weight, "norm_weight"}})
      if (b->buffer && b->offset % 16 != 0)
        throw EncodeError("quantized_matmul (qmv1): " + std::string(what) + " is bound at byte offset " +
                          std::to_string(b->offset) + ", not a multiple of 16 (its 16-byte loads)");
    const uint32_t rows = qmv1_rows(op.N, op.K, op.bits);
    enc.set_kernel(qmm_kernel(route, op.bits, op.x_dtype, op.scale_dtype, op.y_f32, rows));
    enc.set_args(a);
    const Binding x = range(op.x, op.K * xe);
    enc.set_buffer(1, x);
    enc.set_buffer(2, range(op.w, uint64_t(op.N) * op.K * op.bits / 8));
    enc.set_buffer(3, range(op.scales, uint64_t(op.N) * groups * se));
    enc.set_buffer(4, range(op.biases, uint64_t(op.N) * groups * se));
    enc.set_buffer(5, range(op.y, op.N * ye));
    // Unused slots (flag clear) are bound to x, the side outputs' to op.unused_out if bound (never
    // read or written there).
    const Binding unused_out = op.unused_out.buffer ? range(op.unused_out, op.N * ye) : x;
    enc.set_buffer(6, op.residual.buffer ? range(op.residual, op.K * xe) : x);
    enc.set_buffer(7, op.norm_weight.buffer ? range(op.norm_weight, uint64_t(op.K) * 4) : x);
    enc.set_buffer(8, op.h_out.buffer ? range(op.h_out, op.K * xe) : unused_out);
    enc.set_buffer(9, op.xn_out.buffer ? range(op.xn_out, op.K * xe) : unused_out);
    // bytes_touched counts x, residual and norm_w once (as for every kernel: per-threadgroup
    // re-reads are cache hits; docs/kernels-matmul.md qmv1 gives the re-read volume of the 1-row kernels).
    enc.dispatch({ceil_div(op.N, rows), 1, 1}, {32 * qmv1_splits(op.N, op.K, op.bits), 1, 1});
    const QmmFlops f = qmm_flops(1, op.N, op.K, op.bits, tensor_ops);
    enc.add_flops(f.executed, f.useful);
    return;
  }
  QmmArgs args{op.M, op.N, op.K, op.group_size, op.x_stride ? op.x_stride : op.K,
               op.y_stride ? op.y_stride : op.N};
  const bool int8 = qmm_takes_int8(enc, op, route);
  if (int8) {  // x's codes, scales and sums once, read by every threadgroup of qmm_m5i8
    encode_quantize_i8(enc, op.x, op.M, op.K, args.x_stride, op.x_i8);
    enc.barrier();  // x_i8
  }
  if (route == QmmRoute::qmv) {  // 16-byte loads of x (load8): every row's start must be aligned
    const uint64_t stride_bytes = uint64_t(args.x_stride) * xe;
    if (op.x.offset % 16 != 0 || (op.M > 1 && stride_bytes % 16 != 0))
      throw EncodeError("quantized_matmul (qmv): x is bound at byte offset " + std::to_string(op.x.offset) +
                        " with rows " + std::to_string(stride_bytes) + " bytes apart; both must be multiples of 16 "
                        "(its 16-byte loads)");
  }
  enc.set_kernel(qmm_kernel(route, op.bits, op.x_dtype, op.scale_dtype, op.y_f32, kQmv1Rows, int8));
  enc.set_args(args);
  // Bind exactly the bytes the kernel reads, so counters report true weight traffic.
  if (int8) enc.set_buffer(1, range(op.x_i8, qmm_i8_scratch_bytes(op.M, op.K)));
  else enc.set_buffer(1, range(op.x, ((uint64_t(op.M) - 1) * args.x_stride + op.K) * xe));
  enc.set_buffer(2, range(op.w, uint64_t(op.N) * op.K * op.bits / 8));
  enc.set_buffer(3, range(op.scales, uint64_t(op.N) * groups * se));
  enc.set_buffer(4, range(op.biases, uint64_t(op.N) * groups * se));
  enc.set_buffer(5, range(op.y, ((uint64_t(op.M) - 1) * args.y_stride + op.N) * ye));
  const QmmFlops f = qmm_flops(op.M, op.N, op.K, op.bits, tensor_ops, bf16_tiles);
  if (route == QmmRoute::qmv) {
    enc.dispatch({ceil_div(op.N, kQmvRows), 1, 1}, {32 * qmv_splits(op.N, op.K), 1, 1});
  } else if (route == QmmRoute::qmm_bf16) {
    enc.dispatch({ceil_div(op.N, kQmmBf16TileN), ceil_div(op.M, kQmmBf16TileM), 1},
                 {32 * kQmmBf16SimdsPerGroup, 1, 1});
  } else if (route == QmmRoute::qmm_m5) {
    enc.dispatch({ceil_div(op.N, kQmmM5TileN), ceil_div(op.M, kQmmM5TileM), 1},
                 {32 * kQmmM5SimdsPerGroup, 1, 1});
  } else {
    enc.dispatch({ceil_div(op.N, kQmmTileN), ceil_div(op.M, kQmmTileM), 1},
                 {32 * kQmmSimdsPerGroup, 1, 1});
  }
  enc.add_flops(f.executed, f.useful);
}

bool qmv1_gated_supported(uint32_t N, uint32_t K, uint32_t Dv, uint32_t bits) {
  if (bits != 4 && bits != 8) return false;
  const uint32_t V = qmv1_lane_codes(bits);
  const bool pow2 = Dv != 0 && (Dv & (Dv - 1)) == 0;
  if (!pow2 || Dv % V != 0 || Dv / V > 32 || N == 0 || K == 0 || K % Dv != 0) return false;
  const uint32_t rows = qmv1_rows(N, K, bits);
  return rows == kQmv1Rows || rows == 1;
}

bool qmv1_gated_allowed(const Qmv1GatedOperands& op) {
  const QmmOperands& m = op.mm;
  const bool aligned = op.o.offset % 16 == 0 && op.z.offset % 16 == 0 && op.norm_weight.offset % 16 == 0;
  const bool groups = m.group_size == 32 || m.group_size == 64 || m.group_size == 128;
  return qmv1_gated_supported(m.N, m.K, op.Dv, m.bits) && aligned && groups && m.K % m.group_size == 0 &&
         m.blocks.empty();
}

KernelId qmv1_gated_kernel(uint32_t bits, DType x_dtype, DType scale_dtype, uint32_t rows) {
  // kernel_ids.h lists the 16 in this order: rows (8, 1), bits (4, 8), scales (f32, bf16), y (f32, bf16)
  static_assert(uint16_t(KernelId::qmv1_gated_b8_sbf16_ybf16_r1) - uint16_t(KernelId::qmv1_gated_b4_sf32_yf32) == 15,
                "the qmv1_gated rows of kernel_ids.h are consecutive");
  if ((bits != 4 && bits != 8) || (rows != kQmv1Rows && rows != 1))
    throw std::invalid_argument("qmv1_gated: built for 4 and 8 bits at 8 or 1 rows, not " + std::to_string(bits) +
                                " bits at " + std::to_string(rows) + " rows");
  const uint32_t i = (rows == 1 ? 8 : 0) + (bits == 8 ? 4 : 0) + (scale_dtype == DType::bf16 ? 2 : 0) +
                     (x_dtype == DType::bf16 ? 1 : 0);
  return KernelId(uint16_t(KernelId::qmv1_gated_b4_sf32_yf32) + i);
}

void encode_qmv1_gated(Encoder& enc, const Qmv1GatedOperands& op) {
  const QmmOperands& m = op.mm;
  auto fail = [](const std::string& msg) { throw std::invalid_argument("qmv1_gated: " + msg); };
  if (!qmv1_gated_allowed(op))
    fail("not built for N=" + std::to_string(m.N) + " K=" + std::to_string(m.K) + " Dv=" + std::to_string(op.Dv) +
         " at " + std::to_string(m.bits) + " bits, group " + std::to_string(m.group_size) +
         " (or o, z, norm_weight not 16-byte aligned, or the weight in blocks); see qmv1_gated_allowed");
  if (!(op.eps > 0.0f)) fail("eps must be > 0");
  const uint64_t xe = dtype_size(m.x_dtype), se = dtype_size(m.scale_dtype), groups = m.K / m.group_size;
  auto range = [&](Binding b, uint64_t bytes, const char* what) {
    if (b.buffer == nullptr) fail(std::string(what) + " not bound");
    if (b.bytes < bytes)
      fail(std::string(what) + " range has " + std::to_string(b.bytes) + " bytes, needs " + std::to_string(bytes));
    b.bytes = bytes;
    return b;
  };
  const uint32_t rows = qmv1_rows(m.N, m.K, m.bits);
  Qmv1GatedArgs a{m.N, m.K, qmm_group_shift(m.group_size), op.Dv, op.Dv / qmv1_lane_codes(m.bits), op.eps};
  enc.set_kernel(qmv1_gated_kernel(m.bits, m.x_dtype, m.scale_dtype, rows));
  enc.set_args(a);
  enc.set_buffer(1, range(op.o, uint64_t(m.K) * 4, "o"));
  enc.set_buffer(2, range(m.w, uint64_t(m.N) * m.K * m.bits / 8, "w"));
  enc.set_buffer(3, range(m.scales, uint64_t(m.N) * groups * se, "scales"));
  enc.set_buffer(4, range(m.biases, uint64_t(m.N) * groups * se, "biases"));
  enc.set_buffer(5, range(m.y, uint64_t(m.N) * xe, "y"));
  enc.set_buffer(6, range(op.z, uint64_t(m.K) * xe, "z"));
  enc.set_buffer(7, range(op.norm_weight, uint64_t(op.Dv) * 4, "norm_weight"));
  enc.dispatch({ceil_div(m.N, rows), 1, 1}, {32 * qmv1_splits(m.N, m.K, m.bits), 1, 1});
  const QmmFlops f = qmm_flops(1, m.N, m.K, m.bits);
  enc.add_flops(f.executed, f.useful);
}

}  // namespace lily::gpu::ops
