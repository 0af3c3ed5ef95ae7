#include "gpu/ops/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "gpu/ops/qmm.h"

namespace lily::gpu::ops {

namespace {

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// The byte range [offset, offset + bytes) of a binding that must hold at least `bytes`.
Binding need(const char* fn, const Binding& b, uint64_t bytes, const char* what) {
  if (b.buffer == nullptr) throw std::invalid_argument(std::string(fn) + ": " + what + " not bound");
  if (b.bytes < bytes)
    throw std::invalid_argument(std::string(fn) + ": " + what + " range has " + std::to_string(b.bytes) +
                                " bytes, needs " + std::to_string(bytes));
  Binding r = b;
  r.bytes = bytes;
  return r;
}

// Bytes of `rows` rows of `width` elements `stride` apart.
uint64_t rows_bytes(uint32_t rows, uint32_t stride, uint32_t width, DType t) {
  return ((uint64_t(rows) - 1) * stride + width) * dtype_size(t);
}

// Binds `rows` rows of `width` elements `stride` apart (the range from the first row's start to
// the last row's end) and counts as touched only the rows' elements: the proj columns a kernel
// reads (qkv, z, a, b) sit inside wider proj rows, and the bytes between them are never loaded.
// (A narrow read such as a and b, 2 x Hv elements side by side per row, still pulls whole cache
// lines on a GPU; at Hv = 32 in bf16 that is one 128-byte line per row: not counted.)
void bind_rows(Encoder& enc, uint32_t index, const char* fn, const Binding& b, uint32_t rows, uint32_t stride,
               uint32_t width, DType t, const char* what) {
  enc.set_buffer(index, need(fn, b, rows_bytes(rows, stride, width, t), what));
  enc.set_touched(index, uint64_t(rows) * width * dtype_size(t));
}

bool overlap(const Binding& a, const Binding& b) {
  return a.buffer == b.buffer && a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}

}  // namespace

KernelId conv1d_kernel(DType x, DType w) {
  const bool xb = x == DType::bf16, wb = w == DType::bf16;
  return xb ? (wb ? KernelId::conv1d_xbf16_wbf16 : KernelId::conv1d_xbf16_wf32)
            : (wb ? KernelId::conv1d_xf32_wbf16 : KernelId::conv1d_xf32_wf32);
}

KernelId gated_delta_kernel(DType x, DType w) {
  const bool xb = x == DType::bf16, wb = w == DType::bf16;
  return xb ? (wb ? KernelId::gated_delta_xbf16_wbf16 : KernelId::gated_delta_xbf16_wf32)
            : (wb ? KernelId::gated_delta_xf32_wbf16 : KernelId::gated_delta_xf32_wf32);
}

uint32_t gated_delta_threads(uint32_t Dv) { return ceil_div(Dv, kGdColsPerSimd) * 32; }

KernelId gated_delta_decode_kernel(DType x, DType w) {
  const bool xb = x == DType::bf16, wb = w == DType::bf16;
  return xb ? (wb ? KernelId::gated_delta_decode_xbf16_wbf16 : KernelId::gated_delta_decode_xbf16_wf32)
            : (wb ? KernelId::gated_delta_decode_xf32_wbf16 : KernelId::gated_delta_decode_xf32_wf32);
}

uint32_t gated_delta_decode_threads(uint32_t Dv, uint32_t limit) {
  const uint32_t want = ceil_div(Dv, kGdDecodeColsPerSimd) * 32;
  return std::min({uint32_t(kGdDecodeThreads), limit / 32 * 32, want});
}

uint32_t gated_delta_decode_blocks(uint32_t Dv, uint32_t threads) {
  return ceil_div(Dv, threads / 32 * kGdDecodeColsPerSimd);
}

void encode_gated_delta_decode(Encoder& enc, const GdDecodeOperands& op, GdDecodePhase phase) {
  const char* fn = "gated_delta_decode";
  auto fail = [&](const std::string& m) { throw std::invalid_argument(std::string(fn) + ": " + m); };
  if (op.Hk == 0 || op.Hv == 0 || op.Dk == 0 || op.Dv == 0) fail("empty shape");
  if (op.Hv % op.Hk) fail("value heads Hv=" + std::to_string(op.Hv) + " must be a multiple of key heads Hk=" + std::to_string(op.Hk));
  if (op.Dk > kGdMaxDk) fail("key head dim Dk=" + std::to_string(op.Dk) + " > " + std::to_string(kGdMaxDk));
  if (op.Dv > kGdMaxDv) fail("value head dim Dv=" + std::to_string(op.Dv) + " > " + std::to_string(kGdMaxDv));
  if (op.K < 2 || op.K > kConvMaxKernel) fail("kernel size K=" + std::to_string(op.K) + " outside [2, 8]");
  if (!(op.eps > 0.0f)) fail("eps must be > 0");
  const KernelId kernel = gated_delta_decode_kernel(op.x_dtype, op.w_dtype);
  const uint32_t limit = enc.thread_limit(kernel);
  if (limit < 32) fail("the pipeline's limit of " + std::to_string(limit) + " threads is below one simdgroup");
  const uint32_t threads = gated_delta_decode_threads(op.Dv, limit);
  const uint32_t cols = threads / 32 * kGdDecodeColsPerSimd, blocks = gated_delta_decode_blocks(op.Dv, threads);
  const uint32_t C = 2 * op.Hk * op.Dk + op.Hv * op.Dv, VD = op.Hv * op.Dv;
  const DType xt = op.x_dtype, wt = op.w_dtype;
  const size_t xe = dtype_size(xt);
  const uint64_t win = uint64_t(op.K - 1) * C * xe;
  const Binding cin = need(fn, op.conv_in, win, "conv_in"), cout = need(fn, op.conv_out, win, "conv_out");
  if (overlap(cin, cout))
    fail("conv_out must not overlap conv_in (threadgroups read the window of channels another one rewrites)");
  const Binding st = need(fn, op.state, uint64_t(VD) * op.Dk * 4, "state");
  const uint32_t vec4 = op.Dk % 4 == 0 && st.offset % 16 == 0 ? 1 : 0;
  const float q_scale = static_cast<float>(1.0 / std::sqrt(double(op.Dk)));
  GdDecodeArgs args{op.Hk, op.Hv, op.Dk, op.Dv, C, op.K, cols, blocks, vec4, q_scale};
  const Binding o_raw = need(fn, op.o_raw, uint64_t(VD) * 4, "o_raw");
  if (phase != GdDecodePhase::norm) {
    enc.set_kernel(kernel);
    enc.set_args(args);
    enc.set_buffer(1, need(fn, op.x, uint64_t(C) * xe, "x"));
    enc.set_buffer(2, need(fn, op.a, uint64_t(op.Hv) * xe, "a"));
    enc.set_buffer(3, need(fn, op.b, uint64_t(op.Hv) * xe, "b"));
    enc.set_buffer(4, need(fn, op.conv_weight, uint64_t(C) * op.K * dtype_size(wt), "conv_weight"));
    enc.set_buffer(5, cin);
    enc.set_buffer(6, cout);
    enc.set_buffer(7, need(fn, op.A_log, uint64_t(op.Hv) * 4, "A_log"));
    enc.set_buffer(8, need(fn, op.dt_bias, uint64_t(op.Hv) * dtype_size(wt), "dt_bias"));
    enc.set_buffer(9, st);
    enc.set_touched(9, 2 * uint64_t(VD) * op.Dk * 4);  // read and written in place
    enc.set_buffer(10, o_raw);
    enc.dispatch({blocks, op.Hv, 1}, {threads, 1, 1});
    const uint64_t f = gated_delta_useful_flops(1, op.Hv, op.Dk, op.Dv);
    enc.add_flops(f, f);
  }
  if (phase == GdDecodePhase::rule) return;
  // The gated RMSNorm needs every column of a head, which threadgroups of the dispatch above cannot
  // see (MSL 3.1: no device-scope ordering between threadgroups): gd_chunk_norm, one token.
  if (phase == GdDecodePhase::both) enc.barrier();  // o_raw -> gated norm
  GdChunkArgs na{1, 1, op.Hk, op.Hv, op.Dk, op.Dv, 0, 0, VD, q_scale, op.eps, 0};
  enc.set_kernel(gd_chunk_kernels(false, false, xt, wt)[3]);
  enc.set_args(na);
  enc.set_buffer(1, o_raw);
  enc.set_buffer(2, need(fn, op.z, uint64_t(VD) * xe, "z"));
  enc.set_buffer(3, need(fn, op.norm_weight, uint64_t(op.Dv) * dtype_size(wt), "norm_weight"));
  enc.set_buffer(4, need(fn, op.y, uint64_t(VD) * xe, "y"));
  enc.dispatch({1, op.Hv, 1}, {32, 1, 1});
}

void encode_conv1d(Encoder& enc, const Conv1dOperands& op) {
  const char* fn = "conv1d";
  auto fail = [&](const std::string& m) { throw std::invalid_argument(std::string(fn) + ": " + m); };
  if (op.T == 0 || op.C == 0) fail("empty shape");
  if (op.K < 2 || op.K > kConvMaxKernel) fail("kernel size K=" + std::to_string(op.K) + " outside [2, 8]");
  const uint32_t xs = op.x_stride ? op.x_stride : op.C, ys = op.y_stride ? op.y_stride : op.C;
  if (xs < op.C || ys < op.C) fail("row strides must be >= C");
  const uint64_t st = uint64_t(op.K - 1) * op.C * dtype_size(op.x_dtype);
  Conv1dArgs args{op.T, op.C, op.K, xs, ys};
  enc.set_kernel(conv1d_kernel(op.x_dtype, op.w_dtype));
  enc.set_args(args);
  const Binding sin = need(fn, op.state_in, st, "state_in");
  const Binding sout = need(fn, op.state_out, st, "state_out");
  if (op.T > 1 && overlap(sin, sout))
    fail("state_out must not overlap state_in when T > 1 (threads of different tokens read and write it)");
  bind_rows(enc, 1, fn, op.x, op.T, xs, op.C, op.x_dtype, "x");
  enc.set_buffer(2, need(fn, op.weight, uint64_t(op.C) * op.K * dtype_size(op.w_dtype), "weight"));
  enc.set_buffer(3, sin);
  bind_rows(enc, 4, fn, op.y, op.T, ys, op.C, op.x_dtype, "y");
  enc.set_buffer(5, sout);
  enc.dispatch({ceil_div(op.C, kConvThreads), op.T, 1}, {kConvThreads, 1, 1});
}

void encode_gated_delta(Encoder& enc, const GatedDeltaOperands& op) {
  const char* fn = "gated_delta";
  auto fail = [&](const std::string& m) { throw std::invalid_argument(std::string(fn) + ": " + m); };
  if (op.T == 0 || op.Hk == 0 || op.Hv == 0 || op.Dk == 0 || op.Dv == 0) fail("empty shape");
  if (op.Hv % op.Hk) fail("value heads Hv=" + std::to_string(op.Hv) + " must be a multiple of key heads Hk=" + std::to_string(op.Hk));
  if (op.Dk > kGdMaxDk) fail("key head dim Dk=" + std::to_string(op.Dk) + " > " + std::to_string(kGdMaxDk));
  if (op.Dv > kGdMaxDv) fail("value head dim Dv=" + std::to_string(op.Dv) + " > " + std::to_string(kGdMaxDv));
  if (!(op.eps > 0.0f)) fail("eps must be > 0");
  const uint32_t C = 2 * op.Hk * op.Dk + op.Hv * op.Dv, VD = op.Hv * op.Dv;
  const uint32_t qs = op.qkv_stride ? op.qkv_stride : C, zs = op.z_stride ? op.z_stride : VD;
  const uint32_t abs_ = op.ab_stride ? op.ab_stride : op.Hv;
  if (qs < C || zs < VD || abs_ < op.Hv) fail("row strides smaller than the rows");
  const float q_scale = static_cast<float>(1.0 / std::sqrt(double(op.Dk)));
  GatedDeltaArgs args{op.T, op.Hk, op.Hv, op.Dk, op.Dv, qs, zs, abs_, q_scale, op.eps};
  enc.set_kernel(gated_delta_kernel(op.x_dtype, op.w_dtype));
  enc.set_args(args);
  const DType xt = op.x_dtype, wt = op.w_dtype;
  bind_rows(enc, 1, fn, op.qkv, op.T, qs, C, xt, "qkv");
  bind_rows(enc, 2, fn, op.z, op.T, zs, VD, xt, "z");
  bind_rows(enc, 3, fn, op.a, op.T, abs_, op.Hv, xt, "a");
  bind_rows(enc, 4, fn, op.b, op.T, abs_, op.Hv, xt, "b");
  enc.set_buffer(5, need(fn, op.A_log, uint64_t(op.Hv) * 4, "A_log"));
  enc.set_buffer(6, need(fn, op.dt_bias, uint64_t(op.Hv) * dtype_size(wt), "dt_bias"));
  enc.set_buffer(7, need(fn, op.norm_weight, uint64_t(op.Dv) * dtype_size(wt), "norm_weight"));
  enc.set_buffer(8, need(fn, op.state, uint64_t(op.Hv) * op.Dv * op.Dk * 4, "state"));
  enc.set_touched(8, 2 * uint64_t(op.Hv) * op.Dv * op.Dk * 4);  // read and written in place
  enc.set_buffer(9, need(fn, op.y, uint64_t(op.T) * VD * dtype_size(xt), "y"));
  enc.dispatch({op.Hv, 1, 1}, {gated_delta_threads(op.Dv), 1, 1});
  const uint64_t f = gated_delta_useful_flops(op.T, op.Hv, op.Dk, op.Dv);
  enc.add_flops(f, f);  // the scan does exactly the rule's products, token by token
}

uint64_t gated_delta_useful_flops(uint32_t T, uint32_t Hv, uint32_t Dk, uint32_t Dv) {
  return 6ull * T * Hv * Dk * Dv;  // S^T k, k u^T and S^T q per token and value head
}

GdRoute gated_delta_route(uint32_t T, uint32_t Dk, uint32_t Dv) {
  const bool dims = Dk % 8 == 0 && Dv % 8 == 0 && Dk <= 8 * kGdChunkMaxTiles && Dv <= 8 * kGdChunkMaxTiles;
  return T >= kGdChunkMinTokens && dims ? GdRoute::chunked : GdRoute::scan;
}

const char* gated_delta_route_name(GdRoute r) { return r == GdRoute::scan ? "scan" : "chunked"; }

namespace {

// Element offsets of the chunked route's scratch sections (common/args_gated_delta.h).
struct ChunkLayout {
  uint64_t qn, kn, vo, g, beta, wn, u, p, total;
};

ChunkLayout chunk_layout(uint32_t T, uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv) {
  const uint64_t Tp = uint64_t(ceil_div(T, kGdChunk)) * kGdChunk;
  ChunkLayout l{};
  l.qn = 0;
  l.kn = l.qn + Hk * Tp * Dk;
  l.vo = l.kn + Hk * Tp * Dk;
  l.g = l.vo + Hv * Tp * Dv;
  l.beta = l.g + Hv * Tp;
  l.wn = l.beta + Hv * Tp;
  l.u = l.wn + Hv * Tp * Dk;
  l.p = l.u + Hv * Tp * Dv;
  l.total = l.p + Hv * Tp * kGdChunk;
  return l;
}

}  // namespace

uint64_t gated_delta_chunk_scratch_bytes(uint32_t T, uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv) {
  return chunk_layout(T, Hk, Hv, Dk, Dv).total * 4;
}

GdChunkFlops gated_delta_chunk_flops(uint32_t T, uint32_t Hv, uint32_t Dk, uint32_t Dv, bool tensor_ops) {
  constexpr uint64_t tile = 2 * 8 * 8 * 8;        // one 8x8x8 simdgroup multiply-accumulate
  constexpr uint64_t C = kGdChunk, CT = C / 8, lower = CT * (CT + 1) / 2;  // 36 lower-triangle tiles
  const uint64_t nk = Dk / 8, nv = Dv / 8;
  uint64_t subst = 0;  // forward substitution: T[i, c] needs i - c - 1 multiply-adds
  for (uint64_t c = 0; c < C; ++c)
    for (uint64_t i = c + 1; i < C; ++i) subst += 2 * (i - c - 1);
  const uint64_t factors = (nv * lower /* u */ + nk * lower /* wn */) * tile + subst;
  // per 8 value columns: U = u + W S, the tail scaling, e^{G_C} S and S += K^T U (fp32 8x8 products)
  uint64_t feedback = nv * (CT * nk /* U */ + CT /* tail */ + nk + nk * CT /* S */) * tile;
  GdChunkFlops per;  // one (chunk, value head)
  if (tensor_ops) {
    // gd_chunk_wy_m5: two 64 x 64 Gram squares over Dk rounded up to 32. gd_chunk_state_m5, per 32
    // value columns (Dv rounded up), every product a matmul2d with the descriptor's k and m: W S,
    // Q S and P U as 64 x 32 x 128 (k = 128; key dims past Dk and P's columns past 64 read 0), the
    // state update K^T U as 128 x 32 x 64 (key dims past Dk are zero rows).
    const uint64_t dk_steps = ceil_div(Dk, kGdChunkM5StepK) * uint64_t(kGdChunkM5StepK);
    const uint64_t col_blocks = ceil_div(Dv, kGdChunkM5StateCols);
    const uint64_t DK = 8 * kGdChunkMaxTiles, NC = kGdChunkM5StateCols;
    const uint64_t grams = 2 * 2 * C * C * dk_steps;
    const uint64_t state = col_blocks * (3 * 2 * C * NC * DK + 2 * DK * NC * C);
    per.tensor = grams + state;
    per.alu = factors;
    per.wy = grams + factors;
    per.state = state;
    feedback = col_blocks * 2 * (2 * C * NC * DK);  // W S and K^T U
  } else {
    const uint64_t grams = (lower * nk /* K K^T */ + lower * nk /* Q K^T */) * tile;
    const uint64_t out = nv * (CT * nk + CT + lower) * tile;  // O = diag(e^G) Q S + P U
    per.alu = grams + factors + feedback + out;
    per.wy = grams + factors;
    per.state = out + feedback;
  }
  const uint64_t n = uint64_t(ceil_div(T, kGdChunk)) * Hv;
  return GdChunkFlops{n * per.tensor, n * per.alu, n * per.wy, n * per.state, n * feedback};
}

std::array<KernelId, 4> gd_chunk_kernels(bool conv, bool m5, DType x, DType w) {
  const bool xb = x == DType::bf16, wb = w == DType::bf16;
  static constexpr KernelId prep_ids[2][2][2][2] = {  // [conv][m5][xb][wb]
      {{{KernelId::gd_chunk_prep_xf32_wf32, KernelId::gd_chunk_prep_xf32_wbf16},
        {KernelId::gd_chunk_prep_xbf16_wf32, KernelId::gd_chunk_prep_xbf16_wbf16}},
       {{KernelId::gd_chunk_prep_q16_xf32_wf32, KernelId::gd_chunk_prep_q16_xf32_wbf16},
        {KernelId::gd_chunk_prep_q16_xbf16_wf32, KernelId::gd_chunk_prep_q16_xbf16_wbf16}}},
      {{{KernelId::gd_chunk_prep_conv_xf32_wf32, KernelId::gd_chunk_prep_conv_xf32_wbf16},
        {KernelId::gd_chunk_prep_conv_xbf16_wf32, KernelId::gd_chunk_prep_conv_xbf16_wbf16}},
       {{KernelId::gd_chunk_prep_conv_q16_xf32_wf32, KernelId::gd_chunk_prep_conv_q16_xf32_wbf16},
        {KernelId::gd_chunk_prep_conv_q16_xbf16_wf32, KernelId::gd_chunk_prep_conv_q16_xbf16_wbf16}}}};
  const KernelId norm = xb ? (wb ? KernelId::gd_chunk_norm_xbf16_wbf16 : KernelId::gd_chunk_norm_xbf16_wf32)
                           : (wb ? KernelId::gd_chunk_norm_xf32_wbf16 : KernelId::gd_chunk_norm_xf32_wf32);
  return {prep_ids[conv][m5][xb][wb], m5 ? KernelId::gd_chunk_wy_m5_f32 : KernelId::gd_chunk_wy_f32,
          m5 ? KernelId::gd_chunk_state_m5_f32 : KernelId::gd_chunk_state_f32, norm};
}

void encode_gated_delta_chunked(Encoder& enc, const GatedDeltaOperands& op) {
  const char* fn = "gated_delta_chunked";
  auto fail = [&](const std::string& m) { throw std::invalid_argument(std::string(fn) + ": " + m); };
  if (op.T == 0 || op.Hk == 0 || op.Hv == 0 || op.Dk == 0 || op.Dv == 0) fail("empty shape");
  if (op.Hv % op.Hk) fail("value heads Hv=" + std::to_string(op.Hv) + " must be a multiple of key heads Hk=" + std::to_string(op.Hk));
  if (op.Dk % 8 || op.Dv % 8 || op.Dk > 8 * kGdChunkMaxTiles || op.Dv > 8 * kGdChunkMaxTiles)
    fail("head dims Dk=" + std::to_string(op.Dk) + ", Dv=" + std::to_string(op.Dv) + " must be multiples of 8 <= 128");
  if (!(op.eps > 0.0f)) fail("eps must be > 0");
  const uint32_t C = 2 * op.Hk * op.Dk + op.Hv * op.Dv, VD = op.Hv * op.Dv;
  const uint32_t qs = op.qkv_stride ? op.qkv_stride : C, zs = op.z_stride ? op.z_stride : VD;
  const uint32_t abs_ = op.ab_stride ? op.ab_stride : op.Hv;
  if (qs < C || zs < VD || abs_ < op.Hv) fail("row strides smaller than the rows");
  const ChunkLayout l = chunk_layout(op.T, op.Hk, op.Hv, op.Dk, op.Dv);
  const Binding scratch = need(fn, op.chunk_scratch, l.total * 4, "chunk_scratch");
  auto sec = [&](uint64_t begin, uint64_t end) { return Binding{scratch.buffer, scratch.offset + begin * 4, (end - begin) * 4}; };
  const Binding qn = sec(l.qn, l.kn), kn = sec(l.kn, l.vo), vo = sec(l.vo, l.g), g = sec(l.g, l.beta);
  const Binding beta = sec(l.beta, l.wn), wn = sec(l.wn, l.u), u = sec(l.u, l.p), p = sec(l.p, l.total);
  const uint32_t Tp = ceil_div(op.T, kGdChunk) * kGdChunk;
  GdChunkArgs args{op.T, Tp, op.Hk, op.Hv, op.Dk, op.Dv, qs, abs_, zs,
                   static_cast<float>(1.0 / std::sqrt(double(op.Dk))), op.eps, 0};  // conv_k set below
  const DType xt = op.x_dtype, wt = op.w_dtype;
  const bool m5 = enc.tensor_ops();  // q as half, gd_chunk_wy_m5 and gd_chunk_state_m5
  const bool conv = op.conv_weight.buffer != nullptr;
  if (conv) {
    if (op.conv_k < 2 || op.conv_k > kConvMaxKernel)
      fail("conv kernel size K=" + std::to_string(op.conv_k) + " outside [2, " + std::to_string(kConvMaxKernel) + "]");
    args.conv_k = op.conv_k;
  }
  const std::array<KernelId, 4> ks = gd_chunk_kernels(conv, m5, xt, wt);
  enc.set_kernel(ks[0]);
  enc.set_args(args);
  bind_rows(enc, 1, fn, op.qkv, op.T, qs, C, xt, "qkv");
  bind_rows(enc, 2, fn, op.a, op.T, abs_, op.Hv, xt, "a");
  bind_rows(enc, 3, fn, op.b, op.T, abs_, op.Hv, xt, "b");
  enc.set_buffer(4, need(fn, op.A_log, uint64_t(op.Hv) * 4, "A_log"));
  enc.set_buffer(5, need(fn, op.dt_bias, uint64_t(op.Hv) * dtype_size(wt), "dt_bias"));
  // On the M5 route q and P are half: they fill the first half of their (fp32-sized) sections.
  const uint64_t qn_bytes = uint64_t(op.Hk) * Tp * op.Dk * (m5 ? 2 : 4);
  const uint64_t p_bytes = uint64_t(op.Hv) * Tp * kGdChunk * (m5 ? 2 : 4);
  enc.set_buffer(6, qn);
  enc.set_touched(6, qn_bytes);
  enc.set_buffer(7, kn);
  enc.set_buffer(8, vo);
  enc.set_buffer(9, g);
  enc.set_buffer(10, beta);
  if (conv) {
    const uint64_t win = uint64_t(op.conv_k - 1) * C * dtype_size(xt);
    const Binding cin = need(fn, op.conv_state_in, win, "conv_state_in");
    const Binding cout = need(fn, op.conv_state_out, win, "conv_state_out");
    if (overlap(cin, cout))
      fail("conv_state_out must not overlap conv_state_in (threads of other tokens read the window)");
    enc.set_buffer(11, need(fn, op.conv_weight, uint64_t(C) * op.conv_k * dtype_size(wt), "conv_weight"));
    enc.set_buffer(12, cin);
    enc.set_buffer(13, cout);
  }
  enc.dispatch({Tp, op.Hv, 1}, {32, 1, 1});
  enc.barrier();  // qn, kn, vo, g, beta -> wy

  enc.set_kernel(ks[1]);
  enc.set_args(args);
  enc.set_buffer(1, qn);
  enc.set_touched(1, qn_bytes);
  enc.set_buffer(2, kn);
  enc.set_buffer(3, vo);
  enc.set_buffer(4, g);
  enc.set_buffer(5, beta);
  enc.set_buffer(6, wn);
  enc.set_buffer(7, u);
  enc.set_buffer(8, p);
  enc.set_touched(8, p_bytes);
  enc.dispatch({Tp / kGdChunk, op.Hv, 1}, {kGdChunkWyThreads, 1, 1});
  // Executed FLOPs per pass; the rule's useful FLOPs (6 T Hv Dk Dv) go with the state pass.
  const GdChunkFlops parts = gated_delta_chunk_flops(op.T, op.Hv, op.Dk, op.Dv, m5);
  enc.add_flops(parts.wy, 0);
  enc.barrier();  // G, wn, u, p -> state pass

  enc.set_kernel(ks[2]);
  enc.set_args(args);
  enc.set_buffer(1, qn);
  enc.set_touched(1, qn_bytes);
  enc.set_buffer(2, kn);
  enc.set_buffer(3, g);
  enc.set_buffer(4, wn);
  enc.set_buffer(5, u);
  enc.set_buffer(6, p);
  enc.set_touched(6, p_bytes);
  enc.set_buffer(7, need(fn, op.state, uint64_t(op.Hv) * op.Dv * op.Dk * 4, "state"));
  enc.set_touched(7, 2 * uint64_t(op.Hv) * op.Dv * op.Dk * 4);  // read before the first chunk, written after the last
  enc.set_buffer(8, vo);
  if (m5) {
    enc.dispatch({ceil_div(op.Dv, kGdChunkM5StateCols), op.Hv, 1}, {kGdChunkM5StateThreads, 1, 1});
  } else {
    enc.dispatch({op.Dv / kGdChunkStateCols, op.Hv, 1}, {32, 1, 1});
  }
  enc.add_flops(parts.state, gated_delta_useful_flops(op.T, op.Hv, op.Dk, op.Dv));
  enc.barrier();  // o (in vo) -> gated norm

  enc.set_kernel(ks[3]);
  enc.set_args(args);
  enc.set_buffer(1, vo);
  bind_rows(enc, 2, fn, op.z, op.T, zs, VD, xt, "z");
  enc.set_buffer(3, need(fn, op.norm_weight, uint64_t(op.Dv) * dtype_size(wt), "norm_weight"));
  enc.set_buffer(4, need(fn, op.y, uint64_t(op.T) * VD * dtype_size(xt), "y"));
  enc.dispatch({op.T, op.Hv, 1}, {32, 1, 1});
}

uint32_t gated_delta_mixer_proj_rows(uint32_t Hk, uint32_t Hv, uint32_t Dk, uint32_t Dv) {
  return 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv;  // qkv (C) | z (Hv Dv) | b (Hv) | a (Hv)
}

namespace {

// The delta rule's operands inside the mixer: z, b, a are proj's columns after qkv (row stride P).
template <typename At>
GatedDeltaOperands gated_delta_operands(const GatedDeltaMixerOperands& op, At at, uint32_t C, uint32_t VD, uint32_t P) {
  GatedDeltaOperands gd;
  gd.z = at(op.proj, C);
  gd.b = at(op.proj, C + VD);
  gd.a = at(op.proj, C + VD + op.Hv);
  gd.A_log = op.A_log;
  gd.dt_bias = op.dt_bias;
  gd.norm_weight = op.norm_weight;
  gd.state = op.state;
  gd.y = op.o;
  gd.x_dtype = op.x_dtype;
  gd.w_dtype = op.w_dtype;
  gd.T = op.T;
  gd.Hk = op.Hk;
  gd.Hv = op.Hv;
  gd.Dk = op.Dk;
  gd.Dv = op.Dv;
  gd.z_stride = P;
  gd.ab_stride = P;
  gd.eps = op.eps;
  gd.chunk_scratch = op.chunk_scratch;
  return gd;
}

// One of the mixer's projections as a quantized-matmul product: y[M, N] = x[M, K] @ l^T (the
// caller adds blocks, the fused norm and the int8 scratch where they apply).
QmmOperands linear_operands(const QuantLinear& l, Binding x, Binding y, DType x_dtype, uint32_t M, uint32_t N,
                            uint32_t K) {
  QmmOperands m;
  m.x = x;
  m.w = l.w;
  m.scales = l.scales;
  m.biases = l.biases;
  m.y = y;
  m.x_dtype = x_dtype;
  m.scale_dtype = l.scale_dtype;
  m.M = M;
  m.N = N;
  m.K = K;
  m.bits = l.bits;
  m.group_size = l.group_size;
  return m;
}

QmmOperands out_proj_operands(const GatedDeltaMixerOperands& op) {
  QmmOperands out = linear_operands(op.out_proj, op.o, op.out, op.x_dtype, op.T, op.hidden, op.Hv * op.Dv);
  out.x_i8 = op.x_i8;
  return out;
}

}  // namespace

Qmv1GatedOperands gated_delta_mixer_out_proj(const GatedDeltaMixerOperands& op) {
  const uint32_t C = 2 * op.Hk * op.Dk + op.Hv * op.Dv;
  const uint64_t zoff = uint64_t(C) * dtype_size(op.x_dtype);
  Qmv1GatedOperands g;
  g.mm = out_proj_operands(op);
  g.o = op.gd_o_raw;
  g.z = Binding{op.proj.buffer, op.proj.offset + zoff, op.proj.bytes > zoff ? op.proj.bytes - zoff : 0};
  g.norm_weight = op.norm_weight;
  g.Dv = op.Dv;
  g.eps = op.eps;
  return g;
}

namespace {

bool folds_norm(const GatedDeltaMixerOperands& op, const Qmv1GatedOperands& g) {
  return op.T == 1 && op.seqs.empty() && op.gd_o_raw.buffer != nullptr && op.out_proj.blocks.empty() &&
         op.w_dtype == DType::f32 && qmv1_gated_allowed(g);
}

}  // namespace

bool gated_delta_mixer_folds_norm(const GatedDeltaMixerOperands& op) {
  return folds_norm(op, gated_delta_mixer_out_proj(op));
}

void encode_gated_delta_mixer(Encoder& enc, const GatedDeltaMixerOperands& op) {
  const uint32_t C = 2 * op.Hk * op.Dk + op.Hv * op.Dv, VD = op.Hv * op.Dv;
  const uint32_t P = gated_delta_mixer_proj_rows(op.Hk, op.Hv, op.Dk, op.Dv);
  const size_t xe = dtype_size(op.x_dtype);
  auto at = [&](const Binding& b, uint32_t col) {  // binding of proj starting at column `col`
    return Binding{b.buffer, b.offset + size_t(col) * xe, b.bytes - size_t(col) * xe};
  };

  QmmOperands in = linear_operands(op.in_proj, op.x, op.proj, op.x_dtype, op.T, P, op.hidden);
  in.norm_weight = op.in_norm;
  in.eps = op.in_norm_eps;
  in.x_i8 = op.x_i8;
  in.blocks = op.in_proj.blocks;
  validate(in);
  encode_quantized_matmul(enc, in);
  enc.barrier();  // proj written -> read by conv1d / gated_delta_decode / gd_chunk_prep_conv (qkv columns) and the rule (z, b, a)

  // Decode: the conv fused into the rule, heads split by value columns. Token t's row of proj and
  // of o, with sequence state `sq` (batched) or the layer's own (one token).
  auto decode_op = [&](uint32_t t, const GdSequence& sq) {
    // (one token: the whole bindings, as bound before batching: the same bytes_bound)
    const bool one = op.seqs.empty();
    const Binding row = one ? op.proj : Binding{op.proj.buffer, op.proj.offset + uint64_t(t) * P * xe, uint64_t(P) * xe};
    GdDecodeOperands dd;
    dd.x = row;
    dd.z = at(row, C);
    dd.b = at(row, C + VD);
    dd.a = at(row, C + VD + op.Hv);
    dd.conv_weight = op.conv_weight;
    dd.conv_in = sq.conv_state_in;
    dd.conv_out = sq.conv_state_out;
    dd.A_log = op.A_log;
    dd.dt_bias = op.dt_bias;
    dd.norm_weight = op.norm_weight;
    dd.state = sq.state;
    dd.o_raw = sq.o_raw;
    dd.y = one ? op.o : Binding{op.o.buffer, op.o.offset + uint64_t(t) * VD * xe, uint64_t(VD) * xe};
    dd.x_dtype = op.x_dtype;
    dd.w_dtype = op.w_dtype;
    dd.Hk = op.Hk;
    dd.Hv = op.Hv;
    dd.Dk = op.Dk;
    dd.Dv = op.Dv;
    dd.K = op.K;
    dd.eps = op.eps;
    return dd;
  };
  if (!op.seqs.empty()) {  // batched decode: every rule, one barrier, every norm
    if (op.seqs.size() != op.T)
      throw std::invalid_argument("gated_delta_mixer: " + std::to_string(op.seqs.size()) + " sequences for " +
                                  std::to_string(op.T) + " tokens (one token each)");
    for (uint32_t t = 0; t < op.T; ++t) encode_gated_delta_decode(enc, decode_op(t, op.seqs[t]), GdDecodePhase::rule);
    enc.barrier();  // o_raw of every sequence -> its gated norm
    for (uint32_t t = 0; t < op.T; ++t) encode_gated_delta_decode(enc, decode_op(t, op.seqs[t]), GdDecodePhase::norm);
  } else if (op.T == 1) {
    if (op.gd_o_raw.buffer == nullptr)
      throw std::invalid_argument("gated_delta_mixer: one token needs gd_o_raw bound");
    const GdDecodeOperands dd = decode_op(0, GdSequence{op.conv_state_in, op.conv_state_out, op.state, op.gd_o_raw});
    // out_proj reads the raw output and applies the gated norm itself (qmv1_gated) where it is
    // built for the shape: one level fewer. Else the norm is its own level (gd_chunk_norm).
    const Qmv1GatedOperands g = gated_delta_mixer_out_proj(op);
    if (folds_norm(op, g)) {
      encode_gated_delta_decode(enc, dd, GdDecodePhase::rule);
      enc.barrier();  // o_raw -> out_proj with the gated norm
      encode_qmv1_gated(enc, g);
      return;
    }
    encode_gated_delta_decode(enc, dd);
  } else if (op.chunk_scratch.buffer && gated_delta_route(op.T, op.Dk, op.Dv) == GdRoute::chunked) {
    // prefill, chunked: the conv fused into the prep (gd_chunk_prep_conv reads proj's qkv columns)
    GatedDeltaOperands gd = gated_delta_operands(op, at, C, VD, P);
    gd.qkv = op.proj;
    gd.qkv_stride = P;
    gd.conv_weight = op.conv_weight;
    gd.conv_state_in = op.conv_state_in;
    gd.conv_state_out = op.conv_state_out;
    gd.conv_k = op.K;
    encode_gated_delta_chunked(enc, gd);
  } else {
    Conv1dOperands cv;
    cv.x = op.proj;
    cv.weight = op.conv_weight;
    cv.state_in = op.conv_state_in;
    cv.state_out = op.conv_state_out;
    cv.y = op.conv_out;
    cv.x_dtype = op.x_dtype;
    cv.w_dtype = op.w_dtype;
    cv.T = op.T;
    cv.C = C;
    cv.K = op.K;
    cv.x_stride = P;
    encode_conv1d(enc, cv);
    enc.barrier();  // conv_out written -> read by gated_delta

    GatedDeltaOperands gd = gated_delta_operands(op, at, C, VD, P);
    gd.qkv = op.conv_out;
    encode_gated_delta(enc, gd);
  }
  enc.barrier();  // o written -> read by out_proj

  const QmmOperands out = out_proj_operands(op);
  validate(out);
  encode_quantized_matmul(enc, out);
}

}  // namespace lily::gpu::ops
