"""``generate()``'s arguments, checked before anything runs: sampling, limits, stop strings and
logprobs. The CLI checks its flags with the same functions before it loads a model.

One rule throughout: a wrong type raises TypeError naming the parameter (``temperature="0.7"``,
``seed="abc"``, ``stop=123``), a value of the right type out of range raises ValueError
(``temperature=-1``, ``max_tokens=0``).
"""
from __future__ import annotations

from typing import Sequence

from .sampling import MAX_LOGPROBS, SamplingParams, int_param, real_param


def sampling_params(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None) -> SamplingParams:
    """The checked ``SamplingParams`` (floats as floats, integers as ints)."""
    return SamplingParams(real_param("temperature", temperature), int_param("top_k", top_k),
                          real_param("top_p", top_p), real_param("min_p", min_p),
                          None if seed is None else int_param("seed", seed))


def max_tokens_arg(max_tokens) -> int:
    n = int_param("max_tokens", max_tokens)
    if n < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    return n


def stop_strings(stop: Sequence[str] | str | None) -> list[str]:
    """``stop`` as a list: a string, a list or tuple of strings, or None."""
    if isinstance(stop, str):
        return [stop]
    if stop is None:
        return []
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")


def logprobs_top(logprobs, top_logprobs) -> int:
    """How many top logprobs each chunk carries: -1 without logprobs, else 0..MAX_LOGPROBS."""
    if not isinstance(logprobs, bool):
        raise TypeError(f"logprobs must be True or False, got {logprobs!r}")
    top = int_param("top_logprobs", top_logprobs)
    if not 0 <= top <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top_logprobs!r}")
    if top and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True")
    return top if logprobs else -1


def template_kwargs(chat_template_kwargs) -> dict | None:
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError("chat_template_kwargs must be a dict of template variables, got "
                        f"{type(chat_template_kwargs).__name__}")
    return chat_template_kwargs
