"""Prefill throughput ESTIMATE for the real 35B config (not a measurement; nothing runs on a GPU).

    python benchmarks/prefill_estimate.py

FLOPs per token come from the engine's counters on the counting device (count_step: the real
config encoded, nothing allocated): `flops_useful` (what the math needs) and `flops_executed`
(what today's tiles run). Everything else is an ASSUMPTION listed in ASSUMPTIONS below and in
docs/performance.md ("## Prefill"); change them and rerun. tokens/s = min(compute bound, weight
bandwidth bound), per prompt length L prefilled in chunks of min(L, 4096) tokens.
"""
from __future__ import annotations

from lily_py.backends.engine import count_step
from lily_py.config import ModelConfig
from lily_py.testing import REAL_TEXT_CONFIG

ASSUMPTIONS = {
    # GPU ALU fp32 peak (FMA = 2 FLOPs): 128 FP32 lanes per core at ~1.75 GHz; M5 Max 40 cores,
    # M5 10 cores. Consistent with the "capped near 3,400 tok/s at 100% of ALU peak".
    "alu_tflops": {"M5": 4.5, "M5 Max": 17.9},
    # Metal 4 tensor ops on the M5 neural accelerators, bf16 in / fp32 accumulate: 4x the ALU
    # peak (Apple's "over 4x peak GPU compute for AI" vs M4; not a measured figure).
    "tensor_tflops": {"M5": 18.0, "M5 Max": 71.6},
    # Unified memory bandwidth, GB/s (M5: Apple's spec; M5 Max: assumed = M4 Max's 546).
    "bandwidth_gbs": {"M5": 153.0, "M5 Max": 546.0},
    # Weight bytes a chunk reads: the whole 4-bit model (every expert is hit by >= 256 tokens with
    # top-8 of 256: expected distinct experts 256 (1 - (255/256)^(8 T)) ~ 256).
    "weight_gb": 19.5,
    # Fraction of the peak the matmul kernels sustain, per path (assumed).
    "efficiency": {"fp32 32x32 tiles (today)": 0.35, "bf16 64x64 simdgroup tiles (M1-M4 path)": 0.65,
                   "Metal 4 tensor ops (M5 path)": 0.55},
    # executed / useful FLOPs on the future paths (64-row tiles, no MoE waste: items 2 and 4).
    "future_padding": 1.05,
}
MLX_LM_4K_M5_MAX = 5166  # tok/s, published (issue 11)


def per_token(cfg, L: int) -> tuple[float, float]:
    """(useful, executed) FLOPs per token averaged over a prompt of L tokens in 4096-token chunks."""
    chunk = min(L, 4096)
    useful = executed = 0
    for pos in range(0, L, chunk):
        st = count_step(cfg, tokens=chunk, position=pos, context_length=L)
        useful += st["flops_useful"]
        executed += st["flops_executed"]
    return useful / L, executed / L


def qmm_flops_per_token(cfg) -> float:
    """Useful FLOPs per token of the dense 4-bit projections (the qmm family, the one family with
    a tensor-op kernel today: shaders/m5/qmm_m5.metal), from the config's shapes: DeltaNet in
    (q, k, v, z, b, a) and out projections, attention q (with its gate), k, v and o. The router
    (8-bit in MLX conversions) and the experts (MoE kernels) are not qmm."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    dn_in = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
        2 * cfg.linear_num_value_heads * cfg.linear_value_head_dim + 2 * cfg.linear_num_value_heads
    dn_out = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    attn_in = 2 * h * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim
    attn_out = h * cfg.head_dim
    n_attn = sum(1 for t in cfg.layer_types if t == "full_attention")
    n_dn = cfg.num_hidden_layers - n_attn
    return 2.0 * (n_dn * (d * dn_in + dn_out * d) + n_attn * (d * attn_in + attn_out * d))


def moe_rows_executed(T: int, E: int = 256, k: int = 8, seed: int = 0) -> dict:
    """Expert rows the tiles compute for T tokens under uniform random routing (simulated: each
    token picks k distinct experts uniformly; the shared group holds all T), per tile scheme:
    before (one tile size per chunk: 32 rows if T k < 3072, else 64; every group padded to it) and
    now (shaders/moe.metal moe_plan: 64-row tiles, remainder in a 32-row tile or a few-row
    matvec tile of <= 8 rows). Returns executed rows / useful rows for each."""
    import numpy as np
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k]
    counts = np.append(np.bincount(ids.ravel(), minlength=E), T)
    bm = 32 if T * k < 3072 else 64
    before = int((-(-counts // bm) * bm).sum())
    rem = counts % 64
    now = int((64 * (counts // 64) + np.where(rem > 32, 64, np.where(rem > 8, 32, rem))).sum())
    useful = int(counts.sum())
    return {"before": before / useful, "now": now / useful}


def main() -> None:
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    a = ASSUMPTIONS
    print("ESTIMATE, not a measurement. Assumptions:", a)
    for L in (256, 4096, 32768):
        useful, executed = per_token(cfg, L)
        chunk = min(L, 4096)
        moe = moe_rows_executed(chunk)
        print(f"prompt {L:>5} tokens: GFLOP/token useful {useful / 1e9:.2f}, executed today {executed / 1e9:.2f} "
              f"(MoE tiles at the bound over every routing); MoE expert rows executed / useful under "
              f"uniform routing (simulated): {moe['before']:.2f} before per-expert tiles, {moe['now']:.2f} now")
        for gpu in ("M5", "M5 Max"):
            bw = a["bandwidth_gbs"][gpu] * 1e9 / (a["weight_gb"] * 1e9 / chunk)
            cells = []
            for path, eff in a["efficiency"].items():
                today = path.startswith("fp32")
                peak = (a["tensor_tflops"] if path.startswith("Metal 4") else a["alu_tflops"])[gpu] * 1e12
                flops = executed if today else useful * a["future_padding"]
                tps = min(eff * peak / flops, bw)
                cells.append(f"{path}: {tps:>7,.0f}")
            print(f"  {gpu:<7} (weight-bandwidth bound {bw:>8,.0f} tok/s)  " + " | ".join(cells))
            # As built (issue 11 item 3, first family): only qmm on tensor ops; the rest of the
            # useful FLOPs on today's fp32 tiles, or on the M1-M4 bf16 tiles once item 2 lands.
            q = qmm_flops_per_token(cfg)
            t_qmm = q * a["future_padding"] / (a["efficiency"]["Metal 4 tensor ops (M5 path)"] * a["tensor_tflops"][gpu] * 1e12)
            rest_today = (executed - q) / (a["efficiency"]["fp32 32x32 tiles (today)"] * a["alu_tflops"][gpu] * 1e12)
            rest_m14 = (useful - q) * a["future_padding"] / (
                a["efficiency"]["bf16 64x64 simdgroup tiles (M1-M4 path)"] * a["alu_tflops"][gpu] * 1e12)
            print(f"  {'':<7}  qmm only on tensor ops ({q / useful:.0%} of useful FLOPs): rest on today's tiles "
                  f"{min(1 / (t_qmm + rest_today), bw):>7,.0f} | rest on the M1-M4 tiles {min(1 / (t_qmm + rest_m14), bw):>7,.0f}")
    print(f"target: 1.3 x MLX-LM's published {MLX_LM_4K_M5_MAX} tok/s at 4K on M5 Max = "
          f"{1.3 * MLX_LM_4K_M5_MAX:,.0f} tok/s")


if __name__ == "__main__":
    main()
