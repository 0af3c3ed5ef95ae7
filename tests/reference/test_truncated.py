"""lily_py.testing.truncated and benchmarks/depth_oracle.py: the residual stream after layer d, seen
through the final norm and lm_head, is a truncated model's logits, on the reference and the engine."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily_py.checkpoint import load_weights
from lily_py.reference.model import ReferenceModel
from lily_py.reference.ops import rms_norm
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint, truncated

ROOT = Path(__file__).resolve().parents[2]


def test_truncated_logits_are_the_residual_after_that_layer(tmp_path):
    cfg, w = load_weights(make_checkpoint(tmp_path / "c", dict(TINY_TEXT_CONFIG, num_hidden_layers=5), seed=2))
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=13)
    full = ReferenceModel(cfg, w)
    residuals: list = []
    full.hidden_states(ids, full.new_state(), residuals)
    assert len(residuals) == 5
    for d in (1, 3, 5):
        cd, wd = truncated(cfg, w, d)
        assert cd.num_hidden_layers == d and len(wd.layers) == d and wd.layers[0] is w.layers[0]
        part = ReferenceModel(cd, wd)
        got = part.forward(ids, part.new_state(), all_logits=True)
        want = w.lm_head.matmul(rms_norm(residuals[d - 1], w.norm, cfg.rms_norm_eps))
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"layers must be in \[1, 5\], got 6"):
        truncated(cfg, w, 6)


def test_depth_oracle_engine_fp32_tracks_the_reference(tmp_path):
    """The benchmark on 8 stable tiny layers, emulator, fp32 activations: the DeltaNet-only depths
    (1, 2; no KV cache) agree to 1e-5 of the mean |logit| (fp32 association only), and every depth's
    argmax agrees (the margins hold: no router probability gap below 1e-3)."""
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/depth_oracle.py"), "--make", "tiny", "--stable",
                    "--layers", "8", "--out", str(tmp_path / "ck"), "--depths", "1,2,4,8", "--tokens", "24",
                    "--backend", "emu", "--activations", "float32", "--json", str(out)], check=True, timeout=300)
    rows = {r["depth"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[1]["mean_rel"] < 1e-5 and rows[2]["mean_rel"] < 1e-5, rows
    assert all(r["argmax_equal"] == r["rows"] and r["margins_below_1e_3"] == 0 for r in rows.values()), rows
