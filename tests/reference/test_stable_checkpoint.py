"""make_checkpoint(stable=True): routing with margin and a residual stream that stays bounded at
depth (docs/fixtures.md, "Stable checkpoints"), measured on the NumPy reference."""
import numpy as np
import pytest

import lily_py
from lily_py.reference import moe as ref_moe
from lily_py.testing import TINY_TEXT_CONFIG, make_checkpoint


def _route_and_residual(path, ids, monkeypatch):
    """(the gap between the k-th and (k+1)-th router probability of every token and layer, the
    rms of the residual stream after each layer) over a prefill of ``ids`` on the reference."""
    gaps, rms = [], []
    route = ref_moe.route

    def spy(logits, top_k):
        p = np.sort(np.exp(logits - logits.max(-1, keepdims=True)), -1)[:, ::-1]
        p /= p.sum(-1, keepdims=True)
        gaps.append(p[:, top_k - 1] - p[:, top_k])
        return route(logits, top_k)

    monkeypatch.setattr(ref_moe, "route", spy)
    model = lily_py.load(path, backend="reference")._backend.model
    residuals: list = []
    model.hidden_states(np.asarray(ids), model.new_state(), residuals)
    layer_out = [float(np.sqrt(np.mean(r.astype(np.float64) ** 2))) for r in residuals]
    return np.concatenate(gaps), np.array(layer_out)


def test_stable_checkpoints_route_with_margin_and_stay_bounded(tmp_path, monkeypatch):
    """16 layers of the tiny config (6 experts, top 2): with stable=True the smallest gap between
    the 2nd and 3rd router probability over 40 tokens and 16 layers is at least 0.05 (a flip needs
    that much change in a probability), against a default checkpoint whose smallest gap is below
    a tenth of that; and the residual's rms after the last layer is within 5% of its rms after the
    first, where the default checkpoint's grows by more (16% here; the real widths' more still)."""
    cfg = dict(TINY_TEXT_CONFIG, num_hidden_layers=16)
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], size=40)
    stable = make_checkpoint(tmp_path / "stable", cfg, seed=5, stable=True)
    plain = make_checkpoint(tmp_path / "plain", cfg, seed=5)
    g_s, r_s = _route_and_residual(stable, ids, monkeypatch)
    g_p, r_p = _route_and_residual(plain, ids, monkeypatch)
    print(f"min gap stable {g_s.min():.4f} plain {g_p.min():.4f}; residual rms stable {r_s[0]:.3f} -> "
          f"{r_s[-1]:.3f}, plain {r_p[0]:.3f} -> {r_p[-1]:.3f}")
    assert g_s.min() >= 0.05
    assert g_p.min() < 0.005
    assert r_s[-1] < 1.05 * r_s[0] and r_p[-1] > 1.05 * r_p[0]


def test_stable_is_for_mlx_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="stable=True writes MLX checkpoints only"):
        make_checkpoint(tmp_path / "x", fmt="hf", stable=True)
