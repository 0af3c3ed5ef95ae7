"""Where the bf16 error of a long prompt comes from, on the NumPy reference with simulated bf16
rounding points (no emulator: seconds per configuration).

The checkpoint is tests/model/bf16_long.py's (real head dimensions, 3 DeltaNet + 1 attention
layer, bf16 scales); the prompt is its random ``--length``-token prompt. Each row of the table
runs the fp32 reference with a set of activations rounded to bf16 at the points the engine rounds
them (docs/kernels.md, "Activation dtypes") and prints the mean |d| of the logits against the
plain fp32 reference, per window of positions, and the 99th percentile of a row's mean |d| (a
router choice that flips at a token makes that row an outlier). Rounding points:

  resid     the embedding output and the residual stream after every add
  norm      RMSNorm outputs (input, post)
  proj      projection outputs (qkv / z / a / b / o / out_proj, router logits)
  conv      DeltaNet conv1d + SiLU output
  dn_o      DeltaNet gated-norm output
  kv        attention q after norm + RoPE, the K and V cache rows
  attn_out  attention output (after the gate)
  P         softmax weights rounded to bf16 as the operand of P V (the sum l unrounded), as the
            prefill tiles do
  state     hypothetical: the DeltaNet state rounded to bf16 between 64-token chunks (the engine
            and mlx-lm keep it fp32)

``python benchmarks/bf16_error.py [--length 4096]``
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model"))

import bf16_long as B  # noqa: E402
import lily_py  # noqa: E402
from lily_py.checkpoint import AttentionWeights  # noqa: E402
from lily_py.reference import attention as RA, gated_delta as RG, moe as RMo  # noqa: E402
from lily_py.reference.ops import (apply_partial_rope, gated_rms_norm, l2_normalize, rms_norm,  # noqa: E402
                                   rope_cos_sin, sigmoid, softplus)

ENGINE = ("resid", "norm", "proj", "conv", "dn_o", "kv", "attn_out")


def bf(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def attend_p_bf16(q, k, v):
    """Causal attention with the softmax weights rounded to bf16 in P V (l sums them unrounded)."""
    T, Hq, D = q.shape
    g = Hq // k.shape[1]
    out = np.empty((T, Hq, D), np.float32)
    for s in range(0, T, 256):
        e = min(T, s + 256)
        mask = np.arange(e)[None, :] <= np.arange(s, e)[:, None]
        for h in range(Hq):
            sc = np.where(mask, (q[s:e, h] @ k[:e, h // g].T) * np.float32(D ** -0.5), -np.inf)
            p = np.exp(sc - sc.max(1, keepdims=True))
            out[s:e, h] = (bf(p) @ v[:e, h // g]) / p.sum(1, keepdims=True)
    return out


def forward(model, ids, R, *, deltanet="chunked", kvq=None):
    """All logits of ``ids`` from position 0 with the rounding points ``R``; ``kvq`` (a
    reference/kvquant.py format) replaces the K and V cache rows' rounding when given."""
    c, w = model.cfg, model.w
    r = (lambda key, x: bf(x) if key in R else x)
    rkv = (lambda x: kvq(x)) if kvq is not None else (lambda x: r("kv", x))
    st, T = model.new_state(), len(ids)
    x = r("resid", w.embed.take(ids))
    for i, lw in enumerate(w.layers):
        hn = r("norm", rms_norm(x, lw.input_norm, c.rms_norm_eps))
        if isinstance(lw.mixer, AttentionWeights):
            a, D = lw.mixer, c.head_dim
            qg = r("proj", a.q_proj.matmul(hn)).reshape(T, c.num_attention_heads, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(T, -1)
            k = r("proj", a.k_proj.matmul(hn)).reshape(T, c.num_key_value_heads, D)
            v = rkv(r("proj", a.v_proj.matmul(hn)).reshape(T, c.num_key_value_heads, D))
            cos, sin = rope_cos_sin(np.arange(T), c.rotary_dim, c.rope_theta)
            q = r("kv", apply_partial_rope(rms_norm(q, a.q_norm, c.rms_norm_eps), cos, sin))
            k = rkv(apply_partial_rope(rms_norm(k, a.k_norm, c.rms_norm_eps), cos, sin))
            o = attend_p_bf16(q, k, v) if "P" in R else RA.attend(q, k, v, 0)
            mix = r("proj", a.o_proj.matmul(r("attn_out", o.reshape(T, -1) * sigmoid(gate))))
        else:
            d = lw.mixer
            Hk, Dk, kd = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_key_dim
            qkv, _ = RG.causal_conv1d(r("proj", d.in_proj_qkv.matmul(hn)), d.conv1d, st.conv[i])
            qkv = r("conv", qkv)
            q = l2_normalize(qkv[:, :kd].reshape(T, Hk, Dk)) * np.float32(Dk ** -0.5)
            k = l2_normalize(qkv[:, kd:2 * kd].reshape(T, Hk, Dk))
            v = qkv[:, 2 * kd:].reshape(T, c.linear_num_value_heads, c.linear_value_head_dim)
            z = r("proj", d.in_proj_z.matmul(hn)).reshape(v.shape)
            beta = sigmoid(r("proj", d.in_proj_b.matmul(hn)))
            g = -np.exp(d.A_log) * softplus(r("proj", d.in_proj_a.matmul(hn)) + d.dt_bias)
            S, outs = st.recurrent[i], []
            step = T if "state" not in R else 64
            for s in range(0, T, step):
                sl = slice(s, s + step)
                if deltanet == "recurrent":
                    o, S = RG.recurrent_gated_delta(q[sl], k[sl], v[sl], g[sl], beta[sl], S)
                else:
                    o, S = RG.chunked_gated_delta(q[sl], k[sl], v[sl], g[sl], beta[sl], S, 64)
                S = r("state", S)
                outs.append(o)
            o = np.concatenate(outs)
            o = r("dn_o", gated_rms_norm(o, z, d.norm, c.rms_norm_eps).reshape(T, -1))
            mix = r("proj", d.out_proj.matmul(o))
        h = r("resid", x + mix)
        hn2 = r("norm", rms_norm(h, lw.post_norm, c.rms_norm_eps))
        m = lw.moe
        experts, wts = RMo.route(r("proj", m.router.matmul(hn2)), c.num_experts_per_tok)
        y = np.zeros_like(hn2)
        for e in np.unique(experts):
            rows, slot = np.nonzero(experts == e)
            y[rows] += wts[rows, slot][:, None] * RMo.swiglu_mlp(
                hn2[rows], m.gate_proj.expert(e), m.up_proj.expert(e), m.down_proj.expert(e))
        y += sigmoid(m.shared_expert_gate.matmul(hn2)) * RMo.swiglu_mlp(
            hn2, m.shared_gate_proj, m.shared_up_proj, m.shared_down_proj)
        x = r("resid", h + y)
    return w.lm_head.matmul(r("norm", rms_norm(x, w.norm, c.rms_norm_eps)))


ROWS = [("engine (all of its rounding points)", ENGINE, "chunked"),
        ("engine, DeltaNet token by token", ENGINE, "recurrent"),
        ("engine + P in bf16 (prefill tiles)", ENGINE + ("P",), "chunked"),
        ("engine + DeltaNet state bf16 per chunk", ENGINE + ("state",), "chunked"),
        ("resid only", ("resid",), "chunked"),
        ("norm + proj only", ("norm", "proj"), "chunked"),
        ("kv + attn_out + P only", ("kv", "attn_out", "P"), "chunked"),
        ("DeltaNet state bf16 per chunk only", ("state",), "chunked")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    n = ap.parse_args().length
    edges = [e for e in (0, 100, 300, 1000, 3000, 8000, 16000, 32000) if e < n] + [n]
    with tempfile.TemporaryDirectory() as tmp:
        model = lily_py.load(B.make(tmp), backend="reference", verbose=False,
                             kv_dtype="bfloat16")._backend.model
    ids = B.prompt(n).astype(np.int64)
    ref = forward(model, ids, ())
    wins = [f"{a:,}-{b:,}" for a, b in zip(edges, edges[1:])]
    print(f"mean |d| of the logits vs fp32, {n:,}-token prompt, per window of positions (max |ref| "
          f"{np.abs(ref).max():.1f}); p99: 99th percentile of a row's mean |d|\n")
    print("| rounded to bf16 | " + " | ".join(wins) + " | p99 |")
    print("|---|" + "---:|" * (len(wins) + 1))
    for name, R, dn in ROWS:
        d = np.abs(forward(model, ids, set(R), deltanet=dn) - ref).mean(axis=1)
        cells = [f"{d[a:b].mean():.3g}" for a, b in zip(edges, edges[1:])]
        print(f"| {name} | " + " | ".join(cells) + f" | {np.percentile(d, 99):.3g} |", flush=True)


if __name__ == "__main__":
    main()
