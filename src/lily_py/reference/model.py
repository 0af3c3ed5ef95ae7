"""The whole qwen3_5_moe text model in NumPy: the oracle every device is compared with.

Decoder layer (pre-norm residual):
    h   = x + Mixer(RMSNorm_in(x))        Mixer = Gated DeltaNet or gated attention
    out = h + MoE(RMSNorm_post(h))
then the final RMSNorm and the untied lm_head. All math is float32 on weights dequantized on the
fly (a bounded block of rows at a time, and only the routed experts), so the full 35B checkpoint
runs in a few GiB of memory, slowly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..checkpoint import AttentionWeights, ModelWeights
from ..config import ModelConfig
from .attention import KVCache, attention_layer
from .gated_delta import causal_conv1d, chunked_gated_delta, recurrent_gated_delta
from .moe import moe_block
from .ops import gated_rms_norm, l2_normalize, rms_norm, sigmoid, softplus


@dataclass
class ReferenceState:
    """Everything the model carries between calls.

    Arrays in here are never modified in place (each step stores new arrays; the KV cache is
    append-only), so ``fork()`` — a structural copy sharing the arrays — is a full snapshot."""
    position: int = 0
    kv: dict[int, KVCache] = field(default_factory=dict)         # layer -> keys/values [P, Hkv, D]
    conv: dict[int, np.ndarray] = field(default_factory=dict)    # layer -> [K-1, C]
    recurrent: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [Hv, Dk, Dv] fp32

    def fork(self) -> "ReferenceState":
        return ReferenceState(self.position, {i: c.fork() for i, c in self.kv.items()},
                              dict(self.conv), dict(self.recurrent))


class ReferenceModel:
    """``forward(ids, state)`` feeds tokens and returns logits; see ``lily_py.Model`` for the API.

    ``deltanet`` selects the delta-rule form used for multi-token calls: "chunked" (the prefill
    algorithm, default) or "recurrent" (token by token). Single tokens always use the recurrence.
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, *, deltanet: str = "chunked",
                 chunk_size: int = 64, kv_dtype: str | None = None):
        if deltanet not in ("chunked", "recurrent"):
            raise ValueError(f"deltanet must be 'chunked' or 'recurrent', got {deltanet!r}")
        self.cfg, self.w = cfg, weights
        if kv_dtype not in (None, "bfloat16", "float32", "int8"):
            raise ValueError(f"kv_dtype must be 'bfloat16', 'float32', 'int8' or None, got {kv_dtype!r}")
        self.deltanet, self.chunk_size = deltanet, chunk_size
        # "int8": the cache holds each appended row quantized as the engine's int8 cache does;
        # otherwise ("bfloat16", "float32", None) it keeps the float32 rows unrounded: the
        # engine's kv_dtype="float32" cache, and the exact model the bf16 cache approximates
        self.kv_quantize = kv_dtype == "int8"

    def new_state(self) -> ReferenceState:
        c = self.cfg
        st = ReferenceState()
        for i in range(c.num_hidden_layers):
            if c.is_full_attention(i):
                st.kv[i] = KVCache(quantize=self.kv_quantize)
            else:
                st.conv[i] = np.zeros((c.linear_conv_kernel_dim - 1, c.linear_conv_dim), np.float32)
                st.recurrent[i] = np.zeros((c.linear_num_value_heads, c.linear_key_head_dim,
                                            c.linear_value_head_dim), np.float32)
        return st

    def hidden_states(self, ids: np.ndarray, state: ReferenceState,
                      residuals: list | None = None) -> np.ndarray:
        """Run the decoder stack on ``ids [T]``; returns the final-normed hidden ``[T, H]``.
        ``residuals``: a list that gets the residual stream ``[T, H]`` after each layer."""
        c = self.cfg
        x = self.w.embed.take(ids)
        for i, lw in enumerate(self.w.layers):
            hn = rms_norm(x, lw.input_norm, c.rms_norm_eps)
            if isinstance(lw.mixer, AttentionWeights):
                mix = attention_layer(hn, lw.mixer, c, state.kv[i], state.position)
            else:
                mix = self._deltanet(hn, lw.mixer, i, state)
            h = x + mix
            x = h + moe_block(rms_norm(h, lw.post_norm, c.rms_norm_eps), lw.moe,
                              c.num_experts_per_tok)
            if residuals is not None:
                residuals.append(x.copy())
        state.position += len(ids)
        return rms_norm(x, self.w.norm, c.rms_norm_eps)

    def forward(self, ids, state: ReferenceState, *, all_logits: bool = False) -> np.ndarray:
        """Feed ``ids``; logits ``[T, V]`` if ``all_logits`` else ``[V]`` for the last token.
        Updates ``state`` layer by layer: callers that need all-or-nothing pass a ``fork()``."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        h = self.hidden_states(ids, state)
        if not all_logits:
            h = h[-1:]
        logits = self.w.lm_head.matmul(h)
        return logits if all_logits else logits[0]

    def _deltanet(self, x: np.ndarray, w, layer: int, state: ReferenceState) -> np.ndarray:
        c = self.cfg
        T = x.shape[0]
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        Dk, Dv, kd = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_key_dim
        qkv, state.conv[layer] = causal_conv1d(w.in_proj_qkv.matmul(x), w.conv1d, state.conv[layer])
        q = l2_normalize(qkv[:, :kd].reshape(T, Hk, Dk)) * np.float32(Dk ** -0.5)
        k = l2_normalize(qkv[:, kd:2 * kd].reshape(T, Hk, Dk))
        v = qkv[:, 2 * kd:].reshape(T, Hv, Dv)
        z = w.in_proj_z.matmul(x).reshape(T, Hv, Dv)
        beta = sigmoid(w.in_proj_b.matmul(x))
        g = -np.exp(w.A_log) * softplus(w.in_proj_a.matmul(x) + w.dt_bias)
        if self.deltanet == "chunked" and T > 1:
            o, S = chunked_gated_delta(q, k, v, g, beta, state.recurrent[layer], self.chunk_size)
        else:
            o, S = recurrent_gated_delta(q, k, v, g, beta, state.recurrent[layer])
        state.recurrent[layer] = S
        o = gated_rms_norm(o, z, w.norm, c.rms_norm_eps).reshape(T, Hv * Dv)
        return w.out_proj.matmul(o)
