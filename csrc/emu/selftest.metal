// Emulator self-test kernels (compiled into the emulator only, never into the Metal library).
// tests/kernels/test_emulator.py runs them through lily_py._core.emu.dispatch:
//   * feature kernels check the emulated MSL semantics against NumPy (simd collectives, thread
//     positions, threadgroup memory + barriers, atomics, simdgroup_matrix);
//   * "broken_*" kernels contain the bugs a GPU hides; the emulator must raise EmulatorError.
// They follow the shader rules of common/lily_metal.h except where a rule is the bug under test.
#include "common/lily_metal.h"
#include "common/reduce.h"

namespace lily_selftest {

struct SelftestArgs {
  uint32_t n;      // elements / threads that matter
  uint32_t param;  // kernel-specific knob
};

// ------------------------------------------------------------------ features
// out[op * n + i] for thread i; ops listed in tests/kernels/test_emulator.py (SIMD_OPS).
template <typename Dummy>
[[kernel]] void simd_ops(constant SelftestArgs& args [[buffer(0)]],
                         const device float* x [[buffer(1)]],
                         device float* out [[buffer(2)]],
                         LILY_KERNEL_TAIL) {
  const uint32_t i = thread_pos.x;
  const uint32_t n = args.n;
  const float v = x[i];
  out[0 * n + i] = simd_sum(v);
  out[1 * n + i] = simd_max(v);
  out[2 * n + i] = simd_min(v);
  out[3 * n + i] = simd_prefix_inclusive_sum(v);
  out[4 * n + i] = simd_prefix_exclusive_sum(v);
  out[5 * n + i] = simd_shuffle(v, ushort(lane ^ 1u));
  out[6 * n + i] = simd_shuffle_down(v, ushort(3));
  out[7 * n + i] = simd_shuffle_up(v, ushort(5));
  out[8 * n + i] = simd_shuffle_xor(v, ushort(6));
  out[9 * n + i] = simd_broadcast(v, ushort(7));
  out[10 * n + i] = simd_broadcast_first(v);
  out[11 * n + i] = simd_all(v > -100.0f) ? 1.0f : 0.0f;
  out[12 * n + i] = simd_any(v > 2.0f) ? 1.0f : 0.0f;
  out[13 * n + i] = float(simd_sum(int(v * 4.0f)));
  float4 v4 = float4(v);  // (v, 2v, -v, 1): built per component, see common/lily_metal.h
  v4.y = 2.0f * v;
  v4.z = -v;
  v4.w = 1.0f;
  const float4 f4 = simd_sum(v4);
  out[14 * n + i] = f4.x + 10.0f * f4.w;
}

// simd_sum_scatter (common/reduce.h) against simd_sum, one simdgroup: lane l's values are
// x[32 l .. 32 l + 32). out[j] = simd_sum of value j (j < 32); then for each N = 1, 2, ..., 32
// (i = log2 N) out[32 + (2 i) * 32 + l] = lane l's scattered total, out[32 + (2 i + 1) * 32 + l]
// = simd_scatter_index<N>(l) as a float.
template <uint32_t N>
inline void scatter_case(const device float* x, device float* out, uint32_t lane, uint32_t i) {
  float v[N];
  for (uint32_t j = 0; j < N; ++j) v[j] = x[32 * lane + j];
  const float t = lily::simd_sum_scatter<N>(v, lane);
  out[32 + (2 * i) * 32 + lane] = t;
  out[32 + (2 * i + 1) * 32 + lane] = float(lily::simd_scatter_index<N>(lane));
}

template <typename Dummy>
[[kernel]] void sum_scatter(constant SelftestArgs& args [[buffer(0)]],
                            const device float* x [[buffer(1)]],
                            device float* out [[buffer(2)]],
                            LILY_KERNEL_TAIL) {
  for (uint32_t j = 0; j < 32; ++j) {
    const float s = simd_sum(x[32 * lane + j]);
    if (lane == 0) out[j] = s;
  }
  scatter_case<1>(x, out, lane, 0);
  scatter_case<2>(x, out, lane, 1);
  scatter_case<4>(x, out, lane, 2);
  scatter_case<8>(x, out, lane, 3);
  scatter_case<16>(x, out, lane, 4);
  scatter_case<32>(x, out, lane, 5);
}

// out[8 * gid + j] = (grid_pos.xyz, thread_pos.xyz, lane, simd_id) as uint, gid = linear grid index.
template <typename Dummy>
[[kernel]] void thread_ids(constant SelftestArgs& args [[buffer(0)]],
                           device uint32_t* out [[buffer(1)]],
                           LILY_KERNEL_TAIL) {
  const uint32_t groups_x = args.n;  // threadgroups along x
  const uint32_t group = (group_pos.z * args.param + group_pos.y) * groups_x + group_pos.x;
  const uint32_t local = (thread_pos.z * group_size.y + thread_pos.y) * group_size.x + thread_pos.x;
  const uint32_t gid = group * (group_size.x * group_size.y * group_size.z) + local;
  device uint32_t* o = out + 8 * gid;
  o[0] = grid_pos.x;
  o[1] = grid_pos.y;
  o[2] = grid_pos.z;
  o[3] = thread_pos.x;
  o[4] = thread_pos.y;
  o[5] = thread_pos.z;
  o[6] = lane;
  o[7] = simd_id;
}

// Threadgroup memory with a barrier: out[i] = 2 * x[(i + param) % n] (within the threadgroup).
template <typename Dummy>
[[kernel]] void tg_rotate(constant SelftestArgs& args [[buffer(0)]],
                          const device float* x [[buffer(1)]],
                          device float* out [[buffer(2)]],
                          LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, tile, [1024]);
  const uint32_t i = thread_pos.x;
  tile[i] = x[group_pos.x * args.n + i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[group_pos.x * args.n + i] = 2.0f * tile[(i + args.param) % args.n];
}

// Device atomics: counter += 1, fsum += x[i], imax = max(imax, int(x[i] * 100)).
template <typename Dummy>
[[kernel]] void atomics(constant SelftestArgs& args [[buffer(0)]],
                        const device float* x [[buffer(1)]],
                        device atomic_uint* counter [[buffer(2)]],
                        device atomic_float* fsum [[buffer(3)]],
                        device atomic_int* imax [[buffer(4)]],
                        LILY_KERNEL_TAIL) {
  const uint32_t i = grid_pos.x;
  if (i < args.n) {
    atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
    atomic_fetch_add_explicit(fsum, x[i], memory_order_relaxed);
    atomic_fetch_max_explicit(imax, int(x[i] * 100.0f), memory_order_relaxed);
  }
}

// simdgroup_matrix: c[8x8] = a[8x16] @ b[16x8] + c0 where b is given as bt[8x16] (transposed
// load for the second half, plain load for the first: bfirst[8 rows of b] is b[0:8, :]).
template <typename Dummy>
[[kernel]] void mma(constant SelftestArgs& args [[buffer(0)]],
                    const device float* a [[buffer(1)]],       // [8][16]
                    const device float* b_top [[buffer(2)]],   // b[0:8, 0:8]  row-major
                    const device float* bt_bot [[buffer(3)]],  // b[8:16, 0:8] transposed: [8 n][8 k]
                    const device float* c0 [[buffer(4)]],      // [8][8]
                    device float* c [[buffer(5)]],             // [8][8]
                    LILY_KERNEL_TAIL) {
  simdgroup_float8x8 a0, a1, b0, b1, acc;
  simdgroup_load(a0, a, ulong(16), ulong2(0), false);
  simdgroup_load(a1, a + 8, ulong(16), ulong2(0), false);
  simdgroup_load(b0, b_top, ulong(8), ulong2(0), false);
  simdgroup_load(b1, bt_bot, ulong(8), ulong2(0), true);
  simdgroup_load(acc, c0, ulong(8), ulong2(0), false);
  simdgroup_multiply_accumulate(acc, a0, b0, acc);
  simdgroup_multiply_accumulate(acc, a1, b1, acc);
  simdgroup_store(acc, c, ulong(8), ulong2(0), false);
}

// ------------------------------------------------------------------ deliberately broken
// Missing barrier: reads a neighbour's threadgroup slot that may not be written yet.
template <typename Dummy>
[[kernel]] void broken_missing_barrier(constant SelftestArgs& args [[buffer(0)]],
                                       const device float* x [[buffer(1)]],
                                       device float* out [[buffer(2)]],
                                       LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, tile, [1024]);
  const uint32_t i = thread_pos.x;
  tile[i] = x[i];
  // BUG: threadgroup_barrier(mem_flags::mem_threadgroup) missing here.
  out[i] = 2.0f * tile[(i + 1) % args.n];
}

// Unwritten threadgroup memory copied out without arithmetic: the poison shows as NaN.
template <typename Dummy>
[[kernel]] void broken_unwritten_copy(constant SelftestArgs& args [[buffer(0)]],
                                      const device float* x [[buffer(1)]],
                                      device float* out [[buffer(2)]],
                                      LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, tile, [1024]);
  const uint32_t i = thread_pos.x;
  if (i % 2 == 0) tile[i] = x[i];  // BUG: odd slots never written
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = tile[i];
}

// simd_sum inside a branch taken by half of the lanes.
template <typename Dummy>
[[kernel]] void broken_divergent_simd_sum(constant SelftestArgs& args [[buffer(0)]],
                                          const device float* x [[buffer(1)]],
                                          device float* out [[buffer(2)]],
                                          LILY_KERNEL_TAIL) {
  float v = x[thread_pos.x];
  if (lane < args.param) v = simd_sum(v);  // BUG: not every lane calls the collective
  out[thread_pos.x] = v;
}

// Early return before a barrier.
template <typename Dummy>
[[kernel]] void broken_early_return(constant SelftestArgs& args [[buffer(0)]],
                                    const device float* x [[buffer(1)]],
                                    device float* out [[buffer(2)]],
                                    LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, tile, [1024]);
  const uint32_t i = thread_pos.x;
  if (i == args.param) return;  // BUG: the others wait at the barrier below
  tile[i] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = tile[i];
}

// Two different barriers.
template <typename Dummy>
[[kernel]] void broken_different_barriers(constant SelftestArgs& args [[buffer(0)]],
                                          const device float* x [[buffer(1)]],
                                          device float* out [[buffer(2)]],
                                          LILY_KERNEL_TAIL) {
  const uint32_t i = thread_pos.x;
  if (simd_id == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // BUG: simdgroup 0 waits here ...
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // ... the others here
  }
  out[i] = x[i];
}

// Out-of-bounds write: thread i writes out[i + param] (param = 1: the last thread overflows).
template <typename Dummy>
[[kernel]] void broken_oob_write(constant SelftestArgs& args [[buffer(0)]],
                                 const device float* x [[buffer(1)]],
                                 device float* out [[buffer(2)]],
                                 LILY_KERNEL_TAIL) {
  const uint32_t i = grid_pos.x;
  if (i < args.n) out[i + args.param] = x[i];  // BUG
}

// Out-of-bounds read: thread i reads x[i + param].
template <typename Dummy>
[[kernel]] void broken_oob_read(constant SelftestArgs& args [[buffer(0)]],
                                const device float* x [[buffer(1)]],
                                device float* out [[buffer(2)]],
                                LILY_KERNEL_TAIL) {
  const uint32_t i = grid_pos.x;
  if (i < args.n) out[i] = x[i + args.param];  // BUG
}

// Write through a buffer the kernel declares read-only.
template <typename Dummy>
[[kernel]] void broken_write_const(constant SelftestArgs& args [[buffer(0)]],
                                   const device float* x [[buffer(1)]],
                                   device float* out [[buffer(2)]],
                                   LILY_KERNEL_TAIL) {
  const uint32_t i = grid_pos.x;
  if (i < args.n) const_cast<device float*>(x)[i] = 0.0f;  // BUG
  if (i < args.n) out[i] = 1.0f;
}

// Shuffle with a lane-dependent delta (must be uniform).
template <typename Dummy>
[[kernel]] void broken_nonuniform_shuffle(constant SelftestArgs& args [[buffer(0)]],
                                          const device float* x [[buffer(1)]],
                                          device float* out [[buffer(2)]],
                                          LILY_KERNEL_TAIL) {
  const uint32_t i = thread_pos.x;
  out[i] = simd_shuffle_down(x[i], ushort(lane % 2));  // BUG
}

// More threadgroup memory than a Metal GPU has (36,000 > 32,768 bytes).
template <typename Dummy>
[[kernel]] void broken_tg_overflow(constant SelftestArgs& args [[buffer(0)]],
                                   const device float* x [[buffer(1)]],
                                   device float* out [[buffer(2)]],
                                   LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, big, [9000]);  // BUG
  const uint32_t i = thread_pos.x;
  big[i] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = big[i];
}

// A thread-local array larger than the emulator's GPU-thread stack.
template <typename Dummy>
[[kernel]] void broken_stack_overflow(constant SelftestArgs& args [[buffer(0)]],
                                      const device float* x [[buffer(1)]],
                                      device float* out [[buffer(2)]],
                                      LILY_KERNEL_TAIL) {
  float big[65536];  // BUG: 256 KiB of registers/stack per thread
  const uint32_t i = thread_pos.x;
  for (uint32_t k = 0; k < 65536; ++k) big[k] = x[i] + float(k);
  out[i] = big[(i * 7919u + args.param) % 65536u];
}

// Write after read (issue 9): the barrier at the end of a K loop deleted. Each iteration stores a
// tile slot per thread, then every lane reads a slot of the next simdgroup through a simd
// collective (as qmm / the MoE grouped matmul read tiles through simdgroup_multiply_accumulate).
// param = 1: the correct kernel; param = 0: the barrier before the next iteration's store is
// missing, so a simdgroup that runs ahead overwrites slots the next one has not read yet. Lockstep
// scheduling (forward, reverse, shuffle) hides it; Order::ahead gives wrong sums.
template <typename Dummy>
[[kernel]] void broken_war_loop(constant SelftestArgs& args [[buffer(0)]],
                                const device float* x [[buffer(1)]],
                                device float* out [[buffer(2)]],
                                LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, tile, [1024]);
  const uint32_t i = thread_pos.x, n = group_size.x;
  float acc = 0.0f;
  for (uint32_t k = 0; k < args.n; ++k) {
    tile[i] = x[k * n + i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += simd_sum(tile[(i + 32) % n]);
    if (args.param != 0) threadgroup_barrier(mem_flags::mem_threadgroup);  // BUG when param == 0
  }
  out[i] = acc;
}

// Lost update (issue 9): lane 0 of every simdgroup adds to one threadgroup word without an atomic.
template <typename Dummy>
[[kernel]] void broken_lost_update(constant SelftestArgs& args [[buffer(0)]],
                                   const device float* x [[buffer(1)]],
                                   device float* out [[buffer(2)]],
                                   LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, total, [4]);
  const uint32_t i = thread_pos.x;
  if (i == 0) total[0] = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) total[0] += x[simd_id];  // BUG: read-modify-write from several simdgroups
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = total[0];
}

// Two tokens sharing one scratch buffer (issue 9): threadgroup g (token g) stages its row in
// scratch slots every threadgroup uses (the fix: scratch[g * n + i]), then reads a neighbour slot.
template <typename Dummy>
[[kernel]] void broken_shared_scratch(constant SelftestArgs& args [[buffer(0)]],
                                      const device float* x [[buffer(1)]],
                                      device float* scratch [[buffer(2)]],
                                      device float* out [[buffer(3)]],
                                      LILY_KERNEL_TAIL) {
  const uint32_t i = thread_pos.x, g = group_pos.x, n = group_size.x;
  const uint32_t slot = args.param != 0 ? g * n + i : i;  // BUG when param == 0
  scratch[slot] = 2.0f * x[g * n + i];
  threadgroup_barrier(mem_flags::mem_device);
  out[g * n + i] = scratch[slot - i + (i + 1) % n];
}

// Overflow of a threadgroup array (issue 9): param = 1 writes one element past `a` (into `b` on
// a GPU), param = 2 one past `b` (into the spare threadgroup memory), 0: in bounds.
template <typename Dummy>
[[kernel]] void broken_tg_array_overflow(constant SelftestArgs& args [[buffer(0)]],
                                         const device float* x [[buffer(1)]],
                                         device float* out [[buffer(2)]],
                                         LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(float, a, [64]);
  LILY_TG_ARRAY(float, b, [64]);
  const uint32_t i = thread_pos.x, last = group_size.x - 1;
  a[i] = x[i];
  b[i] = 2.0f * x[i];
  if (args.param == 1 && i == last) a[i + 1] = x[i];  // BUG when param == 1: a[64]
  if (args.param == 2 && i == last) b[i + 1] = x[i];  // BUG when param == 2: b[64]
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = a[i] + b[i];
}

// A never-written integer used as an index (issue 9: poison integers too): odd threads read an
// index slot nobody wrote; the poison (0xFFA0FFA0) sends the read far outside every buffer.
template <typename Dummy>
[[kernel]] void broken_unwritten_index(constant SelftestArgs& args [[buffer(0)]],
                                       const device float* x [[buffer(1)]],
                                       device float* out [[buffer(2)]],
                                       LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, idx, [1024]);
  const uint32_t i = thread_pos.x;
  if (i % 2 == 0 || args.param != 0) idx[i] = (i + 1) % args.n;  // BUG when param == 0: odd slots never written
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = x[idx[i]];
}

// Memory ordering between threadgroups (issue 23): every threadgroup stores its partial row, then
// takes a ticket (a relaxed device atomic); the threadgroup that draws the last ticket sums all
// rows into out and resets the counter. param: 0 BUG (MSL 3.1's only idiom, which gated_delta_decode
// used until issue 39): threadgroup_barrier(mem_device) before and after the ticket; a barrier
// orders device memory within its own threadgroup only, so nothing publishes the rows to the last
// threadgroup; 1 BUG: as 0 with mem_threadgroup before the ticket; 2 BUG: as 0 with mem_threadgroup
// after it; 3 correct (MSL 3.2) with per-thread fences: each thread fences
// (atomic_thread_fence(mem_device, seq_cst, thread_scope_device)), takes its own ticket, and the
// thread with the last ticket fences again and sums; 4 BUG: as 3 with the writer's fence after its
// ticket; 5 BUG: as 3 with no fence before the reads either (no device-scope fence at all).
template <typename Dummy>
[[kernel]] void ticket_sum(constant SelftestArgs& args [[buffer(0)]],
                           const device float* x [[buffer(1)]],
                           device float* partial [[buffer(2)]],
                           device atomic_uint* counter [[buffer(3)]],
                           device float* out [[buffer(4)]],
                           LILY_KERNEL_TAIL) {
  LILY_TG_ARRAY(uint32_t, last, [1]);
  const uint32_t i = thread_pos.x, g = group_pos.x, n = group_size.x, groups = args.n;
  partial[g * n + i] = 2.0f * x[g * n + i];
  if (args.param >= 3) {
    if (args.param == 3) atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
    const uint32_t t = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
    if (args.param == 4) atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
    if (t + 1 == groups * n) {
      if (args.param != 5) atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
      for (uint32_t j = 0; j < n; ++j) {
        float s = 0.0f;
        for (uint32_t k = 0; k < groups; ++k) s += partial[k * n + j];
        out[j] = s;
      }
      atomic_store_explicit(counter, 0u, memory_order_relaxed);
    }
    return;
  }
  if (args.param == 1) threadgroup_barrier(mem_flags::mem_threadgroup);  // BUG: stores not fenced
  else threadgroup_barrier(mem_flags::mem_device);
  if (i == 0) last[0] = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed) + 1 == groups ? 1u : 0u;
  if (args.param == 2) threadgroup_barrier(mem_flags::mem_threadgroup);  // BUG: the ticket not acquired
  else threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  if (last[0] != 0) {
    float s = 0.0f;
    for (uint32_t k = 0; k < groups; ++k) s += partial[k * n + i];
    out[i] = s;
    if (i == 0) atomic_store_explicit(counter, 0u, memory_order_relaxed);
  }
}

LILY_INSTANTIATE("selftest_simd_ops", simd_ops<void>)
LILY_INSTANTIATE("selftest_sum_scatter", sum_scatter<void>)
LILY_INSTANTIATE("selftest_thread_ids", thread_ids<void>)
LILY_INSTANTIATE("selftest_tg_rotate", tg_rotate<void>)
LILY_INSTANTIATE("selftest_atomics", atomics<void>)
LILY_INSTANTIATE("selftest_mma", mma<void>)
LILY_INSTANTIATE("selftest_broken_missing_barrier", broken_missing_barrier<void>)
LILY_INSTANTIATE("selftest_broken_unwritten_copy", broken_unwritten_copy<void>)
LILY_INSTANTIATE("selftest_broken_divergent_simd_sum", broken_divergent_simd_sum<void>)
LILY_INSTANTIATE("selftest_broken_early_return", broken_early_return<void>)
LILY_INSTANTIATE("selftest_broken_different_barriers", broken_different_barriers<void>)
LILY_INSTANTIATE("selftest_broken_oob_write", broken_oob_write<void>)
LILY_INSTANTIATE("selftest_broken_oob_read", broken_oob_read<void>)
LILY_INSTANTIATE("selftest_broken_write_const", broken_write_const<void>)
LILY_INSTANTIATE("selftest_broken_nonuniform_shuffle", broken_nonuniform_shuffle<void>)
LILY_INSTANTIATE("selftest_broken_tg_overflow", broken_tg_overflow<void>)
LILY_INSTANTIATE("selftest_broken_stack_overflow", broken_stack_overflow<void>)
LILY_INSTANTIATE("selftest_broken_war_loop", broken_war_loop<void>)
LILY_INSTANTIATE("selftest_broken_lost_update", broken_lost_update<void>)
LILY_INSTANTIATE("selftest_broken_shared_scratch", broken_shared_scratch<void>)
LILY_INSTANTIATE("selftest_broken_tg_array_overflow", broken_tg_array_overflow<void>)
LILY_INSTANTIATE("selftest_broken_unwritten_index", broken_unwritten_index<void>)
LILY_INSTANTIATE("selftest_ticket_sum", ticket_sum<void>)

}  // namespace lily_selftest
