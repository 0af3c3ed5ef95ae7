"""lily-py bench on a small config (CI): the structure of its tables and JSON, exact counters, and
that the counting device reports the same counters as the run it stands in for. Timings are never
asserted."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from lily_py.tools import bench as B


def test_random_weights_cli_runs_small_and_counts_real(tmp_path):
    path = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "-m", "lily_py.cli", "bench", "--random-weights", "--backend", "emu",
                        "--contexts", "16,48,4K", "--decode-tokens", "3", "--json", str(path)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "MEASURED - random weights, tiny config" in out and "on 'emu'" in out
    assert "not run: 4K (above --run-max-context 256 on 'emu'" in out
    assert "COUNTED - Qwen3.6-35B-A3B real config: 40 layers (30 DeltaNet + 10 attention)" in out
    res = json.loads(path.read_text())
    measured, counted = res["tables"]
    assert measured["kind"] == "measured" and measured["device"] == "emu"
    assert [r["context"] for r in measured["rows"]] == [16, 48]
    for r in measured["rows"]:
        assert r["prefill_tps"] > 0 and r["decode_tps"] > 0 and r["ttft_s"] > 0 and r["decode_tokens"] == 3
        assert r["decode_dispatches"] > 0 and r["decode_barriers"] == r["decode_dispatches"] - 1
        assert r["device_bytes"] > 0 and r["peak_rss_bytes"] > 0
    assert counted["kind"] == "counted" and [r["context"] for r in counted["rows"]] == [16, 48, 4096]
    for r in counted["rows"]:
        assert r["prefill_tps"] is None and r["decode_tps"] is None      # nothing ran
        # the real 35B model: 40 layers of at least 6 decode dispatches (3 mixer + 3 MoE), 18 GiB of weights
        assert r["decode_dispatches"] > 6 * 40 and r["device_bytes"] > 18 * 2**30


def test_counted_equals_measured_for_the_same_config():
    """The counting device encodes exactly the steps the emulator runs: same dispatches and
    barriers for the prefill chunks and the decode step."""
    out = io.StringIO()
    res = B.bench(random_weights=True, backend="emu", contexts=[40], decode_tokens=2, prefill_chunk=16,
                  out=out)
    row = res["tables"][0]["rows"][0]
    cfg = B._model_config(B._config_dict("tiny", None))
    counted = B.count_context(cfg, 40, 2, 16, quant={
        "embed": {"bits": 4, "group_size": 64, "scale_dtype": "bfloat16"},
        "lm_head": {"bits": 4, "group_size": 64, "scale_dtype": "bfloat16"},
        "mixer": {"bits": 4, "group_size": 64, "scale_dtype": "bfloat16"},
        "experts_q": {"bits": 4, "group_size": 64, "scale_dtype": "bfloat16"},
        "router": {"bits": 8, "group_size": 64, "scale_dtype": "bfloat16"}})
    for k in ("decode_dispatches", "decode_barriers", "prefill_dispatches", "prefill_barriers"):
        assert row[k] == getattr(counted, k), k
    assert "prefill per token" in out.getvalue()


def test_reference_backend_has_timings_but_no_counters():
    out = io.StringIO()
    res = B.bench(backend="reference", contexts=[8], decode_tokens=2, out=out)
    row = res["tables"][0]["rows"][0]
    assert row["prefill_tps"] > 0 and row["decode_dispatches"] is None and row["device_bytes"] is None
    assert "no counters: backend 'reference' has none" in out.getvalue()


def test_auto_is_loads_rule_and_the_default_is_the_engine(monkeypatch):
    """--backend auto picks what load(backend="auto") picks (lily_py.auto_backend(): reference
    where Metal is not usable); no --backend measures the engine (metal, else emu)."""
    import lily_py
    out = io.StringIO()
    res = B.bench(backend="auto", contexts=[8], decode_tokens=1, out=out)
    assert res["device"] == lily_py.auto_backend()[0]
    monkeypatch.setattr(B, "measure_load", lambda path, device: {})
    monkeypatch.setattr(B, "format_load", lambda load, device: "")
    res = B.bench(contexts=[8], decode_tokens=1, out=io.StringIO())
    from lily_py.tools.doctor import default_device
    assert res["device"] == default_device() and res["device"] != "reference"


def test_compare_without_mlx_lm_says_so(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_mlx(name, *a, **k):
        if name.startswith("mlx"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_mlx)
    out = io.StringIO()
    B.bench(backend="emu", contexts=[8], decode_tokens=1, compare="mlx-lm", out=out)
    assert "COMPARE - mlx-lm: mlx-lm not installed (mlx.core)" in out.getvalue()


def test_parse_contexts():
    assert B.parse_contexts("256,4K,32k,128K") == [256, 4096, 32768, 131072]
    assert B.parse_contexts("64, 16,64") == [16, 64]
    for bad in ("", "x", "0", "4M"):
        with pytest.raises(ValueError, match="--contexts"):
            B.parse_contexts(bad)


def test_bad_arguments_exit_2():
    p = subprocess.run([sys.executable, "-m", "lily_py.cli", "bench", "--contexts", "abc"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--contexts" in p.stderr
    p = subprocess.run([sys.executable, "-m", "lily_py.cli", "bench", "--random-weights", "--model", "x"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "not allowed with" in p.stderr


def test_a_large_checkpoint_off_metal_is_counted_not_run(monkeypatch):
    """A checkpoint too large for the emulator (here: any, by lowering the threshold) is not run;
    its own config is counted, with the checkpoint's own quantization."""
    import lily_py
    monkeypatch.setattr(B, "EMU_RUN_MAX_BYTES", 1000)
    out = io.StringIO()
    res = B.bench(model=lily_py.demo_path(), backend="emu", contexts=[16, 64], decode_tokens=2, out=out)
    measured, counted = res["tables"]
    assert measured["rows"] == [] and "do not run in useful time on 'emu'" in out.getvalue()
    assert "COUNTED - checkpoint " in out.getvalue() and "hidden 256, 16 experts top-4" in counted["subject"]
    m = lily_py.load(lily_py.demo_path(), backend="emu", context_length=64 + 3, prefill_chunk=64)
    m.prefill(list(range(64)))
    m.generate_text(list(range(64)), max_tokens=2)
    assert counted["rows"][1]["decode_dispatches"] == m.stats()["dispatches"]
