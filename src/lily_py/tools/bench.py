"""``lily-py bench``: prefill and decode tokens/s at the context lengths Lily and MLX publish.

Two kinds of rows, always labelled:

* **measured**: a model that actually runs (a checkpoint, the bundled demo, or ``--random-weights``
  built on the fly) on a device: prefill and decode tokens/s, time to first token, the engine's
  counters per token (dispatches, barriers, bytes), device memory and the process's peak RSS.
* **counted**: the engine encodes the same steps on the counting device (no weights, nothing
  runs): exact dispatches, barriers and bytes per token, and the memory the engine would allocate,
  for any config - the real Qwen3.6-35B-A3B one included. No timings.

On a Mac with a usable Metal device, ``--random-weights`` runs the real model's shapes. Elsewhere
the device is the CPU emulator ("emu"), on which the real shapes cannot run in useful time: bench
then runs a small config of the same architecture at the short contexts and counts the real
config at every context. ``--compare mlx-lm`` runs mlx-lm on the same checkpoint and prompt where
it is installed and prints lily_py / mlx-lm ratios. ``--json PATH`` writes every number.

Prompts are random token ids (fixed ``--seed``): speed does not depend on the text, and a random
prompt of any length needs no tokenizer.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

CONTEXTS = (256, 4096, 32768, 131072)          # Lily's and MLX's published prompt lengths
EMU_RUN_MAX_CONTEXT = 256                      # the emulator runs ~10-100 tokens/s on small configs
EMU_RUN_MAX_BYTES = 1 << 30                    # larger checkpoints are only counted off Metal


def parse_contexts(text: str) -> list[int]:
    """"256,4K,32k,128K" -> [256, 4096, 32768, 131072]."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            n = int(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise ValueError(f"--contexts: {part!r} is not a token count (e.g. 256,4K,32K,128K)") from None
        if n < 1:
            raise ValueError(f"--contexts: context lengths must be >= 1, got {n}")
        out.append(n)
    if not out:
        raise ValueError("--contexts: no context lengths given")
    return sorted(set(out))


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _mib(n) -> str:
    return "-" if n is None else (f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB")


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024   # macOS: bytes, Linux: KiB


@dataclass
class Row:
    context: int
    prefill_tps: float | None = None
    decode_tps: float | None = None
    decode_tokens: int | None = None
    ttft_s: float | None = None
    decode_dispatches: int | None = None      # per decode step = per generated token
    decode_barriers: int | None = None
    decode_bytes: int | None = None
    prefill_dispatches: float | None = None   # per prompt token (sum over the chunks / tokens)
    prefill_barriers: float | None = None
    prefill_bytes: float | None = None
    device_bytes: int | None = None           # weights + state + scratch the engine allocated
    kv_bytes: int | None = None               # KV cache blocks in use after the run (docs/memory.md)
    peak_rss_bytes: int | None = None
    mlx_prefill_tps: float | None = None
    mlx_decode_tps: float | None = None
    note: str = ""


@dataclass
class Table:
    kind: str            # "measured" | "counted"
    subject: str         # what ran / was counted
    device: str
    bytes_key: str = "bytes_bound"
    rows: list[Row] = field(default_factory=list)


# ------------------------------------------------------------------------------ subjects
def _config_dict(which: str, layers: int | None) -> dict:
    from ..testing import REAL_TEXT_CONFIG, TINY_TEXT_CONFIG
    raw = dict(REAL_TEXT_CONFIG if which == "real" else TINY_TEXT_CONFIG)
    if layers:
        raw["num_hidden_layers"] = layers
    return raw


def _model_config(raw: dict):
    from ..config import ModelConfig
    return ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(raw)})


def describe(cfg) -> str:
    n_attn = sum(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers))
    return (f"{cfg.num_hidden_layers} layers ({cfg.num_hidden_layers - n_attn} DeltaNet + {n_attn} attention), "
            f"hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
            f"vocab {cfg.vocab_size}")


# ------------------------------------------------------------------------------ measured
def _per_token(stats: list[dict], key: str, tokens: int) -> float | None:
    if not stats or any(key not in s for s in stats):
        return None
    return sum(s[key] for s in stats) / tokens


def random_prompt(model, context: int, rng) -> list[int]:
    vocab = model.tokenizer.vocab_size if model.tokenizer is not None else model.config.vocab_size
    return rng.integers(0, min(vocab, model.config.vocab_size), size=context).tolist()


def measure_context(model, ids: list[int], decode_tokens: int) -> Row:
    """Prefill ``ids`` from an empty state, then ``decode_tokens`` greedy tokens through
    ``generate`` (on-device sampling, two steps in flight on engine backends)."""
    model.reset()
    context = len(ids)
    chunk_stats: list[dict] = []

    def on_chunk(done: int, total: int) -> None:
        st = model.stats()
        if st is not None:
            chunk_stats.append(dict(st))

    t0 = time.perf_counter()
    logits = model.prefill(ids, progress=on_chunk)
    t_prefill = time.perf_counter() - t0
    int(np.argmax(logits))                   # the first token: greedy on the host
    ttft = time.perf_counter() - t0
    row = Row(context, prefill_tps=context / t_prefill, ttft_s=ttft)
    key = "bytes_touched" if chunk_stats and "bytes_touched" in chunk_stats[0] else "bytes_bound"
    row.prefill_dispatches = _per_token(chunk_stats, "dispatches", context)
    row.prefill_barriers = _per_token(chunk_stats, "barriers", context)
    row.prefill_bytes = _per_token(chunk_stats, key, context)
    if decode_tokens > 0:
        # The prompt is already in the state: generate reuses it and samples from its logits.
        r = model.generate_text(ids, max_tokens=decode_tokens + 1, temperature=0.0)
        row.decode_tokens = max(0, r.stats.generated_tokens - 1)
        row.decode_tps = r.stats.decode_tokens_per_second or None
        st = model.stats()
        if st is not None and row.decode_tokens:
            row.decode_dispatches, row.decode_barriers = st["dispatches"], st["barriers"]
            row.decode_bytes = st.get(key)
        if r.finish_reason != "length":
            row.note = f"stopped at EOS after {row.decode_tokens} decode tokens"
    eng = getattr(model._backend, "engine", None)
    if eng is not None:
        row.device_bytes = int(eng.weight_bytes + eng.state_bytes + eng.scratch_bytes)
        row.kv_bytes = int(eng.kv_bytes_in_use)
    row.peak_rss_bytes = peak_rss_bytes()
    return row


_MLX_MODELS: dict[str, object] = {}


def mlx_device() -> str:
    import mlx.core as mx
    import mlx_lm
    return f"mlx-lm {getattr(mlx_lm, '__version__', '?')} on {mx.default_device()}"


def run_mlx(path: str, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    """mlx-lm on the same checkpoint and prompt: (prefill tok/s, decode tok/s), greedy."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    if path not in _MLX_MODELS:
        _MLX_MODELS[path] = load(path)[0]
        for _ in generate_step(mx.array(ids[:4]), _MLX_MODELS[path], max_tokens=2):   # warm-up
            pass
    model = _MLX_MODELS[path]
    context = len(ids)
    t0 = time.perf_counter()
    t_first, n = None, 0
    for _tok, _ in generate_step(mx.array(ids), model, max_tokens=decode_tokens + 1):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    return context / (t_first - t0), (n - 1) / (t1 - t_first) if n > 1 else float("nan")


# ------------------------------------------------------------------------------ counted
def count_context(cfg, context: int, decode_tokens: int, prefill_chunk: int, quant: dict | None = None,
                  kv_dtype: str | None = None) -> Row:
    """Counters of the steps a run at ``context`` would encode, on the counting device: the
    prefill chunks (no logits but for the last chunk) and a decode step at ``context`` that
    samples on the device and reads its token from the slot, as ``generate`` does."""
    from .. import _core
    from ..backends.engine import REAL_QUANT, engine_spec, kv_row_bytes
    chunk = min(prefill_chunk, context)
    spec = engine_spec(cfg, quant or REAL_QUANT, context_length=context + decode_tokens + 1,
                       prefill_chunk=chunk, kv_dtype=kv_dtype)
    eng = _core.Engine(spec, "count")
    steps = []
    for pos in range(0, context, chunk):
        n = min(chunk, context - pos)
        steps.append(eng.count(n, pos, False, None, False, pos + n >= context))
    sample = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=1,
                  valid_vocab=cfg.vocab_size)
    dec = eng.count(1, context, False, sample, True, True)
    key = "bytes_touched" if "bytes_touched" in dec else "bytes_bound"
    # count() leaves the position at 0: the blocks of context + 1 positions, every attention layer
    B = int(spec.get("kv_block_tokens", 1024))
    layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_full_attention(i))
    kv = -(-(context + 1) // B) * B * layers * 2 * cfg.num_key_value_heads * kv_row_bytes(cfg, kv_dtype)
    return Row(context, decode_dispatches=dec["dispatches"], decode_barriers=dec["barriers"],
               decode_bytes=dec[key], prefill_dispatches=_per_token(steps, "dispatches", context),
               prefill_barriers=_per_token(steps, "barriers", context),
               prefill_bytes=_per_token(steps, key, context),
               device_bytes=int(eng.weight_bytes + eng.state_bytes + eng.scratch_bytes), kv_bytes=kv)


# ------------------------------------------------------------------------------ printing
def _f(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{format(v, spec):>{width}}"


def format_speed(t: Table) -> str:
    """The table Lily and MLX publish: tokens/s by prompt length, plus TTFT and memory."""
    head = (f"{'context':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'TTFT':>10} {'device mem':>11} "
            f"{'KV in use':>10} {'peak RSS':>10}")
    lines = [head, "-" * len(head)]
    for r in t.rows:
        lines.append(f"{_k(r.context):>8} {_f(r.prefill_tps, '.1f', 14)} {_f(r.decode_tps, '.2f', 13)} "
                     f"{_f(r.ttft_s, '.3f', 8)} s {_mib(r.device_bytes):>11} {_mib(r.kv_bytes):>10} "
                     f"{_mib(r.peak_rss_bytes):>10}"
                     + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines)


def format_counters(t: Table) -> str:
    """Dispatches, barriers and bytes per token: a decode step, and a prefill averaged per token."""
    b = t.bytes_key
    head = (f"{'context':>8} | {'decode step: dispatches':>23} {'barriers':>9} {b:>12} | "
            f"{'prefill per token: dispatches':>29} {'barriers':>9} {b:>12}")
    lines = [head, "-" * len(head)]
    for r in t.rows:
        lines.append(f"{_k(r.context):>8} | {_f(r.decode_dispatches, 'd', 23)} {_f(r.decode_barriers, 'd', 9)} "
                     f"{_mib(r.decode_bytes):>12} | {_f(r.prefill_dispatches, '.2f', 29)} "
                     f"{_f(r.prefill_barriers, '.2f', 9)} {_mib(r.prefill_bytes):>12}"
                     + (f"  device mem {_mib(r.device_bytes)}  KV in use {_mib(r.kv_bytes)}"
                        if t.kind == "counted" else ""))
    return "\n".join(lines)


def format_compare(t: Table) -> str:
    lines = [f"{'context':>8} {'lily_py prefill':>16} {'mlx-lm prefill':>15} {'ratio':>6} | "
             f"{'lily_py decode':>15} {'mlx-lm decode':>14} {'ratio':>6}"]
    for r in t.rows:
        if r.mlx_prefill_tps is None:
            continue
        lines.append(f"{_k(r.context):>8} {r.prefill_tps:>16.1f} {r.mlx_prefill_tps:>15.1f} "
                     f"{r.prefill_tps / r.mlx_prefill_tps:>6.2f} | {r.decode_tps or 0:>15.2f} "
                     f"{r.mlx_decode_tps:>14.2f} {(r.decode_tps or 0) / r.mlx_decode_tps:>6.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ load
def measure_load(path: str, device: str, context_length: int = 64) -> list[dict]:
    """Load ``path`` on ``device`` twice: every weight copied (``weights="copy"``) and served from
    the checkpoint's pages where the engine can (``"auto"``); wall time of ``load()`` and the
    engine's byte counts (Model.stats()). A small context keeps the state out of the timing."""
    from ..model import load
    rows = []
    quiet = logging.getLogger("lily_py")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        for mode in ("copy", "auto"):
            t0 = time.perf_counter()
            m = load(path, backend=device, context_length=context_length,
                     prefill_chunk=context_length, weights=mode, verbose=False)
            wall = time.perf_counter() - t0
            st = m.stats() or {}
            rows.append({"weights": mode, "load_s": wall, "engine_load_s": st.get("load_s"),
                         **{k: st.get(k) for k in ("weight_bytes", "weights_mapped_bytes",
                                                   "weights_copied_bytes", "mapped_file_bytes",
                                                   "resident_bytes")}})
            del m
    finally:
        quiet.setLevel(level)
    return rows


def format_load(rows: list[dict], device: str) -> str:
    mb = lambda v: "-" if v is None else f"{v / 1e6:.1f}"  # noqa: E731
    lines = [f"LOAD - on '{device}', weights copied vs served from the checkpoint's pages "
             "(load(..., weights=...); context 64):",
             f"  {'weights':<8} {'load s':>8} {'engine s':>9} {'weights MB':>11} {'mapped MB':>10} "
             f"{'copied MB':>10} {'resident MB':>12}"]
    for r in rows:
        es = "-" if r["engine_load_s"] is None else f"{r['engine_load_s']:.3f}"
        lines.append(f"  {r['weights']:<8} {r['load_s']:>8.3f} {es:>9} {mb(r['weight_bytes']):>11} "
                     f"{mb(r['weights_mapped_bytes']):>10} {mb(r['weights_copied_bytes']):>10} "
                     f"{mb(r['resident_bytes']):>12}")
    lines.append("  load s: wall time of load() (header parse, engine, pipelines, uploads); engine s: the "
                 "engine backend's part; resident: copied weights + state + scratch (mapped pages belong to "
                 "the page cache). A checkpoint written by MLX maps little: `lily-py align SRC DST` lays it out "
                 "for zero copy.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ driver
def _is_gpu(device: str) -> bool:
    """Whether the device is a GPU (its DeviceInfo names a GPU family: Metal's apple*, cuda's sm_*)."""
    if device == "reference":
        return False
    try:
        from .. import device_info
        return bool(device_info(device).get("gpu_family"))
    except Exception:  # not available here: bench reports that when it loads
        return False


def bench(*, model: str | None = None, random_weights: bool = False, config: str | None = None,
          layers: int | None = None, backend: str | None = None, contexts=CONTEXTS, decode_tokens: int = 32,
          run_max_context: int | None = None, prefill_chunk: int = 4096, compare: str | None = None,
          seed: int = 0, kv_dtype: str | None = None, out=sys.stdout) -> dict:
    """Run the benchmark (see the module docstring); print the tables to ``out``; return the
    results as a dict (what ``--json`` writes). ``backend``: None measures the engine on
    :func:`lily_py.tools.doctor.default_device` (metal where usable, else emu); "auto" is what
    ``load(backend="auto")`` picks (``lily_py.auto_backend()``); or a backend's name."""
    from .._version import __version__
    from ..model import load
    from .doctor import default_device
    say = (lambda s="": print(s, file=out, flush=True)) if out is not None else (lambda s="": None)
    if model is not None and random_weights:
        raise ValueError("bench: give --model or --random-weights, not both")
    from .._devices import auto_backend
    device = default_device() if backend is None else auto_backend()[0] if backend == "auto" else backend
    gpu = _is_gpu(device)   # a real GPU runs the real shapes and every context by default
    if config is None:
        config = "real" if gpu else "tiny"
    forced = run_max_context is not None
    if run_max_context is None:
        run_max_context = 1 << 62 if gpu else EMU_RUN_MAX_CONTEXT
    contexts = sorted(set(int(c) for c in contexts))
    result = {"lily_py": __version__, "machine": f"{platform.system()} {platform.machine()}, "
              f"{os.cpu_count()} cores", "device": device, "contexts": contexts,
              "decode_tokens": decode_tokens, "seed": seed, "kv_dtype": kv_dtype, "tables": []}
    tmp = None
    try:
        if random_weights:
            from ..testing import make_checkpoint
            raw = _config_dict(config, layers)
            tmp = tempfile.TemporaryDirectory(prefix="lily_bench_")
            say(f"building a random-weight MLX 4-bit checkpoint ({config} config) in {tmp.name} ...")
            path = make_checkpoint(tmp.name, raw, fmt="mlx", seed=seed)
            subject = f"random weights, {config} config"
        else:
            from .. import hub
            from ..resources import demo_path
            path = demo_path() if model is None else hub.resolve(model)
            subject = "bundled demo checkpoint" if model is None else f"checkpoint {model}"
        from ..backends import resolve_kv_dtype
        from ..checkpoint import load_weights
        cfg, weights = load_weights(path)
        kv_dtype = resolve_kv_dtype(cfg, kv_dtype)
        result["kv_dtype"] = kv_dtype
        run_ctx = [c for c in contexts if c <= run_max_context and c + decode_tokens + 1 <= cfg.max_position_embeddings]
        why = (f"above --run-max-context {run_max_context} on '{device}'" if not gpu
               else "beyond the config's max_position_embeddings")
        if not gpu and not forced and weights.nbytes() > EMU_RUN_MAX_BYTES:
            run_ctx = []
            why = (f"{weights.nbytes() / 1e9:.1f} GB of weights do not run in useful time on '{device}'; "
                   "--run-max-context N forces it")
        skipped = [c for c in contexts if c not in run_ctx]

        say(f"lily-py bench: lily_py {__version__}, {result['machine']}, device '{device}'"
            + f", {kv_dtype} KV cache")
        # measured
        measured = Table("measured", f"{subject}: {describe(cfg)}", device)
        if run_ctx:
            quiet = logging.getLogger("lily_py")
            level, quiet.level = quiet.level, logging.ERROR   # random weights: no tokenizer (expected)
            try:
                m = load(path, backend=device, context_length=max(run_ctx) + decode_tokens + 2,
                         prefill_chunk=min(prefill_chunk, max(run_ctx)), kv_dtype=kv_dtype)
            finally:
                quiet.setLevel(level)
            rng = np.random.default_rng(seed)
            for c in run_ctx:
                ids = random_prompt(m, c, rng)
                row = measure_context(m, ids, decode_tokens)
                if compare == "mlx-lm":
                    try:
                        row.mlx_prefill_tps, row.mlx_decode_tps = run_mlx(path, ids, decode_tokens)
                        result["compare"] = mlx_device()
                    except ImportError as e:
                        row.note = f"mlx-lm not installed ({e.name})"
                measured.rows.append(row)
            measured.bytes_key = "bytes_touched" if m.stats() and "bytes_touched" in m.stats() else "bytes_bound"
            del m
        say()
        say(f"MEASURED - {measured.subject}, on '{device}', {decode_tokens} greedy decode tokens:")
        if measured.rows:
            say(format_speed(measured))
            say()
            say("  per token, from the engine's counters:" if measured.rows[0].decode_dispatches is not None
                or measured.rows[0].prefill_dispatches is not None else
                f"  (no counters: backend '{device}' has none)")
            if measured.rows[0].decode_dispatches is not None or measured.rows[0].prefill_dispatches is not None:
                say(format_counters(measured))
        else:
            say("  (nothing run)")
        if skipped:
            say(f"  not run: {', '.join(_k(c) for c in skipped)} ({why}; see the counted rows)")
        if compare == "mlx-lm" and measured.rows:
            say()
            if any(r.mlx_prefill_tps is not None for r in measured.rows):
                say(f"COMPARE - {result['compare']}, same checkpoint and prompts (tokens/s; ratio = lily_py / "
                    "mlx-lm):")
                say(format_compare(measured))
            else:
                say(f"COMPARE - mlx-lm: {measured.rows[0].note or 'not run'}")
        result["tables"].append(asdict(measured))
        if run_ctx and device in ("emu", "metal", "cuda"):
            result["load"] = measure_load(path, device)
            say()
            say(format_load(result["load"], device))

        # counted: the real config (or the checkpoint's own when it is a real one)
        real = _model_config(_config_dict("real", None)) if (random_weights or model is None) else cfg
        quant = None
        if model is not None:
            from ..backends.engine import checkpoint_quant
            try:
                quant = checkpoint_quant(weights)
            except Exception:  # noqa: BLE001 - not engine-quantized: count with the real quantization
                quant = None
        label = "Qwen3.6-35B-A3B real config" if real is not cfg else subject
        counted = Table("counted", f"{label}: {describe(real)}, MLX 4-bit (8-bit router)", "count")
        for c in contexts:
            if c + decode_tokens + 1 > real.max_position_embeddings:
                continue
            counted.rows.append(count_context(real, c, decode_tokens, prefill_chunk, quant, kv_dtype))
        if counted.rows:
            counted.bytes_key = "bytes_bound"
        say()
        say(f"COUNTED - {counted.subject}, encoded on the counting device (nothing runs, no timings; "
            f"prefill in chunks of {prefill_chunk}):")
        say(format_counters(counted))
        say()
        say(f"{counted.bytes_key}: bytes of every buffer range bound to a dispatch (an upper bound of the "
            "traffic: MoE kernels bind whole expert stacks, attention the whole KV cache). device mem: "
            "weights + KV cache + state + scratch the engine allocates for the context (the KV pools grow "
            "as positions advance); KV in use: its blocks that hold the context's positions.")
        result["tables"].append(asdict(counted))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", default=None, help="checkpoint folder or hub id (default: the bundled demo)")
    src.add_argument("--random-weights", action="store_true",
                     help="build a random-weight checkpoint on the fly (--config shapes)")
    p.add_argument("--config", choices=["real", "tiny"], default=None,
                   help="shapes for --random-weights: real Qwen3.6-35B-A3B (default on Metal and cuda) or a "
                        "tiny config of the same architecture (default elsewhere)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--backend", default=None, choices=["auto", "metal", "emu", "reference", "cuda"],
                   help="what runs the measured rows (default: the engine on metal where usable, else "
                        "on emu; auto: what load() picks, metal where usable, else reference)")
    p.add_argument("--contexts", type=parse_contexts, default=list(CONTEXTS),
                   help="prompt lengths, e.g. 256,4K,32K,128K (default)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens decoded per context")
    p.add_argument("--run-max-context", type=int, default=None,
                   help=f"longest context actually run (default: all on metal and cuda, {EMU_RUN_MAX_CONTEXT} elsewhere)")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--compare", choices=["mlx-lm"], default=None,
                   help="also run mlx-lm on the same checkpoint (where installed) and print the ratio")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and weights")
    p.add_argument("--kv-dtype", choices=["bfloat16", "int8", "float32"], default=None,
                   help="KV cache element type (default: bfloat16, as mlx-lm; int8: codes + a float32 "
                        "scale per row; float32: unrounded rows, twice the bytes)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results to this file")
    p.set_defaults(func=main)


def main(a) -> int:
    res = bench(model=a.model, random_weights=a.random_weights, config=a.config, layers=a.layers,
                backend=a.backend, contexts=a.contexts, decode_tokens=a.decode_tokens,
                run_max_context=a.run_max_context, prefill_chunk=a.prefill_chunk, compare=a.compare,
                seed=a.seed, kv_dtype=a.kv_dtype)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(res, f, indent=2)
    return 0
