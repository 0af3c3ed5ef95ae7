"""The mixture-of-experts block as one function over NumPy arrays (re-exported by lily_py.ops).

Packing (MLX affine layout, what an MLX-format ``qwen3_5_moe`` checkpoint stores per layer):

* ``router``: ``(w, scales, biases)`` of ``mlp.gate`` - ``[E, H]`` (usually 8-bit).
* ``experts``: a mapping with ``"gate_proj"``, ``"up_proj"`` (``[E, I, H]``) and ``"down_proj"``
  (``[E, H, I]``), each ``(w, scales, biases)`` stacked over experts: mlx-lm's
  ``mlp.switch_mlp.*`` tensors, 4-bit, ``w`` uint32 ``[E, N, K * 4 / 32]``, scales/biases bfloat16
  ``[E, N, K / group_size]``.
* ``shared_expert``: a mapping with ``"gate_proj"``, ``"up_proj"`` (``[Is, H]``), ``"down_proj"``
  (``[H, Is]``) - ``mlp.shared_expert.*``, 4-bit like the experts or at its own width (a mixed
  checkpoint: routed/shared bits 2/6, 3/6, 4/6, 4/8; ``engine_quant_support()``) - and ``"gate"``: the
  ``mlp.shared_expert_gate`` ``[1, H]``, quantized like the router (same bits, group size and
  scale dtype): it is appended to the router as row ``E`` so one matmul gives every logit.

Any ``(w, scales, biases)`` may also be an object with ``.w``, ``.scales``, ``.biases``
(``lily_py.weights.QuantLinear``); :func:`moe_weights` unpacks a loaded layer's ``MoEWeights``.
"""
from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

__all__ = ["moe", "moe_route", "moe_weights"]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_SCALE_DTYPES = {np.dtype(np.float32): "float32", BFLOAT16: "bfloat16"}
_GROUP_SIZES = (32, 64, 128)
_EXPERT_BITS = (2, 3, 4, 5, 6, 8)  # MLX affine widths the expert kernels take (bfloat16 scales)
FN = "moe"


def _core():
    from .. import _core
    return _core


def moe_route(tokens: int, top_k: int) -> str:
    """The route the block takes: ``"mv"`` (tokens <= 8: gather matvec) or ``"tiled"`` (grouped
    matmul; the device plan sizes each expert's tiles by its load: 64-row tiles, and for the
    remainder a 32-row tile or, for <= 8 rows, a matvec-style tile)."""
    return str(_core().ops.moe_route(int(tokens), int(top_k)))


def moe_weights(w) -> tuple:
    """``(router, experts, shared_expert)`` for :func:`moe` from a checkpoint's ``MoEWeights``
    whose matrices are quantized (``QuantLinear``)."""
    experts = {"gate_proj": w.gate_proj, "up_proj": w.up_proj, "down_proj": w.down_proj}
    shared = {"gate_proj": w.shared_gate_proj, "up_proj": w.shared_up_proj,
              "down_proj": w.shared_down_proj, "gate": w.shared_expert_gate}
    return w.router, experts, shared


def _triple(m, what: str):
    if hasattr(m, "w") and hasattr(m, "scales") and hasattr(m, "biases"):
        m = (m.w, m.scales, m.biases)
    if not isinstance(m, (tuple, list)) or len(m) != 3:
        raise ValueError(f"{FN}: {what} must be (w, scales, biases) or an object with .w/.scales/.biases")
    w, s, b = (np.asarray(a) for a in m)
    if w.dtype != np.uint32:
        raise ValueError(f"{FN}: {what} w must be uint32 (MLX packed codes), got {w.dtype}")
    if s.dtype not in _SCALE_DTYPES or b.dtype != s.dtype:
        raise ValueError(f"{FN}: {what} scales/biases must both be float32 or bfloat16, got {s.dtype}/{b.dtype}")
    if s.shape != b.shape or s.shape[:-1] != w.shape[:-1] or s.shape[-1] == 0:
        raise ValueError(f"{FN}: {what} scales {list(s.shape)} / biases {list(b.shape)} do not match w {list(w.shape)}")
    return w, s, b


def _layout(t, what: str, shape: tuple, k: int):
    """Check a quantized matrix of logical shape ``shape`` (last dim K = k); returns (bits, group)."""
    w, s, _ = t
    if w.ndim != len(shape) or w.shape[:-1] != shape[:-1]:
        raise ValueError(f"{FN}: {what} must be a quantized {list(shape)} matrix, w is {list(w.shape)}")
    if (w.shape[-1] * 32) % k:
        raise ValueError(f"{FN}: {what} w has {w.shape[-1]} words per row, not a whole number of bits for K={k}")
    bits = w.shape[-1] * 32 // k
    if k % s.shape[-1]:
        raise ValueError(f"{FN}: {what} has {s.shape[-1]} groups per row, K={k} is not a multiple")
    return bits, k // s.shape[-1]


def moe(x: np.ndarray, router, experts: Mapping, shared_expert: Mapping, *, top_k: int,
        residual: np.ndarray | None = None, device: str = "emu") -> np.ndarray:
    """The qwen3_5_moe sparse MoE block: ``[residual +] sum_j w_j expert_j(x) + sigmoid(g.x) shared(x)``.

    Router softmax over all experts in float32, top-``top_k`` (ties to the lowest expert index),
    renormalised; SwiGLU experts; the shared expert scaled by its sigmoid gate - exactly
    ``lily_py.reference.moe.moe_block``, on the device, with no host round trip inside the block.
    ``x``: ``[..., H]`` float32 or bfloat16 (the activations' dtype: router logits, residual and
    output follow it; the expert intermediates stay float32); ``residual`` (optional, x's shape and
    dtype): added in the last kernel. Weight packing: see this module's docstring. Returns ``[..., H]``
    of x's dtype.
    """
    return _moe(x, router, experts, shared_expert, top_k=top_k, residual=residual, device=device)[0]


def _moe(x, router, experts, shared_expert, *, top_k, residual=None, device="emu", order="shuffle",
         seed=0, fp_traps=True):
    """:func:`moe` plus the routing (``ids [T, k]``, ``weights [T, k + 1]``: the renormalised
    routing weights, then the shared expert's sigmoid gate) and the run's stats (route, kernels,
    dispatches, barriers, bytes bound, threads, host_syncs)."""
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, BFLOAT16) or x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{FN}: x must be a float32 or bfloat16 array [..., H] with H > 0, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    if device not in ("emu", "metal", "cuda"):
        raise ValueError(f"{FN}: device must be 'emu', 'metal' or 'cuda', got {device!r}")
    if not isinstance(experts, Mapping) or not isinstance(shared_expert, Mapping):
        raise ValueError(f"{FN}: experts and shared_expert must be mappings of named matrices")
    for name, m, keys in (("experts", experts, ("gate_proj", "up_proj", "down_proj")),
                          ("shared_expert", shared_expert, ("gate_proj", "up_proj", "down_proj", "gate"))):
        missing = [k for k in keys if k not in m]
        if missing:
            raise ValueError(f"{FN}: {name} lacks {missing}")
    H = x.shape[-1]
    r = _triple(router, "router")
    g, u, d = (_triple(experts[k], f"experts[{k!r}]") for k in ("gate_proj", "up_proj", "down_proj"))
    sg, su, sd, gate = (_triple(shared_expert[k], f"shared_expert[{k!r}]")
                        for k in ("gate_proj", "up_proj", "down_proj", "gate"))
    if d[0].ndim != 3 or d[0].shape[1] != H:
        raise ValueError(f"{FN}: x has H={H} features but experts['down_proj'] is "
                         f"{list(d[0].shape)}; it must be stacked [E, H, I * bits / 32]")
    E = r[0].shape[0] if r[0].ndim == 2 else -1
    if E < 1:
        raise ValueError(f"{FN}: router must be a quantized [E, H] matrix, w is {list(r[0].shape)}")
    if g[0].ndim != 3:
        raise ValueError(f"{FN}: experts['gate_proj'] must be stacked [E, I, H], w is {list(g[0].shape)}")
    I, Is = g[0].shape[1], sg[0].shape[0]
    rb, rgs = _layout(r, "router", (E, H), H)
    gb, ggs = _layout(gate, "shared_expert['gate']", (1, H), H)
    if (gb, ggs, gate[1].dtype) != (rb, rgs, r[1].dtype):
        raise ValueError(f"{FN}: shared_expert['gate'] must be quantized like the router "
                         f"({rb}-bit, group {rgs}, {r[1].dtype}); got {gb}-bit, group {ggs}, {gate[1].dtype}")
    if rb not in _EXPERT_BITS or rgs not in _GROUP_SIZES:
        raise ValueError(f"{FN}: router must be {_EXPERT_BITS}-bit with group size 32/64/128, got {rb}-bit group {rgs}")
    layouts = {name: _layout(t, name, shape, shape[-1]) for name, t, shape in (
        ("experts['gate_proj']", g, (E, I, H)), ("experts['up_proj']", u, (E, I, H)),
        ("experts['down_proj']", d, (E, H, I)), ("shared_expert['gate_proj']", sg, (Is, H)),
        ("shared_expert['up_proj']", su, (Is, H)), ("shared_expert['down_proj']", sd, (H, Is)))}
    for name, (bits, gs) in layouts.items():
        if bits not in _EXPERT_BITS:
            raise ValueError(f"{FN}: {name} is {bits}-bit; the expert kernels take {_EXPERT_BITS} bits")
        if gs not in _GROUP_SIZES or gs != next(iter(layouts.values()))[1]:
            raise ValueError(f"{FN}: every expert matrix needs the same group size (32, 64 or 128); {name} has {gs}")
    for name, t in (("experts", g), ("experts", u), ("experts", d), ("shared_expert", sg),
                    ("shared_expert", su), ("shared_expert", sd)):
        if t[1].dtype != BFLOAT16:
            raise ValueError(f"{FN}: {name} scales/biases must be bfloat16 (as in the checkpoint), got {t[1].dtype}")
    # One width per stage for the routed matrices and one for the shared ones; the shared expert
    # may have its own width (pairs: engine_quant_support()["moe_shared_widths"]).
    widths = {stage: ({layouts[f"experts[{n!r}]"][0] for n in names},
                      {layouts[f"shared_expert[{n!r}]"][0] for n in names})
              for stage, names in (("gate/up", ("gate_proj", "up_proj")), ("down", ("down_proj",)))}
    if any(len(routed) != 1 or len(shared) != 1 for routed, shared in widths.values()):
        raise ValueError(f"{FN}: the routed gate/up matrices must share one width, and the shared expert's "
                         f"gate/up another; got " + ", ".join(f"{n} {b}-bit" for n, (b, _) in layouts.items()))
    (gu_bits, sgu_bits), (dn_bits, sdn_bits) = ((ro.pop(), sh.pop()) for ro, sh in widths.values())
    top_k = int(top_k)
    if not 1 <= top_k <= min(E, 16):
        raise ValueError(f"{FN}: top_k must be in [1, min(E={E}, 16)], got {top_k}")
    if E > 512:
        raise ValueError(f"{FN}: at most 512 experts, got {E}")
    res = None
    if residual is not None:
        if not isinstance(residual, np.ndarray) or residual.dtype != x.dtype or residual.shape != x.shape:
            raise ValueError(f"{FN}: residual must have x's dtype ({x.dtype}) and shape {list(x.shape)}")
        res = np.ascontiguousarray(residual).reshape(-1, H)
        res = res.view(np.uint16) if res.dtype == BFLOAT16 else res
    lead = x.shape[:-1]
    T = int(np.prod(lead, dtype=np.int64)) if lead else 1
    if T == 0:
        empty = np.zeros(x.shape, x.dtype)
        return (empty if res is None else residual.copy(), np.zeros((0, top_k), np.uint32),
                np.zeros((0, top_k + 1), np.float32), {"kernels": [], "dispatches": 0})

    def raw(a):
        a = np.ascontiguousarray(a)
        return a.view(np.uint16) if a.dtype == BFLOAT16 else a

    # The shared-expert gate becomes row E of the router (done once at load in an engine).
    router_cat = [np.concatenate([r[i], gate[i]], axis=0) for i in range(3)]
    mats = [raw(a) for t in (router_cat, g, u, d, sg, su, sd) for a in t]
    xb = x.dtype == BFLOAT16
    out, ids, weights, stats = _core().ops.moe(
        raw(x).reshape(T, H), mats, res, top_k=top_k, group_size=layouts["experts['gate_proj']"][1],
        router_bits=rb, router_group_size=rgs, router_scale_dtype=_SCALE_DTYPES[r[1].dtype],
        x_dtype="bfloat16" if xb else "float32", device=device, order=order, seed=seed, fp_traps=fp_traps,
        bits=gu_bits, down_bits=dn_bits, shared_bits=sgu_bits, shared_down_bits=sdn_bits)
    if xb:
        out = out.view(BFLOAT16)
    return out.reshape(x.shape), ids.reshape(*lead, top_k), weights.reshape(*lead, top_k + 1), stats
