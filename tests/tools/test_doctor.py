"""lily-py doctor: runs on the emulator and exits 0; a wrong kernel, an unusable device or a bad
pipeline limit makes it fail (exit 1) with the failing check named, never crash."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

import lily_py
import lily_py._core  # noqa: F401  (the extension: a missing build fails loudly)
import lily_py._devices
from lily_py.tools import doctor as D

FAMILIES = ["quantized_matmul", "rms_norm", "embedding", "swiglu/sigmoid_mul", "sampling",
            "gated_delta", "moe", "attention"]


def test_doctor_quick_cli_passes_on_the_emulator(tmp_path):
    path = tmp_path / "doctor.json"
    p = subprocess.run([sys.executable, "-m", "lily_py.cli", "doctor", "--quick", "--device", "emu",
                        "--json", str(path)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for section in ("Device", "Pipelines:", "Kernels vs the NumPy reference",
                    "Model: the bundled demo checkpoint on 'emu'", "OK: all"):
        assert section in out, section
    rep = json.loads(path.read_text())
    assert rep["device"] == "emu" and rep["quick"] is True and rep["failed"] == 0
    kernels = [c for c in rep["checks"] if c["section"] == "kernels"]
    # every family at two shapes (gated_delta and attention have two kernels per shape)
    assert sorted(set(c["name"] for c in kernels)) == sorted(FAMILIES)
    for fam in FAMILIES:
        rows = [c for c in kernels if c["name"] == fam]
        assert len(rows) >= 2 and all(c["ok"] and c["ratio"] <= 1 for c in rows), rows
    model = {c["name"]: c for c in rep["checks"] if c["section"] == "model"}
    assert model["demo greedy 32"]["ok"] and model["demo logits"]["ok"]
    table = {k["name"] for k in lily_py._core.kernel_table()}
    assert f"Pipelines: {len(table)} kernel ids, all in the emulator registry    PASS" in out


def test_the_function_returns_the_exit_status():
    out = io.StringIO()
    rep = D.run("emu", quick=True, families=["rms_norm"], model=False, out=out)
    assert rep.exit_status == 0 and [c.name for c in rep.checks if c.section == "kernels"] == ["rms_norm"] * 2
    assert callable(lily_py.doctor)


def test_a_wrong_kernel_fails_and_is_named(monkeypatch):
    from lily_py import ops
    real = ops.rms_norm
    # 1% off: far outside the rms_norm tolerance ((4 sqrt(D) + 8) u, + 2^-8 for bf16 outputs)
    monkeypatch.setattr(ops, "rms_norm", lambda *a, **k: (real(*a, **k).astype(np.float32) * 1.01).astype(a[0].dtype))
    out = io.StringIO()
    rep = D.run("emu", quick=True, families=["rms_norm", "embedding"], model=False, out=out, seed=3)
    assert rep.exit_status == 1
    bad = [c for c in rep.checks if c.ok is False]
    assert [c.name for c in bad] == ["rms_norm", "rms_norm"] and all(c.ratio > 1 for c in bad)
    text = out.getvalue()
    assert "FAILED: 2 of" in text and "Replay with --seed 3" in text


def test_a_kernel_that_raises_is_a_failure_not_a_crash(monkeypatch):
    from lily_py import ops

    def boom(*a, **k):
        raise RuntimeError("device lost")
    monkeypatch.setattr(ops, "attention_decode", boom)
    rep = D.run("emu", quick=True, families=["attention"], model=False, out=None)
    assert rep.exit_status == 1
    assert any("RuntimeError: device lost" in c.detail for c in rep.failed)


def test_unusable_device_fails_with_the_reason():
    if D.device_status("metal")[0]:
        pytest.skip("this machine has a usable Metal device")
    out = io.StringIO()
    rep = D.run("metal", quick=True, out=out)
    assert rep.exit_status == 1
    assert "metal: not usable:" in out.getvalue() and rep.failed[0].detail


def test_pipeline_limits_table_and_missing_api(monkeypatch):
    out = io.StringIO()
    names = [k["name"] for k in lily_py._core.kernel_table()]
    monkeypatch.delattr(lily_py._devices, "pipeline_limits", raising=False)    # a build without the API
    rep = D.run("emu", families=[], model=False, out=out)
    assert "pipeline limits: not reported by this build" in out.getvalue() and rep.exit_status == 0
    same = [{"kernel": n, "max_threads": 1024, "static_threadgroup_bytes": None, "simd_width": 32} for n in names]
    monkeypatch.setattr(lily_py._devices, "pipeline_limits", lambda dev: same, raising=False)
    out = io.StringIO()
    assert D.run("emu", families=[], model=False, out=out).exit_status == 0
    assert ("every kernel id: max threads per threadgroup 1024, static threadgroup memory not known before a "
            "run, SIMD width 32") in out.getvalue()
    limits = [{"kernel": n, "max_threads": 1024 if i % 2 else 896, "static_threadgroup_bytes": 4096,
               "simd_width": 32} for i, n in enumerate(names)]
    monkeypatch.setattr(lily_py._devices, "pipeline_limits", lambda dev: limits, raising=False)
    out = io.StringIO()
    rep = D.run("emu", families=[], model=False, out=out)
    assert rep.exit_status == 0 and rep.limits == limits
    assert all(n in out.getvalue() for n in names)
    limits[0] = dict(limits[0], static_threadgroup_bytes=40 * 1024)     # over Apple's 32 KiB
    rep = D.run("emu", families=[], model=False, out=io.StringIO())
    assert rep.exit_status == 1 and names[0] in rep.failed[0].detail
    monkeypatch.setattr(lily_py._devices, "pipeline_limits", lambda dev: limits[1:], raising=False)
    rep = D.run("emu", families=[], model=False, out=io.StringIO())
    assert rep.exit_status == 1 and "no limits for" in rep.failed[0].detail


def test_measure_is_the_tests_bound():
    assert D.measure([1.0, 2.0], [1.0, 2.0], atol=0, rtol=0) == (0.0, 0.0)
    err, ratio = D.measure([1.1], [1.0], atol=0.05, rtol=0.05)
    assert err == pytest.approx(0.1) and ratio == pytest.approx(1.0)
    assert D.measure([np.nan], [1.0], atol=1, rtol=0)[1] == float("inf")
    assert D.measure([1.0, 2.0], [1.0], atol=1, rtol=0)[1] == float("inf")


def test_device_registry_api_is_used_where_present(monkeypatch):
    """The registry API of issue 13 (lily_py.devices / device_info / pipeline_limits): doctor
    prints its facts, and a metallib that was built but did not load is a failure."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class DeviceStatus:
        name: str
        available: bool
        reason: str
        description: str = ""

    facts = {"name": "metal", "device_name": "Apple M9 (test double)", "gpu_family": "apple9",
             "working_set_bytes": 48 * 2**30, "max_buffer_bytes": 32 * 2**30,
             "library_path": "/x/lily_shaders.metal", "library_source": "source",
             "metallib_error": "Invalid library file", "metallib_built": True, "build_target": "macOS 14.0",
             "build_sdk": "macOS SDK 14.2", "math_mode": "fastMathEnabled=NO", "residency_set": False,
             "simulated": False, "tensor_ops": False,
             "tensor_ops_reason": "GPU family apple9 < apple10 (M5): the simdgroup-matrix kernels are used"}
    monkeypatch.setattr(lily_py._devices, "devices", lambda: [DeviceStatus("metal", True, ""), DeviceStatus("emu", True, ""),
                                                     DeviceStatus("count", True, "")], raising=False)
    monkeypatch.setattr(lily_py._devices, "device_info", lambda name: dict(facts, name=name), raising=False)
    monkeypatch.setattr(lily_py._devices, "pipeline_limits", lambda name: [
        {"kernel": k["name"], "max_threads": 1024, "static_threadgroup_bytes": 0, "simd_width": 32}
        for k in lily_py._core.kernel_table()], raising=False)
    assert D.default_device() == "metal"
    out = io.StringIO()
    rep = D.run("metal", families=[], model=False, out=out)
    text = out.getvalue()
    for s in ("registry        metal: usable; emu: usable; count: usable", "Apple M9 (test double)", "apple9",
              "48.0 GiB", "macOS SDK 14.2", "fastMathEnabled=NO", "Invalid library file",
              "  library         compiled at run time from /x/lily_shaders.metal (MSL 3.1)\n",
              "  M5 library      unavailable: GPU family apple9 < apple10 (M5): the simdgroup-matrix kernels are used\n",
              "an installed metallib was built but did not load    FAIL"):
        assert s in text, s
    assert "library source" not in text   # Metal: the library rows say it
    assert rep.exit_status == 1 and [c.name for c in rep.failed] == ["metallib"]
    assert rep.to_json()["facts"]["libraries"] == {
        "library": "compiled at run time from /x/lily_shaders.metal (MSL 3.1)",
        "M5 library": "unavailable: GPU family apple9 < apple10 (M5): the simdgroup-matrix kernels are used"}
    monkeypatch.setattr(lily_py._devices, "devices", lambda: [DeviceStatus("metal", False, "no Metal device")],
                        raising=False)
    assert D.device_status("metal") == (False, "no Metal device") and D.default_device() == "emu"


# The Metal device's info (csrc/metal/device.mm, docs/metal.md "Shader libraries"): library_path is
# the base library's file, plus " + <file>" when the M5 tensor-op library loaded (.metallib:
# prebuilt, .metal: compiled at run time); library_source is the base's; tensor_ops_reason says why
# there is no M5 library. Metal only exists on macOS: these are the facts it reports, as doubles.
PKG = "/venv/lib/python3.12/site-packages/lily_py"


@pytest.mark.parametrize("facts, rows", [
    # the macOS 26 SDK wheel on an M5 under macOS 26: both prebuilt
    ({"name": "metal", "library_path": f"{PKG}/lily.metallib + {PKG}/lily_m5.metallib",
      "library_source": "metallib", "tensor_ops": True, "tensor_ops_reason": None},
     [("library", f"prebuilt metallib {PKG}/lily.metallib"),
      ("M5 library", f"prebuilt metallib {PKG}/lily_m5.metallib")]),
    # the macOS 14 SDK wheel on an M5 under macOS 26: the M5 kernels compiled from the installed source
    ({"name": "metal", "library_path": f"{PKG}/lily.metallib + {PKG}/lily_shaders_m5.metal",
      "library_source": "metallib", "tensor_ops": True, "tensor_ops_reason": None},
     [("library", f"prebuilt metallib {PKG}/lily.metallib"),
      ("M5 library", f"compiled at run time from {PKG}/lily_shaders_m5.metal (MSL 4.0)")]),
    # no Metal toolchain at build time, an M5 under macOS 26: both from source
    ({"name": "metal", "library_path": f"{PKG}/lily_shaders.metal + {PKG}/lily_shaders_m5.metal",
      "library_source": "source", "tensor_ops": True},
     [("library", f"compiled at run time from {PKG}/lily_shaders.metal (MSL 3.1)"),
      ("M5 library", f"compiled at run time from {PKG}/lily_shaders_m5.metal (MSL 4.0)")]),
    # an M5 whose run-time compile failed: unavailable, with the device's reason
    ({"name": "metal", "library_path": f"{PKG}/lily.metallib", "library_source": "metallib",
      "tensor_ops": False,
      "tensor_ops_reason": f"compiling {PKG}/lily_shaders_m5.metal (MSL 4.0) at run time: error: x"},
     [("library", f"prebuilt metallib {PKG}/lily.metallib"),
      ("M5 library", f"unavailable: compiling {PKG}/lily_shaders_m5.metal (MSL 4.0) at run time: error: x")]),
    # macOS 15 on an M1
    ({"name": "metal", "library_path": f"{PKG}/lily.metallib", "library_source": "metallib",
      "tensor_ops": False, "tensor_ops_reason": "Metal 4 tensor ops need macOS 26"},
     [("library", f"prebuilt metallib {PKG}/lily.metallib"),
      ("M5 library", "unavailable: Metal 4 tensor ops need macOS 26")]),
    # other devices: as reported (docs/tools.md's emulator output)
    ({"name": "emu", "library_path": None, "library_source": "emulator"},
     [("library", None), ("library source", "emulator")]),
    ({"name": "cuda", "library_path": "/x/cuda_kernels", "library_source": "cubin", "tensor_ops": False},
     [("library", "/x/cuda_kernels"), ("library source", "cubin")]),
    ({}, [("library", None), ("library source", None)]),
])
def test_library_rows_say_how_each_library_was_found(facts, rows):
    assert D.library_rows(facts) == rows


def test_emulator_device_section_keeps_its_library_rows():
    """The emulator's Device section (docs/tools.md shows it) has no Metal library rows."""
    out = io.StringIO()
    rep = D.run("emu", families=[], model=False, out=out)
    text = out.getvalue()
    assert "  library         -\n" in text and "  library source  emulator\n" in text
    assert "M5 library" not in text and "libraries" not in rep.facts
