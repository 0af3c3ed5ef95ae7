"""The NumPy reference's own equivalences: chunked == recurrent DeltaNet, prefill(N)+decode ==
prefill(N+1), chunked prefill == one-shot, and the full-size shapes in bounded memory.

Tolerances: everything is float32. Two algebraically equal orderings of an fp32 computation
differ by a few ulps per operation; through 4 layers with logits of magnitude ~1-10 we allow
atol 2e-4 + rtol 2e-4 (measured differences are ~1e-5 or below)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lily_py
from tolerances import assert_close
from lily_py.reference.gated_delta import (causal_conv1d, chunked_gated_delta,
                                           recurrent_gated_delta)
from lily_py.reference.ops import l2_normalize, sigmoid

ATOL = RTOL = 2e-4


def random_delta_inputs(rng, T, Hk, Hv, Dk, Dv):
    q = l2_normalize(rng.standard_normal((T, Hk, Dk)).astype(np.float32)) * np.float32(Dk ** -0.5)
    k = l2_normalize(rng.standard_normal((T, Hk, Dk)).astype(np.float32))
    v = rng.standard_normal((T, Hv, Dv)).astype(np.float32)
    g = -np.exp(rng.standard_normal((T, Hv))).astype(np.float32) * 0.5   # log-decay < 0
    beta = sigmoid(rng.standard_normal((T, Hv)).astype(np.float32))
    S0 = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32) * 0.3
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T", [1, 7, 16, 33, 64, 65, 130])
@pytest.mark.parametrize("Hk, Hv", [(2, 4), (3, 9), (2, 2)])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrent(T, Hk, Hv, chunk):
    rng = np.random.default_rng()
    q, k, v, g, beta, S0 = random_delta_inputs(rng, T, Hk, Hv, 16, 24)
    o_r, S_r = recurrent_gated_delta(q, k, v, g, beta, S0)
    o_c, S_c = chunked_gated_delta(q, k, v, g, beta, S0, chunk_size=chunk)
    assert_close(o_c, o_r, atol=1e-4, rtol=1e-4, what="outputs")
    assert_close(S_c, S_r, atol=1e-4, rtol=1e-4, what="final state")


def test_recurrent_matches_explicit_definition():
    """One head, three tokens, written out from the delta rule's definition."""
    rng = np.random.default_rng()
    q, k, v, g, beta, S0 = random_delta_inputs(rng, 3, 1, 1, 5, 3)
    S = S0[0].astype(np.float64)
    outs = []
    for t in range(3):
        S = np.exp(g[t, 0]) * S
        u = beta[t, 0] * (v[t, 0] - S.T @ k[t, 0])
        S = S + np.outer(k[t, 0], u)
        outs.append(S.T @ q[t, 0])
    o, S_end = recurrent_gated_delta(q, k, v, g, beta, S0)
    assert_close(o[:, 0], np.array(outs), atol=1e-6, rtol=1e-5, what="o")
    assert_close(S_end[0], S, atol=1e-6, rtol=1e-5, what="S")


def test_conv1d_prefill_equals_steps():
    rng = np.random.default_rng()
    T, C, K = 11, 13, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    st0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    y, st = causal_conv1d(x, w, st0)
    s = st0
    for t in range(T):
        yt, s = causal_conv1d(x[t:t + 1], w, s)
        assert_close(yt[0], y[t], atol=1e-6, rtol=1e-6, what=f"step {t}")
    np.testing.assert_array_equal(s, st)
    np.testing.assert_array_equal(st, x[-3:])
    # definition: out[t] = silu(sum_j w[:, j] * xx[t + j]) with xx = [state; x]
    xx = np.concatenate([st0, x])
    pre = sum(w[:, j] * xx[5 + j] for j in range(K))
    assert_close(y[5], pre / (1 + np.exp(-pre)), atol=1e-6, rtol=1e-5, what="definition")


@pytest.fixture(scope="module", params=["mlx", "hf"])
def model(request, tiny_mlx, tiny_hf):
    return lily_py.load(tiny_mlx if request.param == "mlx" else tiny_hf, backend="reference")


def test_prefill_then_decode_equals_longer_prefill(model):
    rng = np.random.default_rng()
    ids = rng.integers(0, model.config.vocab_size, 12)
    model.reset()
    full = model.prefill(ids, all_logits=True)
    model.reset()
    model.prefill(ids[:9])
    steps = [model.decode(int(t)) for t in ids[9:]]
    assert_close(np.array(steps), full[9:], atol=ATOL, rtol=RTOL,
                 what="decode after prefill(9) vs prefill(12)")


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill_equals_one_shot(tiny_mlx, chunk, kv):
    """The float32 cache rows ("bfloat16": the reference does not round them) to fp32 roundoff.
    The int8 cache: a K or V value within fp32 roundoff of a rounding boundary of its code (the
    projections of a chunk of another size sum in another order: 1-ulp differences) takes the
    neighbouring code, one step of max |row| / 127: about 3% of fresh prompts then move some logit
    by more than the fp32 tolerance, by at most 2.5e-4 of max |logits| over 300 prompts x chunks
    1, 3, 7. The bound there is 2e-3 of max |logits|; a misplaced chunk (positions, cache rows)
    moves them by tens of %."""
    rng = np.random.default_rng()
    ids = rng.integers(0, 320, 23)
    one = lily_py.load(tiny_mlx, backend="reference", kv_dtype=kv).prefill(ids, all_logits=True)
    m = lily_py.load(tiny_mlx, backend="reference", prefill_chunk=chunk, kv_dtype=kv)
    atol = ATOL if kv == "bfloat16" else 2e-3 * float(np.abs(one).max())
    assert_close(m.prefill(ids, all_logits=True), one, atol=atol, rtol=RTOL,
                 what=f"prefill in chunks of {chunk}, {kv} cache")
    assert m.position == 23


def test_model_level_chunked_equals_recurrent_deltanet(tiny_mlx):
    from lily_py.checkpoint import load_weights
    from lily_py.reference.model import ReferenceModel
    cfg, w = load_weights(tiny_mlx)
    ids = np.random.default_rng().integers(0, 320, 70)
    outs = []
    for mode, cs in (("recurrent", 64), ("chunked", 64), ("chunked", 5)):
        rm = ReferenceModel(cfg, w, deltanet=mode, chunk_size=cs)
        outs.append(rm.forward(ids, rm.new_state(), all_logits=True))
    assert_close(outs[1], outs[0], atol=ATOL, rtol=RTOL, what="chunked(64) vs recurrent")
    assert_close(outs[2], outs[0], atol=ATOL, rtol=RTOL, what="chunked(5) vs recurrent")


def test_full_size_shapes_in_bounded_memory(tmp_path):
    """The real model's shapes (vocab 248,320, 256 experts, head dims 256/128), two layers (one
    DeltaNet, one attention), MLX 4-bit. Runs in a subprocess that measures the peak of NumPy's
    allocations with tracemalloc: weights stay memory-mapped and packed, so the peak must stay
    far below even one dequantized layer's experts (256 x 3 x 512 x 2048 x 4 B = 3.2 GB)."""
    script = textwrap.dedent(f"""
        import json, tracemalloc, numpy as np, lily_py
        from lily_py.testing import REAL_TEXT_CONFIG, make_checkpoint
        cfg = dict(REAL_TEXT_CONFIG, num_hidden_layers=2,
                   layer_types=["linear_attention", "full_attention"])
        path = make_checkpoint({str(tmp_path / 'real')!r}, cfg, fmt="mlx", std=0.02)
        m = lily_py.load(path, backend="reference")
        tracemalloc.start()
        a = m.prefill([11, 200000, 3, 77])
        b = m.decode(5)
        peak = tracemalloc.get_traced_memory()[1]
        m.reset()
        c = m.prefill([11, 200000, 3, 77, 5])
        print(json.dumps(dict(peak=peak, weights=m.weights.nbytes(), shape=list(b.shape),
                              finite=bool(np.isfinite(a).all() and np.isfinite(b).all()),
                              err=float(np.abs(b - c).max()), scale=float(np.abs(c).max()))))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nfull-size shapes: weights {r['weights'] / 1e9:.2f} GB mapped, peak NumPy "
          f"allocations {r['peak'] / 1e6:.0f} MB, decode-vs-prefill max err {r['err']:.2e} "
          f"(logits up to {r['scale']:.2f})")
    assert r["shape"] == [248320] and r["finite"]
    assert r["err"] <= 1e-3 * max(1.0, r["scale"])
    assert r["peak"] < 600e6, f"peak NumPy allocations {r['peak'] / 1e6:.0f} MB"
