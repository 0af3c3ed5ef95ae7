"""The backend the engine tests load: "emu" (the CPU emulator), unless LILY_TEST_ENGINE names
another: `LILY_TEST_ENGINE=cuda` runs them on an NVIDIA GPU (docs/gpu.md). A module that loads
it calls `require_engine()` at import: where the registry says that backend is not usable here,
every test of the module is skipped with the registry's reason."""
import os

import pytest

import lily_py._core as core

ENGINE = os.environ.get("LILY_TEST_ENGINE", "emu").strip() or "emu"


def require_engine() -> None:
    if ENGINE != "emu":
        why = core.registry.check_usable(ENGINE)
        if why:
            pytest.skip(f"LILY_TEST_ENGINE={ENGINE}: {why}", allow_module_level=True)


def require_emulator(what: str) -> None:
    """Skip a test whose subject only the emulator has (simulated tensor ops, zero-copy weights),
    with the reason, when LILY_TEST_ENGINE names another backend."""
    if ENGINE != "emu":
        pytest.skip(f"{what} is an emulator feature; LILY_TEST_ENGINE={ENGINE} (docs/gpu.md)")
