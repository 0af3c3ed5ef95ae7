// Mixture-of-experts kernel arguments (shaders/moe_*.metal, host: csrc/gpu/ops/moe.cpp).
// Included by common/args.h; compiled by the shaders, the host and the emulator alike.
//
// Row spaces (must match csrc/gpu/ops/moe.cpp and lily_py/_ops_moe.py):
//   slot    s = t * (top_k + 1) + j, j < top_k a routed expert, j == top_k the shared expert
//           (decode/matvec route: h rows are slots)
//   group   g < experts a routed expert, g == experts the shared expert ("group E")
//   permuted row (tiled route): rows of group g are [offset[g], offset[g + 1]); the shared
//           group always holds every token, so R = tokens * (top_k + 1) rows exactly.
// The plan buffer (uint32, tiled route) holds, in order:
//   [0], [1], [2]                tiles actually used in the 64-row, 32-row and few-row lists
//   [kMoePlanTiles + 3 i + 0..2] tile i: group, first row, one past the last row; three lists
//                                back to back: 64-row tiles (max_tiles - max_tiles32 - max_few
//                                entries), 32-row tiles (max_tiles32), few-row tiles (max_few)
// Tiles by load (moe_plan): each group's rows are cut into 64-row tiles; the remainder r of its
// count goes to a few-row tile (r <= MoeArgs::few_rows: matvec-style, no padding), a 32-row tile
// (r <= kMoeTile32MaxRows) or one more 64-row tile. few_rows is kMoeFewMaxRows (16) on M1-M4 and
// kMoeFewMaxRowsM5 (2) on M5, whose 32-row kind runs a tile of <= kMoeTile16MaxRows rows as a
// 16-row matmul2d (shaders/m5/moe_m5.metal): the plan is the same code on both paths.
//   [moe_plan_row_token(..) + r]  token of permuted row r                      (R entries)
//   [moe_plan_pos(..) + s]        permuted row of slot s                       (R entries)
#pragma once
#if !defined(__METAL_VERSION__)
#include <cstdint>
#endif

namespace lily {

enum : uint32_t {
  kMoeMaxExperts = 512,       // routed experts a block may have (router kernel registers)
  kMoeSelectLane = 8,         // selection (common/moe.h): probabilities per lane when E <= 32 x this
  kMoeMaxTopK = 16,           // experts per token
  kMoeMvMaxTokens = 8,        // tokens <= this: matrix-vector route (decode)
  kMoeFewMaxRows = 16,        // tiled, M1-M4: a group's remainder of <= this many rows -> few-row tile
  kMoeFewBlockRows = 8,       // few-row kernels: rows per register block (a tile runs <= 2 blocks)
  kMoeFewMaxRowsM5 = 2,       // tiled, M5: the few-row threshold (MoeArgs::few_rows)
  kMoeTile16MaxRows = 16,     // tiled, M5: a 32-row-list tile of <= this many rows runs 16-row matmul2d
  kMoeM5SubRows = 16,         // tiled, M5: rows of one simdgroup's matmul2d (16 x 32 x 32 jobs)
  kMoeTileStats = 5,          // uint32 entries of the plan's tile_stats (see moe_plan)
  kMoeTile32MaxRows = 32,     // tiled: a remainder of <= this many rows -> 32-row tile, else 64
  kMoeMvRowsPerSimd = 4,      // few-row tiles (moe_*_few): output features per simdgroup
  kMoeMvSimdsPerGroup = 2,    // few-row tiles (moe_*_few): simdgroups per threadgroup
  kMoeMvRows = 4,             // moe_down_mv: output rows per threadgroup
  kMoeGateUpRows = 4,         // moe_gate_up_mv: rows of every slot per threadgroup (at most: MoeArgs::mv_rows)
  kMoeGateUpRowsOne = 2,      // moe_gate_up_mv at one token: rows per threadgroup (2 x the threadgroups)
  kMoeGateUpMaxSplits = 4,    // moe_gate_up_mv: simdgroups splitting K = H (min(this, H / block))
  kMoeGateUpMaxSimds = 17,    // moe_gate_up_mv: simdgroups a threadgroup, (k + 1) slots x splits
  kMoeDownMaxSplits = 8,      // moe_down_mv: simdgroups splitting K' = k I + Is (min(this, chunks / 32))
  kMoeTileN = 32,             // tiled: output features per tile
  kMoeTileK = 32,             // tiled: K step (divides every supported group size)
  kMoeTileSimds = 4,          // tiled: 4 simdgroups = 128 threads (2 x 2 over the tile)
  kMoePlanThreads = 256,      // plan: one threadgroup of this many threads
  kMoeCombineThreads = 256,   // combine: threads per threadgroup (one output element each)
  kMoePlanTiles = 3,          // first tile entry in the plan buffer (after the three counts)
};

struct MoeArgs {
  uint32_t tokens;        // T
  uint32_t hidden;        // H: features of x / out, K of gate/up, N of down
  uint32_t experts;       // E routed experts (the shared expert is group E)
  uint32_t top_k;         // k routed experts per token
  uint32_t inter;         // I: routed expert intermediate size
  uint32_t shared_inter;  // Is: shared expert intermediate size
  uint32_t h_stride;      // elements between rows of the intermediate h (max(I, Is))
  uint32_t group_size;    // quantization group of every expert matrix (32, 64 or 128)
  uint32_t tile_rows;     // tiled route: 64 (the largest tile); 0 on the matvec route
  uint32_t max_tiles;     // tiled route: entries of the three tile lists (host bounds, >= used)
  uint32_t has_residual;  // 1: out = residual + moe(x); 0: out = moe(x)
  uint32_t max_tiles32;   // tiled route: entries of the 32-row list
  uint32_t max_few;       // tiled route: entries of the few-row list
  uint32_t group_shift;   // log2(group_size)
  uint32_t few_rows;      // tiled route: a remainder of <= this many rows -> few-row tile
                          // (kMoeFewMaxRows, or kMoeFewMaxRowsM5 with tensor ops)
  uint32_t mv_rows;       // matvec route: rows of every slot per moe_gate_up_mv threadgroup
                          // (moe_gate_up_rows: kMoeGateUpRowsOne at T = 1, else kMoeGateUpRows)
  uint32_t mv_routed;     // matvec route: 1 when a moe_route level wrote ids / weights before
                          // moe_gate_up_mv (which then reads them), 0 when it selects itself
};

// First entry of each tile list in the plan buffer (rows <= 64 / <= 32 / <= few_rows).
inline uint32_t moe_plan_list64() { return kMoePlanTiles; }
inline uint32_t moe_plan_list32(uint32_t max_tiles, uint32_t max_tiles32, uint32_t max_few) {
  return kMoePlanTiles + 3 * (max_tiles - max_tiles32 - max_few);
}
inline uint32_t moe_plan_list_few(uint32_t max_tiles, uint32_t max_few) {
  return kMoePlanTiles + 3 * (max_tiles - max_few);
}

// Section offsets of the plan buffer (plain scalars: shader structs stay plain).
inline uint32_t moe_plan_row_token(uint32_t max_tiles) { return kMoePlanTiles + 3 * max_tiles; }
inline uint32_t moe_plan_pos(uint32_t max_tiles, uint32_t tokens, uint32_t top_k) {
  return moe_plan_row_token(max_tiles) + tokens * (top_k + 1);
}

}  // namespace lily
