"""Metal kernels as functions over NumPy arrays, one module per kernel family
(``qmm``, ``norm``, ``embed``, ``elementwise``, ``sampling``, ``gated_delta``, ``moe_block``,
``attention``; shared argument checks in ``_common``).

Each function runs one kernel family on a device and returns NumPy arrays:

* ``device="emu"`` - the CPU emulator: the very ``shaders/*.metal`` sources compiled as C++, with
  GPU-faithful threadgroups, barriers and simd collectives, and checks a GPU would not do (see
  ``docs/emulator.md``). Slow; always available.
* ``device="metal"`` - the GPU, in macOS builds (the Metal device is written but has not run in CI
  yet; see ``docs/metal.md``).

Arrays are float32 or bfloat16 (``ml_dtypes.bfloat16``); quantized weights use MLX's affine
layout (``lily_py.reference.quant``). The NumPy oracle of every function is in
``lily_py.reference.kernels``.
"""
from __future__ import annotations

from ._common import devices
from . import attention, elementwise, embed, gated_delta, moe_block, norm, qmm, sampling
from .attention import *  # noqa: F401,F403
from .elementwise import _elementwise, sigmoid_mul, swiglu  # noqa: F401
from .embed import _embedding, embedding  # noqa: F401
from .gated_delta import *  # noqa: F401,F403
from .moe_block import _moe, moe, moe_route, moe_weights  # noqa: F401
from .norm import _rms_norm, rms_norm  # noqa: F401
from .qmm import (_quantize_i8, _quantized_matmul, _quantized_matmul_norm, quantized_matmul, quantized_matmul_norm,  # noqa: F401
                  quantized_matmul_route)
from .sampling import _argmax, _sample, argmax, sample, sample_logprobs  # noqa: F401

__all__ = ["devices", *qmm.__all__, *norm.__all__, *embed.__all__, *elementwise.__all__,
           *sampling.__all__, *gated_delta.__all__, *moe_block.__all__, *attention.__all__]
