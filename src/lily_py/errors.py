"""Exceptions raised by lily_py. All derive from ValueError or RuntimeError so callers that
catch the builtin kinds keep working."""


class LilyError(Exception):
    """Base class of lily_py's own errors."""


class ConfigError(LilyError, ValueError):
    """config.json is not a supported qwen3_5_moe configuration."""


class CheckpointError(LilyError, ValueError):
    """The checkpoint's files or tensors are missing, truncated or not what the config implies."""


class ContextLengthError(LilyError, ValueError):
    """A prompt or generation would exceed the model's configured context length."""


class BackendError(LilyError, RuntimeError):
    """The requested backend is not available in this build or on this machine."""


class BusyError(LilyError, RuntimeError):
    """The model is already generating; one model runs one generation at a time."""


class DeviceMemoryError(LilyError, MemoryError):
    """The model (weights, KV cache, state, scratch) does not fit the device's memory: the message
    says how much it needs, how much the device has, and which context_length would fit."""
