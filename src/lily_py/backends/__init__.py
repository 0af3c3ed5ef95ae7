"""Model backends, side by side: ``reference`` (the NumPy model, :mod:`.reference`) and the C++
engine on a device, ``emu`` or ``metal`` (:mod:`.engine`). All have the same interface:
``forward(ids, all_logits=...)``, ``reset()``, ``position``, ``valid``, ``snapshot()``, ``restore()``.
``backend="auto"`` is resolved by ``lily_py.auto_backend()`` (the device registry, lily_py._devices),
the one rule every command uses."""
from __future__ import annotations

from .._devices import auto_backend  # noqa: F401  (what backend="auto" picks, and why)
from ..checkpoint import ModelWeights
from ..config import ModelConfig
from .spec import KV_DTYPES, KV_INT8_HEAD_DIMS, default_kv_dtype, resolve_kv_dtype  # noqa: F401

BACKENDS = ("auto", "reference", "emu", "metal", "cuda")
# Not for users: the engine on the counting device with host memory (nothing runs, every sampled
# token is 0), so benchmarks can time the host side of generation (benchmarks/host_overhead.py).
TIMING_BACKENDS = ("count_host",)


def make_backend(name: str, cfg: ModelConfig, weights: ModelWeights, *, context_length: int,
                 prefill_chunk: int, verbose: bool | None = None, activations: str | None = None,
                 weights_mode: str = "auto", kv_block_tokens: int | None = None, kv_dtype: str | None = None):
    """The backend for a resolved name ("auto" is resolved by Model first). ``verbose``: load
    progress on a terminal (engine backends upload the weights; None: when stderr is a TTY).
    ``activations``: the engine's activation dtype ("bfloat16" / "float32"; None: the
    checkpoint's, as MLX computes it); the reference backend computes in float64/float32 NumPy."""
    if activations not in (None, "bfloat16", "float32"):
        raise ValueError(f"activations must be 'bfloat16', 'float32' or None, got {activations!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES[1:]} or None, got {kv_dtype!r}")
    kv_dtype = resolve_kv_dtype(cfg, kv_dtype)
    if name not in BACKENDS and name not in TIMING_BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name in ("emu", "metal", "cuda") + TIMING_BACKENDS:
        # The C++ engine on a device (lily_py/backends/engine.py); "emu" runs the Metal kernels on the CPU.
        from .engine import EngineBackend
        return EngineBackend(name, cfg, weights, context_length=context_length,
                             prefill_chunk=prefill_chunk, verbose=verbose, activations=activations,
                             weights_mode=weights_mode, kv_block_tokens=kv_block_tokens, kv_dtype=kv_dtype)
    if weights_mode not in ("auto", "map", "copy"):
        raise ValueError(f"weights must be 'auto', 'map' or 'copy', got {weights_mode!r}")
    from .reference import ReferenceBackend
    return ReferenceBackend(cfg, weights, kv_dtype=kv_dtype)


def built_with_metal() -> bool:
    try:
        from .. import _core
    except ImportError:
        return False
    return bool(_core.has_metal)
