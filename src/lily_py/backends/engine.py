"""The engine backends (``backend="emu"`` / ``"metal"``): the whole model on a device, driven by
the C++ engine (``lily_py._core.Engine``, csrc/core/engine.h), one command buffer per step.

This module maps a loaded checkpoint onto the engine: it builds the engine's spec from the
config, checks that every tensor has the quantization the engine's kernels take, and uploads the
memory-mapped tensors once (the device buffer is the only copy; row-concatenated projections are
fused by uploading their parts back to back). Mixed-bit checkpoints: each weight's own bits and
group size go into the spec (``quant_overrides``); a fused projection whose parts differ is
uploaded as one weight per run of agreeing parts (``fused_runs``; docs/mixed-bits.md).
``count_step`` computes a step's counters for any config - the real 35B one included - on the
counting device, without weights.
"""
from __future__ import annotations

import time

import numpy as np
import ml_dtypes

from ..checkpoint import AttentionWeights, ModelWeights
from ..config import ModelConfig
from ..errors import BackendError, CheckpointError, DeviceMemoryError
from ..weights import QuantLinear
# The spec pieces live in .spec (sizes.py uses them too); imported here by their old names.
from .spec import (ACTIVATIONS, LOGIT_ROWS, REAL_QUANT, checkpoint_activations,  # noqa: F401
                   engine_spec, kv_row_bytes, resolve_kv_dtype)


def _core():
    from .. import _core
    return _core


def _scale_dtype(a: np.ndarray, what: str) -> str:
    if a.dtype == ml_dtypes.bfloat16:
        return "bfloat16"
    if a.dtype == np.float32:
        return "float32"
    raise BackendError(f"engine: {what} has {a.dtype} scales; the engine's kernels take bfloat16 or "
                       "float32 scales (use backend='reference')")


def _quant(lin, what: str) -> dict:
    if not isinstance(lin, QuantLinear):
        raise BackendError(f"engine: {what} is not MLX-quantized ({type(lin).__name__}); the engine "
                           "runs MLX affine-quantized checkpoints only (use backend='reference')")
    return {"bits": int(lin.bits), "group_size": int(lin.group_size),
            "scale_dtype": _scale_dtype(lin.scales, what)}


def quant_parts(w: ModelWeights) -> list[tuple[str, str, object, str]]:
    """Every quantized weight the engine takes, by part, in load order: (engine name, quant class,
    Linear, canonical checkpoint module). A part of a fused projection is named
    ``<fused>:<part>`` (csrc/core/model_spec.h: kQkvParts, kInProjParts, kRouterParts), the names
    of ``ModelSpec::quant_overrides``."""
    out = [("embed", "embed", w.embed, "embed_tokens")]
    for i, lw in enumerate(w.layers):
        p, mx, m = f"layers.{i}.", lw.mixer, lw.moe
        if isinstance(mx, AttentionWeights):
            a = p + "self_attn."
            out += [(p + "qkv_proj:q", "mixer", mx.q_proj, a + "q_proj"),
                    (p + "qkv_proj:k", "mixer", mx.k_proj, a + "k_proj"),
                    (p + "qkv_proj:v", "mixer", mx.v_proj, a + "v_proj"),
                    (p + "o_proj", "mixer", mx.o_proj, a + "o_proj")]
        else:
            a = p + "linear_attn."
            out += [(p + "in_proj:qkv", "mixer", mx.in_proj_qkv, a + "in_proj_qkv"),
                    (p + "in_proj:z", "mixer", mx.in_proj_z, a + "in_proj_z"),
                    (p + "in_proj:b", "mixer", mx.in_proj_b, a + "in_proj_b"),
                    (p + "in_proj:a", "mixer", mx.in_proj_a, a + "in_proj_a"),
                    (p + "out_proj", "mixer", mx.out_proj, a + "out_proj")]
        e = p + "mlp."
        out += [(p + "router:router", "router", m.router, e + "gate"),
                (p + "router:shared_expert_gate", "router", m.shared_expert_gate, e + "shared_expert_gate"),
                (p + "experts.gate", "experts_q", m.gate_proj, e + "switch_mlp.gate_proj"),
                (p + "experts.up", "experts_q", m.up_proj, e + "switch_mlp.up_proj"),
                (p + "experts.down", "experts_q", m.down_proj, e + "switch_mlp.down_proj"),
                (p + "shared.gate", "experts_q", m.shared_gate_proj, e + "shared_expert.gate_proj"),
                (p + "shared.up", "experts_q", m.shared_up_proj, e + "shared_expert.up_proj"),
                (p + "shared.down", "experts_q", m.shared_down_proj, e + "shared_expert.down_proj")]
    out.append(("lm_head", "lm_head", w.lm_head, "lm_head"))
    return out


def fused_runs(parts: list[tuple[str, object]]) -> list[tuple[str, list[object]]]:
    """How a projection fused at load from ``parts`` ([(part name, Linear)] in row order) is
    uploaded: [(label, [Linear])] - one run of every part when they agree in quantization (the
    fused route: one weight, one dispatch), else one run per group of agreeing neighbours (the
    split route). Must match csrc/core/engine_buffers.cpp alloc_fused."""
    runs: list[tuple[str, list[object], dict]] = []
    for part, lin in parts:
        q = _quant(lin, part)
        if runs and runs[-1][2] == q:
            runs[-1] = (runs[-1][0] + "+" + part, runs[-1][1] + [lin], q)
        else:
            runs.append((part, [lin], q))
    return [(label, lins) for label, lins, _q in runs]


def _tensors(cfg: ModelConfig, w: ModelWeights):
    """(engine weight name, quant class or None, [Linear], [parts]) for every engine weight.
    Parts are the checkpoint's memory-mapped arrays (quantized) or small float32 vectors."""
    def q(name, cls, *lins):
        yield name + ".weight", cls, lins, [lin.w for lin in lins]
        yield name + ".scales", cls, lins, [lin.scales for lin in lins]
        yield name + ".biases", cls, lins, [lin.biases for lin in lins]

    def fused(name, cls, **parts):
        runs = fused_runs(list(parts.items()))
        for label, lins in runs:
            yield from q(name if len(runs) == 1 else f"{name}:{label}", cls, *lins)

    def f32(name, a):
        yield name, None, (), [np.ascontiguousarray(a, dtype=np.float32)]

    def moe(p, m):
        yield from fused(p + "router", "router", router=m.router, shared_expert_gate=m.shared_expert_gate)
        yield from q(p + "experts.gate", "experts_q", m.gate_proj)
        yield from q(p + "experts.up", "experts_q", m.up_proj)
        yield from q(p + "experts.down", "experts_q", m.down_proj)
        yield from q(p + "shared.gate", "experts_q", m.shared_gate_proj)
        yield from q(p + "shared.up", "experts_q", m.shared_up_proj)
        yield from q(p + "shared.down", "experts_q", m.shared_down_proj)

    yield from q("embed", "embed", w.embed)
    for i, lw in enumerate(w.layers):
        p = f"layers.{i}."
        yield from f32(p + "input_norm", lw.input_norm)
        yield from f32(p + "post_norm", lw.post_norm)
        mx = lw.mixer
        if isinstance(mx, AttentionWeights):
            yield from fused(p + "qkv_proj", "mixer", q=mx.q_proj, k=mx.k_proj, v=mx.v_proj)
            yield from q(p + "o_proj", "mixer", mx.o_proj)
            yield from f32(p + "q_norm", mx.q_norm)
            yield from f32(p + "k_norm", mx.k_norm)
            yield from moe(p, lw.moe)
            continue
        yield from fused(p + "in_proj", "mixer", qkv=mx.in_proj_qkv, z=mx.in_proj_z, b=mx.in_proj_b,
                         a=mx.in_proj_a)
        yield from q(p + "out_proj", "mixer", mx.out_proj)
        yield from f32(p + "conv1d", mx.conv1d)
        yield from f32(p + "A_log", mx.A_log)
        yield from f32(p + "dt_bias", mx.dt_bias)
        yield from f32(p + "gated_norm", mx.norm)
        yield from moe(p, lw.moe)
    yield from f32("norm", w.norm)
    yield from q("lm_head", "lm_head", w.lm_head)


def checkpoint_quant(w: ModelWeights) -> dict:
    """The engine's quantization: each class's default, read off the first tensor of the class,
    and ``quant_overrides`` for every weight or fused part that differs from its class's default
    (a mixed-bit checkpoint; engine names as in ``quant_parts``)."""
    first_dn = next((lw for lw in w.layers if not isinstance(lw.mixer, AttentionWeights)), None)
    mixer = first_dn.mixer.in_proj_qkv if first_dn is not None else w.layers[0].mixer.q_proj
    m = w.layers[0].moe
    quant = {"embed": _quant(w.embed, "embed_tokens"), "lm_head": _quant(w.lm_head, "lm_head"),
             "mixer": _quant(mixer, "layer 0 mixer projections"),
             "experts_q": _quant(m.gate_proj, "layer 0 experts"), "router": _quant(m.router, "layer 0 router")}
    overrides = {}
    for name, cls, lin, module in quant_parts(w):
        q = _quant(lin, module)
        if q != quant[cls]:
            overrides[name] = q
    if overrides:
        quant["quant_overrides"] = overrides
    return quant


def _raw(a: np.ndarray) -> np.ndarray:
    """A C-contiguous view (bfloat16 as uint16: the core sees bytes); no copy for checkpoint views."""
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        a = a.view(np.uint16)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _source_file(a: np.ndarray) -> str | None:
    """The checkpoint file a memory-mapped tensor view reads from (None for in-memory arrays)."""
    while a is not None:
        fn = getattr(a, "filename", None)
        if fn:
            return fn
        a = getattr(a, "base", None)
    return None


WEIGHT_MODES = ("auto", "map", "copy")


def _file_offset(a: np.ndarray) -> tuple[str, int] | None:
    """(checkpoint file, absolute byte offset) of a C-contiguous view into a whole-file memory map
    (SafetensorsFile maps each file whole from byte 0); None for in-memory arrays."""
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        return None
    base = a      # the root memmap: the one whose base is the mmap object, not another array
    while isinstance(getattr(base, "base", None), np.ndarray):
        base = base.base
    if not isinstance(base, np.memmap) or not getattr(base, "filename", None) or base.offset != 0:
        return None
    return base.filename, a.ctypes.data - base.ctypes.data


def mapping_plan(tensors) -> tuple[list[str], dict[str, tuple[int, int]], dict[str, str]]:
    """Which engine weights can be served from the checkpoint's pages: (files, {weight: (file
    index, offset)}, {weight: why not}). A weight qualifies when its parts are views of one file
    that lie back to back there (one tensor, or the parts of a fused weight stored contiguously);
    the engine then checks the offset's alignment. Float vectors made at load (norms, conv1d,
    A_log, dt_bias: converted to float32) and fused weights whose parts lie apart are copied."""
    files: list[str] = []
    mapped: dict[str, tuple[int, int]] = {}
    why: dict[str, str] = {}
    for name, cls, _lins, parts in tensors:
        if cls is None:
            why[name] = "converted to float32 at load"
            continue
        locs = [_file_offset(p) for p in parts]
        if any(loc is None for loc in locs):
            why[name] = "not a view of a checkpoint file"
            continue
        if len({f for f, _ in locs}) != 1 or any(
                locs[i + 1][1] != locs[i][1] + np.asarray(parts[i]).nbytes for i in range(len(parts) - 1)):
            why[name] = f"fused from {len(parts)} tensors that do not lie back to back in one file"
            continue
        fn = locs[0][0]
        if fn not in files:
            files.append(fn)
        mapped[name] = (files.index(fn), int(locs[0][1]))
    return files, mapped, why


def _tensor_names(tensors) -> dict[tuple[str, int], str]:
    """{(file, offset): tensor name as stored} for the files the tensors' parts come from."""
    from ..checkpoint import SafetensorsFile
    files = {loc[0] for *_, parts in tensors for loc in map(_file_offset, parts) if loc}
    return {(fn, ref.begin): ref.name for fn in files
            for ref in SafetensorsFile(fn).tensors.values()}


def check_kernel_widths(tensors, w: ModelWeights | None = None) -> None:
    """CheckpointError naming the first tensor whose bit width or group size the engine's kernels
    do not take (``lily_py._core.engine_quant_support()``: the quantized matmuls and embedding
    take ``bits``, the MoE expert kernels ``expert_bits``), with its numbers; with ``w``, also the
    first MoE stage whose matrices differ (``check_moe_stages``)."""
    support = _core().engine_quant_support()
    names = None
    for name, cls, lins, _parts in tensors:
        widths = support["expert_bits"] if cls == "experts_q" else support["bits"]
        for lin in lins if cls is not None else ():
            if not isinstance(lin, QuantLinear):
                continue
            if lin.bits in widths and lin.group_size in support["group_sizes"]:
                continue
            names = _tensor_names(tensors) if names is None else names
            loc = _file_offset(lin.w)
            where = f"{loc[0]}: tensor {names.get(loc, '?')!r}" if loc else f"engine weight {name!r}"
            what = "MoE expert kernels" if cls == "experts_q" else "kernels"
            raise CheckpointError(
                f"{where} (engine weight {name.rsplit('.', 1)[0]!r}, logical shape {list(lin.shape)}) "
                f"is {lin.bits}-bit with group size {lin.group_size}; the engine's {what} take "
                f"{'/'.join(map(str, widths))}-bit weights in groups of "
                f"{'/'.join(map(str, support['group_sizes']))} (backend='reference' runs every MLX width)")
    if w is not None:
        check_moe_stages(w)


# The MoE kernels read the routed and the shared expert in one dispatch per stage: the routed
# matrices of a stage agree in quantization, and so do the shared ones; the shared expert may have
# its own width for the (routed, shared) pairs the kernels are built for, in the stage's group size
# (csrc/core/engine_spec.cpp ModelSpec::validate).
MOE_STAGES = (("experts.gate", "experts.up", "shared.gate", "shared.up"), ("experts.down", "shared.down"))


def check_moe_stages(w: ModelWeights) -> None:
    """CheckpointError naming the first two modules of one MoE stage whose quantization the
    engine's MoE kernels cannot read together (a mixed-bit checkpoint: routed matrices that differ,
    shared ones that differ, a different group size, or a (routed, shared) width pair not built)."""
    pairs = {tuple(p) for p in _core().engine_quant_support()["moe_shared_widths"]}
    built = ", ".join(f"{b}/{s}" for b, s in sorted(pairs))
    parts = {name: (lin, module) for name, _cls, lin, module in quant_parts(w)}
    for i in range(len(w.layers)):
        for stage in MOE_STAGES:
            (l0, m0) = parts[f"layers.{i}.{stage[0]}"]
            shared = [s for s in stage if s.startswith("shared.")]
            (ls, ms) = parts[f"layers.{i}.{shared[0]}"]
            for other in stage[1:]:
                lin, module = parts[f"layers.{i}.{other}"]
                ref, ref_module = (ls, ms) if other in shared else (l0, m0)
                q = _quant(lin, module)
                if q == _quant(ref, ref_module):  # then compare all but the bits with the routed ones
                    ref, ref_module = l0, m0
                    if {**q, "bits": 0} == {**_quant(l0, m0), "bits": 0}:
                        continue
                raise CheckpointError(
                    f"{module} is {lin.bits}-bit group {lin.group_size} but {ref_module} is {ref.bits}-bit "
                    f"group {ref.group_size}; the engine's MoE kernels read "
                    f"{', '.join(parts[f'layers.{i}.{s}'][1] for s in stage)} in one dispatch: the routed "
                    "matrices must agree in quantization, the shared ones too, and the shared expert may "
                    "differ in bits only (backend='reference' runs it)")
            if ls.bits != l0.bits and (l0.bits, ls.bits) not in pairs:
                raise CheckpointError(
                    f"{ms} is {ls.bits}-bit but {m0} is {l0.bits}-bit; the engine's MoE kernels take the "
                    f"shared expert at its own width for routed/shared bits {built} (backend='reference' "
                    "runs every pair)")


def upload_weights(engine, cfg: ModelConfig, w: ModelWeights, quant: dict, *,
                   verbose: bool | None = None, tensors=None) -> None:
    """Upload (copy) every tensor the engine did not bind to the mapped checkpoint files. Shows
    bytes and shards on a terminal as it goes (lily_py.progress; ``verbose=False``: never)."""
    from ..progress import LoadProgress
    tensors = list(_tensors(cfg, w)) if tensors is None else tensors
    placed = {d["name"]: d for d in engine.weight_sources()}
    tensors = [t for t in tensors if placed[t[0]]["file"] is None]
    total = sum(np.asarray(p).nbytes for *_, parts in tensors for p in parts)
    shards: dict[str, int] = {}     # checkpoint files read so far
    bar = LoadProgress(total, max(len(w.files), 1), verbose=verbose)
    done = 0
    for name, cls, lins, parts in tensors:
        engine.upload(name, [_raw(p) for p in parts])
        done += sum(np.asarray(p).nbytes for p in parts)
        if bar.enabled:
            shards.update({f: 1 for f in map(_source_file, parts) if f is not None})
            bar.update(done, max(len(shards), 1))
    engine.check_loaded()
    bar.close(done)


class EngineBackend:
    """The C++ engine as a Model backend (same interface as ReferenceBackend)."""

    def __init__(self, device: str, cfg: ModelConfig, weights: ModelWeights, *, context_length: int,
                 prefill_chunk: int, verbose: bool | None = None, activations: str | None = None,
                 weights_mode: str = "auto", kv_block_tokens: int | None = None,
                 kv_dtype: str | None = None):
        if weights_mode not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights_mode!r}")
        t0 = time.perf_counter()
        status = {d["name"]: d for d in _core().registry.list()}
        if device not in status or not status[device]["available"]:
            why = status[device]["reason"] if device in status else "unknown device"
            raise BackendError(f"device {device!r} is not available in this build or on this "
                               f"machine: {why}")
        self.name = device
        self.cfg = cfg
        quant = checkpoint_quant(weights)
        self.activations = activations or checkpoint_activations(quant)
        core = _core()
        tensors = list(_tensors(cfg, weights))
        check_kernel_widths(tensors, weights)
        files, mapped, self.copy_reasons = mapping_plan(tensors)
        if weights_mode == "copy":
            files, mapped = [], {}
        try:
            self.engine = core.Engine(engine_spec(cfg, quant, context_length=context_length,
                                                  prefill_chunk=prefill_chunk, activations=self.activations,
                                                  kv_block_tokens=kv_block_tokens, kv_dtype=kv_dtype),
                                      device, files, mapped)
        except core.DeviceMemoryError as e:
            raise DeviceMemoryError(str(e)) from None
        except (ValueError, core.DeviceLimitError) as e:
            raise BackendError(str(e)) from None
        self.kv_dtype = resolve_kv_dtype(cfg, kv_dtype)
        self._say_plan(cfg, context_length, prefill_chunk, verbose)
        upload_weights(self.engine, cfg, weights, quant, verbose=verbose, tensors=tensors)
        e = self.engine
        # why each copied weight was copied (the engine's reason, or the plan's for the weights
        # it never offered to map)
        self.copy_reasons = {d["name"]: ("weights='copy'" if weights_mode == "copy" else
                                         self.copy_reasons.get(d["name"], d["why_copied"]))
                             for d in e.weight_sources() if d["file"] is None}
        if weights_mode == "map" and e.mapped_weight_bytes == 0:
            engine_why = [d["why_copied"] for d in e.weight_sources()
                          if d["why_copied"] not in (None, "not in the mapping")]
            raise BackendError(f"engine: weights='map', but device {device!r} binds no weight to the "
                               f"checkpoint's pages: {len(engine_why)} weight(s) offered, e.g. "
                               f"{engine_why[0] if engine_why else 'none: no weight is a view of a file'}"
                               "; `lily-py align SRC DST` writes a layout that maps")
        self.load_stats = {
            "load_s": time.perf_counter() - t0,
            "weights_mode": weights_mode,
            "weight_bytes": int(e.weight_bytes),
            "weights_mapped_bytes": int(e.mapped_weight_bytes),
            "weights_copied_bytes": int(e.copied_weight_bytes),
            "mapped_file_bytes": int(e.mapped_file_bytes),
            # what the engine holds in memory of its own: copied weights, state and scratch (the
            # mapped pages belong to the page cache: resident only while touched)
            "resident_bytes": int(e.copied_weight_bytes + e.state_bytes + e.scratch_bytes),
        }
        self.prefill_chunk = prefill_chunk
        self._context = context_length
        self.logit_rows = min(prefill_chunk, LOGIT_ROWS)
        self._last_stats: dict | None = None
        self._stats_pending = False          # last_stats not fetched since the last complete_token()
        self.last_token: int | None = None   # the device sampler's token of the last step

    def _say_plan(self, cfg: ModelConfig, context_length: int, prefill_chunk: int,
                  verbose: bool | None) -> None:
        """Before the weights load: the bytes the engine planned and, where the device has a
        working set (Metal's recommendedMaxWorkingSetSize), the largest context that fits it. On
        stderr when ``verbose`` (None: stderr is a terminal); logged at INFO always."""
        import logging
        import sys
        from ..sizes import config_recipe, human, largest_context
        mem = self.engine.memory
        e = self.engine
        line = (f"lily_py: engine plan on {self.name!r}: {human(mem['total_bytes'])} (weights "
                f"{human(mem['weight_bytes'])}, {human(e.mapped_weight_bytes)} of them served from the "
                f"checkpoint's pages; KV cache and state {human(mem['state_bytes'])}; scratch "
                f"{human(mem['scratch_bytes'])}) at context {context_length}")
        ws = mem.get("working_set_bytes")
        if ws:
            recipe = config_recipe(cfg)
            fit = largest_context(cfg, recipe, ws, prefill_chunk, kv_dtype=self.kv_dtype) if recipe else None
            line += (f"; working set {human(ws)} (recommendedMaxWorkingSetSize)"
                     + (f", largest context that fits at prefill_chunk {prefill_chunk}: {fit}"
                        if fit is not None else ""))
        logging.getLogger("lily_py").info("%s", line)
        if verbose or (verbose is None and sys.stderr.isatty()):
            print(line, file=sys.stderr)

    # Model.generate samples decode steps with the device sampler (fused into the step), and
    # Model.prefill skips the final norm and lm_head of every chunk but the last.
    samples_on_device = True
    skips_logits = True
    keeps_logits = True   # the last step's logits stay on the device: last_logits() copies them

    @property
    def kv_stats(self) -> dict:
        """The KV cache's bytes now: kv_bytes (the pools allocated, every attention layer's K and
        V) and kv_bytes_in_use (the blocks that hold the positions so far)."""
        return {"kv_bytes": int(self.engine.kv_bytes), "kv_bytes_in_use": int(self.engine.kv_bytes_in_use)}

    @property
    def last_stats(self) -> dict | None:
        """Counters of the last step (fetched from the engine on demand)."""
        if self._stats_pending:
            self._last_stats = self.engine.last_stats()
            self._stats_pending = False
        return self._last_stats

    @last_stats.setter
    def last_stats(self, st: dict | None) -> None:
        self._last_stats = st
        self._stats_pending = False

    def forward(self, ids: np.ndarray, *, all_logits: bool, sample: dict | None = None,
                logits: bool = True, fetch: bool = True) -> np.ndarray | None:
        """Logits of the last position (or all with ``all_logits``). ``sample``: dict(temperature,
        top_k, top_p, min_p, seed, step, valid_vocab) also samples the last position on the device
        (``self.last_token``); when ``ids`` is that token, the step reads it from the device slot.
        ``logits=False`` (a prefill chunk that is not the last): no final norm / lm_head, None.
        ``fetch=False``: the logits stay on the device (None; ``last_logits()`` copies them)."""
        ids = np.ascontiguousarray(ids, dtype=np.uint32).reshape(-1)
        mask = None
        if sample is not None and "mask" in sample:
            sample = dict(sample)
            mask = sample.pop("mask")
        if self.engine.position + len(ids) > self._context:
            raise ValueError("engine: the step would exceed the engine's context length")
        step = self.logit_rows if all_logits else self.prefill_chunk
        from_slot = (sample is not None and len(ids) == 1 and self.last_token is not None
                     and int(ids[0]) == self.last_token)
        self.last_token = None
        want = logits or all_logits or sample is not None
        if len(ids) <= step:
            out, self.last_stats = self.engine.forward(ids, all_logits, sample, from_slot, want, fetch, mask)
            self.last_token = self.last_stats.get("token")
            return None if not want or not fetch else out if all_logits else out[0]
        if sample is not None or not want:
            raise ValueError("engine: sampling and logits=False steps feed at most one chunk")
        # (a mask comes with sampling only)
        # Several steps: keep them all-or-nothing with a snapshot.
        snap = self.engine.snapshot()
        out = []
        try:
            for s in range(0, len(ids), step):
                logits, self.last_stats = self.engine.forward(ids[s:s + step], all_logits)
                out.append(logits)
        except BaseException:
            self.engine.restore(snap)
            raise
        return np.concatenate(out) if all_logits else out[-1][0]

    def submit(self, token: int | None, sample: dict) -> None:
        """Commit a one-token step that samples on the device, without waiting: it feeds
        ``token`` from the host, or (None) the token the previous step sampled, from the device
        slot. At most two steps are in flight; ``complete()`` returns the oldest."""
        ids = np.array([0 if token is None else token], dtype=np.uint32)
        self.last_stats = self.engine.submit(ids, sample, token is None)

    def sampling(self, sample: dict):
        """Sampling parameters parsed once, for ``submit_next``."""
        return _core().Sampling(sample)

    def submit_next(self, sampling, step: int) -> None:
        """The per-token call of generation: commit a one-token step fed from the device slot
        (the token the previous step sampled) that samples at ``step``, without waiting."""
        self.engine.submit_slot(sampling, step)
        self._stats_pending = True

    def submit_logits(self, token: int | None = None) -> None:
        """Constrained generation: commit a one-token step that does not sample, without waiting;
        it feeds ``token`` from the host, or (None) the token the previous step's sampler chose,
        from the device slot. Its logits row stays on the device for ``submit_sampler``."""
        if token is None:
            self.engine.submit_logits_slot()
        else:
            self.engine.submit(np.array([token], dtype=np.uint32))
        self._stats_pending = True

    def submit_sampler(self, sampling, step: int, mask: np.ndarray | None = None) -> None:
        """Commit the sampler of the newest step in flight (``submit_logits``) at ``step`` with a
        constraint's allowed-token bitset ``mask`` (uint32 [ceil(valid_vocab / 32)], None: every
        token), in a command buffer of its own; ``complete_token()`` returns its token."""
        self.engine.submit_sampler(sampling, step, mask)

    @property
    def counters(self) -> dict:
        """Engine totals since load: commits, idle_commits (committed with nothing in flight),
        host_waits, masks_written."""
        return self.engine.counters

    def complete_token(self) -> int:
        """Wait for the oldest step in flight; its sampled token. The logits stay on the device."""
        self.last_token = self.engine.complete_token()
        self._stats_pending = True
        return self.last_token

    def sample_row(self, logits: np.ndarray, sample: dict, mask: np.ndarray | None = None) -> int:
        """One token sampled on the device from a host logits row [V] (the sampler alone, one
        wait): the first token when the prompt added nothing to the state. ``mask``: a
        constraint's allowed-token bitset (uint32 [ceil(valid_vocab / 32)])."""
        row = np.ascontiguousarray(logits, dtype=np.float32)
        self.last_token = int(self.engine.sample_row(row, _core().Sampling(sample), mask))
        return self.last_token

    def last_logprobs(self) -> tuple[float, np.ndarray, np.ndarray]:
        """(logprob of the sampled token, top ids, top logprobs) of the last completed sampling
        step whose sampling dict had ``logprobs=k`` (computed on the device; 2 + 2k words read)."""
        return self.engine.last_logprobs()

    def last_logits(self) -> np.ndarray:
        """float32 logits [V] of the last position of the last completed step (a copy)."""
        return self.engine.last_logits()

    @property
    def has_last_logits(self) -> bool:
        return self.engine.has_last_logits

    def complete(self) -> tuple[np.ndarray, int]:
        """Wait for the oldest step in flight: (float32 logits [V], its sampled token)."""
        logits, self.last_stats = self.engine.complete()
        self.last_token = self.last_stats["token"]
        return logits, self.last_token

    @property
    def engine_context(self) -> int:
        return self._context

    @property
    def position(self) -> int:
        """Tokens in the engine's state (the truth if a host call was interrupted)."""
        return self.engine.position

    @property
    def in_flight(self) -> int:
        return self.engine.in_flight

    @property
    def valid(self) -> bool:
        return self.engine.valid

    def reset(self) -> None:
        self.engine.reset()
        self.last_token = None

    def snapshot(self):
        return self.engine.snapshot()

    def restore(self, snap) -> None:
        self.engine.restore(snap)
        self.last_token = None

    @staticmethod
    def snapshot_nbytes(snap) -> int:
        return int(snap.nbytes)

    @staticmethod
    def snapshot_bytes(snap) -> bytes:
        return snap.to_bytes()


def count_step(cfg: ModelConfig, *, tokens: int = 1, position: int = 0, all_logits: bool = False,
               quant: dict | None = None, prefill_chunk: int | None = None,
               context_length: int | None = None, activations: str | None = None) -> dict:
    """Counters of one step for ``cfg`` on the counting device (no weights, nothing runs):
    dispatches, barriers, bytes_bound, threads, commits, waits_in_step. The KV caches are bound
    whole (bytes_bound grows with ``context_length``, default position + tokens). ``activations``:
    default the quantization's (bfloat16 for the real checkpoint's)."""
    chunk = prefill_chunk or max(tokens, 1)
    q = quant or REAL_QUANT
    spec = engine_spec(cfg, q, context_length=context_length or position + tokens,
                       prefill_chunk=chunk, activations=activations or checkpoint_activations(q))
    eng = _core().Engine(spec, "count")
    return eng.count(tokens, position, all_logits)


def count_batch_step(cfg: ModelConfig, *, batch: int, position: int = 0, quant: dict | None = None,
                     context_length: int | None = None, activations: str | None = None) -> dict:
    """Counters of one batched decode step (``batch`` sequences, one token each, every one at
    ``position``) for ``cfg`` on the counting device; ``batch`` 1 is the single-stream decode step.
    The routed experts count as ``min(experts, batch * top_k)`` distinct ones a layer (the bound:
    no two sequences share an expert)."""
    if batch == 1:
        return count_step(cfg, tokens=1, position=position, quant=quant, context_length=context_length,
                          activations=activations)
    q = quant or REAL_QUANT
    spec = engine_spec(cfg, q, context_length=context_length or position + 1, prefill_chunk=batch,
                       activations=activations or checkpoint_activations(q))
    eng = _core().Engine(spec, "count")
    return eng.count_batch(batch, position)


def count_dispatches(cfg: ModelConfig, *, tokens: int = 1, position: int = 0, all_logits: bool = False,
                     quant: dict | None = None, prefill_chunk: int | None = None,
                     context_length: int | None = None, activations: str | None = None,
                     logits: bool = True) -> tuple[dict, list[dict]]:
    """(step counters, every dispatch in order) of one step for ``cfg`` on the counting device, as
    :func:`count_step`. Each dispatch: kernel, groups, threads, bytes_touched, bytes_bound, level,
    unit (what runs its arithmetic: alu, simdgroup_fp32, simdgroup_bf16, tensor) and the
    flops_executed / flops_useful its host code attributed to it (Encoder::add_flops right after
    the dispatch). Inside ``lily_py._devices.simulated_device(tensor_ops=True)`` the M5 routes are
    encoded. ``logits=False``: a prefill chunk that is not the last (no final norm, no lm_head)."""
    chunk = prefill_chunk or max(tokens, 1)
    q = quant or REAL_QUANT
    spec = engine_spec(cfg, q, context_length=context_length or position + tokens,
                       prefill_chunk=chunk, activations=activations or checkpoint_activations(q))
    eng = _core().Engine(spec, "count")
    st = eng.count(tokens, position, all_logits, None, False, logits)
    return st, eng.count_dispatches()


def _qbytes(rows: int, cols: int, q: dict) -> int:
    """Bytes of an MLX affine-quantized [rows, cols] matrix: codes plus scales and biases."""
    s = 2 if q["scale_dtype"] == "bfloat16" else 4
    return rows * cols * q["bits"] // 8 + 2 * rows * (cols // q["group_size"]) * s


def decode_floor_bytes(cfg: ModelConfig, *, position: int, quant: dict | None = None,
                       activations: str | None = None, kv_dtype: str | None = None) -> dict:
    """The bytes one decode token cannot avoid moving, derived from the config alone
    (docs/decode.md): every weight it uses read once (one embedding row; every layer's
    norms and mixer; the router, the top-k routed experts and the shared expert; the final norm
    and lm_head), each DeltaNet layer's recurrent state and conv window read and written once,
    and each attention layer's KV cache read for ``position + 1`` rows and one row written.
    Activations (a few KB per kernel, the 1 MB logits row) are not in the floor; the conv window
    has the activation dtype (``activations``, default the quantization's: bf16 for the real one).
    Every weight counts at its own width (``quant_overrides``: a mixed-bit checkpoint). A KV row
    is ``kv_row_bytes`` (2 head_dim bytes; head_dim + 4 with ``kv_dtype="int8"``, 4 head_dim with
    ``kv_dtype="float32"``)."""
    q = quant or REAL_QUANT
    over = q.get("quant_overrides", {})

    def qb(rows: int, cols: int, name: str, cls: str) -> int:
        return _qbytes(rows, cols, over.get(name, q[cls]))
    xe = 2 if (activations or checkpoint_activations(q)) == "bfloat16" else 4
    H, V = cfg.hidden_size, cfg.vocab_size
    E, k, I, Is = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   cfg.shared_expert_intermediate_size)
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    C, K = 2 * Hk * Dk + Hv * Dv, cfg.linear_conv_kernel_dim
    D, kv, hq = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    parts = {"embedding row": qb(1, H, "embed", "embed"), "lm_head": qb(V, H, "lm_head", "lm_head"),
             "norms": 4 * H * (2 * cfg.num_hidden_layers + 1)}
    mixer = state = kv_bytes = moe = 0
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        if cfg.is_full_attention(i):
            mixer += (qb(2 * hq * D, H, p + "qkv_proj:q", "mixer") + qb(kv * D, H, p + "qkv_proj:k", "mixer")
                      + qb(kv * D, H, p + "qkv_proj:v", "mixer") + qb(H, hq * D, p + "o_proj", "mixer"))
            mixer += 2 * 4 * D                                            # q_norm, k_norm
            row = kv_row_bytes(cfg, kv_dtype)
            kv_bytes += 2 * kv * row * (position + 1) + 2 * kv * row  # K, V read; new row written
        else:
            mixer += (qb(C, H, p + "in_proj:qkv", "mixer") + qb(Hv * Dv, H, p + "in_proj:z", "mixer")
                      + qb(Hv, H, p + "in_proj:b", "mixer") + qb(Hv, H, p + "in_proj:a", "mixer")
                      + qb(H, Hv * Dv, p + "out_proj", "mixer"))
            mixer += C * K * 4 + 2 * Hv * 4 + Dv * 4                      # conv1d, A_log, dt_bias, norm
            state += 2 * (Hv * Dv * Dk * 4) + 2 * ((K - 1) * C * xe)      # state and conv window, r + w
        moe += qb(E, H, p + "router:router", "router") + qb(1, H, p + "router:shared_expert_gate", "router")
        moe += k * (qb(I, H, p + "experts.gate", "experts_q") + qb(I, H, p + "experts.up", "experts_q")
                    + qb(H, I, p + "experts.down", "experts_q"))
        moe += (qb(Is, H, p + "shared.gate", "experts_q") + qb(Is, H, p + "shared.up", "experts_q")
                + qb(H, Is, p + "shared.down", "experts_q"))
    parts.update({"mixers": mixer, "moe (router, routed + shared experts)": moe,
                  "deltanet state r+w": state, "kv cache": kv_bytes})
    parts["total"] = sum(parts.values())
    return parts


def count_kernels(cfg: ModelConfig, *, position: int, sample: dict | None = None,
                  quant: dict | None = None, activations: str | None = None,
                  kv_dtype: str | None = None) -> tuple[dict, dict]:
    """(step counters, per-kernel totals) of one decode step at ``position`` for ``cfg`` on the
    counting device: kernel name -> dispatches, bytes_touched, threads, groups."""
    q = quant or REAL_QUANT
    spec = engine_spec(cfg, q, context_length=position + 1, prefill_chunk=1,
                       activations=activations or checkpoint_activations(q), kv_dtype=kv_dtype)
    eng = _core().Engine(spec, "count")
    st = eng.count(1, position, False, sample, False)
    return st, eng.count_kernels()
