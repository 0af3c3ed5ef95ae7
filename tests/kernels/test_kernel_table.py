"""The host kernel table (csrc/gpu/kernel_ids.h) against the emulator registry and the shaders.

Every kernel id must exist in the emulator with the same args struct size and buffer count, and
every kernel the shaders instantiate must be a kernel id (the emulator's own self-test kernels
aside). On macOS the built metallib gets the same check when the Metal device lands.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

import lily_py._core as core

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_id_is_registered_in_the_emulator():
    registry = {k["name"]: k for k in core.emu.kernels()}
    table = core.kernel_table()
    assert len(table) > 0
    missing = [k["name"] for k in table if k["name"] not in registry]
    assert not missing, f"kernel ids without an emulator kernel: {missing}"
    for k in table:
        e = registry[k["name"]]
        assert e["args_size"] == k["args_size"], (k["name"], e["args_size"], k["args_size"])
        assert e["num_buffers"] == k["num_buffers"], (k["name"], e["num_buffers"], k["num_buffers"])
        assert e["file"].endswith(".metal"), e["file"]


def test_every_emulator_kernel_has_an_id_or_is_a_selftest():
    ids = {k["name"] for k in core.kernel_table()}
    extra = [k["name"] for k in core.emu.kernels() if k["name"] not in ids]
    assert all(name.startswith("selftest_") for name in extra), extra
    for k in core.emu.kernels():
        if k["name"].startswith("selftest_"):
            # never in shaders/ (selftest_m5.metal: the Metal 4 tensor-op self-tests)
            assert k["file"].endswith(("csrc/emu/selftest.metal", "csrc/emu/selftest_m5.metal")), k


def test_names_are_unique():
    for names in ([k["name"] for k in core.kernel_table()], [k["name"] for k in core.emu.kernels()]):
        dup = [n for n, c in Counter(names).items() if c > 1]
        assert not dup, dup


def test_shader_instantiations_are_exactly_the_kernel_ids():
    text = "\n".join(p.read_text() for p in sorted((ROOT / "shaders").glob("*.metal")) +
                     sorted((ROOT / "shaders" / "m5").glob("*.metal")))
    names = re.findall(r'^\s*LILY_INSTANTIATE\("([^"]+)"', text, flags=re.M)
    assert Counter(names) == Counter(k["name"] for k in core.kernel_table())


def test_kernel_signatures_bind_buffers_in_order():
    # [[buffer(0)]] is the args struct, then device buffers 1, 2, ... in parameter order: the host
    # binds by index and the emulator by position, so the two must agree.
    sources = (sorted((ROOT / "shaders").glob("*.metal")) + sorted((ROOT / "shaders" / "m5").glob("*.metal")) +
               [ROOT / "csrc/emu/selftest.metal"])
    seen = 0
    for path in sources:
        text = path.read_text()
        for name, params in re.findall(r"\[\[kernel(?:,[^\]]*)?\]\]\s+void\s+(\w+)\s*\((.*?)LILY_KERNEL_TAIL\s*\)", text, re.S):
            seen += 1
            idx = [int(i) for i in re.findall(r"\[\[buffer\((\d+)\)\]\]", params)]
            assert idx == list(range(len(idx))), f"{path.name}:{name} buffer indices {idx}"
            first = params.strip().split(",")[0]
            assert re.match(r"constant\s+\w+Args&\s+args\s+\[\[buffer\(0\)\]\]", first), f"{path.name}:{name}: {first}"
    assert seen >= 2
    assert seen == len(set(re.findall(r'LILY_INSTANTIATE\("\w+", (\w+)<', "\n".join(p.read_text() for p in sources))))


@pytest.mark.skipif("metal" not in core.devices(), reason="this build has no Metal device (built without LILY_METAL: not macOS)")
def test_every_kernel_id_is_in_the_metal_library():
    # library_functions() loads the library on any Metal GPU, including the paravirtual GPU of
    # hosted macOS CI runners that cannot run the kernels (core.metal.available() is False there).
    # The tensor-op kernels are in lily_m5.metallib, loaded only where the device reports them.
    functions = set(core.metal.library_functions())
    tensor_ops = bool(core.metal.info().get("tensor_ops"))
    missing = [k["name"] for k in core.kernel_table()
               if k["name"] not in functions and (tensor_ops or not k["tensor_ops"])]
    assert not missing, f"kernel ids missing from {core.metal.info()['library']}: {missing}"


@pytest.mark.parametrize("which, message", [
    ("ok", ""),
    ("buffer_before_args", ""),
    ("dispatch_without_kernel", "dispatch without a kernel"),
    ("no_args", "dispatch sample_noise: args struct not set"),
    ("index", "sample_noise buffer(2): index out of range 1..1"),
    ("null", "sample_noise buffer(1): null buffer"),
    ("empty", "sample_noise buffer(1): empty range"),
    ("range", "sample_noise buffer(1): range [32, +64) exceeds buffer of 64 bytes"),
    ("unbound", "dispatch sample_noise: buffer(1) not bound"),
    ("grid", "dispatch sample_noise: empty grid"),
    ("threads", "dispatch sample_noise: 1025 threads per threadgroup exceeds 1024"),
])
def test_encoder_errors_name_the_kernel_and_buffer(which, message):
    """The encoder validates every binding and dispatch with plain comparisons and builds its
    message only on failure (encoding a decode step builds no strings): every message still
    names the kernel, the buffer index and the numbers."""
    from lily_py import _core
    assert _core.encoder_error(which) == message
