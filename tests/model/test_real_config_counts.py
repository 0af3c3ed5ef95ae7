"""The real 35B shapes on the counting device (no weights, nothing allocated, no backend run):
the counters, grids and bytes of a step, exactly as the encoding plan (tests/model/step_plan.py)
and the docs state them. tests/model/test_engine.py holds the same counters on a small checkpoint
that the emulator runs."""
from __future__ import annotations

import pytest

from step_plan import attention_decode_padding_flops, expected_counts, expected_useful_flops, real_cfg


@pytest.mark.parametrize("tokens,position", [(1, 0), (1, 4096), (4096, 0)])
def test_real_config_counters(tokens, position):
    """Per-step counters of the real 35B shapes on the counting device (no weights, nothing
    allocated): printed for the docs and the benchmark."""
    from lily_py.backends.engine import count_step
    cfg = real_cfg()
    st = count_step(cfg, tokens=tokens, position=position)
    print(f"real config, {tokens} token(s) at position {position}:", st)
    assert (st["dispatches"], st["barriers"]) == expected_counts(cfg, tokens, position)
    assert st["waits_in_step"] == 0 and st["commits"] == 1
    assert st["flops_useful"] == expected_useful_flops(cfg, tokens, position)
    if tokens == 1:
        assert st["flops_executed"] == st["flops_useful"] + attention_decode_padding_flops(cfg, position)
    else:
        assert st["flops_useful"] < st["flops_executed"] < 1.5 * st["flops_useful"]


@pytest.mark.parametrize("position", [0, 255, 32767])
def test_moe_decode_grids_real_config(position):
    """The MoE decode matvecs of the real 35B config on the counting device, every dispatch:
    grids and threads as docs/kernels-moe.md states them (gate_up: 2 rows of the token's 9 slots
    per threadgroup at one token, one simdgroup each over K = H = 2048 (17 // 9 = 1 split); down:
    4 rows per threadgroup, the 8 x 512 + 512 concatenated K' in 144 chunks of 32 codes over 5
    simdgroups), no moe_route level; 3 dispatches per MoE block, each after a barrier."""
    from lily_py.backends.engine import REAL_QUANT, _core, engine_spec
    cfg = real_cfg()
    eng = _core().Engine(engine_spec(cfg, REAL_QUANT, context_length=position + 1, prefill_chunk=1), "count")
    eng.count(1, position, False)
    ds = eng.count_dispatches()
    names = [d["kernel"] for d in ds]
    L = cfg.num_hidden_layers
    assert not any(n.startswith("moe_route") for n in names)
    gu = [d for d in ds if d["kernel"] == "moe_gate_up_mv_b4_xf32_sbf16"]
    dn = [d for d in ds if d["kernel"] == "moe_down_mv_b4_xf32_sbf16"]
    assert len(gu) == len(dn) == L
    assert {(d["groups"], d["threads"]) for d in gu} == {((256, 1, 1), (288, 1, 1))}
    assert {(d["groups"], d["threads"]) for d in dn} == {((512, 1, 1), (160, 1, 1))}
    simds = lambda d: d["groups"][0] * d["groups"][1] * d["threads"][0] // 32  # noqa: E731
    assert simds(gu[0]) / 40 == 57.6 and simds(dn[0]) / 40 == 64.0
    for g, d in zip(gu, dn):  # router -> gate_up -> down, one level each
        i = ds.index(g)
        assert names[i - 1] == "qmv1_b8_xf32_sbf16_r1" and names[i + 1] == "moe_down_mv_b4_xf32_sbf16"
        assert ds[i - 1]["level"] + 1 == g["level"] == ds[i + 1]["level"] - 1


@pytest.mark.parametrize("position", [0, 255])
def test_qmv1_decode_grids_real_config(position):
    """Every qmv1 dispatch of a real 35B decode step on the counting device (docs/kernels-matmul.md qmv1):
    8 rows per threadgroup where that gives >= 1024 simdgroups (25.6 per core on a 40-core GPU), 1
    row otherwise: only the 8-bit router + shared gate (257 x 2048: 33 -> 257 threadgroups, 132 ->
    1028 simdgroups) takes the 1-row kernel; K split over min(4, ceil(K / block)) simdgroups, except
    where the 8-row groups alone reach QMV1_ONE_SPLIT_GROUPS (lm_head: one simdgroup per 16 rows,
    15,520 threadgroups, no split: x loaded once per 16 rows)."""
    import collections
    from lily_py.backends.engine import REAL_QUANT, _core, engine_spec
    cfg = real_cfg()
    eng = _core().Engine(engine_spec(cfg, REAL_QUANT, context_length=position + 1, prefill_chunk=1), "count")
    eng.count(1, position, False)
    got = collections.Counter((d["kernel"], d["groups"], d["threads"]) for d in eng.count_dispatches()
                              if d["kernel"].startswith("qmv1"))
    L = cfg.num_hidden_layers
    n_full = sum(t == "full_attention" for t in cfg.layer_types)  # 10 attention, 30 DeltaNet layers
    assert got == {
        ("qmv1_b4_xf32_sbf16", (1544, 1, 1), (64, 1, 1)): L - n_full,    # DeltaNet in_proj 12352 x 2048
        ("qmv1_b4_xf32_sbf16", (256, 1, 1), (128, 1, 1)): n_full,        # o_proj 2048 x 4096
        # DeltaNet out_proj 2048 x 4096 with the gated norm folded in front (8 rows, 4 splits)
        ("qmv1_gated_b4_sbf16_yf32", (256, 1, 1), (128, 1, 1)): L - n_full,
        ("qmv1_b4_xf32_sbf16", (1152, 1, 1), (64, 1, 1)): n_full,        # attention qkv 9216 x 2048
        ("qmv1_b4_xf32_sbf16_r16", (15520, 1, 1), (32, 1, 1)): 1,        # lm_head 248320 x 2048, 16 rows, 1 split
        ("qmv1_b8_xf32_sbf16_r1", (257, 1, 1), (128, 1, 1)): L,          # router + shared gate 257 x 2048
    }
    ops = _core().ops
    assert ops.QMV1_ROWS == 8 and ops.QMV1_MIN_SIMDGROUPS == 1024
    # only lm_head is past the threshold: 31,040 8-row groups against in_proj's 1544
    assert -(-cfg.vocab_size // ops.QMV1_ROWS) >= ops.QMV1_ONE_SPLIT_GROUPS > 1544
    for (_, g, t), _n in got.items():
        # out_proj / o_proj 1024 (25.6 per core at 40 cores), router 1028 (25.7); the others >= 2304
        assert g[0] * t[0] // 32 >= ops.QMV1_MIN_SIMDGROUPS


@pytest.mark.parametrize("position", [255, 4095, 32767])
def test_bytes_touched_real_config_against_the_floor(position):
    """bytes_touched of a real 35B decode step (routed experts only, KV rows up to the position,
    DeltaNet state read and written) against the floor derived from the config: at least the
    floor (it is a lower bound), within 1.03x of it at 256 context (activations, logits and the
    split-K partials are the difference)."""
    from lily_py.backends.engine import count_kernels, decode_floor_bytes, kv_row_bytes
    cfg = real_cfg()
    st, ks = count_kernels(cfg, position=position)   # the default KV cache (bf16)
    floor = decode_floor_bytes(cfg, position=position)["total"]
    print(f"decode at {position}: bytes_touched {st['bytes_touched']}, floor {floor}, "
          f"ratio {st['bytes_touched'] / floor:.4f}, bytes_bound {st['bytes_bound']}")
    assert floor <= st["bytes_touched"] <= 1.03 * floor
    assert st["bytes_touched"] == sum(k["bytes_touched"] for k in ks.values())
    assert sum(k["dispatches"] for k in ks.values()) == st["dispatches"]
    # The KV part of the floor is exact: K and V rows [0, position] of every attention layer.
    attn = [v for n, v in ks.items() if n.startswith("attn_decode")]
    kv_read = 2 * cfg.num_key_value_heads * kv_row_bytes(cfg) * (position + 1)
    attn_layers = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    assert sum(v["bytes_touched"] for v in attn) >= attn_layers * kv_read


# (sampling parameters, dependent levels the sampler adds to a decode step): greedy 2, temperature
# only 4, small-k (0 < top_k <= 64) 4, the bucket route 6 (docs/kernels-sampling.md, sampling section).
SAMPLER_ROUTES = [
    (dict(temperature=0.0), 2),
    (dict(temperature=0.8), 4),
    (dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05), 4),
    (dict(temperature=0.8, top_p=0.9), 6),
    (dict(temperature=0.8, min_p=0.05), 6),
    (dict(temperature=0.8, top_p=0.95, min_p=0.02), 6),
    (dict(temperature=0.8, top_k=65), 6),
    (dict(temperature=0.8, top_k=1000, top_p=0.9, min_p=0.05), 6),
    (dict(temperature=0.8, top_k=248_000, top_p=0.999), 6),
]


@pytest.mark.parametrize("position", [0, 4095])
def test_real_config_sampler_levels(position):
    """Issue 10: the full sampler adds at most 6 dependent levels to a decode step of the real
    config (a chain: each level one dispatch after a barrier), counted exactly per route."""
    from lily_py.backends.engine import REAL_QUANT, engine_spec
    cfg = real_cfg()
    import lily_py._core as core
    eng = core.Engine(engine_spec(cfg, REAL_QUANT, context_length=position + 1, prefill_chunk=1), "count")
    base = eng.count(1, position)
    for params, levels in SAMPLER_ROUTES:
        sample = dict(dict(top_k=0, top_p=1.0, min_p=0.0), **params, seed=3, step=1, valid_vocab=0)
        st = eng.count(1, position, sample=sample)
        added = (st["dispatches"] - base["dispatches"], st["barriers"] - base["barriers"])
        print(f"real config, decode at {position}, sampler {params}: +{added[0]} dispatches, "
              f"+{added[1]} barriers, levels {st['dispatches']}")
        assert added == (levels, levels) and levels <= 6
        assert st["barriers"] == st["dispatches"] - 1


def test_real_config_prefill_qmm_tiles():
    """The 4096-token chunk of the real 35B config on the counting device: every projection takes
    the tiled route (qmm_bf16's 64 x 64 tiles with bf16 activations, qmm's 32 x 32 with fp32 ones:
    fp32 x keeps fp32 operands), the router qmm (fp32 operands: its logits choose the experts);
    one threadgroup of 128 threads per tile; executed FLOPs 2 * tile_m * tile_n * K per tile,
    exactly: the only padding is the router's E + 1 = 257 rows rounded up to the tile."""
    from lily_py.backends.engine import REAL_QUANT, _core, engine_spec
    cfg, T = real_cfg(), 4096
    eng = _core().Engine(engine_spec(cfg, REAL_QUANT, context_length=T, prefill_chunk=T), "count")
    st = eng.count(T, 0, False)
    H, E = cfg.hidden_size, cfg.num_experts
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    got = [d for d in eng.count_dispatches() if d["kernel"].startswith(("qmm", "qmv"))][:-1]  # - lm_head
    tiles = "qmm_bf16" if "_xbf16_" in got[0]["kernel"] else "qmm"  # the engine's activation dtype
    want = []  # (kernel, N, K) of every matmul-family dispatch, in order
    for i in range(cfg.num_hidden_layers):
        if cfg.is_full_attention(i):
            want += [(f"{tiles}_b4", 2 * Hq * D + 2 * Hkv * D, H), (f"{tiles}_b4", H, Hq * D)]
        else:
            want += [(f"{tiles}_b4", 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv, H), (f"{tiles}_b4", H, Hv * Dv)]
        want.append(("qmm_b8", E + 1, H))  # router + shared-expert gate (8-bit, fp32 operands)
    assert [d["kernel"].rsplit("_x", 1)[0] for d in got] == [k for k, _, _ in want]
    executed = useful = 0
    for d, (kern, n, k) in zip(got, want):
        t = 64 if kern.startswith("qmm_bf16") else 32
        assert d["groups"] == (-(-n // t), T // t, 1) and d["threads"] == (128, 1, 1)
        executed += 2 * (d["groups"][0] * t) * (d["groups"][1] * t) * k
        useful += 2 * T * n * k
    assert executed - useful == cfg.num_hidden_layers * 2 * T * (-(-(E + 1) // 32) * 32 - (E + 1)) * H
    print(f"real config, 4096-token chunk, {tiles} tiles: projections + router executed {executed / 1e9:.1f} "
          f"GFLOP, useful {useful / 1e9:.1f}; step executed {st['flops_executed'] / 1e9:.1f}, "
          f"useful {st['flops_useful'] / 1e9:.1f}")
    assert st["flops_executed"] - st["flops_useful"] >= executed - useful
