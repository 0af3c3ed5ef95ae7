"""lily_py: fast local inference for Qwen3.6-35B-A3B (qwen3_5_moe, MLX 4-bit).

    import lily_py
    model = lily_py.load("path/or/org-name")       # or lily_py.load() for the tiny demo model
    for chunk in model.generate([{"role": "user", "content": "Hello"}], max_tokens=64):
        print(chunk.text, end="", flush=True)
"""
from ._devices import DeviceStatus, auto_backend, device_info, devices, pipeline_limits
from .config import ModelConfig
from .errors import (BackendError, BusyError, CheckpointError, ConfigError, ContextLengthError,
                     DeviceMemoryError, LilyError)
from .generation import GenerationChunk, GenerationStats, TokenLogprob
from .defaults import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_CACHE_BYTES
from .generation import GenerationResult
from .model import Model, load
from .parsing import ToolCall, ToolCallError
from .prompt_cache import PromptCache
from .resources import demo_path
from .chat_template import ChatTemplateError
from .sampling import SamplingParams
from .tools.doctor import doctor

from ._version import __version__

__all__ = [
    "load", "Model", "ModelConfig", "GenerationChunk", "GenerationStats", "GenerationResult", "TokenLogprob",
    "SamplingParams", "demo_path", "LilyError", "ConfigError", "CheckpointError",
    "ContextLengthError", "BackendError", "BusyError", "ChatTemplateError", "doctor", "__version__",
    "DeviceMemoryError", "DeviceStatus", "devices", "device_info", "pipeline_limits", "auto_backend",
    "ToolCall", "ToolCallError", "PromptCache", "DEFAULT_MAX_TOKENS",
    "DEFAULT_PROMPT_CACHE_BYTES",
]


def build_info() -> dict:
    """What the compiled core was built with (devices, compiler, version)."""
    from . import _core
    return {"version": _core.version(), "compiler": _core.compiler(),
            "devices": list(_core.devices()), "has_metal": bool(_core.has_metal)}
