"""The device registry from Python: which devices exist, whether they are usable and why not,
what they are and what their kernels' pipelines allow.

``backend="auto"``, ``lily-py doctor`` and ``lily-py bench`` ask this registry (the C++ one in
csrc/core/device_registry.h, the only place devices are made), so they agree on what runs where.

    lily_py.devices()               # [DeviceStatus(name, available, reason, description), ...]
    lily_py.device_info("emu")      # dict: device_name, gpu_family, working_set_bytes, ...
    lily_py.pipeline_limits("emu")  # [{"kernel", "max_threads", "static_threadgroup_bytes", "simd_width"}, ...]
    lily_py.auto_backend()          # ("metal" | "reference", why Metal was not picked or None)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from .errors import BackendError


def _core():
    from . import _core
    return _core


@dataclass(frozen=True)
class DeviceStatus:
    """One registered device. ``reason`` says why it is unavailable ("" when available)."""
    name: str
    available: bool
    reason: str
    description: str


def devices() -> list[DeviceStatus]:
    """Every device the registry knows, in the order ``backend="auto"`` prefers them
    ("metal", "emu", "count"), with availability and the reason when unavailable."""
    return [DeviceStatus(**d) for d in _core().registry.list()]


def _require(name: str) -> None:
    by_name = {d.name: d for d in devices()}
    if name not in by_name:
        raise ValueError(f"unknown device {name!r} (expected one of {sorted(by_name)})")
    if not by_name[name].available:
        raise BackendError(f"device {name!r} is not available in this build or on this machine: "
                           f"{by_name[name].reason}")


def device_info(name: str) -> dict:
    """Facts about device ``name`` (see docs/metal.md): device_name, gpu_family,
    working_set_bytes, max_buffer_bytes (None: unlimited), library_path, library_source
    ("metallib" | "source" | "emulator" | None), metallib_error, metallib_built, build_target,
    build_sdk, math_mode, residency_set, simulated, tensor_ops (Metal 4 tensor ops: the M5
    routes), tensor_ops_reason (why not, None when tensor_ops). Raises BackendError when unavailable."""
    _require(name)
    try:
        return dict(_core().registry.info(name))
    except (RuntimeError, ValueError) as e:
        raise BackendError(f"device {name!r}: {e}") from None


def pipeline_limits(name: str) -> list[dict]:
    """Every kernel's pipeline on device ``name`` (on Metal this creates every pipeline):
    kernel, max_threads (maxTotalThreadsPerThreadgroup), static_threadgroup_bytes (None where
    unknown: the emulator checks threadgroup memory as kernels run), simd_width."""
    _require(name)
    try:
        return [dict(d) for d in _core().registry.pipeline_limits(name)]
    except (RuntimeError, ValueError) as e:
        raise BackendError(f"device {name!r}: {e}") from None


def auto_backend() -> tuple[str, str | None]:
    """What ``backend="auto"`` picks and why: ("metal", None) when the Metal device, its library
    and every kernel's pipeline are usable; otherwise ("reference", the reason Metal is not).
    The emulator is never picked automatically (far slower than the NumPy reference)."""
    try:
        core = _core()
    except ImportError as e:
        return "reference", f"the compiled core does not import ({e})"
    reason = core.registry.check_usable("metal")
    return ("metal", None) if not reason else ("reference", reason)


@contextlib.contextmanager
def simulated_device(*, max_threads: dict[str, int] | None = None, default_max_threads: int = 0,
                     threadgroup_bytes: dict[str, int] | None = None,
                     working_set_bytes: int = 0, max_buffer_bytes: int = 0,
                     tensor_ops: bool = False, tensor_int8: bool = False) -> Iterator[None]:
    """Within the block, the "emu" and "count" devices made afterwards report and enforce a
    Mac's limits: per-kernel maxTotalThreadsPerThreadgroup (``max_threads`` by kernel name,
    ``default_max_threads`` for the others; a dispatch above it fails as on Metal), static
    threadgroup memory, recommendedMaxWorkingSetSize and maxBufferLength (0: unlimited).
    ``tensor_ops=True`` makes them report Metal 4 tensor ops, as an M5 does: host ops take their
    M5 routes (qmm_m5) and the emulator runs those kernels; ``tensor_int8=True`` (with tensor ops)
    lets those routes take int8 activations where they have them (bf16 activations: qmm_m5i8 for the
    4-bit projections, moe_gate_up_m5i8 / moe_down_m5i8 for the MoE 64-row tiles)."""
    reg = _core().registry
    if reg.simulation_active():
        raise RuntimeError("simulated_device blocks do not nest")
    reg.set_simulation(default_max_threads=default_max_threads, max_threads=dict(max_threads or {}),
                       threadgroup_bytes=dict(threadgroup_bytes or {}),
                       working_set_bytes=working_set_bytes, max_buffer_bytes=max_buffer_bytes,
                       tensor_ops=tensor_ops, tensor_int8=tensor_int8)
    try:
        yield
    finally:
        reg.clear_simulation()
