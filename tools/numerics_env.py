"""Print the CPU kernels NumPy and its OpenBLAS use in this process: the OpenBLAS core (its
DYNAMIC_ARCH choice, or OPENBLAS_CORETYPE's) and NumPy's enabled dispatch targets. The error
figures of the generated pages depend on both; tools/gendocs.py runs its commands with
NUMERICS_ENV so that every x86-64 machine prints `openblas Haswell` and `numpy X86_V3`
(tests/api/test_docs_generated.py checks it).

    python tools/numerics_env.py
"""
import ctypes
import glob
import os

import numpy


def openblas_core() -> str:
    """The core OpenBLAS runs with, from NumPy's bundled scipy-openblas; "unknown" when this NumPy
    bundles none (another BLAS, or a build from source)."""
    for lib in glob.glob(os.path.join(os.path.dirname(numpy.__file__) + ".libs", "*openblas*")):
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            f = getattr(ctypes.CDLL(lib), name, None)
            if f is not None:
                f.restype = ctypes.c_char_p
                return f().decode()
    return "unknown"


def numpy_targets() -> list[str]:
    """NumPy's runtime dispatch targets that this process enables (its baseline not included)."""
    core = getattr(numpy, "_core", None) or numpy.core
    m = core._multiarray_umath
    return [t for t in m.__cpu_dispatch__ if m.__cpu_features__.get(t)]


if __name__ == "__main__":
    print("openblas", openblas_core())
    print("numpy", " ".join(numpy_targets()) or "-")
