"""Per-kernel table of one decode step of the real 35B config, and a roofline + latency estimate of
tok/s on Apple M5 / M5 Max (not a test; not a measurement: nothing runs).

    python benchmarks/decode_table.py [--positions 255 4095 32767] [--markdown] [--bits 3]
    python benchmarks/decode_table.py --widths     # est. tok/s at 2, 3, mixed 3/4, 4 and 8 bits
    python benchmarks/decode_table.py --long       # 64K / 128K / 262K, bf16 and 8-bit KV, published

Every number about the step comes from the counting device (lily_py._core.Engine(..., "count")
.count() and .count_dispatches()): each dispatch's kernel, grid, threads, bytes it reads plus
writes (bytes_touched, computed by the op host code) and its dependency level (barriers before it).
Dispatches are grouped by role (their place in the layer pattern) and grid.

The estimate is a model with stated assumptions, printed with it:
  t_step = sum over levels of max(level bytes / (eta * BW * occupancy), t_min) + levels * t_level
  occupancy = min(1, simdgroups per core of the level / sat)   (too few simdgroups in flight
              cannot keep the memory system busy: Little's law with a bounded number of loads
              in flight per simdgroup)
  the vec attention decode level takes max(its bandwidth time, its instruction time): simd
              instructions per key and KV head counted from the kernel's inner loop (instr_per_key),
              issued at alu_eff x cores x 4 schedulers x clock
  the old staged attention decode kernel (head dims other than 64/128/256) counts its bytes
              `attn_factor` times (instruction-bound, issue 10's analysis)
and tok/s = 1 / t_step. Change the assumptions with the flags; --ideal drops the occupancy and
attention penalties (what the issue-10 kernel designs aim at, with the same level count).
"""
from __future__ import annotations

import argparse
from collections import OrderedDict

from lily_py import _core
from lily_py.backends import resolve_kv_dtype
from lily_py.backends.engine import REAL_QUANT, checkpoint_activations, decode_floor_bytes, engine_spec
from lily_py.config import ModelConfig
from lily_py.sizes import decode_weight_bytes, engine_quant, recipes, weight_bytes
from lily_py.testing import REAL_TEXT_CONFIG

GPUS = {"M5 Max (40 cores, 614 GB/s)": (40, 614e9), "M5 (10 cores, 153 GB/s)": (10, 153e9)}
FULL = dict(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05, seed=1, step=1)

# Facts read off the shaders (shaders/*.metal, as of this branch): bytes per load instruction
# per lane, what runs serially, the design. Kernels the `decode` helper rewrites (issue 10) are
# described as they are here.
FACTS = {
    "embedding": ("4 B codes", "-", "one row gather"),
    "rms_norm": ("4 B", "one threadgroup: whole row, threadgroup_sum", "single threadgroup"),
    "rms_norm_residual": ("4 B", "one threadgroup", "single threadgroup, residual fused"),
    "qmv_b4": ("8 B codes (2 words), 4 B x", "4 rows per simdgroup in a loop with `break` guard; "
               "x re-read per row", "MLX-like qmv, not qmv_fast"),
    "qmv_b8": ("8 B codes, 4 B x", "as qmv; 33 threadgroups for 257 rows", "qmv"),
    "conv1d": ("4 B", "-", "one thread per channel"),
    "gated_delta": ("4 B q/k/v, 16 B state (float4)", "tokens in order; 1 barrier per token",
                    "one threadgroup (1024 threads) per value head"),
    "gated_delta_decode": ("16 B state (float4 load + store), 4 B conv window / input / weights",
                           "conv taps + 1 barrier; 3 simd_sums; raw outputs to o_raw (the gated "
                           "norm is out_proj's, qmv1_gated: MSL 3.1 orders nothing between threadgroups)",
                           "conv1d fused; each value head split by value columns (2 per simdgroup)"),
    "gd_chunk_norm": ("4 B o_raw / z / weight", "one simdgroup per value head: simd_sum of o^2 over Dv",
                      "gated RMSNorm over a head's columns"),
    "qmv1_gated": ("16 B codes (uint4), 2 B scales/biases, 16 B o_raw / z / norm weight",
                   "as qmv1; per block the head's |o|^2 over its lanes (xor shuffles), then x = the gated "
                   "norm's value, rounded as gd_chunk_norm writes it", "out_proj with the gated RMSNorm folded in"),
    "moe_route": ("4 B", "one simdgroup per token; top-k as k rounds of simd_max", "single simdgroup"),
    "moe_gate_up_mv": ("16 B codes, 16 B x", "every slot of a token in one threadgroup, its experts selected once "
                       "(one barrier; the shared slot loads first); one 1024-code block x 4 rows x 2 matrices per lane", "gather_qmv_fast / mul_mv_id (routed + shared slots)"),
    "moe_down_mv": ("16 B codes, 16 B h", "routing read from gate/up's ids and weights; one 32-code chunk of the k + 1 slots' "
                    "K' x 4 rows per lane; splits summed in tg memory", "gather_qmv_fast, split-K over slots"),
    "qk_norm_rope": ("4 B", "-", "one simdgroup per head"),
    # kQmv1Rows (shaders/common/args.h) rows per threadgroup, read from the extension
    "qmv1_b4": ("16 B codes (uint4), 2 B scales/biases, 4 B x", f"{_core.ops.QMV1_ROWS} rows per threadgroup; K split "
                "over <= 4 simdgroups, summed through threadgroup memory (not split for lm_head)",
                "MLX qmv_fast (single token; norm fused)"),
    "qmv1_b8": ("16 B codes (uint4), 2 B scales/biases, 4 B x", "as qmv1_b4", "MLX qmv_fast, 8-bit"),
    # the *_r1 kernels: 1 row per threadgroup where QMV1_ROWS rows would give < QMV1_MIN_SIMDGROUPS
    # simdgroups (qmv1_rows)
    "qmv1_b8_r1": ("16 B codes (uint4), 2 B scales/biases, 4 B x", "1 row per threadgroup (x, residual, "
                   "norm_w re-read and the norm's sum of squares recomputed by each); K split over "
                   "<= 4 simdgroups, summed through threadgroup memory", "MLX qmv_fast, 8-bit, 1 row"),
    "qmv1_b4_r1": ("16 B codes (uint4), 2 B scales/biases, 4 B x", "as qmv1_b8_r1", "MLX qmv_fast, 1 row"),
    # the *_r16 kernels: K not split (lm_head), 16 rows per threadgroup of one simdgroup
    "qmv1_b4_r16": ("16 B codes (uint4), 2 B scales/biases, 4 B x", "16 rows per threadgroup (one simdgroup "
                    "walks K once; x, norm_w and the norm's sum of squares once per 16 rows); rows loaded in "
                    "batches of 8 (8 weight loads per lane in flight)", "MLX qmv_fast, 16 rows, K not split"),
    "qmv1_b8_r16": ("16 B codes (uint4), 2 B scales/biases, 4 B x", "as qmv1_b4_r16", "MLX qmv_fast, 8-bit, 16 rows"),
    "attn_decode_vec": ("16 B (uint4 = 8 bf16 of K and of V per lane per key)", "keys of a block in order, "
                        "ceil(keys / 8) per simdgroup; 8 simdgroups merged in threadgroup memory",
                        "MLX sdpa_vector 2-pass / Lily: GQA query in registers, online softmax"),
    "attn_vec_combine": ("4 B (128 B per simdgroup and block)", "blocks s, s + 8, ... per simdgroup; 8 sums "
                         "through threadgroup memory", "2-pass combine, gate fused"),
    "attn_decode": ("2 B (bf16 K/V staged through threadgroup memory)", "each lane a whole "
                    "256-long dot product; 3 barriers per 32-key block", "blocked, staged"),
    "attn_decode_split": ("2 B (staged)", "as attn_decode, per key range", "split-K + combine"),
    "attn_combine": ("4 B", "-", "split-K combine"),
    "sample_max_partial": ("4 B (128 B per simdgroup load)", "-", "partial argmax"),
    "sample_max_final": ("4 B", "one simdgroup over G partials", "merge"),
    "sample_topk_partial": ("4 B (128 B per simdgroup load)", "top_k rounds, 1 barrier each",
                            "per-threadgroup candidates"),
    "sample_topk_merge": ("4 B", "top_k rounds over G*k candidates; filters + Gumbel on thread 0 "
                          "(k entries)", "one merge"),
    "sample_gumbel_partial": ("4 B (128 B per simdgroup load)", "-", "Gumbel-max partial"),
    "sample_gumbel_final": ("4 B", "one simdgroup", "merge"),
    "sample_hist_partial": ("4 B (128 B per simdgroup load)", "-", "bucket histogram (tg atomics, "
                            "device atomics for non-empty buckets)"),
    "sample_select": ("4 B", "one threadgroup: scan of 1024 buckets, thread 0 picks them",
                      "bucket select"),
    "sample_collect": ("4 B (128 B per simdgroup load)", "-", "candidate append + Gumbel partial"),
    "sample_resolve": ("4 B", "one threadgroup: up to 3 x 16 search rounds over the candidates",
                       "exact cutoff + Gumbel merge"),
}


def facts(kernel: str):
    if kernel.startswith("qmv1_gated"):
        return FACTS["qmv1_gated"]
    for tail in ("_r1", "_r16"):
        if kernel.startswith("qmv1_") and kernel.endswith(tail):
            return FACTS[kernel[:7] + tail]
    for k in sorted(FACTS, key=len, reverse=True):
        if kernel.startswith(k):
            return FACTS[k]
    return ("?", "?", "?")


def roles(dispatches: list[dict], cfg: ModelConfig) -> list[str]:
    """A role name per dispatch, from its place in the layer pattern (csrc/gpu/step.cpp): a
    projection is named by the kernel after it (its consumer) or before it (its producer)."""
    out = []
    kern = [d["kernel"] for d in dispatches]
    for i, d in enumerate(dispatches):
        k = kern[i]
        nxt = kern[i + 1] if i + 1 < len(kern) else ""
        prev = kern[i - 1] if i > 0 else ""
        if k.startswith("embedding"):
            r = "embedding"
        elif k.startswith("rms_norm_residual"):
            r = "post-mixer residual + norm"
        elif k.startswith("rms_norm"):
            r = "final norm" if nxt.startswith("qmv") and dispatches[i + 1]["groups"][0] * 16 >= cfg.vocab_size \
                else "input norm"
        elif k.startswith(("qmv_b8", "qmv1_b8", "qmm_b8")):
            r = "router + shared gate (8-bit, post norm fused)"
        elif k.startswith("moe_route"):
            r = "route (softmax, top-k)"
        elif k.startswith("moe_gate_up"):
            r = "experts gate/up + SwiGLU (8 routed + shared; top-k selected in the kernel)"
        elif k.startswith("moe_down"):
            r = "experts down (+ residual)"
        elif k.startswith("qmv1_gated"):
            r = "DeltaNet out_proj (gated norm fused)"
        elif k.startswith("qmv") and d["groups"][0] * 16 >= cfg.vocab_size:
            r = "lm_head (final norm fused)"
        elif k.startswith("qmv"):
            if nxt.startswith(("gated_delta", "conv1d")):
                r = "DeltaNet in_proj (qkv, z, b, a; input norm fused)"
            elif nxt.startswith("qk_norm_rope"):
                r = "attn qkv_proj (input norm fused)"
            elif prev.startswith(("gated_delta", "gd_chunk_norm")):
                r = "DeltaNet out_proj"
            else:
                r = "attn o_proj"
        elif k.startswith("gated_delta_decode"):
            r = "DeltaNet conv + recurrent step"
        elif k.startswith("gd_chunk_norm"):
            r = "DeltaNet gated norm"
        elif k.startswith("gated_delta"):
            r = "DeltaNet recurrent step"
        elif k.startswith("conv1d"):
            r = "DeltaNet conv1d"
        elif k.startswith("qk_norm_rope"):
            r = "attn q/k norm + RoPE + KV write"
        elif k.startswith("attn_decode_vec"):
            r = "attention decode (vec, pass 1)"
        elif k.startswith("attn_vec_combine"):
            r = "attention combine (vec, pass 2; gate)"
        elif k.startswith("attn_"):
            r = "attention " + k.split("_")[1] + ("" if "split" not in k else " (split-K)")
        elif k.startswith("sample"):
            r = "sampler " + k[len("sample_"):].replace("_f32", "")
        else:
            r = k
        out.append(r)
    return out


def step(cfg: ModelConfig, position: int, sample: dict | None, quant: dict | None = None,
         kv_dtype: str | None = None):
    """One decode step on the counting device; ``quant``: another width (lily_py.sizes.engine_quant);
    ``kv_dtype``: the KV cache's ("int8": the int8 kernels and pools)."""
    q = quant or REAL_QUANT
    spec = engine_spec(cfg, q, context_length=position + 1, prefill_chunk=1,
                       activations=checkpoint_activations(q), kv_dtype=kv_dtype)  # bf16, as load() runs it
    eng = _core.Engine(spec, "count")
    st = eng.count(1, position, False, None if sample is None else dict(sample, valid_vocab=cfg.vocab_size), False)
    return st, eng.count_dispatches()


def table(cfg, position, sample, markdown: bool, quant: dict | None = None) -> None:
    st, ds = step(cfg, position, sample, quant)
    rows: OrderedDict = OrderedDict()
    for r, d in zip(roles(ds, cfg), ds):
        key = (r, d["kernel"], d["groups"], d["threads"], d["bytes_touched"])
        rows.setdefault(key, 0)
        rows[key] += 1
    levels = len({d["level"] for d in ds})
    print(f"\n### decode at position {position} ({'full sampler ' + str(FULL) if sample else 'greedy'}): "
          f"{st['dispatches']} dispatches, {levels} dependent levels, bytes_touched "
          f"{st['bytes_touched'] / 1e6:.1f} MB (floor {decode_floor_bytes(cfg, position=position)['total'] / 1e6:.1f} MB)\n")
    hdr = ["role", "kernel", "n", "MB r+w / token", "grid x threads", "simdgroups/core 40c", "10c",
           "bytes per load (lane)", "serial part", "design", "roofline us 614", "153"]
    sep = " | " if markdown else "  "
    if markdown:
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
    else:
        print(sep.join(hdr))
    for (r, k, g, t, b), n in rows.items():
        simds = g[0] * g[1] * g[2] * ((t[0] * t[1] * t[2] + 31) // 32)
        load, serial, design = facts(k)
        mb = n * b / 1e6
        cells = [r, k, str(n), f"{mb:.3f}", f"{g[0]}x{g[1]}x{g[2]} x {t[0]}", f"{simds / 40:.1f}",
                 f"{simds / 10:.1f}", load, serial, design, f"{n * b / 614e9 * 1e6:.2f}", f"{n * b / 153e9 * 1e6:.2f}"]
        print(("| " + " | ".join(cells) + " |") if markdown else sep.join(cells))


def instr_per_key(group: int, e: int, q8: bool = False) -> int:
    """Simd instructions per key per KV head in attention_vec's key loop (shaders/attention_decode.metal),
    counted from the source, per simdgroup: the K and V loads (bf16: 2 wide loads; int8: 2 and the
    rows' 2 scales), the widening of 2E values (bf16: 1 each; int8 codes by the magic number: shift,
    and-or, subtract), per query head of the group E FMAs for the dot, reduce_scatter8 (16 + 8 + 4 +
    4: selects, shuffles and adds), the lazy-base softmax for all heads (compare and vote, subtract,
    exp at ~4, l: ~8; the rare rebase not counted; int8: +2 for the scales), per head 1 broadcast
    (p) and E FMAs for o += p v; ~4 of loop overhead. Real config (group 8, E 8): 198 bf16, 234 int8
    (272 and 308 before the lazy base and the fused multiply-adds)."""
    loads, widen, scales = (4, 3 * 2 * e, 2) if q8 else (2, 2 * e, 0)
    return loads + widen + group * e + 32 + 8 + scales + group * (1 + e) + 4


def measured_fractions(paths, by: str = "copy") -> tuple[dict, dict, str]:
    """From benchmarks/gpu_kernels.py --json files: ({kernel: fraction of a device copy (by="copy")
    or of a streaming read (by="read") of its bytes it reached}, from the first file's first decode
    row; {context: {attention kernel: fraction}} from every decode row of every file), and a line
    naming the runs. A copy of a small dispatch is slower than a read of it, so the copy fraction
    flatters a kernel; the read fraction is the stricter reading."""
    import json
    frac, attn, runs = {}, {}, []
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path) as f:
            d = json.load(f)
        runs.append(f"{d.get('device')}, {d.get('date')}, {d.get('layers')} layers ({path})")
        for row in d["decode"]:
            ctx = int(row["label"].rsplit(" ", 1)[1])
            for k, r in row["kernels"].items():
                fr = r[f"{by}_us"] / r["us"] if r["us"] > 0 else 1.0
                if k.startswith("attn_"):
                    attn.setdefault(ctx, {})[k] = fr
                elif k not in frac:
                    frac[k] = fr
    return frac, attn, "; ".join(runs)


def stand_in(kernel: str) -> str:
    """The measured kernel an unmeasured one is read as: qmv1_gated_b{b}_s{S}_y{Y}[_r1] (newer than
    the committed runs) as qmv1_b{b}_x{Y}_s{S}[_r1], whose rows, loads and reduction it shares; its
    gated-norm prologue (z, norm weight, sigmoids, shuffles per block) is in no measured fraction."""
    import re
    m = re.fullmatch(r"qmv1_gated_b(\d)_s(\w+?)_y(\w+?)(_r1)?", kernel)
    return f"qmv1_b{m[1]}_x{m[3]}_s{m[2]}{m[4] or ''}" if m else kernel


def stand_ins_used(kernels, frac: dict) -> str:
    """'K as M, ...' for each kernel of `kernels` with no measured fraction of its own that is read
    as its stand_in's; '' when none is."""
    return ", ".join(sorted({f"{k} as {stand_in(k)}" for k in kernels if k not in frac and stand_in(k) in frac}))


def attention_at(attn: dict, context: int) -> tuple[dict, int]:
    """The attention fractions measured at the context nearest to `context` (in log2), and that context."""
    import math
    if not attn:
        return {}, 0
    ctx = min(attn, key=lambda c: (abs(math.log2(c) - math.log2(context)), c))
    return attn[ctx], ctx


def estimate(cfg, positions, sample, eta: float, t_level: float, t_min: float, attn_factor: float,
             sat: float, clock: float = 1.6e9, alu_eff: float = 0.7, quiet: bool = False,
             quant: dict | None = None, measured: str | None = None,
             ipk: int | None = None, kv_dtype: str | None = None, measured_by: str = "copy") -> list:
    """Print (unless quiet) and return [(gpu, context, tok/s)] of the model below. ``quant``: the
    step counted at another width (lily_py.sizes.engine_quant: its own kernels, bytes and grids).
    With `measured` (a gpu_kernels.py JSON), a kernel's eta is eta x min(1, the fraction of a
    device copy, or with measured_by="read" of a streaming read, it reached there): the kernel
    keeps on Apple the shortfall it shows on the NVIDIA GPU.
    ``ipk`` replaces the vec attention's instructions per key and KV head; ``kv_dtype`` counts the
    step with that KV cache ("int8": its kernels and bytes; None: the engine's default)."""
    out = []
    q8 = resolve_kv_dtype(cfg, kv_dtype) == "int8"
    n_ipk = ipk or instr_per_key(cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim // 32, q8=q8)
    frac, attn, run = measured_fractions(measured, measured_by) if measured else ({}, {}, "")
    steps = {pos: step(cfg, pos, sample, quant, kv_dtype) for pos in positions}  # counted once, every GPU reads them
    if not quiet and measured:
        what = "a device copy" if measured_by == "copy" else "a streaming read"
        ctxs = ", ".join(f"{attention_at(attn, p + 1)[1]}" for p in positions)
        subs = stand_ins_used({d["kernel"] for d in steps[positions[0]][1]}, frac)
        print(f"\n### per-kernel eta = {eta} x min(1, fraction of {what} measured on {run}); the "
              f"attention's at the measured context nearest each row's ({ctxs}); "
              f"{'not measured, read as the kernel whose code it shares (stand_in): ' + subs + '; ' if subs else ''}"
              f"other kernels not measured keep {eta}")
    if not quiet:
        print(f"\n### estimate (a model, not a measurement): eta = {eta} of peak bandwidth, occupancy "
          f"min(1, simdgroups per core / {sat:g}), t_level = {t_level * 1e6:.1f} us per dependent "
          f"level (dispatch + barrier drain), a level never shorter than t_min = {t_min * 1e6:.1f} us, "
          f"vec attention: max(bandwidth, {n_ipk} "
          f"instructions per key and KV head at {alu_eff:g} x cores x 4 x {clock / 1e9:g} GHz), staged attention "
          f"bytes x {attn_factor:g}; sampler "
          f"{'full ' + str(FULL) if sample else 'greedy'}\n")
        print("| GPU | context | levels | MB touched | bandwidth part ms | level part ms | est. tok/s |")
        print("|---|---|---|---|---|---|---|")
    for gpu, (cores, bw) in GPUS.items():
        for pos in positions:
            st, ds = steps[pos]
            fk = {**frac, **attention_at(attn, pos + 1)[0]}
            by_level: dict = {}
            issue = alu_eff * cores * 4 * clock  # simd instructions per second
            for d in ds:
                k = d["kernel"]
                staged = k.startswith("attn_decode") and not k.startswith("attn_decode_vec")
                b = d["bytes_touched"] * (attn_factor if staged else 1) / min(1.0, fk.get(k, fk.get(stand_in(k), 1.0)))
                ti = cfg.num_key_value_heads * (pos + 1) * n_ipk / issue if k.startswith("attn_decode_vec") else 0.0
                g, t = d["groups"], d["threads"]
                simds = g[0] * g[1] * g[2] * ((t[0] * t[1] * t[2] + 31) // 32) / cores
                lb, ls, li = by_level.get(d["level"], (0, 0.0, 0.0))
                by_level[d["level"]] = (lb + b, ls + simds, li + ti)
            bw_part = sum(max(b / (eta * bw * (min(1.0, sp / sat) if sat > 0 else 1.0)), ti, t_min)
                          for b, sp, ti in by_level.values())
            lvl_part = len(by_level) * t_level
            tok = 1.0 / (bw_part + lvl_part)
            out.append((gpu, pos + 1, tok))
            if not quiet:
                print(f"| {gpu} | {pos + 1} | {len(by_level)} | {st['bytes_touched'] / 1e6:.0f} | "
                      f"{bw_part * 1e3:.2f} | {lvl_part * 1e3:.2f} | {tok:.0f} |")
    return out


def sensitivity(cfg, positions, a) -> None:
    """Greedy est. tok/s on the first GPU with one assumption changed from the defaults per line."""
    base = dict(eta=a.eta, t_level=a.t_level_us * 1e-6, t_min=a.t_min_us * 1e-6, attn_factor=a.attn_factor,
                sat=a.sat, clock=a.clock_ghz * 1e9, alu_eff=a.alu_eff)
    lines = [("defaults", {}), ("--eta 0.7", dict(eta=0.7)), ("--t-level-us 3", dict(t_level=3e-6)),
             ("--sat 48", dict(sat=48.0)), ("--clock-ghz 1.2", dict(clock=1.2e9)),
             ("--alu-eff 0.5", dict(alu_eff=0.5))]
    first = next(iter(GPUS))
    print(f"sensitivity ({first}, greedy):")
    for name, change in lines:
        for gpu, ctx, tok in estimate(cfg, positions, None, **dict(base, **change), quiet=True):
            if gpu == first:
                print(f"{name:<16} context {ctx:>6}: {tok:.0f} tok/s")


WIDTHS = {"2": "2-bit", "3": "3-bit", "mixed_3_4": "mixed 3/4 (mixed_3_4)", "4": "4-bit", "8": "8-bit"}


def widths(cfg, positions, a) -> None:
    """Greedy est. tok/s per weight width on both GPUs (the defaults' model, bytes scaled per width)."""
    sat, attn = (0.0, 1.0) if a.ideal else (a.sat, a.attn_factor)
    print("| width | weights GiB | weights read per token MB | " + " | ".join(
        f"{g.split(' (')[0]} ctx {p + 1}" for g in GPUS for p in positions) + " |")
    print("|---|---|---|" + "---|" * (len(GPUS) * len(positions)))
    for name in WIDTHS.values():
        res = estimate(cfg, positions, None, a.eta, a.t_level_us * 1e-6, a.t_min_us * 1e-6, attn, sat,
                       a.clock_ghz * 1e9, a.alu_eff, quiet=True, quant=engine_quant(cfg, name))
        r = recipes(cfg)[name]
        print(f"| {name} | {weight_bytes(cfg, r) / 2**30:.2f} | {decode_weight_bytes(cfg, r) / 1e6:.0f} | "
              + " | ".join(f"{tok:.0f}" for _, _, tok in res) + " |")
    print("\nest. tok/s: greedy decode, the estimate above with the defaults, on the step counted at each "
          "width (lily_py.sizes.engine_quant: that width's kernels, grids and bytes; router and shared-expert "
          "gate 8-bit).")


# Published decode on an M5 Max, tok/s (the issue 26 text; Lily: perplexityai/pplx-garden's lily docs,
# MLX-LM: mlx 0.32.2 / mlx-lm 0.31.3 as measured there). No figures are published for 262K.
PUBLISHED_LONG = {65536: (125.4, 98.5), 131072: (92.7, 75.0)}  # context: (Lily, MLX-LM)
LONG_TARGET = 1.5  # x MLX-LM at 64K and 128K (issue 26)


def int8_kv(cfg) -> tuple[float, int]:
    """(bytes factor, instructions per key and KV head) of attn_decode_vec_q8 on the int8 KV cache
    (kv_dtype="int8"): a row moves D + 4 bytes instead of 2D; instr_per_key(q8=True)."""
    group, D = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    return (D + 4) / (2 * D), instr_per_key(group, D // 32, q8=True)


def quiet_estimate_args(a) -> dict:
    """estimate()'s model arguments from the command line (--ideal: no occupancy penalty, staged
    attention at its roofline), printing nothing."""
    sat, attn = (0.0, 1.0) if a.ideal else (a.sat, a.attn_factor)
    return dict(eta=a.eta, t_level=a.t_level_us * 1e-6, t_min=a.t_min_us * 1e-6, attn_factor=attn, sat=sat,
                clock=a.clock_ghz * 1e9, alu_eff=a.alu_eff, quiet=True)


def long_context(cfg, a) -> None:
    """Greedy est. tok/s at 64K, 128K and 262K on the M5 Max: the bf16 KV cache (the default, the
    numerics of the published figures) and the int8 one (int8_kv), the published figures, the target, and the instructions per key and
    KV head that would reach the target with each cache (bisection on the model's ipk)."""
    kw = quiet_estimate_args(a)
    positions = [65535, 131071, 262143]
    gpu = next(iter(GPUS))
    cores, bw = GPUS[gpu]
    f8, ipk8 = int8_kv(cfg)
    ipk16 = instr_per_key(cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim // 32)
    caches = {"bf16": ("bfloat16", ipk16), "int8": ("int8", ipk8)}

    def tok(pos, kv, ipk):
        return {c: t for g, c, t in estimate(cfg, [pos], None, ipk=ipk, kv_dtype=kv, **kw) if g == gpu}[pos + 1]

    def needed(pos, kv, ipk, target):
        """The most instructions per key that reach the target, or a word."""
        if tok(pos, kv, ipk) >= target:
            return f"{ipk} (met)"
        if tok(pos, kv, 1) < target:
            return "not by instructions"
        lo, hi = 1, ipk
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if tok(pos, kv, mid) >= target else (lo, mid)
        return str(lo)

    print(f"{gpu}, greedy decode (ESTIMATE: the model above with the defaults; Lily and MLX-LM: "
          "published)\n")
    print("| context | MB touched: bf16 / int8 KV | bytes / floor: bf16 / int8 | est. bf16 KV | est. int8 KV "
          "| Lily | MLX-LM | bf16 KV / MLX-LM | int8 KV / MLX-LM | target 1.5x MLX-LM | instr. per key for the target: bf16 / int8 KV |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for pos in positions:
        c = pos + 1
        mb, ratio = [], []
        for kv, _ in caches.values():
            st, _ = step(cfg, pos, None, kv_dtype=kv)
            mb.append(f"{st['bytes_touched'] / 1e6:,.0f}")
            ratio.append(f"{st['bytes_touched'] / decode_floor_bytes(cfg, position=pos, kv_dtype=kv)['total']:.3f}")
        est = {name: tok(pos, kv, ipk) for name, (kv, ipk) in caches.items()}
        row = [f"{c}", " / ".join(mb), " / ".join(ratio), f"{est['bf16']:.0f}", f"{est['int8']:.0f}"]
        if c in PUBLISHED_LONG:
            lily, mlx = PUBLISHED_LONG[c]
            target = LONG_TARGET * mlx
            row += [f"{lily:.1f}", f"{mlx:.1f}", f"{est['bf16'] / mlx:.2f}", f"{est['int8'] / mlx:.2f}", f"{target:.0f}",
                    " / ".join(needed(pos, kv, ipk, target) for kv, ipk in caches.values())]
        else:
            row += ["-"] * 6
        print("| " + " | ".join(row) + " |")
    kvh, D = cfg.num_key_value_heads, cfg.head_dim
    pos = 131071
    t_bw = 2 * kvh * D * 2 * (pos + 1) / (a.eta * bw)
    t_in = kvh * (pos + 1) * ipk16 / (a.alu_eff * cores * 4 * a.clock_ghz * 1e9)
    print(f"\nper attention layer at {pos + 1}, bf16 KV: KV bandwidth time {t_bw * 1e3:.3f} ms, instruction "
          f"time {t_in * 1e3:.3f} ms ({ipk16} per key and KV head); the level takes the larger. "
          f"int8 KV (attn_decode_vec_q8): bytes x {f8:.3f}, {ipk8} instructions per key (int8_kv).")


# MLX-LM's published decode on an M5 Max, tok/s (docs/decode.md; PUBLISHED_LONG for 64K / 128K).
PUBLISHED_MLX_LM = {256: 148.5, 4096: 145.6, 32768: 118.2, **{c: m for c, (_, m) in PUBLISHED_LONG.items()}}
TARGET_CONTEXTS = [255, 4095, 32767, 65535, 131071]


def target_table(cfg, a) -> None:
    """Issue 41's target table: the greedy estimate on the M5 Max with the measured per-kernel
    efficiencies (--measured: gpu_kernels.py JSONs, split by their kv_dtype), read by the copy and
    by the read fraction, with the bf16 KV cache (MLX-LM's numerics) and the int8 one, against
    1.5x MLX-LM's published figures at 256 / 4K / 32K / 64K / 128K."""
    import json
    files: dict = {}
    for path in a.measured or []:
        with open(path) as f:
            files.setdefault(json.load(f).get("kv_dtype"), []).append(path)
    kw = quiet_estimate_args(a)
    gpu = next(iter(GPUS))
    cols, subs = {}, set()
    for kv, name in (("bfloat16", "bf16"), ("int8", "int8")):
        if kv not in files:
            continue
        kernels = {d["kernel"] for d in step(cfg, TARGET_CONTEXTS[0], None, None, kv)[1]}
        subs.add(stand_ins_used(kernels, measured_fractions(files[kv])[0]))
        for by in ("copy", "read"):
            res = estimate(cfg, TARGET_CONTEXTS, None, measured=files[kv], measured_by=by, kv_dtype=kv, **kw)
            cols[f"{name} KV, {by}"] = {c: t for g, c, t in res if g == gpu}
        _, att, run = measured_fractions(files[kv])
        near = ", ".join(f"{p + 1} from {attention_at(att, p + 1)[1]}" for p in TARGET_CONTEXTS)
        print(f"{name} KV: measured on {run}; the attention's fraction at the measured context nearest each ({near})")
    print(f"\n{gpu}, greedy decode, ESTIMATE with each kernel's measured fraction (a model, not a measurement; "
          f"{''.join(f'not measured, read as its stand_in: {x}; ' for x in sorted(subs) if x)}MLX-LM: published). "
          f"Target: {LONG_TARGET}x MLX-LM.\n")
    print("| context | " + " | ".join(f"est. {c}" for c in cols) + " | MLX-LM | target | "
          + " | ".join(f"{c} / MLX-LM" for c in cols) + " |")
    print("|---|" + "---|" * (2 * len(cols) + 2))
    for pos in TARGET_CONTEXTS:
        c = pos + 1
        m = PUBLISHED_MLX_LM[c]
        print(f"| {c} | " + " | ".join(f"{v[c]:.0f}" for v in cols.values()) + f" | {m} | {LONG_TARGET * m:.0f} | "
              + " | ".join(f"{v[c] / m:.2f}x" for v in cols.values()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, nargs="*", default=[255, 4095, 32767])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--eta", type=float, default=0.8)
    ap.add_argument("--t-level-us", type=float, default=2.0)
    ap.add_argument("--t-min-us", type=float, default=2.0)
    ap.add_argument("--attn-factor", type=float, default=4.0)
    ap.add_argument("--sat", type=float, default=32.0,
                    help="simdgroups per core a level needs to reach eta of the bandwidth")
    ap.add_argument("--clock-ghz", type=float, default=1.6, help="GPU clock assumed for instruction time")
    ap.add_argument("--alu-eff", type=float, default=0.7, help="fraction of the issue rate a kernel reaches")
    ap.add_argument("--ideal", action="store_true",
                    help="no occupancy penalty (sat 0) and staged attention at its roofline (factor 1)")
    ap.add_argument("--measured", default=None, nargs="+",
                    help="benchmarks/gpu_kernels.py --json files: per-kernel eta from the GPU's fractions of copy "
                         "speed (the attention's from the measured context nearest each position)")
    ap.add_argument("--measured-by", choices=["copy", "read"], default="copy",
                    help="with --measured: the fraction of a device copy (default) or of a streaming read")
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument("--no-estimate", action="store_true")
    ap.add_argument("--sensitivity", action="store_true",
                    help="only the greedy estimate with one assumption changed per line")
    ap.add_argument("--bits", choices=list(WIDTHS), default=None,
                    help="estimate at this weight width (mixed_3_4: mlx-lm's recipe) instead of the real 4-bit "
                         "checkpoint's: the step counted with that width's kernels (lily_py.sizes.engine_quant)")
    ap.add_argument("--widths", action="store_true",
                    help="only the greedy estimate at every width (2, 3, mixed 3/4, 4, 8 bits)")
    ap.add_argument("--targets", action="store_true",
                    help="only issue 41's target table: the measured estimate (--measured JSONs of both KV dtypes) "
                         "at 256 / 4K / 32K / 64K / 128K against 1.5x MLX-LM")
    ap.add_argument("--long", action="store_true",
                    help="only the long-context table: 64K, 128K, 262K, bf16 and 8-bit KV, published figures")
    a = ap.parse_args()
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    if a.long:
        long_context(cfg, a)
        return
    if a.targets:
        target_table(cfg, a)
        return
    if a.sensitivity:
        sensitivity(cfg, a.positions, a)
        return
    if a.widths:
        widths(cfg, a.positions, a)
        return
    quant = engine_quant(cfg, WIDTHS[a.bits]) if a.bits else None
    if not a.no_table:
        for pos in a.positions:
            table(cfg, pos, None, a.markdown, quant)
        table(cfg, a.positions[0], FULL, a.markdown, quant)
    if a.no_estimate:
        return
    sat, attn = (0.0, 1.0) if a.ideal else (a.sat, a.attn_factor)
    for sample in (None, FULL):
        estimate(cfg, a.positions, sample, a.eta, a.t_level_us * 1e-6, a.t_min_us * 1e-6, attn, sat,
                 a.clock_ghz * 1e9, a.alu_eff, quant=quant, measured=a.measured,
                 measured_by=a.measured_by)


if __name__ == "__main__":
    main()
