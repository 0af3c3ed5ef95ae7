"""Prefill throughput ESTIMATE for the real 35B config, as built (not a measurement; nothing runs on a GPU).

    python benchmarks/prefill_estimate.py            # both paths, 256 / 4K / 32K, M5 and M5 Max
    python benchmarks/prefill_estimate.py --brief    # totals only
    python benchmarks/prefill_estimate.py --long     # 64K / 128K / 262K prompts, Lily and MLX-LM

Every dispatch of each prefill chunk comes from the engine on the counting device
(lily_py.backends.engine.count_dispatches: the real config encoded, nothing allocated), once
without tensor ops (the M1-M4 path: what an M1-M4 GPU runs) and once with them (the M5 path:
lily_py.testing.simulated_device(tensor_ops=True)). Each dispatch carries the FLOPs its host code
attributed to it (Encoder::add_flops), the bytes it touches and the unit that runs its arithmetic
(`unit`: kernel_default_unit in csrc/gpu/kernel_ids.cpp, or Encoder::set_unit): Metal 4 tensor
ops, bf16 simdgroup-matrix tiles, fp32 8x8 simdgroup-matrix tiles, or plain ALU code. Dispatches
are grouped by kernel family (the kernel name without its dtype / bit-width suffixes); a family's
time is max(FLOPs executed / (efficiency x peak of its unit), bytes touched / (eta x bandwidth),
and for a tensor-op family the ALU work of its staging: alu_time);
the families run one after another, plus t_level per dependency level (barrier). tokens/s =
L / total over the chunks of a prompt of L tokens (chunks of 4096: 32K = 8 chunks at positions 0,
4096, ..., 28672). Every hardware figure and efficiency is an ASSUMPTION below (docs/prefill-estimate.md); change them and rerun.

The MoE tiled route's plan is made on the device: the counting device records the FLOPs bound
over every routing on its 64-row kind and counts each tile kind as reading every used expert.
Here the MoE expert work is split by tile kind (64-row, 32-row, few-row) under a simulated
uniform random routing instead (moe_split), with the kernel and unit of each kind taken from the
dispatches: a new tile kernel or unit flows in through its name and unit.
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict

import numpy as np

from lily_py.backends.engine import REAL_QUANT, _qbytes, count_dispatches
from lily_py.config import ModelConfig
from lily_py.testing import REAL_TEXT_CONFIG, simulated_device
import lily_py._core as core

ASSUMPTIONS = {
    # GPU ALU fp32 peak (FMA = 2 FLOPs): 128 FP32 lanes per core at ~1.75 GHz; M5 Max 40 cores,
    # M5 10 cores. Consistent with the "capped near 3,400 tok/s at 100% of ALU peak".
    "alu_tflops": {"M5": 4.5, "M5 Max": 17.9},
    # Metal 4 tensor ops on the M5 neural accelerators, bf16 / half in, fp32 accumulate: 4x the ALU
    # peak (Apple's "over 4x peak GPU compute for AI" vs M4; not a measured figure).
    "tensor_tflops": {"M5": 18.0, "M5 Max": 71.6},
    # Unified memory bandwidth, GB/s (M5: Apple's spec; M5 Max: assumed = M4 Max's 546; the decode
    # estimate uses 614, this one stays on the lower figure).
    "bandwidth_gbs": {"M5": 153.0, "M5 Max": 546.0},
    # The whole 4-bit model, GB: a chunk of >= 256 tokens touches nearly every expert (printed as
    # the weight-bandwidth bound of a chunk for reference; the estimate uses the bytes per dispatch).
    "weight_gb": 19.5,
    # Fraction of the peak each unit's kernels sustain (assumed). The first three are the earlier
    # per-path figures, now per unit: fp32 8x8 simdgroup tiles 35% (today's fp32 tiles: the issue's
    # 930-1,720 tok/s range), bf16 64x64 simdgroup tiles 65%, tensor ops 55%.
    # NEW: plain ALU code (the few-row MoE matvec tiles, lm_head's row, the per-token scan) 40%:
    # scalar FMAs with the dequantization (~2 ALU ops per 4-bit weight) amortized over <= 8 rows (a
    # register block of the few-row kernels) and no matrix hardware.
    "efficiency": {"simdgroup_fp32": 0.35, "simdgroup_bf16": 0.65, "tensor": 0.55, "alu": 0.40},
    # NEW: fraction of the peak bandwidth a streaming kernel reaches (same as the decode estimate,
    # docs/decode.md "Estimated tok/s": eta = 0.8).
    "eta": 0.8,
    # NEW: per dependency level (barrier), the dispatch and the drain / refill of the GPU (same as
    # the decode estimate's t_level = 2 us).
    "t_level_us": 2.0,
    # NEW: the MoE routing the tile kinds are split by: each token picks top_k distinct experts
    # uniformly at random (seed 0, a fresh draw per layer); real routers are skewed (more rows per
    # hot expert: fewer few-row tiles, more 64-row tiles).
    "moe_routing": "uniform random, seed 0",
    # NEW: the MoE tile kinds read each expert's weights once per kind from memory (the tiles of
    # one expert run next to each other in the grid; later ones hit the system-level cache), and
    # their activation bytes are the engine's (rows bound) scaled by the kind's share of rows.
    "moe_weight_reads": "once per expert and tile kind",
    # On M5 the 32-row MoE kind runs a tile of <= 16 rows as one 16-row block of the same
    # 16 x 32 x 32 matmul2d jobs as the 64- and 32-row tiles (one simdgroup per op), so it costs 16
    # rows; the jobs' rate relative to 32 x 32 x 32 is in tensor_shape_tflops below (measured:
    # docs/tensor-ops.md, "Execution scope and tile shape"). The script also prints the 256-token
    # estimate with such tiles costing 32 rows.
    "m5_tile16_cost_rows": 16,
    # NEW (2026-12-01): the tensor-op efficiency above is for ops of 32 x 32 x 32 (M x N x K: qmm_m5,
    # the DeltaNet Gram quarters); a family whose ops have other shapes runs at the measured rate
    # of its shape relative to that one (TFLOPS, A19, one simdgroup per op: docs/tensor-ops.md,
    # "Execution scope and tile shape"). Attention's O += P V op is 16 x 64 x 32 at head_dim 256,
    # a shape the page did not plot: its nearest, 16 x 32 x 32, is taken.
    "tensor_shape_tflops": {"32x32x32": 6.97, "16x32x32": 6.72, "16x16x128": 7.14, "16x32x128": 7.33,
                            "32x32x64": 7.31},
    # the op shapes of each tensor-op family and their shares of its FLOPs (the kernels as built)
    "tensor_family_shapes": {
        "qmm_m5": {"32x32x32": 1.0},
        "moe_gate_up_m5": {"16x32x32": 1.0},
        "moe_down_m5": {"16x32x32": 1.0},
        "attn_prefill_m5": {"16x16x128": 0.5, "16x32x32": 0.5},  # S = Q K^T and O += P V
        "gd_chunk_wy_m5": {"32x32x32": 1.0},
        # W S, Q S and P U as 16 x 32 x 128 ops, the state update K^T U as 32 x 32 x 64 (equal FLOPs)
        "gd_chunk_state_m5": {"16x32x128": 0.75, "32x32x64": 0.25},
    },
    # NEW (2026-12-02): the ALU work of a tensor-op family. Its threads stage every K step on the
    # GPU's ALUs (load, convert, dequantize into threadgroup memory) and, for int8, quantize x and
    # rescale the int32 sums; only the multiply runs on the tensor units. ALU issue ops per MAC of
    # the family, counted from the kernel source per thread and K step (not from compiler output;
    # loads and stores not counted; about +-50%), divided by the MACs the threadgroup's ops do in
    # that step. Half operands: x converted to half (2-3 ops a value); qmm_m5's 4-bit weights
    # unpacked and dequantized in fp32 (5 ops a code: shift, mask, convert, FMA, convert): 64x64
    # tiles, 134 ops x 128 threads / 131,072 MACs. The MoE tiles dequantize in half arithmetic
    # (moe_m5_stage_w: per word of 8 codes 3 shifts, 4 masks, 4 ors and 8 half2 operations, each
    # half2 operation counted as one op: FP16 issues at twice the FP32 rate on M5, ~1.7x measured on
    # the A19 (docs/metal.md); plus ~12 for the group's index, scale and bias): 31 ops per matrix and
    # step; 64-row gate+up 110, down 63 ops per thread; 32-row 86 and 47 per 65,536 / 32,768 MACs;
    # a tile of <= 16 rows 74 and 39 per 32,768 / 16,384 (next entry).
    # int8 as built. qmm_m5i8 (2026-12-02, second form): x quantized once by quantize_i8 (its own
    # bytes-bound dispatch) and staged as codes (two 16-byte copies), the weights' nibbles spread to
    # bytes by two masks (3 ops a word, 4 words), ~10 ops of scale staging, and per 64-wide K step
    # (one weight group) the rescale of each of the thread's 32 elements: 2 converts, a multiply and
    # 3 FMAs (the element's row / column index hoisted out of the K loop: a function of the lane and
    # the unrolled element only; ~9 ops an element if it were not: 0.15 ops per MAC): ~218 ops per
    # thread and step for 2,048 MACs. moe_*_m5i8 the same way (x's codes from quantize_i8 beside the
    # router, h's from one after the gate/up tiles): gate/up 16 elements of each of two matrices
    # (192 ops), 4 code words (~18), ~5 of x staging: ~215 ops for 2,048 MACs; down 96 + ~14 for
    # 1,024. The first forms (until 2026-12-02) quantized x while staging, again in every threadgroup
    # that reads the row (max, divide, rint, clamp, convert, code sum: ~13 ops a value), unpacked the
    # codes (5 ops) and rescaled every 32-wide K step (~9 ops an output): 0.573 (qmm_m5i8), 0.579 and
    # 0.756 (moe_gate_up_m5i8 / moe_down_m5i8). The family's time is the largest
    # of its tensor time, this ALU time (at the ALU efficiency) and its bytes: the two units are
    # assumed to overlap fully (optimistic). NEW (2026-12-04) the prefill attention (D = 256, per
    # thread and 32-key block of 262,144 MACs, 128 threads): the int8 cache's K and V staged as
    # codes, 8 ops a word of 4 (128 each), the softmax with the K and V row factors ~72, the rescale
    # test 3: 330 ops, 0.161; the bf16 cache's K and V converted (3 ops a value: 192 each), softmax
    # ~60, test 3: 0.218. O's rescale (+64) runs only in blocks where a row's running max moves,
    # rare late in a long prompt: not counted; the sensitivity line prints the estimate with it in
    # every block. Before (until 2026-12-04) K and V were staged as half(code x scale) at ~4 ops a
    # value and O rescaled every block: 639 ops, 0.312 (int8), attention ALU-bound at 1.9x its
    # tensor time. With bf16 activations (the M5 path and the int8 opt-in) the int8 cache's attention
    # is attn_prefill_m5i8_q8 (attn_prefill_m5_q8: fp32 activations only; Q quantized per row once per
    # threadgroup, K's codes copied with 16-byte loads, S in int32 converted per score): V 128,
    # softmax ~76, test 3, K ~2, Q's quantization ~230 once per threadgroup (~4 a block at 4K): 213
    # ops, 0.104. The DeltaNet chunk kernels: not counted (bytes-bound). The 32-row kind's 16-row
    # tiles: next entry.
    "tensor_alu_ops_per_mac": (("qmm_m5i8", 0.106), ("moe_gate_up_m5i8", 0.105), ("moe_down_m5i8", 0.107),
                               ("qmm_m5", 0.131), ("moe_gate_up_m5_64", 0.107), ("moe_down_m5_64", 0.123),
                               ("moe_gate_up_m5_32", 0.168), ("moe_down_m5_32", 0.184),
                               ("attn_prefill_m5i8", 0.104), ("attn_prefill_m5_q8", 0.161), ("attn_prefill_m5", 0.218)),
    # sensitivity (printed with --long): the attention's O rescaled in every block, 64 more ops per
    # thread and block (x 128 threads / 262,144 MACs), added to each attn_prefill_m5* entry above
    "attn_rescale_ops_per_mac": 64 * 128 / 262144,
    # the 32-row kind's tiles of <= 16 rows run 16 rows (BM = 16: 74 and 39 ops per thread and step
    # for 32,768 and 16,384 MACs): their MACs at these rates instead. With the MoE weights
    # dequantized in fp32 as qmm_m5 does (5 ops a code; until 2026-12-02): 0.406 and 0.422 (and
    # 0.137 / 0.152 / 0.227 / 0.242 above): the 16-row tiles were then ALU-bound at 256 tokens.
    "tensor_alu_ops_per_mac_16": (("moe_gate_up_m5_32", 0.289), ("moe_down_m5_32", 0.305)),
    # sensitivity (printed, not the estimate): the MoE half2 operations at the FP32 rate (two ops
    # each: 8 more per matrix and step)
    "fp16_slow_alu_ops_per_mac": (("moe_gate_up_m5_64", 0.123), ("moe_down_m5_64", 0.139),
                                  ("moe_gate_up_m5_32", 0.199), ("moe_down_m5_32", 0.215)),
    "fp16_slow_alu_ops_per_mac_16": (("moe_gate_up_m5_32", 0.352), ("moe_down_m5_32", 0.367)),
    # int8 activations on the projections and the MoE tiles (built for the projections and the MoE
    # 64-row tiles as the opt-in, "M5 int8 opt-in"). INT8 matmul2d ran at about 2x the FP16 rate in
    # the A19 measurement (docs/tensor-ops.md, "Execution scope and tile shape"); x quantized per row
    # and per group of `int8_group` along K (symmetric, scale = max |x| / 127), the 4-bit codes
    # exact as uint8. As built the ALU work above bounds these families, not the tensor ops.
    # WHAT-IF, the with_int8 lines: the int8 design as built (qmm_m5i8, moe_*_m5i8: 0.106 ALU ops
    # per MAC, above) for the MoE 32- and 16-row tiles as well (not built: they keep half operands).
    "int8_speedup": 2.0,
    "int8_group": 32,
    "int8_design_alu_ops_per_mac": None,  # qmm_m5i8's tensor_alu_ops_per_mac (set below the table)
    "int8_families": ("qmm_m5", "moe_gate_up_m5", "moe_down_m5"),
    # the families built with int8 activations (charged int8_speedup on the tensor units and their
    # tensor_alu_ops_per_mac on the ALUs): the projections and the MoE 64-row tiles (the opt-in),
    # the prefill attention's scores on the int8 cache (both M5 paths)
    "int8_built": ("qmm_m5i8", "moe_gate_up_m5i8", "moe_down_m5i8", "attn_prefill_m5i8"),
    # the share of a built int8 family's FLOPs on int8 operands (1 unless listed): the prefill
    # attention on the int8 cache with bf16 activations (attn_prefill_m5i8_q8: the M5 path's and
    # the opt-in's) runs S = Q K^T on int8, P V on half
    "int8_flop_share": (("attn_prefill_m5i8", 0.5),),
}
ASSUMPTIONS["int8_design_alu_ops_per_mac"] = dict(ASSUMPTIONS["tensor_alu_ops_per_mac"])["qmm_m5i8"]
# MLX-LM's published prefill on an M5 Max (tok/s; mlx 0.32.2, mlx-lm 0.31.3, median of two rounds):
# perplexityai/pplx-garden, lily/docs/2026-09-02-performance-mlx-0.32.2.md (the 5,166 at 4K).
MLX_LM_M5_MAX = {256: 2536.4, 512: 3309.5, 1024: 4471.7, 2048: 5121.9, 4096: 5165.7, 8192: 5031.8,
                 16384: 4722.5, 32768: 3963.7, 65536: 3051.1, 131072: 2237.5}
MLX_LM_4K_M5_MAX = 5166  # tok/s, published (issue 11)
# Lily's published prefill on an M5 Max, tok/s (issue 26's figures, same source).
LILY_M5_MAX = {65536: 2752.0, 131072: 1793.0}
TARGET = 1.3 * MLX_LM_4K_M5_MAX
TARGETS = {L: 1.3 * v for L, v in MLX_LM_M5_MAX.items()}  # the issue: >= 1.3 x MLX-LM at every length
GPUS = ("M5", "M5 Max")
# (name, device mode): False = no tensor ops, True = tensor ops, "int8" = tensor ops with int8 activations
# where a kernel has them (simulated_device(tensor_ops=True, tensor_int8=True): qmm_m5i8 and the MoE
# 64-row tiles moe_*_m5i8)
PATHS = (("M1-M4 path", False), ("M5 path", True), ("M5 int8 opt-in", "int8"))
UNIT_SHORT = {"tensor": "tensor", "simdgroup_bf16": "sg-bf16", "simdgroup_fp32": "sg-fp32", "alu": "alu"}

_SUFFIX = re.compile(r"(_(b4|b8|xf32|xbf16|sf32|sbf16|wf32|wbf16|yf32|d\d+|e\d+|r1))+$")
_DTYPE = re.compile(r"_(f32|bf16)$")
_MOE_KIND = re.compile(r"^moe_(gate_up|down)_(?:(?:m5i8|m5|bf16)_)?(?:mm)?(64|32|few)(?:_|$)")


def family(kernel: str) -> str:
    """Kernel family: the name without dtype, bit-width and head-dim suffixes
    (qmm_m5_b4_xbf16_sbf16 -> qmm_m5; attn_prefill_m5_d256_bf16 -> attn_prefill_m5)."""
    return _SUFFIX.sub("", _DTYPE.sub("", kernel))


def real_config() -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})


def unit_rate(unit: str, gpu: str, a: dict) -> float:
    """FLOP/s a unit sustains on `gpu`."""
    peak = a["tensor_tflops"] if unit == "tensor" else a["alu_tflops"]
    return a["efficiency"][unit] * peak[gpu] * 1e12


MOE_FEW_ROWS = {False: 16, True: 2}  # moe_few_rows(tensor_ops): kMoeFewMaxRows / kMoeFewMaxRowsM5
MOE_TILE16_ROWS = 16                 # kMoeTile16MaxRows: on M5 such 32-row-list tiles run 16 rows


def remainder_tile(rem: int, tensor_ops: bool, tile16_cost: int = 16) -> tuple[str, int]:
    """moe_plan's rule for a group's remainder of rem (< 64) rows: (kind, rows the tile executes).
    Another 64-row tile if rem > 32; a 32-row tile if f < rem <= 32 (on M5 one of <= 16 rows runs
    as 16, counted as tile16_cost); else a few-row matvec tile of exactly rem rows; f =
    MOE_FEW_ROWS[tensor_ops]."""
    if rem > 32:
        return "64", 64
    if rem > MOE_FEW_ROWS[tensor_ops]:
        return "32", tile16_cost if tensor_ops and rem <= MOE_TILE16_ROWS else 32
    return "few", rem


def moe_split(cfg: ModelConfig, T: int, layers: int, seed: int = 0, tensor_ops: bool = False,
              tile16_cost: int = 16) -> dict:
    """MoE expert work of `layers` layers for a chunk of T tokens by tile kind under uniform random
    routing, following moe_plan (shaders/moe_plan.metal): each group (expert, and the shared group of
    all T rows) of c rows takes c // 64 64-row tiles and its remainder one tile by remainder_tile.
    Returns {(stage, kind): dict(executed, useful, rows, weight_bytes, executed16, executed16_true)}
    with stage gate_up / down, kind 64 / 32 / few; executed as moe_expert_flops_from_tiles (whole
    32-column tiles); executed16: the part of the 32-row kind's executed FLOPs from tiles that run
    16 rows (as counted, tile16_cost rows), executed16_true: the same tiles at their 16 rows."""
    E, k, H = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    I, Is = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    q = REAL_QUANT["experts_q"]
    pad = lambda n: -(-n // 32) * 32  # noqa: E731
    rng = np.random.default_rng(seed)
    out = {(s, kd): dict(executed=0, useful=0, rows=0, weight_bytes=0, executed16=0, executed16_true=0)
           for s in ("gate_up", "down") for kd in ("64", "32", "few")}
    for _ in range(layers):
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :k]
        counts = np.bincount(ids.ravel(), minlength=E)
        for c, N in [(int(c), I) for c in counts] + [(T, Is)]:
            if c == 0:
                continue
            rem = c % 64
            kind, ex_rem = remainder_tile(rem, tensor_ops, tile16_cost)
            rows = {"64": 64 * (c // 64), "32": 0, "few": 0}
            tiles_rows = {"64": 64 * (c // 64), "32": 0, "few": 0}
            rows[kind] += rem
            tiles_rows[kind] += ex_rem if rem else 0
            for kd in ("64", "32", "few"):
                if rows[kd] == 0:
                    continue
                ex = tiles_rows[kd]
                gu = out["gate_up", kd]
                dn = out["down", kd]
                gu["executed"] += ex * 4 * (N if kd == "few" else pad(N)) * H
                dn["executed"] += ex * 2 * (H if kd == "few" else pad(H)) * N
                if kd == "32" and tensor_ops and rem <= MOE_TILE16_ROWS:  # a 16-row tile
                    gu["executed16"] += ex * 4 * pad(N) * H
                    dn["executed16"] += ex * 2 * pad(H) * N
                    gu["executed16_true"] += MOE_TILE16_ROWS * 4 * pad(N) * H
                    dn["executed16_true"] += MOE_TILE16_ROWS * 2 * pad(H) * N
                gu["useful"] += rows[kd] * 4 * N * H
                dn["useful"] += rows[kd] * 2 * N * H
                gu["rows"] += rows[kd]
                dn["rows"] += rows[kd]
                gu["weight_bytes"] += 2 * _qbytes(N, H, q)
                dn["weight_bytes"] += _qbytes(H, N, q)
    return out


def moe_rows_executed(T: int, E: int = 256, k: int = 8, seed: int = 0) -> dict:
    """Expert rows the tiles compute for T tokens under uniform random routing (each token picks k
    distinct experts uniformly; the shared group holds all T), per tile scheme: before (one tile
    size per chunk: 32 rows if T k < 3072, else 64; every group padded to it) and now (moe_plan:
    64-row tiles, remainder in a 32-row tile or a few-row matvec tile of <= 16 rows). Returns
    executed rows / useful rows for each."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k]
    counts = np.append(np.bincount(ids.ravel(), minlength=E), T)
    bm = 32 if T * k < 3072 else 64
    before = int((-(-counts // bm) * bm).sum())
    full = int((64 * (counts // 64)).sum())
    now, m5 = (full + sum(remainder_tile(int(c) % 64, tops)[1] for c in counts) for tops in (False, True))
    useful = int(counts.sum())
    return {"before": before / useful, "now": now / useful, "m5": m5 / useful}


def _moe_bound_weight_bytes(cfg: ModelConfig, T: int, stage: str) -> int:
    """Expert weight bytes the engine counts for one MoE tile dispatch (every used expert:
    min(E, T k), and the shared expert) - the part the simulated split replaces."""
    E, k, H = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    I, Is = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    q = REAL_QUANT["experts_q"]
    used = min(E, T * k)
    if stage == "gate_up":
        return used * 2 * _qbytes(I, H, q) + 2 * _qbytes(Is, H, q)
    return used * _qbytes(H, I, q) + _qbytes(H, Is, q)


_MOE_CACHE: dict = {}


def chunk_families(cfg: ModelConfig, T: int, position: int, context: int, tensor_ops: bool,
                   logits: bool, a: dict = ASSUMPTIONS) -> tuple[dict, int]:
    """Per family of one prefill chunk: dict(unit, dispatches, executed, useful, bytes, groups,
    threads) and the chunk's dependency levels (barriers + 1)."""
    with simulated_device(tensor_ops=bool(tensor_ops), tensor_int8=tensor_ops == "int8"):
        st, ds = count_dispatches(cfg, tokens=T, position=position, context_length=context,
                                  prefill_chunk=T, logits=logits)
    fams: dict = defaultdict(lambda: dict(unit="", dispatches=0, executed=0, useful=0, bytes=0,
                                          groups=0, threads=0))
    moe_recs = defaultdict(list)  # (stage, kind) -> records (tiled route)
    first_unit: dict = {}
    for d in ds:
        m = _MOE_KIND.match(d["kernel"])
        name = family(d["kernel"])
        # a family whose dispatches run on different units (Encoder::set_unit) splits by unit
        if first_unit.setdefault(name, d["unit"]) != d["unit"]:
            name = f"{name}@{UNIT_SHORT[d['unit']]}"
        f = fams[name]
        f["unit"] = d["unit"]
        f["dispatches"] += 1
        f["groups"] = max(f["groups"], d["groups"][0] * d["groups"][1] * d["groups"][2])
        f["threads"] = d["threads"][0] * d["threads"][1] * d["threads"][2]
        if m and m.group(2) != "mv":
            moe_recs[m.group(1), m.group(2)].append(d)
            continue  # FLOPs and bytes from the routing split below
        f["executed"] += d["flops_executed"]
        f["useful"] += d["flops_useful"]
        f["bytes"] += d["bytes_touched"]
    if moe_recs:
        layers = len(moe_recs["gate_up", "64"])
        key = (T, layers, bool(tensor_ops), a["m5_tile16_cost_rows"])
        if key not in _MOE_CACHE:
            _MOE_CACHE[key] = moe_split(cfg, T, layers, tensor_ops=bool(tensor_ops), tile16_cost=a["m5_tile16_cost_rows"])
        split = _MOE_CACHE[key]
        R = T * (cfg.num_experts_per_tok + 1)
        for (stage, kind), recs in moe_recs.items():
            f = fams[family(recs[0]["kernel"])]  # one kernel per kind and path
            s = split[stage, kind]
            act = sum(r["bytes_touched"] for r in recs) - len(recs) * _moe_bound_weight_bytes(cfg, T, stage)
            f["executed"] += s["executed"]
            f["useful"] += s["useful"]
            f["executed16"] = f.get("executed16", 0) + s["executed16"]
            f["executed16_true"] = f.get("executed16_true", 0) + s["executed16_true"]
            # act: the engine's activation bytes of the kind's dispatches (all R rows of each
            # layer, bound); the kind moves its share of the rows
            f["bytes"] += s["weight_bytes"] + act * s["rows"] / (R * len(recs))
    return dict(fams), st["barriers"] + 1


def prompt_families(cfg: ModelConfig, L: int, tensor_ops: bool, chunk: int = 4096,
                    a: dict = ASSUMPTIONS) -> tuple[dict, int]:
    """Families summed over the chunks of an L-token prompt (the last chunk computes the logits)."""
    total: dict = {}
    levels = 0
    for pos in range(0, L, chunk):
        T = min(chunk, L - pos)
        fams, lv = chunk_families(cfg, T, pos, L, tensor_ops, logits=pos + T >= L, a=a)
        levels += lv
        for name, f in fams.items():
            t = total.setdefault(name, dict(f, executed=0, useful=0, bytes=0, dispatches=0, executed16=0,
                                            executed16_true=0))
            for c in ("executed", "useful", "bytes", "dispatches", "executed16", "executed16_true"):
                t[c] += f.get(c, 0)
    return total, levels


def shape_factor(name: str, unit: str, a: dict = ASSUMPTIONS) -> float:
    """Time of a tensor-op family's FLOPs relative to ops of 32 x 32 x 32 (1.0 for other units
    and for families without a listed shape)."""
    if unit != "tensor":
        return 1.0
    fam = next((f for f in a["tensor_family_shapes"] if name.startswith(f)), None)
    if fam is None:
        return 1.0
    r = a["tensor_shape_tflops"]
    return sum(share * r["32x32x32"] / r[shape] for shape, share in a["tensor_family_shapes"][fam].items())


def estimate(fams: dict, levels: int, L: int, gpu: str, a: dict = ASSUMPTIONS) -> dict:
    """Time per family (max of compute and bandwidth), total and tokens/s on `gpu`."""
    bw = a["eta"] * a["bandwidth_gbs"][gpu] * 1e9
    times = {}
    for name, f in fams.items():
        tc = tensor_time(name, f, gpu, a)
        ta = alu_time(name, f, gpu, a)
        tb = f["bytes"] / bw
        t = max(tc, ta, tb)
        times[name] = (t, "flops" if t == tc else "alu" if t == ta else "bytes")
    t_levels = levels * a["t_level_us"] * 1e-6
    total = sum(t for t, _ in times.values()) + t_levels
    by_unit = defaultdict(float)
    for name, (t, _) in times.items():
        by_unit[fams[name]["unit"]] += t
    return dict(times=times, t_levels=t_levels, total=total, tps=L / total, by_unit=dict(by_unit))


def with_units(fams: dict, units: dict) -> dict:
    """The families with some moved to another unit ({family prefix: unit}): what-if lines."""
    out = {}
    for name, f in fams.items():
        u = next((u for p, u in units.items() if name.startswith(p)), f["unit"])
        out[name] = dict(f, unit=u)
    return out


def tensor_time(name: str, f: dict, gpu: str, a: dict = ASSUMPTIONS) -> float:
    """Seconds of a family's FLOPs on its unit (for tensor ops: at its op shapes' rate, and a built
    int8 family's int8_flop_share of them at int8_speedup)."""
    if not f["executed"]:
        return 0.0
    tc = f["executed"] * shape_factor(name, f["unit"], a) / unit_rate(f["unit"], gpu, a)
    if int8_family(name, f, a):
        share = by_prefix(a["int8_flop_share"], name, 1.0)
        tc *= (1.0 - share) + share / a["int8_speedup"]
    return tc


def int8_family(name: str, f: dict, a: dict = ASSUMPTIONS) -> bool:
    """Whether the estimate charges `name` at the int8 tensor rate: a built int8 kernel
    (int8_built) or one a what-if marked (with_int8)."""
    return f["unit"] == "tensor" and (f.get("int8", False) or name.startswith(a["int8_built"]))


def alu_time(name: str, f: dict, gpu: str, a: dict = ASSUMPTIONS) -> float:
    """Seconds of a family's ALU work (staging, int8 quantization and rescale) on `gpu`, overlapped
    with its tensor time: executed FLOPs x ops per MAC / ALU FLOP/s = MACs x ops / ALU op/s (an FMA
    is 2 FLOPs and 1 op); the 32-row MoE kind's 16-row tiles at their own rate and true MACs."""
    e16, e16t = f.get("executed16", 0), f.get("executed16_true", 0)
    ops16 = by_prefix(a["tensor_alu_ops_per_mac_16"], name, None)
    if f["unit"] != "tensor" or ops16 is None or f.get("int8", False):
        e16, e16t, ops16 = 0, 0, 0.0
    work = (f["executed"] - e16) * alu_ops_per_mac(name, f, a) + e16t * ops16
    return work / unit_rate("alu", gpu, a)


def alu_ops_per_mac(name: str, f: dict, a: dict = ASSUMPTIONS) -> float:
    """ALU issue ops per MAC of a tensor-op family (tensor_alu_ops_per_mac; a what-if int8 family:
    int8_design_alu_ops_per_mac); 0 for other units (their efficiency covers their staging)."""
    if f["unit"] != "tensor":
        return 0.0
    if f.get("int8", False) and not name.startswith(a["int8_built"]):
        return a["int8_design_alu_ops_per_mac"]
    return by_prefix(a["tensor_alu_ops_per_mac"], name, 0.0)


def by_prefix(table, name: str, default):
    """The value of the first (prefix, value) entry of `table` that `name` starts with."""
    return next((v for p, v in table if name.startswith(p)), default)


def with_int8(fams: dict, a: dict = ASSUMPTIONS) -> dict:
    """What-if: the int8_families on int8 activations (charged as int8_family says)."""
    return {name: dict(f, int8=True) if f["unit"] == "tensor" and name.startswith(a["int8_families"]) else f
            for name, f in fams.items()}


def efficiency_for(fams: dict, levels: int, L: int, gpu: str, unit: str, tps: float, a: dict = ASSUMPTIONS):
    """The efficiency of `unit` at which the estimate reaches `tps` (None: not even at 100%)."""
    lo, hi = 0.0, 1.0
    if estimate(fams, levels, L, gpu, dict(a, efficiency=dict(a["efficiency"], **{unit: hi})))["tps"] < tps:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        e = estimate(fams, levels, L, gpu, dict(a, efficiency=dict(a["efficiency"], **{unit: mid})))
        lo, hi = (mid, hi) if e["tps"] < tps else (lo, mid)
    return hi


def run(cfg: ModelConfig, lengths=(256, 4096, 32768), chunk: int = 4096, a: dict = ASSUMPTIONS) -> dict:
    """{(path, L): dict(fams, levels, est={gpu: estimate})} for both paths."""
    out = {}
    for path, tops in PATHS:
        for L in lengths:
            fams, levels = prompt_families(cfg, L, tops, chunk, a)
            out[path, L] = dict(fams=fams, levels=levels, est={g: estimate(fams, levels, L, g, a) for g in GPUS})
    return out


def print_tables(res: dict, brief: bool = False, only: list | None = None) -> None:
    """Per (path, length): the totals line and (unless brief) the per-family table; then the
    summary. ``only``: ["PATH:LENGTH", ...] prints just those tables, no summary."""
    a = ASSUMPTIONS
    for (path, L), r in res.items():
        if only and f"{path}:{L}" not in only:
            continue
        fams, est = r["fams"], r["est"]
        ex = sum(f["executed"] for f in fams.values())
        us = sum(f["useful"] for f in fams.values())
        print(f"\n{path}, prompt {L} tokens ({-(-L // 4096)} chunk(s), {r['levels']} levels): "
              f"GFLOP executed {ex / 1e9:,.0f} (useful {us / 1e9:,.0f}); " +
              "; ".join(f"{g}: {e['total'] * 1e3:,.1f} ms -> {e['tps']:,.0f} tok/s" for g, e in est.items()))
        if brief:
            continue
        mx = est["M5 Max"]
        print(f"  {'family':<22} {'unit':<8} {'GFLOP exec':>10} {'GB':>7} {'B/FLOP':>7} {'tg x thr':>12} "
              f"{'M5 Max ms':>9} {'share':>6} {'bound':>5} {'M5 share':>8}")
        for name in sorted(fams, key=lambda n: -mx["times"][n][0]):
            f = fams[name]
            t, bound = mx["times"][name]
            if t < 0.0005 * mx["total"]:
                continue
            bpf = f"{f['bytes'] / f['executed']:.4f}" if f["executed"] else "-"
            print(f"  {name:<22} {UNIT_SHORT[f['unit']]:<8} {f['executed'] / 1e9:>10,.1f} {f['bytes'] / 1e9:>7.2f} "
                  f"{bpf:>7} {str(f['groups']) + ' x ' + str(f['threads']):>12} {t * 1e3:>9.2f} "
                  f"{t / mx['total']:>6.1%} {bound:>5} {est['M5']['times'][name][0] / est['M5']['total']:>8.1%}")
        rest = sum(t for n, (t, _) in mx["times"].items() if t < 0.0005 * mx["total"])
        print(f"  {'(families < 0.05%)':<22} {'':<8} {'':>10} {'':>7} {'':>7} {'':>12} {rest * 1e3:>9.2f}")
        print(f"  {'levels x t_level':<22} {'':<8} {'':>10} {'':>7} {'':>7} {'':>12} {mx['t_levels'] * 1e3:>9.2f} "
              f"{mx['t_levels'] / mx['total']:>6.1%}")
        print("  time by unit, M5 Max: " + ", ".join(f"{UNIT_SHORT[u]} {t / mx['total']:.0%}"
                                                    for u, t in sorted(mx["by_unit"].items(), key=lambda kv: -kv[1])))
    if only:
        return
    print("\nSummary (ESTIMATE, tok/s):")
    lengths = sorted({L for _, L in res})
    print(f"  {'path':<14} {'GPU':<7} " + " ".join(f"{L:>8}" for L in lengths))
    for path, _ in PATHS:
        for g in GPUS:
            print(f"  {path:<14} {g:<7} " + " ".join(f"{res[path, L]['est'][g]['tps']:>8,.0f}" for L in lengths))
    known = [L for L in lengths if L in TARGETS]
    if known:
        print(f"  {'MLX-LM':<14} {'M5 Max':<7} " + " ".join(
            f"{MLX_LM_M5_MAX[L]:>8,.0f}" if L in MLX_LM_M5_MAX else f"{'-':>8}" for L in lengths) + "  (published)")
        if any(L in LILY_M5_MAX for L in lengths):
            print(f"  {'Lily':<14} {'M5 Max':<7} " + " ".join(
                f"{LILY_M5_MAX[L]:>8,.0f}" if L in LILY_M5_MAX else f"{'-':>8}" for L in lengths) + "  (published)")
        print(f"  {'target 1.3x':<14} {'M5 Max':<7} " + " ".join(
            f"{TARGETS[L]:>8,.0f}" if L in TARGETS else f"{'-':>8}" for L in lengths))
        for path, _ in PATHS:
            met = [f"{L}: {'met' if res[path, L]['est']['M5 Max']['tps'] >= TARGETS[L] else 'not met'} "
                   f"({res[path, L]['est']['M5 Max']['tps'] / TARGETS[L]:.2f} of it)" for L in known]
            print(f"  {path}, M5 Max vs the target: " + ", ".join(met))
        for path, tops in PATHS:
            if not tops:
                continue
            need = {L: efficiency_for(res[path, L]["fams"], res[path, L]["levels"], L, "M5 Max", "tensor", TARGETS[L])
                    for L in known}
            print(f"  {path}, tensor-op efficiency each target needs (assumed {a['efficiency']['tensor']:.0%}): "
                  + ", ".join(f"{L}: " + (f"{v:.0%}" if v else "not at 100%") for L, v in need.items()))
    full = dict(a, efficiency={u: 1.0 for u in a["efficiency"]})
    print("  ceiling (every unit at 100% of its peak, bandwidth at eta): " + "; ".join(
        f"{path} {g} " + " ".join(f"{estimate(res[path, L]['fams'], res[path, L]['levels'], L, g, full)['tps']:,.0f}"
                                  for L in lengths) for path, _ in PATHS for g in GPUS))
    if ("M5 path", 4096) in res:
        r = res["M5 path", 4096]
        fams, lv = r["fams"], r["levels"]
        print("\nWhat closes the gap, M5 path, 4096 tokens, M5 Max (ESTIMATE, same assumptions otherwise):")
        lines = [("as built", fams)]
        f1 = fams
        f2 = f1
        if "qmm" in f1 and f1["qmm"]["unit"] != "tensor":  # the 8-bit router off tensor ops (fp32 x)
            f2 = with_units(f1, {"qmm": "tensor"})  # "qmm" alone: qmm_m5 is tensor already
            lines.append(("+ the router (8-bit qmm, fp32 tiles) on tensor ops", f2))
        f3 = {n: dict(f, bytes=f["bytes"] / 2) if f["unit"] == "alu" and not f["executed"] else f for n, f in f2.items()}
        lines.append(("+ the ALU-only families' bytes halved (what-if)", f3))
        for label, f in lines:
            e = estimate(f, lv, 4096, "M5 Max")
            need = efficiency_for(f, lv, 4096, "M5 Max", "tensor", TARGET)
            print(f"  {label:<52} {e['tps']:>6,.0f} tok/s; tensor-op efficiency for {TARGET:,.0f}: "
                  + (f"{need:.0%}" if need else "not reached at 100%"))
        print("  (that line: the families without FLOPs - norms, conv1d, the DeltaNet prep and gated norm, the MoE "
              "route / plan / combine - moving half their bytes, as bf16 instead of fp32 scratch or fusion would)")
        f4 = with_int8(f2)
        e = estimate(f4, lv, 4096, "M5 Max")
        need = efficiency_for(f4, lv, 4096, "M5 Max", "tensor", TARGET)
        print(f"  {'+ int8 on every tile, MoE 32-row too (what-if)':<52} {e['tps']:>6,.0f} tok/s; tensor-op "
              f"efficiency for {TARGET:,.0f}: " + (f"{need:.0%}" if need else "not reached at 100%"))
        print("  int8 what-if at every length, M5 path, M5 Max (target): " + ", ".join(
            f"{L}: {estimate(with_int8(res['M5 path', L]['fams']), res['M5 path', L]['levels'], L, 'M5 Max')['tps']:,.0f}"
            + (f" ({TARGETS[L]:,.0f})" if L in TARGETS else "") for L in lengths if ("M5 path", L) in res))
        print("  (int8 what-if lines: qmm_m5 and every MoE tensor-op tile, the 32- and 16-row ones too, on int8 at "
              "%.0fx the FP16 rate with %.3f ALU ops per MAC, as the built int8 kernels (the 'M5 int8 opt-in' rows: "
              "projections and MoE 64-row tiles) - without their quantize_i8 dispatches; ASSUMPTIONS)"
              % (a["int8_speedup"], a["int8_design_alu_ops_per_mac"]))
        e = estimate(f2, lv, 4096, "M5 Max")
        alu = sum(t for n, (t, _) in e["times"].items() if f2[n]["unit"] == "alu")
        print(f"  as built: ALU families (norms, conv, prep, gated norm, combine, few-row MoE) {alu * 1e3:.1f} ms "
              f"of {e['total'] * 1e3:.1f} ms, tensor-op families "
              f"{e['by_unit'].get('tensor', 0) * 1e3:.1f} ms; the target needs {4096 / TARGET * 1e3:.1f} ms")
    print(f"  target: 1.3 x MLX-LM's published {MLX_LM_4K_M5_MAX:,} tok/s at 4K on M5 Max = {TARGET:,.0f} tok/s")
    print(f"  weight-bandwidth bound of a chunk (the whole {a['weight_gb']} GB model once per chunk, eta "
          f"{a['eta']}): " + ", ".join(f"{g} {min(L, 4096) * a['eta'] * a['bandwidth_gbs'][g] / a['weight_gb']:,.0f} "
                                         f"tok/s at {L}" for g in GPUS for L in lengths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--brief", action="store_true", help="totals only, no per-family tables")
    ap.add_argument("--moe-waste", action="store_true", help="only the MoE rows executed / useful line")
    ap.add_argument("--only", nargs="+", metavar="PATH:LENGTH",
                    help='only these per-family tables, e.g. "M5 path:4096" (no summary)')
    ap.add_argument("--long", action="store_true",
                    help="prompts of 64K, 128K and 262K tokens (totals and summary, Lily's and MLX-LM's figures)")
    args = ap.parse_args()
    cfg = real_config()
    if args.long:
        res = run(cfg, lengths=(65536, 131072, 262144))
        print_tables(res, brief=True)
        print_attention_alu(res)
        print_attention_budget(res)
        return
    waste = ("MoE expert rows executed / useful under uniform routing (simulated): " + ", ".join(
        f"{T} tokens: M1-M4 plan {r['now']:.2f}, M5 plan {r['m5']:.2f} (one tile size per chunk: {r['before']:.2f})"
        for T in (256, 4096) for r in [moe_rows_executed(T, cfg.num_experts, cfg.num_experts_per_tok)]))
    if args.moe_waste:
        print(waste)
        return
    res = run(cfg)
    if args.only:
        print_tables(res, only=args.only)
        return
    print("ESTIMATE, not a measurement. Assumptions:", ASSUMPTIONS)
    print(waste)
    print_tables(res, brief=args.brief)
    print_attention_budget(res)
    if ("M5 path", 256) in res:  # sensitivity of the short-prompt line to the 16-row tiles' rate
        a32 = dict(ASSUMPTIONS, m5_tile16_cost_rows=32)
        fams, lv = prompt_families(cfg, 256, True, 4096, a32)
        e = {g: estimate(fams, lv, 256, g, a32)["tps"] for g in GPUS}
        slow = dict(ASSUMPTIONS,  # the first matching prefix wins: the overrides go first
                    tensor_alu_ops_per_mac=ASSUMPTIONS["fp16_slow_alu_ops_per_mac"] + ASSUMPTIONS["tensor_alu_ops_per_mac"],
                    tensor_alu_ops_per_mac_16=ASSUMPTIONS["fp16_slow_alu_ops_per_mac_16"])
        r = res["M5 path", 256]
        need = efficiency_for(r["fams"], r["levels"], 256, "M5 Max", "alu", TARGETS[256])
        print("  M5 path at 256 tokens if FP16 ran at the FP32 rate (the MoE tiles' half2 dequantization, "
              "fp16_slow_alu_ops_per_mac): " + ", ".join(
                  f"{g} {estimate(r['fams'], r['levels'], 256, g, slow)['tps']:,.0f} tok/s" for g in GPUS) +
              "; ALU efficiency the M5 Max needs for the target as built: " +
              (f"{need:.0%}" if need else "not reached at 100%") +
              f" (assumed {ASSUMPTIONS['efficiency']['alu']:.0%})")
        print("  M5 path at 256 tokens if a 16-row matmul2d cost as much as a 32-row one (the MoE 16-row "
              "tiles counted as 32 rows): " + ", ".join(f"{g} {v:,.0f} tok/s" for g, v in e.items()) +
              f"; target {TARGETS[256]:,.0f} on M5 Max")
    if all(("M5 int8 opt-in", L) in res for L in (256, 4096, 32768)):
        print_int8_sensitivity(res)


def print_attention_alu(res: dict, a: dict = ASSUMPTIONS) -> None:
    """Long prompts: the prefill attention's tensor time against its ALU time (staging, softmax) on
    the M5 paths, and the estimate with O rescaled in every block (attn_rescale_ops_per_mac more)."""
    every = dict(a, tensor_alu_ops_per_mac=tuple(
        (p, v + a["attn_rescale_ops_per_mac"] if p.startswith("attn_prefill_m5") else v)
        for p, v in a["tensor_alu_ops_per_mac"]))
    for path in ("M5 path", "M5 int8 opt-in"):
        parts = []
        for L in sorted(L for p, L in res if p == path):
            r = res[path, L]
            name, f = attention_family(r["fams"])
            tc = tensor_time(name, f, "M5 Max", a)
            parts.append(f"{L}: {name} tensor {tc:,.1f} s, ALU {alu_time(name, f, 'M5 Max', a):,.1f} s; "
                         f"O rescaled every block {estimate(r['fams'], r['levels'], L, 'M5 Max', every)['tps']:,.0f} tok/s")
        print(f"  {path}, M5 Max, prefill attention (ESTIMATE): " + "; ".join(parts))


def attention_family(fams: dict) -> tuple[str, dict]:
    """The prefill attention's family of an M5 path's families."""
    return next((n, f) for n, f in fams.items() if n.startswith("attn_prefill_m5"))


def mlx_attention_s(L: int) -> float:
    """Seconds of MLX-LM's prefill attention at L tokens implied by its published M5 Max figures:
    its time at L less L tokens at its 4K rate (ASSUMED: its other work per token is as at 4K, whose
    own attention is small; so this charges MLX-LM's attention slightly less than it takes)."""
    return L / MLX_LM_M5_MAX[L] - L / MLX_LM_M5_MAX[4096]


def attention_budget(r: dict, L: int, gpu: str = "M5 Max", a: dict = ASSUMPTIONS) -> dict:
    """The seconds the target at L tokens leaves a path's prefill attention after the path's other
    work (its estimate on `gpu`; r = run()'s entry), and the useful FLOP rate the attention then needs."""
    e = estimate(r["fams"], r["levels"], L, gpu, a)
    name, f = attention_family(r["fams"])
    other = e["total"] - e["times"][name][0]
    budget = L / TARGETS[L] - other
    return dict(name=name, useful=f["useful"], other=other, budget=budget, as_built=e["times"][name][0],
                need=f["useful"] / budget if budget > 0 else float("inf"))


def print_attention_budget(res: dict, path: str = "M5 path", a: dict = ASSUMPTIONS, min_length: int = 32768) -> None:
    """Long prompts: the time the target leaves the M5 path's prefill attention after the path's
    other work, the useful FLOP rate that takes, and the rate MLX-LM's published figures imply for
    its own attention (the same FLOPs on the same units, in half precision)."""
    parts = []
    for L in sorted(L for p, L in res if p == path and L in MLX_LM_M5_MAX and L >= min_length):
        b = attention_budget(res[path, L], L, a=a)
        mlx = b["useful"] / mlx_attention_s(L)
        if b["budget"] <= 0:
            parts.append(f"{L}: the other work alone ({b['other']:,.1f} s) exceeds the target's {L / TARGETS[L]:,.1f} s")
            continue
        parts.append(f"{L}: the target's {L / TARGETS[L]:,.1f} s less the other work's {b['other']:,.1f} s leaves "
                     f"{b['budget']:,.1f} s for {b['useful'] / 1e12:,.0f} TFLOP (as built {b['as_built']:,.1f} s, "
                     f"{b['useful'] / b['as_built'] / 1e12:,.1f} TFLOP/s): {b['need'] / 1e12:,.1f} TFLOP/s, "
                     f"{b['as_built'] / b['budget']:.2f}x as built and {b['need'] / mlx:.2f}x the {mlx / 1e12:,.1f} "
                     "TFLOP/s MLX-LM's figures imply")
    print(f"  {path}, M5 Max, prefill attention's budget for the target (ESTIMATE; useful FLOPs; MLX-LM's "
          "attention implied: its time at the length less as many tokens at its 4K rate): " + "; ".join(parts))


def print_int8_sensitivity(res: dict, a: dict = ASSUMPTIONS) -> None:
    """How the int8 opt-in's M5 Max line moves with its least certain assumptions: the ALU ops per
    MAC of the int8 kernels (hand counts) and the INT8 matmul2d rate (one microbenchmark)."""
    lengths = (256, 4096, 32768)
    heavy = dict(a, tensor_alu_ops_per_mac=tuple((p, v * 1.5) if p in a["int8_built"] else (p, v)
                                                 for p, v in a["tensor_alu_ops_per_mac"]))
    slow = dict(a, int8_speedup=1.5)
    line = lambda aa: ", ".join(  # noqa: E731
        f"{L}: {estimate(res['M5 int8 opt-in', L]['fams'], res['M5 int8 opt-in', L]['levels'], L, 'M5 Max', aa)['tps']:,.0f}"
        for L in lengths)
    print("  M5 int8 opt-in, M5 Max, if the int8 kernels' ALU ops per MAC were 1.5x the count: " + line(heavy) +
          "; if INT8 matmul2d ran at 1.5x the FP16 rate (not 2x): " + line(slow) +
          "; ALU efficiency each target needs (assumed %.0f%%): " % (100 * a["efficiency"]["alu"]) + ", ".join(
              f"{L}: " + (lambda n: f"{n:.0%}" if n else "not at 100%")(efficiency_for(
                  res["M5 int8 opt-in", L]["fams"], res["M5 int8 opt-in", L]["levels"], L, "M5 Max", "alu", TARGETS[L]))
              for L in lengths) +
          f"; targets {', '.join(f'{TARGETS[L]:,.0f}' for L in lengths)}")


if __name__ == "__main__":
    main()
