"""The generation loop behind ``Model.generate``: prompt-cache reuse and prefill, then one token
per step (sampled on the host, or on the device inside the engine's step), detokenized, matched
against stop strings and split by the output parser into ``GenerationChunk`` objects.

Three layers, as mlx-lm's generate.py: ``stream`` yields the chunks (this module),
``Model.generate`` checks the arguments and wraps ``stream`` in ``Guarded`` (the model is released
however iteration ends), ``Model.generate_text`` joins the chunks into a ``GenerationResult``.
``stream`` drives the model's own stepping (``_prefill``, ``_feed``, its history): it is the
model's loop, kept apart from the model's API.
"""
from __future__ import annotations

import secrets
import time
from typing import Iterator

import numpy as np

from .generation import GenerationChunk, GenerationStats, StopMatcher, TokenLogprob
from .parsing import OutputParser
from .sampling import SamplingParams, sample, unpack_mask
from .sampling import logprobs as token_logprobs


class Cancelled(Exception):
    """model.cancel() was called while generate() was prefilling."""


def dead_end(constraint) -> str:
    """The error of a generation whose constraint admits no token (not at an accepting state)."""
    return ("the constraint admits no token here (a dead end: no allowed continuation and not at "
            "an accepting state" + (f"; {constraint.error}" if constraint.error else "") + ")")



def stream(m, ids: list[int], points: list[int], params: SamplingParams,
           max_tokens: int, stops: list[str], parser: OutputParser | None,
           progress=None, lp_top: int = -1, constraint=None) -> Iterator[GenerationChunk]:
    """The chunks of one generation on model ``m`` (``Model.generate`` checked the arguments and
    holds the model; a ``lily_py.Model``): ``ids`` is the prompt, ``points`` where to snapshot the state into the
    prompt cache, ``lp_top`` the top logprobs per token (-1: no logprobs)."""
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    t0 = time.perf_counter()
    cache = m._active_prompt_cache
    reuse = m._reusable_prefix(ids)
    entry = cache.lookup(ids, count=False) if cache is not None else None
    cached = 0
    if entry is not None and len(entry.tokens) > reuse:
        # A snapshot covers more of the prompt than the live state: restore it. (Hybrid
        # state cannot be rolled back, so this is how an earlier conversation, a shared
        # system prompt, or the previous turn before its reply is picked up again.)
        m._backend.restore(entry.state)
        m._history = list(entry.tokens)
        m._last_logits, m._logits_on_device = entry.logits, False
        reuse = cached = len(entry.tokens)
        cache.hits += 1
    else:
        if cache is not None:
            cache.misses += 1
        if reuse == 0 and m._history:
            m._reset()
    # The embedding/lm_head may have more rows than the tokenizer has ids (padding): those
    # ids can never be sampled.
    n_ids = m.tokenizer.vocab_size if m.tokenizer is not None else m.config.vocab_size
    # A constraint's allowed set depends on the previous token. Engine backends sample those
    # generations on the device too (`masked`, below); the reference backend (and an engine
    # with `_device_masks` False) samples each token on the host from the step's logits row
    # with the mask (lily_py.sampling.sample, bit-identical to the device sampler with the
    # same mask), one step at a time.
    device_sampler = getattr(m._backend, "samples_on_device", False)
    masked = device_sampler and constraint is not None and m._device_masks
    on_device = device_sampler and (constraint is None or masked)

    def sample_args(step: int) -> dict:
        return dict(temperature=params.temperature,
                    top_k=min(int(params.top_k), m.config.vocab_size), top_p=params.top_p,
                    min_p=params.min_p, seed=int(seed) & 0xFFFFFFFFFFFFFFFF, step=step,
                    valid_vocab=min(n_ids, m.config.vocab_size), logprobs=lp_top)

    # Engine backends sample the first token on the device, in the command buffer of the
    # prompt's last prefill step (its logits stay on the device). With a constraint the
    # prefill's last step leaves its row on the device unsampled (the prompt cache may still
    # copy it), and a sampler of its own applies the first allowed set.
    first = sample_args(0) if on_device and not masked else None
    first_tok = None
    # prefill_progress: one count over every prefill call below (tokens reused from the
    # state or the prompt cache are not counted).
    start, total = len(m._history), len(ids) - len(m._history)
    if progress is not None:
        user_cb = progress
        progress = lambda done, _n: user_cb(len(m._history) - start, total)  # noqa: E731
    try:
        # Prefill up to each snapshot point in turn and snapshot there (the end of a long
        # system prompt / tool list, the end of the conversation before the generation
        # prompt), then the rest.
        for p in points:
            if len(m._history) < p:
                whole = p == len(ids)
                m._prefill(ids[len(m._history):p], all_logits=False, cancellable=True,
                              sample=first if whole else None, progress=progress,
                              fetch=not masked)
                if whole and first is not None:
                    first_tok = m._backend.last_token
            if cache is not None and len(m._history) == p and tuple(ids[:p]) not in cache:
                snap = m._backend.snapshot()
                cache.insert(ids[:p], snap, m._current_logits(),
                             m._backend.snapshot_nbytes(snap))
        if first_tok is not None:
            logits = None
        elif len(m._history) == len(ids):
            # with a constraint, a row left on the device is sampled there
            on_dev = masked and m._last_logits is None and m._backend.has_last_logits
            logits = None if on_dev else m._current_logits()
        elif first is not None:
            m._prefill(ids[len(m._history):], all_logits=False, cancellable=True,
                          sample=first, progress=progress)
            logits, first_tok = None, m._backend.last_token
        elif masked:
            m._prefill(ids[len(m._history):], all_logits=False, cancellable=True,
                          progress=progress, fetch=False)
            logits = None
        else:
            logits = m._prefill(ids[len(m._history):], all_logits=False,
                                   cancellable=True, progress=progress)
        if m._cancel.is_set():
            raise Cancelled
    except Cancelled:
        yield GenerationChunk("", None, "cancelled", GenerationStats(
            len(ids), reuse, len(ids) - reuse, 0, time.perf_counter() - t0, 0.0,
            m.backend, cached))
        return
    t_prefill = time.perf_counter() - t0
    eos = m._eos_ids()
    detok = m.tokenizer.detokenizer() if m.tokenizer is not None else None
    matcher = StopMatcher(stops)
    t1 = time.perf_counter()

    def stats(n: int) -> GenerationStats:
        return GenerationStats(len(ids), reuse, len(ids) - reuse, n, t_prefill,
                               time.perf_counter() - t1, m.backend, cached)

    lp = None              # this token's TokenLogprob (logprobs requested)

    def chunk(text: str, tok: int | None, finish: str | None = None,
              n: int | None = None) -> GenerationChunk:
        """The chunk for the raw ``text``: split by the parser; on the last chunk
        (``finish``), the parser is flushed and the finish reason becomes "tool_calls" when
        an EOS / stop string ended a generation that called tools."""
        stop = matcher.matched if finish == "stop" else ""
        if parser is None:
            return GenerationChunk(text, tok, finish, None if finish is None else stats(n),
                                   raw=text, logprobs=lp, stop_sequence=stop)
        d = parser.push(text)
        section = parser.section
        if finish is not None:
            d += parser.finish()
            if finish == "stop" and parser.n_tool_calls:
                finish = "tool_calls"
        return GenerationChunk(d.text, tok, finish, None if finish is None else stats(n),
                               d.reasoning, d.tool_calls, d.errors, raw=text, logprobs=lp,
                               stop_sequence=stop, section=section)

    def host_logprob(row: np.ndarray, t: int) -> TokenLogprob:
        valid = min(n_ids, row.shape[-1])
        c, top_ids, top_lps = token_logprobs(row[:valid], t, lp_top)
        return TokenLogprob(t, c, list(zip(top_ids.tolist(), top_lps.tolist())))

    def device_logprob(t: int) -> TokenLogprob:
        c, top_ids, top_lps = m._backend.last_logprobs()
        return TokenLogprob(t, float(c), list(zip(top_ids.tolist(), top_lps.tolist())))

    # Engine backends sample decode steps on the device, inside the step's command buffer
    # (bit-identical to lily_py.sampling.sample), and keep two steps in flight: the step that
    # feeds token n (read from the device slot) is committed before the host waits for the
    # step that samples token n. The first token is sampled on the device too, in the prompt's
    # last prefill step (when the prompt added no token to the state, from the host's logits
    # row by the sampler alone: sample_row).
    # Per token the host copies no logits and builds no array.
    # A token after which generation stops (EOS, stop string) has then usually already been
    # fed; feed_last() feeds it where it was not, so every backend ends with it in `tokens`.
    in_flight = 0          # engine steps submitted and not completed (each feeds `tok`)
    tok = None
    sampling = m._backend.sampling(sample_args(0)) if on_device else None

    def complete(fed: int) -> int | None:
        nonlocal in_flight
        in_flight -= 1
        m._history.append(fed)
        m._last_logits, m._logits_on_device = None, True
        return m._backend.complete_token()

    def drain() -> None:
        # The engine's own count: a KeyboardInterrupt can land between a submit() and our
        # bookkeeping. Each step still in flight fed the token the previous one sampled.
        nonlocal in_flight
        fed = tok
        while getattr(m._backend, "in_flight", 0):
            in_flight = max(in_flight, 1)
            fed = complete(fed)
        in_flight = 0
        if masked:      # a masked sampler leaves -inf in its row: not the model's logits
            m._logits_on_device = bool(m._backend.has_last_logits)

    base = len(m._history)

    def feed_last(n: int) -> None:
        # Generation stopped at token n (EOS / stop string): make it part of the state on
        # every backend (the engine's pipelined step usually fed it already).
        if len(m._history) == base + n and m.position < m.context_length:
            m._feed([tok], all_logits=False)

    try:
        for n in range(max_tokens):
            if n == 0 and masked:
                # Token 0 under the first allowed set; the step that feeds it is committed
                # right behind (from the slot) before the host waits.
                mask0 = None
                if constraint.active:
                    mask0 = constraint.allowed()
                    if constraint.dead_end or not mask0.any():
                        yield GenerationChunk("", None, "error", stats(0), error=dead_end(constraint))
                        return
                room = max_tokens > 1 and m.position + 1 <= m.context_length
                if logits is None:
                    m._backend.submit_sampler(sampling, 0, mask0)
                    if room:
                        m._backend.submit_logits()           # feeds token 0 from the slot
                    tok = m._backend.complete_token()
                else:
                    tok = m._backend.sample_row(logits, sample_args(0), mask=mask0)
                    if room:
                        m._backend.submit_logits(tok)        # feeds token 0 from the host
                in_flight += room
                m._last_logits, m._logits_on_device = None, False
                lp = device_logprob(tok) if lp_top >= 0 else None
            elif n == 0 and first_tok is not None:
                tok = first_tok
                lp = device_logprob(tok) if lp_top >= 0 else None
            elif n == 0 and on_device:
                # the prompt added no token (a prompt-cache hit or the state itself): the
                # logits row is on the host; the device samples it (the sampler alone)
                tok = m._backend.sample_row(logits, sample_args(0))
                lp = device_logprob(tok) if lp_top >= 0 else None
            elif n == 0 or not on_device:
                if n_ids < logits.shape[-1]:
                    logits = logits.copy()
                    logits[n_ids:] = -np.inf
                allowed = None
                if constraint is not None and constraint.active:
                    valid = constraint.valid_vocab
                    words = constraint.allowed()
                    if constraint.dead_end or not words.any():
                        drain()
                        yield GenerationChunk("", None, "error", stats(n), error=dead_end(constraint))
                        return
                    allowed = np.zeros(logits.shape[-1], bool)
                    allowed[:valid] = unpack_mask(words, valid)
                    logits = np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32)
                tok = sample(logits, params, n, seed, allowed=allowed)
                if constraint is not None:
                    if constraint.active:
                        constraint.consume(tok)
                    elif tok == constraint.think_end:
                        constraint.active = True
                lp = host_logprob(logits, tok) if lp_top >= 0 else None
            elif masked:
                # the step that fed token n - 1 and its sampler (submitted last iteration)
                tok = complete(tok)
                lp = device_logprob(tok) if lp_top >= 0 else None
            else:
                if n < max_tokens - 1 and m.position + in_flight + 1 <= m.context_length:
                    m._backend.submit_next(sampling, n + 1)   # feeds token n
                    in_flight += 1
                tok = complete(tok)
                # the record of the step just completed (the step in flight writes the other slot)
                lp = device_logprob(tok) if lp_top >= 0 else None
            if masked:
                if constraint.active:
                    constraint.consume(tok)
                elif tok == constraint.think_end:
                    constraint.active = True
            if tok in eos:
                drain()
                feed_last(n)
                rest = (detok.finalize() if detok else "")
                text, _ = matcher.push(rest)
                yield chunk(text + matcher.flush(), tok, "stop", n + 1)
                return
            piece = detok.add(tok) if detok else ""
            text, stopped = matcher.push(piece)
            if stopped:
                drain()
                feed_last(n)
                yield chunk(text, tok, "stop", n + 1)
                return
            cancelled = m._cancel.is_set()
            if n == max_tokens - 1 or m.position >= m.context_length or cancelled:
                drain()
                rest = detok.finalize() if detok else ""
                more, stopped = matcher.push(rest)
                text += more
                if not stopped:
                    text += matcher.flush()
                why = "stop" if stopped else "cancelled" if cancelled else \
                    "length" if n == max_tokens - 1 else "context_length"
                yield chunk(text, tok, why, n + 1)
                return
            if masked:
                # Constrained: the step that feeds token n (fed from the slot) runs while the
                # host advances the matcher and computes the allowed set of token n + 1; then
                # that step's sampler with the set, and the step that feeds token n + 1, go
                # in behind it (docs/structured.md, "Masks on the device").
                words = None
                if constraint.active:
                    words = constraint.allowed()
                    if constraint.dead_end or not words.any():
                        yield chunk(text, tok)
                        drain()
                        yield GenerationChunk("", None, "error", stats(n + 1),
                                              error=dead_end(constraint))
                        return
                m._backend.submit_sampler(sampling, n + 1, words)
                if n + 1 < max_tokens - 1 and m.position + in_flight + 1 <= m.context_length:
                    m._backend.submit_logits()               # feeds token n + 1 from the slot
                    in_flight += 1
                yield chunk(text, tok)
                continue
            yield chunk(text, tok)
            if on_device and n == 0:
                m._check_room(1)
                if first_tok is not None:
                    m._backend.submit_next(sampling, 1)      # feeds token 0 from the slot
                else:
                    m._backend.submit(tok, sample_args(1))   # feeds token 0 from the host
                in_flight += 1
            elif not on_device:
                logits = m._feed([tok], all_logits=False)
    finally:
        drain()     # closed mid-stream or failed: finish the steps in flight
        m._cancel.clear()
        if not getattr(m._backend, "valid", True):
            m._reset()       # a device error mid-generation: start clean next time


class Guarded:
    """Wraps the generation generator so that the model is released however iteration ends
    (exhausted, closed early, garbage-collected, or an exception)."""

    def __init__(self, gen: Iterator[GenerationChunk], model, prompt_tokens: int):
        self._gen, self._model = gen, model
        self._released = False
        self.prompt_tokens = prompt_tokens      # tokens in the rendered prompt, known at once

    def __iter__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __next__(self) -> GenerationChunk:
        try:
            return next(self._gen)
        except BaseException:
            self._release()
            raise

    def close(self) -> None:
        try:
            self._gen.close()
        finally:
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._model._generating = False

    def __del__(self):
        if not self._released:
            self.close()
