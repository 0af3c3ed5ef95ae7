"""What one engine step should encode and compute, derived from the config alone: the
(dispatches, barriers) of the encoding plan and the useful FLOPs. The counter tests
(tests/model/test_engine.py on a small checkpoint, tests/model/test_real_config_counts.py on the
real 35B shapes) hold the engine's counters to these."""
from __future__ import annotations


def expected_counts(cfg, tokens: int, position: int = 0, logits: bool = True,
                    all_logits: bool = False, out_bits: int = 4) -> tuple[int, int]:
    """(dispatches, barriers) of one step, from the engine's encoding plan (csrc/gpu/step.h):
    embedding | per layer: input norm, mixer, fused residual + post norm, MoE, one barrier after
    each | final norm | lm_head. Decode (one token) fuses the input norm into the mixer's first
    projection and the post norm into the router (two dispatches and barriers fewer per layer);
    with one row of logits the final norm is fused into lm_head. Mixers: DeltaNet 4 dispatches /
    3 barriers inside (the chunked delta rule: 2 more of each, the conv fused into its prep; one
    token: 3 / 2, the conv fused into gated_delta_decode and its gated norm into out_proj,
    qmv1_gated, where that is built for the shape (`out_bits`: out_proj's width), else 4 / 3, the
    norm a dispatch of its own: MSL 3.1 orders nothing between threadgroups); attention 4 / 3, plus one dispatch
    and one barrier when decode attention takes two passes (the vec route of head_dim 64 / 128 /
    256 at every length; other head dims beyond 256 keys). MoE: mv route (tokens <= 8; below
    3 tokens gate/up selects the experts itself, no route dispatch) 3 / 2, from 3 tokens on a
    moe_route dispatch first 4 / 3, tiled 10 / 9 (the three tile kinds of a stage one after another). `cfg` is a ModelConfig."""
    from lily_py.backends.engine import _core
    from lily_py.ops import attention_decode_route, gated_delta_route, moe_route
    if moe_route(tokens, cfg.num_experts_per_tok) == "mv":
        moe, moe_barriers = (4, 3) if tokens >= _core().ops.MOE_MV_ROUTE_MIN_TOKENS else (3, 2)
    else:
        moe, moe_barriers = 10, 9
    chunked = gated_delta_route(tokens, cfg.linear_key_head_dim, cfg.linear_value_head_dim) == "chunked"
    two_pass = tokens == 1 and attention_decode_route(position + 1, cfg.head_dim)["route"] != "single"
    norms = 0 if tokens == 1 else 2  # separate norm dispatches per layer
    Dv = cfg.linear_value_head_dim
    folds = tokens == 1 and _core().ops.qmv1_gated_supported(cfg.hidden_size, cfg.linear_num_value_heads * Dv, Dv,
                                                              out_bits)
    dispatches = barriers = 1
    for i in range(cfg.num_hidden_layers):
        mixer = 3 if folds and not cfg.is_full_attention(i) else 4
        if cfg.is_full_attention(i) and two_pass:
            mixer = 5
        if not cfg.is_full_attention(i) and chunked:
            mixer = 6
        dispatches += norms + mixer + moe
        barriers += norms + (mixer - 1) + 1 + moe_barriers + 1
    if not logits:
        return dispatches, barriers - 1
    head = 1 if (tokens == 1 or not all_logits) else 2  # lm_head (+ a separate final norm)
    return dispatches + head, barriers + head - 1


def expected_useful_flops(cfg, tokens: int, position: int = 0, logit_rows: int = 1) -> int:
    """FLOPs the math of one step needs (2 per multiply-add of the matrix products; norms, gates,
    softmax, conv1d and elementwise ops are not counted), from the config alone: projections,
    the delta rule (S^T k, k u^T, S^T q per token and value head), attention over the visible
    keys, router (E + 1 rows with the shared gate), the routed rows of the experts and the
    shared expert, lm_head over the logit rows."""
    T, H = tokens, cfg.hidden_size
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, k, I, Is = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   cfg.shared_expert_intermediate_size)
    total = 0
    for i in range(cfg.num_hidden_layers):
        if cfg.is_full_attention(i):
            total += 2 * T * H * (2 * Hq * D + 2 * Hkv * D)          # q|gate, k, v projection
            total += 4 * D * Hq * (T * position + T * (T + 1) // 2)  # q.k and p.v, causal
            total += 2 * T * Hq * D * H                              # o_proj
        else:
            total += 2 * T * H * (2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv)  # in_proj (qkv | z | b | a)
            total += 6 * T * Hv * Dk * Dv                            # the delta rule
            total += 2 * T * Hv * Dv * H                             # out_proj
        total += 2 * T * H * (E + 1) + 6 * H * (T * k * I + T * Is)  # router + experts
    return total + 2 * logit_rows * cfg.vocab_size * H


def attention_decode_padding_flops(cfg, position: int) -> int:
    """Decode attention off the vec route scores whole 32-key blocks: the flops past the visible
    keys. The vec route (head_dim 64 / 128 / 256) scores exactly the visible keys."""
    from lily_py.ops import attention_decode_route
    if attention_decode_route(position + 1, cfg.head_dim)["route"] == "vec":
        return 0
    keys = position + 1
    pad = (keys + 31) // 32 * 32 - keys
    layers = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    return layers * 4 * cfg.head_dim * cfg.num_attention_heads * pad


def real_cfg():
    """The ModelConfig of the real 35B shapes (lily_py.testing.REAL_TEXT_CONFIG)."""
    from lily_py.config import ModelConfig
    from lily_py.testing import REAL_TEXT_CONFIG
    return ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
