"""benchmarks/prefill_estimate.py's core on the tiny config (so the estimate cannot rot): the
families it builds from the counting device's dispatches keep every useful FLOP, the MoE split by
tile kind keeps every row, and the time model is what its docstring says."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lily_py.backends.engine import count_step
from lily_py.config import ModelConfig
from lily_py.testing import TINY_TEXT_CONFIG, simulated_device

_spec = importlib.util.spec_from_file_location(
    "prefill_estimate", Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_estimate.py")
pe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pe)


def _cfg():
    return ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(TINY_TEXT_CONFIG)})


def test_family_names():
    assert pe.family("qmm_bf16_b4_xbf16_sbf16") == "qmm_bf16"
    assert pe.family("qmm_m5_b4_xbf16_sbf16") == "qmm_m5"
    assert pe.family("qmm_b8_xbf16_sbf16") == "qmm"
    assert pe.family("attn_prefill_m5_d256_bf16") == "attn_prefill_m5"
    assert pe.family("moe_down_bf16_64_b4_sbf16") == "moe_down_bf16_64"
    assert pe.family("gd_chunk_state_f32") == "gd_chunk_state"
    assert pe.family("rms_norm_residual_xbf16_wf32") == "rms_norm_residual"
    for name, kind in [("moe_gate_up_m5_64_b4_xbf16_sbf16", ("gate_up", "64")),
                       ("moe_down_bf16_32_b4_sbf16", ("down", "32")), ("moe_down_mm64_b4_sbf16", ("down", "64")),
                       ("moe_gate_up_few_b4_xbf16_sbf16", ("gate_up", "few"))]:
        assert pe._MOE_KIND.match(name).groups() == kind
    assert pe._MOE_KIND.match("moe_gate_up_mv_b4_xbf16_sbf16") is None
    assert pe.family("moe_gate_up_m5i8_64_b4_xbf16_sbf16") == "moe_gate_up_m5i8_64"
    assert pe._MOE_KIND.match("moe_down_m5i8_64_b4_sbf16").groups() == ("down", "64")


def test_int8_path_charges_exactly_the_built_int8_families():
    """The "M5 int8 opt-in" path: the projections and the MoE 64-row tiles are the int8 kernels,
    charged half their tensor-op time, and every tensor-op family its ALU work (staging, int8
    quantization and rescale: tensor_alu_ops_per_mac) overlapped with it; the MoE 32-row tiles keep
    half operands; every useful FLOP is still in some family. The what-if int8 design is charged
    its own ALU ops per MAC."""
    cfg = _cfg()
    L, chunk = 200, 64
    f8, lv8 = pe.prompt_families(cfg, L, "int8", chunk)
    f5, _ = pe.prompt_families(cfg, L, True, chunk)
    assert {n for n, f in f8.items() if pe.int8_family(n, f)} == {"qmm_m5i8", "moe_gate_up_m5i8_64", "moe_down_m5i8_64"}
    # the default (bf16) KV cache: the M5 attention on half operands on both M5 paths (scores on
    # int8 come with kv_dtype="int8" only)
    assert not any(pe.int8_family(n, f) for n, f in f5.items())
    assert "attn_prefill_m5" in f5 and "attn_prefill_m5" in f8
    assert not any(n.startswith("attn_prefill_m5i8") for n in list(f5) + list(f8))
    assert sum(f["useful"] for f in f8.values()) == sum(f["useful"] for f in f5.values())
    assert f8["moe_gate_up_m5i8_64"]["executed"] == f5["moe_gate_up_m5_64"]["executed"]
    a = pe.ASSUMPTIONS
    ops = dict(a["tensor_alu_ops_per_mac"])
    e = pe.estimate(f8, lv8, L, "M5 Max")
    bw = a["eta"] * a["bandwidth_gbs"]["M5 Max"] * 1e9
    alu = pe.unit_rate("alu", "M5 Max", a)
    for name, key in (("qmm_m5i8", "qmm_m5i8"), ("moe_gate_up_m5i8_64", "moe_gate_up_m5i8"),
                      ("moe_down_m5i8_64", "moe_down_m5i8"), ("qmm_m5", "qmm_m5")):
        f = f8[name]
        tc = f["executed"] * pe.shape_factor(name, "tensor", a) / pe.unit_rate("tensor", "M5 Max", a)
        if pe.int8_family(name, f):
            tc /= a["int8_speedup"]
        want = max(tc, f["executed"] * ops[key] / alu, f["bytes"] / bw)
        assert e["times"][name][0] == pytest.approx(want), name
    # the bf16 cache's attention is the same on both paths (the opt-in's int8 is the projections' and
    # the MoE's; scores on int8 need kv_dtype="int8", which this estimate does not model)
    e5 = pe.estimate(f5, pe.prompt_families(cfg, L, True, chunk)[1], L, "M5 Max")
    assert e["times"]["attn_prefill_m5"][0] == pytest.approx(e5["times"]["attn_prefill_m5"][0])
    tc = f8["moe_gate_up_m5_32"]["executed"] * pe.shape_factor("moe_gate_up_m5_32", "tensor", a) / \
        pe.unit_rate("tensor", "M5 Max", a)
    assert e["times"]["moe_gate_up_m5_32"][0] == pytest.approx(
        max(tc, pe.alu_time("moe_gate_up_m5_32", f8["moe_gate_up_m5_32"], "M5 Max", a), f8["moe_gate_up_m5_32"]["bytes"] / bw))
    # the 32-row kind's 16-row tiles: their true MACs at tensor_alu_ops_per_mac_16
    f = f5["moe_gate_up_m5_32"]
    ops16 = dict(a["tensor_alu_ops_per_mac_16"])["moe_gate_up_m5_32"]
    assert f["executed16"] > 0
    assert pe.alu_time("moe_gate_up_m5_32", f, "M5 Max", a) == pytest.approx(
        ((f["executed"] - f["executed16"]) * ops["moe_gate_up_m5_32"] + f["executed16_true"] * ops16) / alu)
    # as built (x and h quantized once by quantize_i8, rescaled per 64 columns) the int8 kernels keep
    # their ALU work within 1.25x their int8 tensor time (the first forms, quantizing while staging:
    # 4-6x)
    def alu_over_tensor(name, key):
        f = f8[name]
        tc = f["executed"] * pe.shape_factor(name, "tensor", a) / pe.unit_rate("tensor", "M5 Max", a) / a["int8_speedup"]
        return f["executed"] * ops[key] / alu / tc
    for name, key in (("qmm_m5i8", "qmm_m5i8"), ("moe_gate_up_m5i8_64", "moe_gate_up_m5i8"),
                      ("moe_down_m5i8_64", "moe_down_m5i8")):
        assert alu_over_tensor(name, key) < 1.25, name
    assert "quantize_i8" in f8 and f8["quantize_i8"]["unit"] == "alu" and "quantize_i8" not in f5
    # the what-if design: marked families at int8_design_alu_ops_per_mac
    w = pe.with_int8(f5)
    assert w["qmm_m5"]["int8"] and pe.alu_ops_per_mac("qmm_m5", w["qmm_m5"]) == a["int8_design_alu_ops_per_mac"]
    assert pe.alu_ops_per_mac("qmm_m5", f5["qmm_m5"]) == ops["qmm_m5"]
    assert pe.alu_ops_per_mac("rms_norm", f5["rms_norm"]) == 0.0


@pytest.mark.parametrize("tensor_ops", [False, True])
@pytest.mark.parametrize("T", [9, 97, 301])
def test_moe_split_keeps_every_row(T, tensor_ops):
    cfg = _cfg()
    s = pe.moe_split(cfg, T, layers=3, seed=1, tensor_ops=tensor_ops)
    small = 16 if tensor_ops else 32  # the M5 32-row kind runs tiles of <= 16 rows as 16
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    for stage, per in (("gate_up", 4), ("down", 2)):
        assert sum(s[stage, kd]["rows"] for kd in ("64", "32", "few")) == 3 * T * (k + 1)
        assert sum(s[stage, kd]["useful"] for kd in ("64", "32", "few")) == 3 * T * (k + 1) * per * H * I
        assert s[stage, "few"]["executed"] == s[stage, "few"]["useful"]  # matvec: exact
        for kd in ("64", "32"):
            assert s[stage, kd]["executed"] >= s[stage, kd]["useful"]
            assert s[stage, kd]["executed"] % (small * per * H * 32) == 0 or s[stage, kd]["executed"] == 0
    # the 32-row kind's tiles of <= 16 rows (M5 only): counted at 16 rows, their true rows
    for stage in ("gate_up", "down"):
        e16, e16t = s[stage, "32"]["executed16"], s[stage, "32"]["executed16_true"]
        assert e16 == e16t and 0 <= e16 <= s[stage, "32"]["executed"]
        assert (e16 > 0) == (tensor_ops and e16 > 0) and (tensor_ops or e16 == 0)
        assert s[stage, "64"]["executed16"] == s[stage, "few"]["executed16"] == 0
    if tensor_ops:  # counted as 32 rows (the sensitivity line): executed doubles, the true MACs do not
        s32 = pe.moe_split(cfg, T, layers=3, seed=1, tensor_ops=True, tile16_cost=32)
        assert s32["gate_up", "32"]["executed16"] == 2 * s["gate_up", "32"]["executed16"]
        assert s32["gate_up", "32"]["executed16_true"] == s["gate_up", "32"]["executed16_true"]
    # the M5 plan's few-row tiles hold <= 2 rows, the M1-M4 plan's <= 8: fewer rows on M5
    if tensor_ops:
        m14 = pe.moe_split(cfg, T, layers=3, seed=1)
        assert s["gate_up", "few"]["rows"] <= m14["gate_up", "few"]["rows"]
        assert s["gate_up", "32"]["executed"] <= m14["gate_up", "32"]["executed"] + \
            (m14["gate_up", "few"]["rows"] - s["gate_up", "few"]["rows"]) * 16 * 4 * H * I


def test_targets_are_the_published_figures_times_1_3():
    assert pe.TARGETS[4096] == pytest.approx(pe.TARGET, rel=1e-4)  # the 5,166 x 1.3
    assert pe.TARGETS[256] == pytest.approx(1.3 * 2536.4) and pe.TARGETS[32768] == pytest.approx(1.3 * 3963.7)


@pytest.mark.parametrize("tensor_ops", [False, True])
def test_prompt_families_and_estimate(tensor_ops):
    cfg = _cfg()
    L, chunk = 200, 64  # chunks of 64, 64, 64 and 8 tokens (the last one: scan and matvec routes)
    fams, levels = pe.prompt_families(cfg, L, tensor_ops, chunk)
    useful = 0
    with simulated_device(tensor_ops=tensor_ops):
        for pos in range(0, L, chunk):
            T = min(chunk, L - pos)
            st = count_step(cfg, tokens=T, position=pos, context_length=L, prefill_chunk=T)
            useful += st["flops_useful"] - (0 if pos + T >= L else 2 * cfg.vocab_size * cfg.hidden_size)
    # every useful FLOP of every chunk is in some family (the MoE kinds' split keeps every row);
    # only the last chunk computes logits
    assert sum(f["useful"] for f in fams.values()) == useful
    units = {f["unit"] for f in fams.values() if f["executed"]}
    assert ("tensor" in units) == tensor_ops
    assert all(f["executed"] >= f["useful"] for f in fams.values())
    a = pe.ASSUMPTIONS
    e = pe.estimate(fams, levels, L, "M5 Max")
    bw = a["eta"] * a["bandwidth_gbs"]["M5 Max"] * 1e9
    for name, f in fams.items():
        tc = f["executed"] * pe.shape_factor(name, f["unit"], a) / pe.unit_rate(f["unit"], "M5 Max", a)
        ta = pe.alu_time(name, f, "M5 Max", a)
        assert (ta > 0) == (f["unit"] == "tensor" and f["executed"] > 0 and name.startswith(
            ("qmm_m5", "moe_gate_up_m5", "moe_down_m5", "attn_prefill_m5"))), name
        if f.get("executed16", 0) == 0:  # no 16-row split: executed x ops per MAC
            assert ta == pytest.approx(f["executed"] * pe.alu_ops_per_mac(name, f, a) / pe.unit_rate("alu", "M5 Max", a))
        assert e["times"][name][0] == pytest.approx(max(tc, ta, f["bytes"] / bw))
    assert e["total"] == pytest.approx(sum(t for t, _ in e["times"].values()) + levels * a["t_level_us"] * 1e-6)
    assert e["tps"] == pytest.approx(L / e["total"])
    # a faster GPU never estimates fewer tokens/s
    fast = dict(a, alu_tflops={"M5 Max": 2 * a["alu_tflops"]["M5 Max"]},
                tensor_tflops={"M5 Max": 2 * a["tensor_tflops"]["M5 Max"]})
    assert pe.estimate(fams, levels, L, "M5 Max", fast)["tps"] > e["tps"]


def test_run_prints_both_paths(capsys):
    res = pe.run(_cfg(), lengths=(70, 130), chunk=64)
    assert set(res) == {(p, L) for p, _ in pe.PATHS for L in (70, 130)}
    pe.print_tables(res)
    out = capsys.readouterr().out
    assert "M5 path, prompt 130 tokens" in out and "Summary (ESTIMATE, tok/s)" in out
    assert "levels x t_level" in out and "target: 1.3 x MLX-LM" in out
    assert "M5 path, M5 Max vs the target" not in out  # 70 / 130 tokens: no published figure


def test_attention_budget_is_the_time_that_meets_the_target():
    """attention_budget: the path's other work plus the attention's budget is the target's time,
    the other work is the estimate without the attention family; MLX-LM's implied attention is its
    published time less as many tokens at its 4K rate."""
    L = 512
    r = pe.run(_cfg(), lengths=(L,), chunk=128)["M5 path", L]
    b = pe.attention_budget(r, L)
    assert b["name"].startswith("attn_prefill_m5") and b["useful"] == r["fams"][b["name"]]["useful"] > 0
    e = pe.estimate(r["fams"], r["levels"], L, "M5 Max")
    without = pe.estimate({n: f for n, f in r["fams"].items() if n != b["name"]}, r["levels"], L, "M5 Max")
    assert b["as_built"] == e["times"][b["name"]][0] > 0
    assert b["other"] == pytest.approx(without["total"])
    assert b["other"] + b["budget"] == pytest.approx(L / pe.TARGETS[L])
    assert b["need"] == pytest.approx(b["useful"] / b["budget"])
    assert pe.mlx_attention_s(131072) == pytest.approx(131072 / 2237.5 - 131072 / 5165.7)
