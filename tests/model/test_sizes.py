"""What fits, said before loading (lily_py.sizes, ``lily-py info``): the Python inventory of the
engine's weights agrees with the engine's own plan and with checkpoints on disk; the largest
context that fits a budget is the boundary; the CLI prints the plan."""
import pytest

from lily_py import _core
from lily_py.backends.engine import REAL_QUANT, engine_spec
from lily_py.checkpoint import load_weights
from lily_py.config import ModelConfig
from lily_py.resources import demo_path
from lily_py.sizes import (config_recipe, inventory, kv_bytes, largest_context, matrix_bytes, mixed, needs,
                           uniform, weight_bytes)
from lily_py.testing import REAL_TEXT_CONFIG, TINY_TEXT_CONFIG, make_checkpoint
from lily_py.weights import QuantLinear


def _cfg(text):
    return ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(text)})


@pytest.mark.parametrize("text", [REAL_TEXT_CONFIG, TINY_TEXT_CONFIG], ids=["real", "tiny"])
def test_weight_bytes_equal_the_engine_plan(text):
    cfg = _cfg(text)
    spec = engine_spec(cfg, REAL_QUANT, context_length=64, prefill_chunk=16)
    assert weight_bytes(cfg, uniform(4)) == _core.plan_memory(spec)["weight_bytes"]


def test_kv_bytes_are_what_the_plan_adds_per_token():
    cfg = _cfg(REAL_TEXT_CONFIG)
    a, b = (_core.plan_memory(engine_spec(cfg, REAL_QUANT, context_length=c, prefill_chunk=16))
            for c in (1000, 1777))
    assert b["state_bytes"] - a["state_bytes"] == kv_bytes(cfg, 1777) - kv_bytes(cfg, 1000)


@pytest.mark.parametrize("bits", [3, 4])
def test_quantized_bytes_equal_a_checkpoint_on_disk(tmp_path, bits):
    """The inventory at the checkpoint's own widths (config_recipe: default + 8-bit router overrides)
    holds exactly the bytes of the checkpoint's quantized tensors."""
    p = make_checkpoint(tmp_path / "c", fmt="mlx", seed=7, bits=bits)
    cfg, w = load_weights(p)
    on_disk = 0
    seen = set()
    for lin in [w.embed, w.lm_head] + [v for lw in w.layers for part in (lw.mixer, lw.moe)
                                       for v in vars(part).values()]:
        if isinstance(lin, QuantLinear) and id(lin) not in seen:
            seen.add(id(lin))
            on_disk += lin.nbytes
    r = config_recipe(cfg)
    assert sum(matrix_bytes(m, r) for m in inventory(cfg) if m.quantized) == on_disk


def test_mixed_recipe_sits_between_its_widths():
    cfg = _cfg(REAL_TEXT_CONFIG)
    w3, w4, w34 = (weight_bytes(cfg, r) for r in (uniform(3), uniform(4), mixed(3, 4, 40)))
    assert w3 < w34 < w4
    r = mixed(3, 4, 40)
    # mlx-lm's rule on a few modules: first eighth and every third layer after get 4-bit down_proj
    assert r("layers.0.mlp.switch_mlp.down_proj") == (4, 64)
    assert r("layers.7.mlp.switch_mlp.down_proj") == (4, 64)      # (7 - 5) % 3 == 2
    assert r("layers.8.mlp.switch_mlp.down_proj") == (3, 64)
    assert r("layers.36.mlp.switch_mlp.up_proj") == (3, 64)
    assert r("layers.8.mlp.gate") == (3, 64) and r("lm_head") == (4, 64)


@pytest.mark.parametrize("budget_gib", [11, 17.5, 40])
def test_largest_context_is_the_boundary(budget_gib):
    cfg = _cfg(REAL_TEXT_CONFIG)
    budget = int(budget_gib * (1 << 30))
    c = largest_context(cfg, uniform(3), budget)
    if c == 0:
        assert needs(cfg, uniform(3), 1)["total"] > budget
    elif c == cfg.max_position_embeddings:
        assert needs(cfg, uniform(3), c)["total"] <= budget
    else:
        assert needs(cfg, uniform(3), c)["total"] <= budget < needs(cfg, uniform(3), c + 1)["total"]


def test_info_prints_the_plan_and_the_fit(capsys):
    from lily_py.cli import main
    assert main(["info", "--context", "1000"]) == 0
    out = capsys.readouterr().out
    assert "memory at context 1000 (prefill_chunk 1000): weights" in out
    assert "largest context that fits a Mac" in out
    cfg = load_weights(demo_path())[0]
    n = needs(cfg, config_recipe(cfg), 1000)
    assert f"({n['total']} bytes)" in out and n["total"] > n["weights"] > 0


def test_load_says_the_plan_and_the_largest_context_that_fits(capsys):
    """With a simulated working set, load() prints the largest context that fits before the weights
    load. The engine's own check at load counts what it allocates (one KV block per pool: the KV
    cache grows later, tests/model/test_kv_paging.py has the full-cache error), so a longer
    context loads too."""
    import lily_py
    from lily_py.errors import DeviceMemoryError
    from lily_py.testing import simulated_device
    cfg = load_weights(demo_path())[0]
    budget = 24 << 20
    c = largest_context(cfg, config_recipe(cfg), budget)
    assert 0 < c < cfg.max_position_embeddings
    at_chunk = largest_context(cfg, config_recipe(cfg), budget, prefill_chunk=c)  # the scratch of a c chunk
    assert at_chunk >= c
    with simulated_device(working_set_bytes=budget), pytest.warns(RuntimeWarning, match="above 85%"):
        m = lily_py.load(backend="emu", context_length=c, verbose=True)
        err = capsys.readouterr().err
        assert "lily_py: engine plan on 'emu': " in err
        assert f"largest context that fits at prefill_chunk {c}: {at_chunk}" in err
        del m
        lily_py.load(backend="emu", context_length=c + 1, prefill_chunk=c, verbose=False)
        lily_py.load(backend="emu", context_length=at_chunk + 1, prefill_chunk=c, verbose=False)
        with pytest.raises(DeviceMemoryError, match=r"would fit"):  # the chunk's scratch still counts
            lily_py.load(backend="emu", context_length=8 * at_chunk, prefill_chunk=8 * at_chunk, verbose=False)
