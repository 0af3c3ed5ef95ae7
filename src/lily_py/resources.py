"""Files shipped inside the package."""
from __future__ import annotations

import os

from .errors import CheckpointError

_HERE = os.path.dirname(os.path.abspath(__file__))


def demo_path() -> str:
    """Folder of the small demo checkpoint shipped with lily_py (MLX 4-bit, same architecture as
    Qwen3.6-35B-A3B, trained briefly on the King James Bible; see its README.md)."""
    path = os.path.join(_HERE, "demo")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: the demo checkpoint is missing from this installation")
    return path
