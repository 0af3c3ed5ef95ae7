"""What a model needs in memory, said before loading: bytes of weights, KV cache, state and
scratch per quantization recipe, the largest context that fits a budget, and which Mac memory
sizes a recipe fits (``lily-py info``, ``load()``, ``python -m lily_py.sizes`` for docs/memory.md).

The weight bytes are the engine's: MLX affine codes plus bfloat16 scales and biases for every
quantized matrix, float32 for the vectors the engine converts at load (norms, conv1d, A_log,
dt_bias). The state, KV cache and scratch come from the engine's own plan
(``lily_py._core.plan_memory``: the buffers it allocates, computed without allocating).

Recipes follow mlx-lm's conversions (``mlx_lm.convert``): a uniform width ``-q --q-bits N``
keeps the router and shared-expert gate at 8 bits (the qwen3_5_moe model's quant predicate), and
``--quant-predicate mixed_3_4`` gives 4 bits to lm_head and to the attention v_proj and
expert/shared down_proj of the first and last eighth of the layers and of every third layer
between, 3 bits to everything else (embedding and router included), groups of 64
(tests/fixtures/mixed_bits/recipes.json: mlx-lm's own predicate, checked by
tests/model/test_mixed_bits.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .backends.spec import REAL_QUANT, engine_spec, kv_row_bytes
from .config import ModelConfig

GiB = 1 << 30
GB = 10 ** 9


@dataclass(frozen=True)
class Matrix:
    """One weight of the engine's inventory."""
    module: str          # canonical module name ("layers.3.mlp.switch_mlp.down_proj")
    rows: int
    cols: int
    count: int = 1       # stacked experts
    quantized: bool = True
    per_token: float = 1.0   # fraction of it one decode token reads (routed experts: top_k / E)
    cls: str = ""        # the engine's quantization class (embed, lm_head, mixer, experts_q, router)


def inventory(cfg: ModelConfig) -> list[Matrix]:
    """Every weight the engine holds for ``cfg`` (the same matrices as csrc/core/engine_buffers.cpp
    build_buffers; the fused ones listed by part)."""
    H, V, E = cfg.hidden_size, cfg.vocab_size, cfg.num_experts
    I, Is, k = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.num_experts_per_tok
    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    C, K = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
    out = [Matrix("embed_tokens", V, H, per_token=1 / V, cls="embed")]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out += [Matrix(p + "input_layernorm", 1, H, quantized=False),
                Matrix(p + "post_attention_layernorm", 1, H, quantized=False)]
        if cfg.is_full_attention(i):
            a = p + "self_attn."
            out += [Matrix(a + "q_proj", 2 * Hq * D, H, cls="mixer"), Matrix(a + "k_proj", Hkv * D, H, cls="mixer"),
                    Matrix(a + "v_proj", Hkv * D, H, cls="mixer"), Matrix(a + "o_proj", H, Hq * D, cls="mixer"),
                    Matrix(a + "q_norm", 1, D, quantized=False), Matrix(a + "k_norm", 1, D, quantized=False)]
        else:
            a = p + "linear_attn."
            out += [Matrix(a + "in_proj_qkv", C, H, cls="mixer"), Matrix(a + "in_proj_z", Hv * Dv, H, cls="mixer"),
                    Matrix(a + "in_proj_b", Hv, H, cls="mixer"), Matrix(a + "in_proj_a", Hv, H, cls="mixer"),
                    Matrix(a + "out_proj", H, Hv * Dv, cls="mixer"),
                    Matrix(a + "conv1d", C, K, quantized=False), Matrix(a + "A_log", 1, Hv, quantized=False),
                    Matrix(a + "dt_bias", 1, Hv, quantized=False), Matrix(a + "norm", 1, Dv, quantized=False)]
        m = p + "mlp."
        out += [Matrix(m + "gate", E, H, cls="router"), Matrix(m + "shared_expert_gate", 1, H, cls="router"),
                Matrix(m + "switch_mlp.gate_proj", I, H, E, per_token=k / E, cls="experts_q"),
                Matrix(m + "switch_mlp.up_proj", I, H, E, per_token=k / E, cls="experts_q"),
                Matrix(m + "switch_mlp.down_proj", H, I, E, per_token=k / E, cls="experts_q"),
                Matrix(m + "shared_expert.gate_proj", Is, H, cls="experts_q"),
                Matrix(m + "shared_expert.up_proj", Is, H, cls="experts_q"),
                Matrix(m + "shared_expert.down_proj", H, Is, cls="experts_q")]
    out += [Matrix("norm", 1, H, quantized=False), Matrix("lm_head", V, H, cls="lm_head")]
    return out


Recipe = Callable[[str], "tuple[int, int]"]


def uniform(bits: int, group_size: int = 64) -> Recipe:
    """``mlx_lm.convert -q --q-bits bits``: the router and shared-expert gate stay 8-bit."""
    def spec(module: str) -> tuple[int, int]:
        if module.endswith("mlp.gate") or module.endswith("shared_expert_gate"):
            return 8, group_size
        return bits, group_size
    return spec


def mixed(low: int, high: int, num_layers: int, group_size: int = 64) -> Recipe:
    """mlx-lm's ``mixed_<low>_<high>`` quant predicate (mlx_lm/convert.py), on canonical names."""
    def spec(module: str) -> tuple[int, int]:
        parts = module.split(".")
        index = int(parts[1]) if parts[0] == "layers" else 0
        more = (index < num_layers // 8 or index >= 7 * num_layers // 8
                or (index - num_layers // 8) % 3 == 2)
        if more and ("v_proj" in module or "down_proj" in module):
            return high, group_size
        if "lm_head" in module:
            return high, group_size
        return low, group_size
    return spec


def recipes(cfg: ModelConfig) -> dict[str, Recipe]:
    """The recipes of the docs table."""
    n = cfg.num_hidden_layers
    return {"2-bit": uniform(2), "3-bit": uniform(3), "mixed 3/4 (mixed_3_4)": mixed(3, 4, n),
            "4-bit": uniform(4), "8-bit": uniform(8)}


def engine_quant(cfg: ModelConfig, recipe_name: str) -> dict:
    """The engine's quantization (``lily_py.backends.spec.engine_spec``'s ``quant``) of a recipe of
    :func:`recipes`, for the counting device: uniform widths keep the router and shared-expert gate
    at 8 bits; ``mixed_3_4`` puts v_proj, the routed and shared down projections of mlx-lm's "more
    bits" layers and lm_head at 4 bits as :func:`mixed` does (``quant_overrides``)."""
    gs = REAL_QUANT["mixer"]["group_size"]
    if recipe_name.startswith("mixed"):
        low, high = 3, 4
    else:
        low = high = int(recipe_name.split("-")[0])
    q = {k: (dict(v) if k == "router" else dict(v, bits=low, group_size=gs)) for k, v in REAL_QUANT.items()}
    if high != low:
        spec = mixed(low, high, cfg.num_hidden_layers, gs)
        hi = dict(REAL_QUANT["mixer"], bits=high, group_size=gs)
        over = {"lm_head": hi}
        for i in range(cfg.num_hidden_layers):
            if spec(f"layers.{i}.mlp.experts.down_proj")[0] == high:
                over.update({f"layers.{i}.experts.down": hi, f"layers.{i}.shared.down": hi})
            if cfg.is_full_attention(i) and spec(f"layers.{i}.self_attn.v_proj")[0] == high:
                over[f"layers.{i}.qkv_proj:v"] = hi
        q["quant_overrides"] = over
    return q


def matrix_bytes(m: Matrix, recipe: Recipe, scale_bytes: int = 2) -> int:
    """Bytes the engine holds for ``m``: codes + scales + biases, or float32."""
    if not m.quantized:
        return m.count * m.rows * m.cols * 4
    bits, g = recipe(m.module)
    return m.count * (m.rows * m.cols * bits // 8 + 2 * m.rows * (m.cols // g) * scale_bytes)


def weight_bytes(cfg: ModelConfig, recipe: Recipe) -> int:
    return sum(matrix_bytes(m, recipe) for m in inventory(cfg))


def decode_weight_bytes(cfg: ModelConfig, recipe: Recipe, cls: str | None = None) -> float:
    """Weight bytes one decode token reads (routed experts: top_k of E; one embedding row), of
    class ``cls`` only when given."""
    return sum(matrix_bytes(m, recipe) * m.per_token for m in inventory(cfg)
               if m.quantized and (cls is None or m.cls == cls))


def plan(cfg: ModelConfig, *, context_length: int, prefill_chunk: int = 4096,
         activations: str = "bfloat16", kv_dtype: str | None = None,
         kv_block_tokens: int | None = None) -> dict:
    """The engine's plan (bytes of weights at 4 bits, state, scratch) for ``cfg`` with a KV cache
    of ``kv_dtype`` (None: the default, bfloat16)."""
    from . import _core
    spec = engine_spec(cfg, REAL_QUANT, context_length=context_length,
                       prefill_chunk=min(prefill_chunk, context_length), activations=activations,
                       kv_dtype=kv_dtype, kv_block_tokens=kv_block_tokens)
    return dict(_core.plan_memory(spec))


KV_BLOCK_TOKENS = 1024  # the engine's default KV cache block (docs/memory.md)


def kv_bytes(cfg: ModelConfig, context_length: int, block_tokens: int = KV_BLOCK_TOKENS,
             kv_dtype: str | None = None) -> int:
    """K and V of every attention layer for ``context_length`` tokens, in whole blocks of
    ``block_tokens`` (what the engine's pools hold once the context is full); rows of
    ``kv_dtype`` (None: the default, bfloat16)."""
    tokens = -(-context_length // block_tokens) * block_tokens
    return 2 * len(cfg.full_attention_layers) * cfg.num_key_value_heads * tokens * kv_row_bytes(cfg, kv_dtype)


def snapshot_bytes(cfg: ModelConfig, tokens: int, *, engine: bool = True, kv_dtype: str | None = None,
                   activations: str = "bfloat16", block_tokens: int = KV_BLOCK_TOKENS) -> dict:
    """Bytes of a prompt-cache snapshot of a ``tokens``-long prefix (``Model.prompt_cache``):
    ``recurrent`` (every DeltaNet layer's state and conv window) and ``kv`` (the attention layers'
    K and V rows), and their ``total``. The engine (``engine=True``) copies every state buffer but
    the KV pools whole (its own plan says their bytes) and the KV pools' filled blocks: whole
    blocks of ``block_tokens``, rows of ``kv_dtype``. The reference keeps float32 arrays: the
    DeltaNet state, the K-1 conv positions and exactly ``tokens`` float32 KV rows (the bfloat16
    default's values, unrounded storage)."""
    if engine:
        p = plan(cfg, context_length=block_tokens, prefill_chunk=min(4096, block_tokens),
                 activations=activations, kv_dtype=kv_dtype, kv_block_tokens=block_tokens)
        recurrent = p["state_bytes"] - kv_bytes(cfg, block_tokens, block_tokens, kv_dtype)
        kv = kv_bytes(cfg, tokens, block_tokens, kv_dtype)
    else:
        n_lin = cfg.num_hidden_layers - len(cfg.full_attention_layers)
        recurrent = 4 * n_lin * (cfg.linear_num_value_heads * cfg.linear_key_head_dim
                                 * cfg.linear_value_head_dim
                                 + (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim)
        kv = 2 * len(cfg.full_attention_layers) * cfg.num_key_value_heads * tokens * 4 * cfg.head_dim
    return {"recurrent": recurrent, "kv": kv, "total": recurrent + kv}


def needs(cfg: ModelConfig, recipe: Recipe, context_length: int, prefill_chunk: int = 4096,
          activations: str = "bfloat16", kv_dtype: str | None = None) -> dict:
    """Bytes a load of ``cfg`` at ``recipe`` and ``context_length`` allocates: weights, KV cache
    (of ``kv_dtype``), other state (DeltaNet state, conv windows), scratch, total."""
    p = plan(cfg, context_length=context_length, prefill_chunk=prefill_chunk, activations=activations,
             kv_dtype=kv_dtype)
    kv = kv_bytes(cfg, context_length, kv_dtype=kv_dtype)
    w = weight_bytes(cfg, recipe)
    return {"weights": w, "kv_cache": kv, "state": p["state_bytes"] - kv, "scratch": p["scratch_bytes"],
            "total": w + p["state_bytes"] + p["scratch_bytes"]}


def largest_context(cfg: ModelConfig, recipe: Recipe, budget: int, prefill_chunk: int = 4096,
                    activations: str = "bfloat16", kv_dtype: str | None = None) -> int:
    """The largest context_length (<= max_position_embeddings) whose load fits ``budget`` bytes;
    0 when none does."""
    fits = lambda c: needs(cfg, recipe, c, prefill_chunk, activations, kv_dtype)["total"] <= budget  # noqa: E731
    hi = cfg.max_position_embeddings
    if fits(hi):
        return hi
    if not fits(1):
        return 0
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def config_recipe(cfg: ModelConfig) -> Recipe | None:
    """The checkpoint's own widths (its config's quantization and per-module overrides); None
    for an unquantized checkpoint."""
    q = cfg.quantization
    if q is None:
        return None

    def spec(module: str) -> tuple[int, int]:
        s = q.spec_for(module)
        return s.bits, s.group_size
    return spec


def human(n: float) -> str:
    """Bytes in GiB from 1 GiB, else MiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def describe_fit(cfg: ModelConfig, recipe: Recipe, *, context_length: int, prefill_chunk: int = 4096,
                 working_set: int | None = None, device: str = "", kv_dtype: str | None = None) -> list[str]:
    """Lines for ``lily-py info`` / ``load(verbose=True)``: what the load needs and the largest
    context that fits ``working_set`` (a device's recommendedMaxWorkingSetSize), or each Mac size's
    assumed working set when there is none; the KV cache of ``kv_dtype`` (None: bfloat16)."""
    n = needs(cfg, recipe, context_length, prefill_chunk, kv_dtype=kv_dtype)
    kv_name = "" if kv_dtype in (None, "bfloat16") else f" ({kv_dtype})"
    lines = [f"memory at context {context_length} (prefill_chunk {min(prefill_chunk, context_length)}): "
             f"weights {human(n['weights'])} + KV cache{kv_name} {human(n['kv_cache'])} + state {human(n['state'])} "
             f"+ scratch {human(n['scratch'])} = {human(n['total'])} ({n['total']} bytes)"]
    if working_set:
        c = largest_context(cfg, recipe, working_set, prefill_chunk, kv_dtype=kv_dtype)
        lines.append(f"{device or 'device'} working set (recommendedMaxWorkingSetSize) {human(working_set)}: "
                     + (f"the largest context that fits is {c}" if c else "the weights alone do not fit"))
    else:
        fit = []
        for g in MAC_MEMORY_GB:
            c = largest_context(cfg, recipe, mac_working_set(g), prefill_chunk, kv_dtype=kv_dtype)
            fit.append(f"{g} GB -> {c if c else 'no'}")
        lines.append("largest context that fits a Mac (assumed working set: 2/3 of memory below 36 GB, "
                     "3/4 above): " + ", ".join(fit))
    return lines


MAC_MEMORY_GB = (16, 24, 32, 48, 64, 128)


def mac_working_set(ram_gb: int) -> int:
    """An assumed recommendedMaxWorkingSetSize for a Mac with ``ram_gb`` GB: 2/3 of the memory
    below 36 GB, 3/4 from 36 GB (what llama.cpp logs report, e.g. 21845 MiB on a 32 GB Mac; macOS
    26 reports more on some machines). On a Mac, ``lily-py info`` prints the real value."""
    ram = ram_gb * GiB
    return ram * 2 // 3 if ram_gb < 36 else ram * 3 // 4


def table(cfg: ModelConfig, contexts=(8192, 32768, 131072), prefill_chunk: int = 4096) -> str:
    """The docs table: per recipe, bytes of weights, KV cache at each context, other state and
    scratch, and per Mac memory size the largest context that fits its assumed working set."""
    out = []
    hdr = (["recipe", "weights GiB"] + [f"KV {c // 1024}K GiB" for c in contexts]
           + ["state GiB", "scratch GiB"] + [f"{g} GB Mac" for g in MAC_MEMORY_GB])
    out.append("| " + " | ".join(hdr) + " |")
    out.append("|" + "---|" * len(hdr))
    st = needs(cfg, uniform(4), contexts[0], prefill_chunk)
    for name, r in recipes(cfg).items():
        w = weight_bytes(cfg, r)
        cells = [name, f"{w / GiB:.2f}"] + [f"{kv_bytes(cfg, c) / GiB:.2f}" for c in contexts]
        cells += [f"{st['state'] / GiB:.3f}", f"{st['scratch'] / GiB:.2f}"]
        for g in MAC_MEMORY_GB:
            c = largest_context(cfg, r, mac_working_set(g), prefill_chunk)
            cells.append("no" if c == 0 else str(c))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


FUSED_PARTS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
               "linear_attn.in_proj_a", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
               "mlp.gate", "mlp.shared_expert_gate")


def zero_copy_split(cfg: ModelConfig, recipe: Recipe) -> dict:
    """Bytes of the engine's weights by what zero copy does with them: ``fused`` (the parts the
    engine concatenates at load: DeltaNet in_proj q|k|v / z / b / a, attention q|k|v, router +
    shared-expert gate; mapped only when the parts lie back to back in one file, as
    ``lily-py align`` writes them), ``vectors`` (float32 made at load: always copied), ``single``
    (one tensor each: mapped when its offset is a multiple of 16)."""
    out = {"fused": 0, "vectors": 0, "single": 0}
    for m in inventory(cfg):
        key = "vectors" if not m.quantized else "fused" if m.module.endswith(FUSED_PARTS) \
            else "single"
        out[key] += matrix_bytes(m, recipe)
    return out


def main(argv=None) -> int:
    import argparse
    from .testing import REAL_TEXT_CONFIG
    ap = argparse.ArgumentParser(description="memory per quantization recipe of the real config")
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--zero-copy", action="store_true",
                    help="only the 4-bit weights by what zero copy does with them")
    a = ap.parse_args(argv)
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    if a.zero_copy:
        z = zero_copy_split(cfg, uniform(4))
        print(f"zero copy, 4-bit: {z['single'] / GiB:.2f} GiB in single tensors (mapped at 16-byte offsets), "
              f"{z['fused'] / GiB:.3f} GiB in fused weights ({z['fused']} bytes: copied unless their parts "
              f"lie back to back, as `lily-py align` writes them), {z['vectors'] / (1 << 20):.1f} MiB of "
              f"float32 vectors (copied)")
        return 0
    print(table(cfg, prefill_chunk=a.prefill_chunk))
    print()
    print(f"Mac columns: the largest context_length (of {cfg.max_position_embeddings}) whose weights + KV "
          f"cache + state + scratch (prefill_chunk {a.prefill_chunk}) fit the assumed working set: "
          + ", ".join(f"{g} GB -> {mac_working_set(g) / GiB:.1f} GiB" for g in MAC_MEMORY_GB)
          + " (2/3 of the memory below 36 GB, 3/4 above; other apps' memory not counted); "
          "'no': not even one token.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
