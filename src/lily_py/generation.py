"""Generation objects: what ``Model.generate`` yields (``GenerationChunk``, with
``GenerationStats`` on the last), what ``Model.generate_text`` returns (``GenerationResult``), and
stop-string matching."""
from __future__ import annotations

from dataclasses import dataclass, field

from .parsing import ToolCall, ToolCallError


@dataclass
class GenerationStats:
    """Timing and token counts of one ``generate`` call (on the last chunk)."""
    prompt_tokens: int          # tokens in the rendered prompt
    reused_tokens: int          # of those, not prefilled again (live state or prompt cache)
    prefilled_tokens: int       # prompt tokens actually run through prefill
    generated_tokens: int       # tokens sampled (including a final stop/EOS token)
    prefill_seconds: float
    decode_seconds: float
    backend: str
    cached_tokens: int = 0      # of reused_tokens, restored from a prompt-cache snapshot

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first generated token comes from the prefill's logits.
        n = max(0, self.generated_tokens - 1)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def __str__(self) -> str:
        cached = f", {self.cached_tokens} from the prompt cache" if self.cached_tokens else ""
        return (f"prompt {self.prompt_tokens} tokens ({self.reused_tokens} reused{cached}, "
                f"{self.prefilled_tokens} prefilled at {self.prefill_tokens_per_second:.1f} tok/s), "
                f"generated {self.generated_tokens} tokens at "
                f"{self.decode_tokens_per_second:.1f} tok/s [{self.backend}]")


@dataclass
class TokenLogprob:
    """The log-probability of a sampled token and the ``top`` most likely tokens at its step,
    as ``(token id, logprob)`` pairs, most likely first. Taken from the model's distribution,
    ``log_softmax`` of the raw logits (before temperature and the filters; docs/structured.md)."""
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationChunk:
    """One streamed piece of a generation.

    ``text`` is the new answer text (may be empty while a multi-byte character, a possible stop
    string or a possible tag is pending), ``reasoning`` the new reasoning text (inside
    ``<think>...</think>``; only when the output is parsed, as for chat prompts), ``tool_calls``
    the tool calls completed at this chunk and ``tool_call_errors`` the malformed ones.
    ``token`` is the token id sampled at this step (None when nothing was sampled).
    ``finish_reason`` is None until the last chunk, then "stop" (EOS token or stop string),
    "tool_calls" (stopped after calling tools), "length" (max_tokens reached),
    "context_length" (the context is full), "cancelled" (``Model.cancel()``) or "error" (a
    constraint reached a dead end: no token allowed and not at an accepting state; ``error``
    says why); the last chunk also carries ``stats``. ``raw`` is this step's text before parsing. ``logprobs``: the
    sampled token's ``TokenLogprob`` when ``generate(logprobs=True)``. ``stop_sequence``: on a
    last chunk that a ``stop`` string ended, that string. ``section``: the part of a parsed
    output this chunk's text belongs to: "reasoning" (including the ``</think>`` tag),
    "content" (answer text), "tool_call" (a ``<tool_call>`` block) or "whitespace" (newlines
    the parser drops around the tags); "" when the output is not parsed.
    """
    text: str
    token: int | None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[ToolCallError] = field(default_factory=list)
    raw: str = ""
    logprobs: TokenLogprob | None = None
    error: str = ""             # finish_reason "error": why (a constraint that admits no token)
    stop_sequence: str = ""     # the stop string that ended the generation
    section: str = ""           # "reasoning" | "content" | "tool_call" | "whitespace" | ""


class StopMatcher:
    """Holds back streamed text that could still become one of the stop strings.

    ``push(piece)`` returns ``(safe_text, stopped)``: text that can be shown, and whether a stop
    string completed (then ``safe_text`` ends right before it and the rest is dropped).
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched = ""       # the stop string found, once push() has returned stopped

    def push(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        buf = self.pending + piece
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            pos = min(h[0] for h in hits)
            self.matched = next(s for p, s in hits if p == pos)
            self.pending = ""
            return buf[:pos], True
        # Keep the longest suffix of buf that is a proper prefix of some stop string.
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class GenerationResult:
    """What ``Model.generate_text`` returns: the answer ``text`` (without reasoning and tool
    calls when the output is parsed), the sampled ``tokens``, ``finish_reason``, ``stats``, the
    ``reasoning``, the parsed ``tool_calls`` and malformed ones (``tool_call_errors``), and
    ``raw_text``, the model's whole text before parsing (stop strings removed). A constraint
    that reaches a dead end ends with ``finish_reason`` "error" and the reason in ``error``.
    ``logprobs`` (``generate_text(..., logprobs=True)``): one ``TokenLogprob`` per token of
    ``tokens``, in order; None when logprobs were not asked for."""
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[ToolCallError] = field(default_factory=list)
    raw_text: str = ""
    error: str = ""             # finish_reason "error": why (a constraint that admits no token)
    logprobs: list[TokenLogprob] | None = None
