"""The device registry and the engine's load-time checks (issue 13), on the emulator and the
counting device with *simulated* Mac limits (lily_py.testing.simulated_device):

* a kernel whose pipeline allows fewer threads per threadgroup than the engine dispatches either
  takes a fitting route (rms_norm strides its row with any multiple of 32 threads) or fails at
  load, naming the kernel, both numbers and the device;
* the emulator, like Metal, refuses a dispatch above the pipeline's limit;
* memory: above the working set the load fails before allocating, saying what is needed, what is
  available and which context_length fits; above 85% it warns; a buffer above maxBufferLength fails.
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import lily_py
from lily_py import _core
from lily_py.backends.engine import REAL_QUANT, engine_spec
from lily_py.config import ModelConfig
from lily_py.testing import REAL_TEXT_CONFIG, TINY_TEXT_CONFIG, make_checkpoint, simulated_device

from tolerances import assert_close


def test_registry_lists_every_device_with_a_reason():
    devs = {d.name: d for d in lily_py.devices()}
    assert list(devs) == ["metal", "emu", "count", "count_host", "cuda"]   # backend="auto" preference order (never cuda)
    assert devs["emu"].available and devs["count"].available and devs["emu"].reason == ""
    if not _core.has_metal:
        assert not devs["metal"].available
        assert "LILY_METAL" in devs["metal"].reason
        assert lily_py.auto_backend() == ("reference", devs["metal"].reason)
        with pytest.raises(lily_py.BackendError, match="not available"):
            lily_py.device_info("metal")
    if "LILY_CUDA" in devs["cuda"].reason:   # a build without the cuda device says so
        with pytest.raises(lily_py.BackendError, match="not available"):
            lily_py.device_info("cuda")
    with pytest.raises(ValueError, match="unknown device 'vulkan'"):
        lily_py.device_info("vulkan")


def test_device_info_and_pipeline_limits_on_the_emulator():
    info = lily_py.device_info("emu")
    assert info["name"] == "emu" and info["simulated"] is False
    assert info["working_set_bytes"] is None and info["max_buffer_bytes"] is None   # unlimited
    assert info["build_target"]
    limits = lily_py.pipeline_limits("emu")
    assert [d["kernel"] for d in limits] == [k["name"] for k in _core.kernel_table()]
    assert all(d["max_threads"] == 1024 and d["simd_width"] == 32 for d in limits)
    assert all(d["static_threadgroup_bytes"] is None for d in limits)   # checked as kernels run
    with simulated_device(max_threads={"gated_delta_xf32_wf32": 512}, default_max_threads=768,
                          threadgroup_bytes={"moe_plan": 4096}, working_set_bytes=10 << 30):
        sim = {d["kernel"]: d for d in lily_py.pipeline_limits("emu")}
        assert sim["gated_delta_xf32_wf32"]["max_threads"] == 512
        assert sim["qmv_b4_xf32_sf32"]["max_threads"] == 768
        assert sim["moe_plan"]["static_threadgroup_bytes"] == 4096
        info = lily_py.device_info("emu")
        assert info["simulated"] and info["working_set_bytes"] == 10 << 30
    assert lily_py.device_info("emu")["simulated"] is False             # the block restored it


def test_emulator_refuses_a_dispatch_above_the_pipeline_limit(rng):
    from lily_py.ops import swiglu
    a = rng.standard_normal((3, 700)).astype(np.float32)
    b = rng.standard_normal((3, 700)).astype(np.float32)
    swiglu(a, b)                                                        # 256 threads: fine
    with simulated_device(max_threads={"swiglu_f32": 128}):
        with pytest.raises(RuntimeError, match=r"swiglu_f32: 256 threads per threadgroup exceed this "
                                               r"pipeline's \(simulated\) limit of 128"):
            swiglu(a, b)


@pytest.mark.parametrize("limit", [32, 96])
def test_rms_norm_fits_a_lower_pipeline_limit(rng, limit):
    """D = 4000 wants 512 threads; under a lower limit the host takes `limit` threads (a multiple
    of 32) and the result still matches the reference."""
    from lily_py.ops import _rms_norm
    from lily_py.reference.kernels import rms_norm as ref_rms_norm
    x = rng.standard_normal((5, 4000)).astype(np.float32)
    w = rng.standard_normal(4000).astype(np.float32)
    _, _, st = _rms_norm(x, w)
    assert st["threads"] == 5 * 512
    with simulated_device(max_threads={"rms_norm_xf32_wf32": limit}):
        y, _, st = _rms_norm(x, w)
    assert st["threads"] == 5 * limit
    ref = ref_rms_norm(x, w, eps=1e-6)
    assert_close(y, ref, atol=1e-6, rtol=1e-5, what=f"rms_norm under a {limit}-thread limit")


def _cfg(**kw):
    return dict(TINY_TEXT_CONFIG, **kw)


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """hidden 320: rms_norm wants 64 threads; DeltaNet value heads of 32: gated_delta 256."""
    return make_checkpoint(tmp_path_factory.mktemp("limits"), _cfg(hidden_size=320), fmt="mlx",
                           seed=11, std=0.08)


def test_load_picks_the_fitting_rms_norm_route(wide_ckpt):
    ids = [3, 17, 250, 9, 41, 77, 5]
    ref = lily_py.load(wide_ckpt, backend="reference").prefill(ids)
    plain = lily_py.load(wide_ckpt, backend="emu", context_length=64, prefill_chunk=16, activations="float32")
    by_kernel = {p["kernel"]: p for p in plain._backend.engine.pipelines}
    assert by_kernel["rms_norm_xf32_wf32"]["threads"] == 64
    assert by_kernel["gated_delta_xf32_wf32"]["threads"] == 256
    with simulated_device(max_threads={"rms_norm_xf32_wf32": 32, "rms_norm_residual_xf32_wf32": 32}):
        m = lily_py.load(wide_ckpt, backend="emu", context_length=64, prefill_chunk=16, activations="float32")
        by_kernel = {p["kernel"]: p for p in m._backend.engine.pipelines}
        assert by_kernel["rms_norm_xf32_wf32"] == {"kernel": "rms_norm_xf32_wf32", "threads": 32,
                                                  "max_threads": 32, "static_threadgroup_bytes": None}
        assert by_kernel["rms_norm_residual_xf32_wf32"]["threads"] == 32
        out = m.prefill(ids)
    scale = float(np.abs(ref).max())
    assert_close(out, ref, atol=2.0 ** -7 * scale, rtol=0, what="logits, rms_norm at 32 threads")


def test_deltanet_decode_fits_a_lower_pipeline_limit(wide_ckpt):
    """gated_delta_decode sizes its grid from the pipeline's limit: value heads of 32 take 2
    threadgroups of 256 threads by default, 8 of 64 under a 64-thread limit; the logits of three
    decode steps stay within rounding of the unrestricted engine's (and of the reference's). On the
    fp32 activation path, so that 64 vs 256 threads differ by fp32 summation order only."""
    ids, steps = [3, 17, 250, 9], [5, 77, 41]
    ref = lily_py.load(wide_ckpt, backend="reference")
    want = [ref.prefill(ids)] + [ref.decode(t) for t in steps]
    plain = lily_py.load(wide_ckpt, backend="emu", context_length=64, prefill_chunk=16,
                             activations="float32")
    by_kernel = {p["kernel"]: p for p in plain._backend.engine.pipelines}
    assert by_kernel["gated_delta_decode_xf32_wf32"]["threads"] == 256
    got = [plain.prefill(ids)] + [plain.decode(t) for t in steps]
    with simulated_device(max_threads={"gated_delta_decode_xf32_wf32": 64}):
        m = lily_py.load(wide_ckpt, backend="emu", context_length=64, prefill_chunk=16,
                             activations="float32")
        by_kernel = {p["kernel"]: p for p in m._backend.engine.pipelines}
        assert by_kernel["gated_delta_decode_xf32_wf32"]["threads"] == 64
        low = [m.prefill(ids)] + [m.decode(t) for t in steps]
    np.testing.assert_array_equal(low[0], got[0])          # prefill does not use the kernel
    for i, (a, b, r) in enumerate(zip(low, got, want)):
        scale = float(np.abs(r).max())
        assert_close(a, b, atol=1e-5 * scale, rtol=0, what=f"step {i}: 64 vs 256 threads")
        assert_close(a, r, atol=2.0 ** -7 * scale, rtol=0, what=f"step {i}: vs the reference")


def test_load_fails_naming_kernel_numbers_and_device(wide_ckpt):
    with simulated_device(max_threads={"gated_delta_xbf16_wf32": 128}):  # the default: bf16 activations
        with pytest.raises(lily_py.BackendError) as ei:
            lily_py.load(wide_ckpt, backend="emu", context_length=64, prefill_chunk=16)
    msg = str(ei.value)
    assert "kernel 'gated_delta_xbf16_wf32' dispatches 256 threads per threadgroup" in msg
    assert "allows at most 128 (maxTotalThreadsPerThreadgroup)" in msg
    assert "device 'emu' (CPU emulator" in msg and "simulated limits" in msg


def test_load_checks_static_threadgroup_memory(wide_ckpt):
    with simulated_device(threadgroup_bytes={"moe_route_xbf16": 40000}):
        with pytest.raises(lily_py.BackendError, match=r"kernel 'moe_route_xbf16' uses 40000 bytes of "
                                                      r"threadgroup memory .* more than the 32768"):
            lily_py.load(wide_ckpt, backend="emu", context_length=64, prefill_chunk=16)


# ---- memory: the real 35B config on the counting device (sizes only, nothing allocated) ----------

REAL = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})


def _real_spec(context_length, prefill_chunk=4096):
    return engine_spec(REAL, REAL_QUANT, context_length=context_length,
                       prefill_chunk=min(prefill_chunk, context_length))


def _total(context_length, prefill_chunk=4096):
    return _core.Engine(_real_spec(context_length, prefill_chunk), "count").memory["total_bytes"]


def test_memory_error_says_needed_available_and_a_context_that_fits():
    need_32k = _total(32768)
    assert 18 << 30 < need_32k < 24 << 30          # ~20 GB: weights dominate
    ws = need_32k - (256 << 20)                     # 256 MiB short of 32K tokens
    with simulated_device(working_set_bytes=ws):
        with pytest.raises(MemoryError) as ei:
            _core.Engine(_real_spec(32768), "count")
    msg = str(ei.value)
    assert f"the model needs {need_32k} bytes" in msg and f"has {ws} bytes" in msg
    # The KV pools start at one block: the context costs little at load, the chunk's scratch much.
    m = re.search(r"context_length=(\d+)(?: \(prefill_chunk \d+\))? would fit", msg)
    assert m, msg
    fit = int(m.group(1))
    assert fit < 32768 and _total(fit) <= ws < _total(fit + 1)      # the largest that fits
    m = re.search(r"or prefill_chunk=(\d+) at context_length 32768", msg)   # or a smaller chunk
    assert m, msg
    chunk = int(m.group(1))
    assert chunk < 4096 and _total(32768, chunk) <= ws < _total(32768, chunk + 1)
    with simulated_device(working_set_bytes=ws):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)          # it fits, just above 85%
            _core.Engine(_real_spec(fit), "count")


def test_memory_error_when_even_the_weights_do_not_fit():
    with simulated_device(working_set_bytes=8 << 30):
        with pytest.raises(MemoryError, match="no context_length fits: the weights alone need"):
            _core.Engine(_real_spec(4096), "count")


def test_memory_warns_above_85_percent():
    need = _total(8192)
    with simulated_device(working_set_bytes=int(need / 0.9)):
        with pytest.warns(RuntimeWarning, match=r"above 85%") as rec:
            e = _core.Engine(_real_spec(8192), "count")
    assert len(rec) == 1
    assert e.memory["warning"] and e.memory["working_set_bytes"] == int(need / 0.9)
    with simulated_device(working_set_bytes=int(need / 0.8)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _core.Engine(_real_spec(8192), "count")            # 80%: quiet


def test_max_buffer_length_per_buffer():
    e = _core.Engine(_real_spec(4096), "count")
    largest, what = e.memory["largest_buffer_bytes"], e.memory["largest_buffer"]
    with simulated_device(max_buffer_bytes=largest - 1):
        with pytest.raises(MemoryError, match=re.escape(f"{what} needs one buffer of {largest} bytes")):
            _core.Engine(_real_spec(4096), "count")
    with simulated_device(max_buffer_bytes=largest):
        _core.Engine(_real_spec(4096), "count")


def test_model_load_raises_device_memory_error(wide_ckpt):
    with simulated_device(working_set_bytes=1 << 20):
        with pytest.raises(lily_py.DeviceMemoryError, match="would fit|no context_length fits"):
            lily_py.load(wide_ckpt, backend="emu", context_length=64, prefill_chunk=16)


def test_auto_warns_once_when_a_metal_build_cannot_use_the_gpu(monkeypatch, tiny_mlx):
    import types
    monkeypatch.setattr(_core, "has_metal", True)
    monkeypatch.setattr(_core, "registry", types.SimpleNamespace(
        check_usable=lambda name: "pipeline 'gated_delta_xf32_wf32': compiler error (simulated)"))
    with pytest.warns(RuntimeWarning) as rec:
        m = lily_py.load(tiny_mlx, backend="auto")
    assert m.backend == "reference"
    msgs = [str(r.message) for r in rec if issubclass(r.category, RuntimeWarning)]
    assert len(msgs) == 1 and "Metal device is not usable: pipeline 'gated_delta_xf32_wf32'" in msgs[0]
