"""The engine on the M5 path: the emulator reporting Metal 4 tensor ops
(lily_py.testing.simulated_device(tensor_ops=True)), so every 4-bit quantized matmul of more than
8 rows takes qmm_m5 (matmul2d, half operands, fp32 accumulation) instead of the simdgroup qmm.

Greedy tokens on the bundled demo must equal the reference's for 32 steps after a prompt of 100
tokens prefilled in chunks of 64 and 4096 (qmm_m5 in every prefill step, qmv in decode). The
prompt's logits stay within the attention tolerance of tests/model/test_engine.py
(2^-7 * max|ref|): the half rounding of x and the weights errs by <= 2^-10 relative per product,
below the bf16 KV cache's 2^-9 that tolerance was derived for.
"""
from __future__ import annotations

import numpy as np
import pytest

import lily_py
from lily_py.testing import simulated_device

from conftest import assert_close

N_PROMPT = 100
_REF: dict = {}


def _prompt(model):
    ids = model.tokenizer.encode("In the beginning God created the heaven and the earth. " * 20)[:N_PROMPT]
    assert len(ids) == N_PROMPT
    return ids


def _reference():
    if not _REF:
        ref = lily_py.load(backend="reference", context_length=256)
        prompt = _prompt(ref)
        _REF["logits"] = ref.prefill(prompt)
        ref.reset()
        _REF["tokens"] = ref.generate_text(prompt, max_tokens=32).tokens
        _REF["prompt"] = prompt
    return _REF


@pytest.mark.parametrize("chunk", [64, 4096])
def test_demo_greedy_on_the_m5_path(chunk):
    ref = _reference()
    with simulated_device(tensor_ops=True):
        emu = lily_py.load(backend="emu", context_length=256, prefill_chunk=chunk)
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    assert any(k.startswith("qmm_m5_") for k in kernels), sorted(kernels)
    # every 4-bit qmm on M5, except the all-logits lm_head of bf16 activations (fp32 logits from
    # bf16 x: qmm_m5 has no float32-output variant yet, so that one product takes qmm *_yf32)
    assert not any(k.startswith("qmm_b4_") and not k.endswith("_yf32") for k in kernels), sorted(kernels)
    logits = emu.prefill(ref["prompt"])
    assert_close(logits, ref["logits"], atol=2.0 ** -7 * float(np.abs(ref["logits"]).max()), rtol=0,
                 what=f"demo prefill logits on the M5 path (chunks of {chunk})")
    emu.reset()
    got = emu.generate_text(ref["prompt"], max_tokens=32)
    assert got.tokens == ref["tokens"]


def test_without_tensor_ops_the_engine_keeps_the_simdgroup_qmm():
    emu = lily_py.load(backend="emu", context_length=256, prefill_chunk=64)
    kernels = {p["kernel"] for p in emu._backend.engine.pipelines}
    assert not any(k.startswith("qmm_m5_") for k in kernels)
    assert any(k.startswith("qmm_b4_") for k in kernels)
