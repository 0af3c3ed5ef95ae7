"""Dispatches, barriers and bytes bound per attention-layer mixer step at the model's shapes (hidden
2048, 16 / 2 heads of 256), decode at a short and a long context (vec route: attention + combine at both).
Run: python tests/kernels/attention_counts.py (quoted in docs/kernels-attention.md)."""
import numpy as np, ml_dtypes
from lily_py.ops import attention as A
from lily_py.reference import quant
BF16 = np.dtype(ml_dtypes.bfloat16)
rng = np.random.default_rng(0)
H, Hq, Hkv, D = 2048, 16, 2, 256
w = {}
for name, n, k in [("q_proj", Hq * 2 * D, H), ("k_proj", Hkv * D, H), ("v_proj", Hkv * D, H), ("o_proj", H, Hq * D)]:
    w[name] = quant.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.02, bits=4, group_size=64, scale_dtype=BF16)
w["q_norm"] = np.ones(D, BF16); w["k_norm"] = np.ones(D, BF16)
# the loader's alternative: q/k/v rows concatenated into one projection
fused = {k: v for k, v in w.items() if k not in ("q_proj", "k_proj", "v_proj")}
fused["qkv_proj"] = tuple(np.concatenate([w[n][i] for n in ("q_proj", "k_proj", "v_proj")]) for i in range(3))
for label, weights in (("separate q/k/v", w), ("fused qkv", fused)):
    for ctx in (256, 4096):
        kc = rng.standard_normal((Hkv, ctx, D)).astype(BF16); vc = kc.copy()
        x = rng.standard_normal((1, H)).astype(BF16)
        _, _, _, s = A._attention_mixer(x, weights, kc, vc, position=ctx - 1, q_heads=Hq, rotary_dim=64, theta=1e7)
        print(f"decode, {label:14s}, context {ctx:5d}: route {A.attention_decode_route(ctx, D)['route']:6s} "
              f"dispatches {s['dispatches']} barriers {s['barriers']} bytes bound {s['bytes_bound']:,}")
