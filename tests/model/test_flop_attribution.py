"""Per-dispatch FLOP attribution and execution units on the counting device (Encoder::add_flops
attributes to the dispatch just encoded; kernel_default_unit / Encoder::set_unit give its unit).
benchmarks/prefill_estimate.py groups a step's work by these; the counts here are exact, derived
from the config."""
from __future__ import annotations

from collections import defaultdict

import pytest

from lily_py import _core
from lily_py.backends.engine import count_dispatches, count_step
from lily_py.config import ModelConfig
from lily_py.testing import TINY_TEXT_CONFIG, simulated_device

# Matrix-like kernels that run as plain ALU code (matvecs, the per-token scan, scalar attention).
ALU_MATMULS = ("qmv", "moe_gate_up_mv", "moe_down_mv", "moe_gate_up_few", "moe_down_few", "gated_delta_",
               "attn_decode", "attn_prefill_f32", "attn_prefill_bf16")


def _cfg():
    return ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(TINY_TEXT_CONFIG)})


def _gd_chunk_flops(T, Hv, Dk, Dv):
    """(wy, state) executed FLOPs of the chunked delta rule, derived here from the kernels' 8x8
    products (gd_chunk_wy: K K^T, u, wn, Q K^T over the 36 lower-triangle tiles of a 64-token chunk
    plus the forward substitution; gd_chunk_state: U, O and S updates per 8 value columns)."""
    tile, CT, nk, nv = 2 * 8 * 8 * 8, 8, Dk // 8, Dv // 8
    lower = CT * (CT + 1) // 2
    subst = sum(2 * (i - c - 1) for c in range(64) for i in range(c + 1, 64))
    wy = (lower * nk + nv * lower + nk * lower + lower * nk) * tile + subst
    state = nv * (2 * CT * nk + CT + lower + CT + nk + nk * CT) * tile
    n = -(-T // 64) * Hv
    return n * wy, n * state


@pytest.mark.parametrize("tensor_ops", [False, True])
@pytest.mark.parametrize("tokens,position", [(97, 5), (3, 11)])
def test_flops_attributed_per_dispatch(tokens, position, tensor_ops):
    cfg = _cfg()
    with simulated_device(tensor_ops=tensor_ops):
        st, ds = count_dispatches(cfg, tokens=tokens, position=position)
    assert len(ds) == st["dispatches"]
    # nothing is lost: the per-dispatch FLOPs sum to the step's counters
    assert sum(d["flops_executed"] for d in ds) == st["flops_executed"]
    assert sum(d["flops_useful"] for d in ds) == st["flops_useful"]
    if not tensor_ops:
        plain = count_step(cfg, tokens=tokens, position=position)
        assert [plain[c] for c in ("dispatches", "flops_executed", "flops_useful")] == \
            [st[c] for c in ("dispatches", "flops_executed", "flops_useful")]

    T, H = tokens, cfg.hidden_size
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, k, I, Is = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   cfg.shared_expert_intermediate_size)
    n_attn = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    n_dn = cfg.num_hidden_layers - n_attn
    L = cfg.num_hidden_layers
    by = defaultdict(lambda: [0, 0, 0])  # kernel -> dispatches, executed, useful
    for d in ds:
        b = by[d["kernel"]]
        b[0] += 1
        b[1] += d["flops_executed"]
        b[2] += d["flops_useful"]

    def useful(prefix):
        return sum(v[2] for n, v in by.items() if n.startswith(prefix))

    def executed(prefix):
        return sum(v[1] for n, v in by.items() if n.startswith(prefix))

    # every quantized matmul dispatch carries 2 M N K of its own: projections, router, lm_head (1 row)
    proj = n_dn * 2 * T * H * ((2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv) + Hv * Dv) + \
        n_attn * 2 * T * H * ((2 * Hq * D + 2 * Hkv * D) + Hq * D)
    assert useful("qm") == proj + L * 2 * T * H * (E + 1) + 2 * cfg.vocab_size * H
    expected_sizes = {2 * T * H * n for n in (2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv, Hv * Dv, 2 * Hq * D + 2 * Hkv * D,
                                              Hq * D, E + 1)} | {2 * cfg.vocab_size * H}
    assert {d["flops_useful"] for d in ds if d["kernel"].startswith("qm")} == expected_sizes
    # attention: the causal scores and values, on the attention kernel itself
    assert useful("attn_") == n_attn * 4 * D * Hq * (T * position + T * (T + 1) // 2)
    # experts: gate + up (4 H per row and feature) and down (2 H) on separate dispatches
    rows = T * k * I + T * Is
    if T > 8:  # tiled: the bound goes to the 64-row kind; the 32-row and few-row kinds carry none
        gu = [n for n in by if n.startswith("moe_gate_up") and ("64" in n)]
        dn = [n for n in by if n.startswith("moe_down") and ("64" in n)]
        assert len(gu) == 1 and len(dn) == 1
        assert by[gu[0]][2] == L * 4 * H * rows and by[dn[0]][2] == L * 2 * H * rows
        assert by[gu[0]][1] + by[dn[0]][1] == executed("moe_")
        assert by[gu[0]][1] > by[gu[0]][2] and by[dn[0]][1] > by[dn[0]][2]  # the bound pads
        for n, v in by.items():
            if n.startswith("moe_") and ("few" in n or "32" in n):
                assert v[1] == v[2] == 0, n
    else:  # matvec route: exact, no padding
        assert by["moe_gate_up_mv_b4_xbf16_sbf16"][1:] == [L * 4 * H * rows] * 2
        assert by["moe_down_mv_b4_xbf16_sbf16"][1:] == [L * 2 * H * rows] * 2
    # the delta rule: chunked (WY products, then the state pass with the rule's useful FLOPs) or scan
    if T >= 64:
        if tensor_ops:  # gd_chunk_*_m5: the Gram and output products on tensor ops (fewer padded)
            f = _core.ops.gated_delta_chunk_flops(T, Hv, Dk, Dv, True)
            assert by["gd_chunk_wy_m5_f32"][2] == 0 and by["gd_chunk_state_m5_f32"][2] == n_dn * 6 * T * Hv * Dk * Dv
            assert by["gd_chunk_wy_m5_f32"][1] + by["gd_chunk_state_m5_f32"][1] == n_dn * (f["tensor"] + f["alu"])
            assert "gd_chunk_wy_f32" not in by and "gd_chunk_state_f32" not in by
        else:
            wy, state = _gd_chunk_flops(T, Hv, Dk, Dv)
            assert by["gd_chunk_wy_f32"][1:] == [n_dn * wy, 0]
            assert by["gd_chunk_state_f32"][1:] == [n_dn * state, n_dn * 6 * T * Hv * Dk * Dv]
    else:
        assert useful("gated_delta_") == executed("gated_delta_") == n_dn * 6 * T * Hv * Dk * Dv

    # units: tensor ops only where the device has them; FLOPs only on matmul-like kernels
    for d in ds:
        name, unit = d["kernel"], d["unit"]
        if d["flops_executed"] == 0:
            continue
        if unit == "alu":
            assert name.startswith(ALU_MATMULS), name
        # every _m5 kernel runs all its products on tensor ops (gd_chunk_state_m5 too, the state
        # feedback included), and nothing else does
        assert (unit == "tensor") == ("_m5" in name), name
        assert unit != "tensor" or tensor_ops
    if tensor_ops and T > 8:
        assert {d["unit"] for d in ds if d["kernel"].startswith(("qmm_m5", "moe_gate_up_m5", "attn_prefill_m5"))} == {"tensor"}
        assert any(d["kernel"].startswith("qmm_m5") for d in ds)


def test_kernel_units_and_per_kernel_totals():
    """The default unit of each kernel family (kernel_table) and the per-kernel totals of count()."""
    units = {k["name"]: k["unit"] for k in _core.kernel_table()}
    assert set(units.values()) == {"alu", "simdgroup_fp32", "simdgroup_bf16", "tensor"}
    for name, unit in units.items():
        expected = ("tensor" if "_m5" in name
                    else "simdgroup_bf16" if name.startswith(("qmm_bf16_", "moe_gate_up_bf16_", "moe_down_bf16_",
                                                              "attn_prefill_tiles_"))
                    else "simdgroup_fp32" if name.startswith(("qmm_b", "moe_gate_up_mm", "moe_down_mm",
                                                              "attn_prefill_mma_", "gd_chunk_wy_", "gd_chunk_state_"))
                    else "alu")
        assert unit == expected, name
    cfg = _cfg()
    from lily_py.backends.engine import engine_spec, REAL_QUANT, checkpoint_activations
    spec = engine_spec(cfg, REAL_QUANT, context_length=200, prefill_chunk=97,
                       activations=checkpoint_activations(REAL_QUANT))
    eng = _core.Engine(spec, "count")
    st = eng.count(97, 0)
    ks = eng.count_kernels()
    assert sum(v["flops_executed"] for v in ks.values()) == st["flops_executed"]
    assert sum(v["flops_useful"] for v in ks.values()) == st["flops_useful"]
    ds = eng.count_dispatches()
    for name, v in ks.items():
        assert v["unit"] == units[name]
        assert v["flops_executed"] == sum(d["flops_executed"] for d in ds if d["kernel"] == name)


@pytest.mark.parametrize("tensor_ops", [False, True])
@pytest.mark.parametrize("tokens", [97, 4096])
def test_deltanet_prefill_bytes_touched(tokens, tensor_ops):
    """bytes_touched of the chunked DeltaNet dispatches of the real config, derived from the shapes
    (the prep with the conv fused): the proj columns each kernel reads (qkv, z, a, b sit in 12,352-column proj rows) count their
    elements only, not the range from the first row to the last; q and P are half on the M5 route;
    the state is read and written once per chunk step."""
    from lily_py.testing import REAL_TEXT_CONFIG
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    with simulated_device(tensor_ops=tensor_ops):
        _, ds = count_dispatches(cfg, tokens=tokens)
    T, Tp = tokens, -(-tokens // 64) * 64
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    C, VD, K, xe, we = 2 * Hk * Dk + Hv * Dv, Hv * Dv, cfg.linear_conv_kernel_dim, 2, 4  # bf16 x, fp32 w
    qe = 2 if tensor_ops else 4
    want = {
        # gd_chunk_prep_conv: conv1d fused (reads proj's qkv columns, the conv weight and window,
        # writes the next window); no conv1d dispatch on the chunked route
        "gd_chunk_prep": T * C * xe + 2 * T * Hv * xe + Hv * (4 + we) + C * K * we + 2 * (K - 1) * C * xe
                         + Hk * Tp * Dk * (qe + 4) + Hv * Tp * Dv * 4 + 2 * Hv * Tp * 4,
        "gd_chunk_wy": Hk * Tp * Dk * (qe + 4) + Hv * Tp * Dv * 4 + 2 * Hv * Tp * 4
                       + Hv * Tp * (Dk + Dv) * 4 + Hv * Tp * 64 * qe,
        "gd_chunk_state": Hk * Tp * Dk * (qe + 4) + Hv * Tp * 4 + Hv * Tp * (Dk + Dv) * 4 + Hv * Tp * 64 * qe
                          + 2 * Hv * Dv * Dk * 4 + Hv * Tp * Dv * 4,
        "gd_chunk_norm": Hv * Tp * Dv * 4 + 2 * T * VD * xe + Dv * we,
    }
    first = {}
    for d in ds:
        for fam in want:
            if d["kernel"].startswith(fam) and fam not in first:
                first[fam] = d
    assert set(first) == set(want), sorted(first)
    assert first["gd_chunk_prep"]["kernel"].startswith("gd_chunk_prep_conv_")
    assert not [d["kernel"] for d in ds if d["kernel"].startswith("conv1d")]
    for fam, n in want.items():
        assert first[fam]["bytes_touched"] == n, (fam, first[fam]["kernel"], first[fam]["bytes_touched"], n)
