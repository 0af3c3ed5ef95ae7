"""The user-facing model: ``lily_py.load`` and ``Model`` (prefill / decode / reset / generate).

A ``Model`` owns one conversation state (KV cache, DeltaNet state, conv windows) on its backend
and remembers the token ids it has fed, so a new prompt that extends them (the next turn of a
chat) only prefills the new tokens.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .checkpoint import ModelWeights, load_weights
from .config import ModelConfig
from .errors import BusyError, ContextLengthError
from .generation import GenerationChunk, GenerationStats, StopMatcher
from .sampling import SamplingParams, sample
from .backends import BACKENDS, auto_backend, make_backend  # noqa: F401  (BACKENDS: public name)

log = logging.getLogger("lily_py")

DEFAULT_PREFILL_CHUNK = 4096
DEFAULT_ENGINE_CONTEXT = 32768


def load(path_or_repo_id: str | os.PathLike | None = None, *, backend: str = "auto",
         context_length: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
         revision: str | None = None) -> "Model":
    """Load a qwen3_5_moe checkpoint.

    ``path_or_repo_id``: a local folder, a Hugging Face repo id (``org/name``, downloaded through
    huggingface_hub, text weights only), or None for the small demo model shipped with lily_py.
    ``context_length``: maximum tokens in the conversation state (default: the config's
    ``max_position_embeddings``). ``prefill_chunk``: long prompts are prefilled in chunks of
    this many tokens.
    """
    from . import hub
    from .resources import demo_path
    from .tokenizer import Tokenizer

    folder = demo_path() if path_or_repo_id is None else hub.resolve(path_or_repo_id,
                                                                     revision=revision)
    cfg, weights = load_weights(folder)
    tok = Tokenizer.from_dir(folder) if os.path.exists(os.path.join(folder, "tokenizer.json")) \
        else None
    if tok is None:
        log.warning("lily_py: %s has no tokenizer.json; only token-id prompts work", folder)
    return Model(folder, cfg, weights, tok, backend=backend, context_length=context_length,
                 prefill_chunk=prefill_chunk)


@dataclass
class GenerationResult:
    """What ``Model.generate_text`` returns."""
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats


class Model:
    """One model with one conversation state. Not thread-safe for concurrent generation: a
    second ``generate`` while one is running raises ``BusyError``."""

    def __init__(self, path: str, config: ModelConfig, weights: ModelWeights, tokenizer, *,
                 backend: str = "auto", context_length: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if backend == "auto":
            backend = auto_backend()
            log.info("lily_py: backend 'auto' selected %r", backend)
        if context_length is None:
            # Engine backends allocate the KV cache for the whole context up front (5.4 GB of
            # bf16 at the real model's 262,144): default to 32K there; pass more when needed.
            context_length = config.max_position_embeddings if backend == "reference" else \
                min(config.max_position_embeddings, DEFAULT_ENGINE_CONTEXT)
        if not isinstance(context_length, int) or not 1 <= context_length <= \
                config.max_position_embeddings:
            raise ValueError(f"context_length must be an integer in [1, "
                             f"{config.max_position_embeddings}] (the model's "
                             f"max_position_embeddings), got {context_length!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        prefill_chunk = min(prefill_chunk, context_length)   # scratch is sized from it
        self.path = path
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.prefill_chunk = prefill_chunk
        self._backend = make_backend(backend, config, weights, context_length=context_length,
                                      prefill_chunk=prefill_chunk)
        self._history: list[int] = []
        self._last_logits: np.ndarray | None = None
        # Engine backends: the last step's logits are still on the device (fetched on demand by
        # _current_logits(); generation never copies them per token).
        self._logits_on_device = False
        # (prompt ids, backend state, logits) saved right after the last generate() prefill, so
        # the next turn can roll back to it when the reply re-tokenizes differently.
        self._snapshot: tuple[list[int], object, np.ndarray] | None = None
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()   # one explicit prefill/decode/reset at a time
        self._generating = False
        self.prefilled_tokens_total = 0     # tokens run through prefill since load

    # ---- introspection ------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token ids currently in the model's state, in order."""
        return tuple(self._history)

    @property
    def position(self) -> int:
        return len(self._history)

    def stats(self) -> dict | None:
        """Counters of the backend's last step (engine backends: dispatches, barriers,
        bytes_bound, bytes_touched (what the kernels read plus write: routed experts only),
        threads, commits, waits_in_step, host_waits, tokens, encode_ns); None for the
        reference backend or before the first step."""
        return getattr(self._backend, "last_stats", None)

    def __repr__(self) -> str:
        return (f"<lily_py.Model {self.config.summary()}; backend={self.backend}, "
                f"{self.position}/{self.context_length} tokens in state, path={self.path!r}>")

    # ---- explicit stepping --------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int] | np.ndarray, *, all_logits: bool = False
                ) -> np.ndarray:
        """Feed ``token_ids`` after the current state. Returns float32 logits of the last
        position ``[vocab]``, or of every fed position ``[T, vocab]`` with ``all_logits``."""
        with self._exclusive():
            return self._prefill(token_ids, all_logits=all_logits)

    def decode(self, token_id: int) -> np.ndarray:
        """Feed one token; returns the next-token logits ``[vocab]`` (float32)."""
        if isinstance(token_id, (np.integer,)):
            token_id = int(token_id)
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise TypeError(f"decode takes one token id (int), got {type(token_id).__name__}")
        with self._exclusive():
            return self._feed(self._validate_ids([token_id]), all_logits=False)

    def reset(self) -> None:
        """Clear the KV cache, recurrent and conv state."""
        with self._exclusive():
            self._reset()

    @contextlib.contextmanager
    def _exclusive(self):
        """Explicit steps from two threads at once would interleave in one state: refuse."""
        self._check_idle()
        if not self._step_lock.acquire(blocking=False):
            raise BusyError("another thread is running a step on this model; one model runs one "
                            "call at a time")
        try:
            yield
        finally:
            self._step_lock.release()

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompt, *, max_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 stop: Sequence[str] | str | None = None, enable_thinking: bool | None = None,
                 tools: list | None = None) -> Iterator[GenerationChunk]:
        """Stream a completion as ``GenerationChunk`` objects.

        ``prompt``: a string (fed as raw text), a list of chat messages
        (``[{"role": "user", "content": "..."}]``, rendered with the checkpoint's chat template
        and a generation prompt; ``enable_thinking`` and ``tools`` go to the template), or a list
        of token ids. If the prompt extends the tokens already in the state, only the new ones
        are prefilled. Generation ends at an EOS token, a ``stop`` string (not included in the
        text) or ``max_tokens``. Closing the generator early leaves the model usable.
        """
        params = SamplingParams(float(temperature), top_k, float(top_p), float(min_p), seed)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        ids, boundary = self._prompt_ids(prompt, enable_thinking=enable_thinking, tools=tools)
        with self._lock:
            if self._generating:
                raise BusyError("this model is already generating; finish or close the other "
                                "generator first (g.close(), or `with model.generate(...) as g:`); "
                                "one model runs one generation at a time")
            self._generating = True
        try:
            gen = self._generate(ids, boundary, params, max_tokens, stops)
        except BaseException:
            self._generating = False
            raise
        return _Guarded(gen, self)

    def generate_text(self, prompt, **kwargs) -> GenerationResult:
        """Non-streaming ``generate``: the whole text, sampled tokens, finish reason, stats."""
        parts, tokens, last = [], [], None
        for chunk in self.generate(prompt, **kwargs):
            parts.append(chunk.text)
            if chunk.token is not None:
                tokens.append(chunk.token)
            last = chunk
        return GenerationResult("".join(parts), tokens, last.finish_reason, last.stats)

    def _generate(self, ids: list[int], boundary: int, params: SamplingParams, max_tokens: int,
                  stops: list[str]) -> Iterator[GenerationChunk]:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        t0 = time.perf_counter()
        reuse = self._reusable_prefix(ids)
        snap = self._snapshot
        if reuse == 0 and snap is not None and ids[:len(snap[0])] == snap[0]:
            # The prompt extends an earlier conversation but not the tokens generated after it
            # (the next chat turn renders or tokenizes the reply differently): roll back.
            self._restore_snapshot()
            reuse = len(self._history)
        elif reuse == 0 and self._history:
            self._reset()
        # The embedding/lm_head may have more rows than the tokenizer has ids (padding): those
        # ids can never be sampled.
        n_ids = self.tokenizer.vocab_size if self.tokenizer is not None else self.config.vocab_size
        on_device = getattr(self._backend, "samples_on_device", False)

        def sample_args(step: int) -> dict:
            return dict(temperature=params.temperature,
                        top_k=min(int(params.top_k), self.config.vocab_size), top_p=params.top_p,
                        min_p=params.min_p, seed=int(seed) & 0xFFFFFFFFFFFFFFFF, step=step,
                        valid_vocab=min(n_ids, self.config.vocab_size))

        # Engine backends sample the first token on the device, in the command buffer of the
        # prompt's last prefill step (its logits stay on the device).
        first = sample_args(0) if on_device else None
        first_tok = None
        # Keep a snapshot at the end of the conversation proper (before the generation prompt
        # of a chat; the whole prompt otherwise): the next turn starts with exactly these tokens.
        if len(self._history) < boundary:
            whole = boundary == len(ids)
            self._prefill(ids[len(self._history):boundary], all_logits=False,
                          sample=first if whole else None)
            if whole and first is not None:
                first_tok = self._backend.last_token
        if len(self._history) == boundary and not (snap is not None and snap[0] == ids[:boundary]
                                                   and self._snapshot is snap):
            self._snapshot = (list(self._history), self._backend.snapshot(), self._current_logits())
        if first_tok is not None:
            logits = None
        elif len(self._history) == len(ids):
            logits = self._current_logits()
        elif first is not None:
            self._prefill(ids[len(self._history):], all_logits=False, sample=first)
            logits, first_tok = None, self._backend.last_token
        else:
            logits = self._prefill(ids[len(self._history):], all_logits=False)
        t_prefill = time.perf_counter() - t0
        eos = self._eos_ids()
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        matcher = StopMatcher(stops)
        t1 = time.perf_counter()

        def stats(n: int) -> GenerationStats:
            return GenerationStats(len(ids), reuse, len(ids) - reuse, n, t_prefill,
                                   time.perf_counter() - t1, self.backend)

        # Engine backends sample decode steps on the device, inside the step's command buffer
        # (bit-identical to lily_py.sampling.sample), and keep two steps in flight: the step that
        # feeds token n (read from the device slot) is committed before the host waits for the
        # step that samples token n. The first token is sampled on the device too, in the prompt's
        # last prefill step (on the host only when the prompt added no token to the state).
        # Per token the host copies no logits and builds no array.
        # A token after which generation stops (EOS, stop string) has then already been fed: it
        # is in `tokens`, unlike with the reference backend.
        in_flight = 0          # engine steps submitted and not completed (each feeds `tok`)
        tok = None
        sampling = self._backend.sampling(sample_args(0)) if on_device else None

        def complete(fed: int) -> int | None:
            nonlocal in_flight
            in_flight -= 1
            self._history.append(fed)
            self._last_logits, self._logits_on_device = None, True
            return self._backend.complete_token()

        def drain() -> None:
            # The engine's own count: a KeyboardInterrupt can land between a submit() and our
            # bookkeeping. Each step still in flight fed the token the previous one sampled.
            nonlocal in_flight
            fed = tok
            while getattr(self._backend, "in_flight", 0):
                in_flight = max(in_flight, 1)
                fed = complete(fed)
            in_flight = 0

        try:
            for n in range(max_tokens):
                if n == 0 and first_tok is not None:
                    tok = first_tok
                elif n == 0 or not on_device:
                    if n_ids < logits.shape[-1]:
                        logits = logits.copy()
                        logits[n_ids:] = -np.inf
                    tok = sample(logits, params, n, seed)
                else:
                    if n < max_tokens - 1 and self.position + in_flight + 1 <= self.context_length:
                        self._backend.submit_next(sampling, n + 1)   # feeds token n
                        in_flight += 1
                    tok = complete(tok)
                if tok in eos:
                    drain()
                    rest = (detok.finalize() if detok else "")
                    text, _ = matcher.push(rest)
                    yield GenerationChunk(text + matcher.flush(), tok, "stop", stats(n + 1))
                    return
                piece = detok.add(tok) if detok else ""
                text, stopped = matcher.push(piece)
                if stopped:
                    drain()
                    yield GenerationChunk(text, tok, "stop", stats(n + 1))
                    return
                if n == max_tokens - 1 or self.position >= self.context_length:
                    drain()
                    rest = detok.finalize() if detok else ""
                    more, stopped = matcher.push(rest)
                    text += more
                    if not stopped:
                        text += matcher.flush()
                    yield GenerationChunk(text, tok, "stop" if stopped else "length", stats(n + 1))
                    return
                yield GenerationChunk(text, tok)
                if on_device and n == 0:
                    self._check_room(1)
                    if first_tok is not None:
                        self._backend.submit_next(sampling, 1)      # feeds token 0 from the slot
                    else:
                        self._backend.submit(tok, sample_args(1))   # feeds token 0 from the host
                    in_flight += 1
                elif not on_device:
                    logits = self._feed([tok], all_logits=False)
        finally:
            drain()     # closed mid-stream or failed: finish the steps in flight
            if not getattr(self._backend, "valid", True):
                self._reset()       # a device error mid-generation: start clean next time

    # ---- internals ----------------------------------------------------------------------------
    def _check_idle(self) -> None:
        if self._generating:
            raise BusyError("the model is generating; close the generator before calling "
                            "prefill/decode/reset")

    def _reset(self) -> None:
        self._backend.reset()
        self._history.clear()
        self._last_logits = None
        self._logits_on_device = False
        self._snapshot = None

    def _current_logits(self) -> np.ndarray | None:
        """Logits of the last fed position (from the device when the last step left them there)."""
        if self._last_logits is None and self._logits_on_device:
            self._logits_on_device = False
            self._last_logits = self._backend.last_logits()
        return self._last_logits

    def _restore_snapshot(self) -> None:
        history, state, logits = self._snapshot
        self._backend.restore(state)
        self._history = list(history)
        self._last_logits = logits
        self._logits_on_device = False

    def _eos_ids(self) -> frozenset[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return frozenset(self.tokenizer.eos_token_ids)
        return frozenset(self.config.eos_token_id)

    def _reusable_prefix(self, ids: list[int]) -> int:
        h = self._history
        if h and len(ids) >= len(h) and ids[:len(h)] == h:
            if len(ids) > len(h) or self._last_logits is not None or self._logits_on_device:
                return len(h)
        return 0

    def _prompt_ids(self, prompt, *, enable_thinking, tools) -> tuple[list[int], int]:
        """Token ids of the prompt, and where the conversation proper ends in them (before the
        generation prompt of a chat; the whole prompt otherwise)."""
        boundary = None
        if isinstance(prompt, str):
            ids = self._require_tokenizer().encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and not isinstance(
                prompt[0], (int, float, np.number, list, tuple, np.ndarray)):
            tok = self._require_tokenizer()
            kw = dict(enable_thinking=enable_thinking, tools=tools)
            ids = tok.encode(tok.apply_chat_template(list(prompt), add_generation_prompt=True, **kw))
            head = tok.encode(tok.apply_chat_template(list(prompt), add_generation_prompt=False, **kw))
            if head == ids[:len(head)]:
                boundary = len(head)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = self._validate_ids(prompt) if len(prompt) else []
        else:
            raise TypeError("prompt must be a string, a list of chat messages (dicts with 'role' "
                            f"and 'content') or a list of token ids; got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty (no tokens to feed)")
        ids = self._validate_ids(ids)
        if len(ids) > self.context_length:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens; the context length is "
                                     f"{self.context_length}")
        return ids, len(ids) if boundary is None else boundary

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer

    def _validate_ids(self, token_ids) -> list[int]:
        arr = np.asarray(token_ids)
        if arr.dtype == np.bool_:
            raise TypeError("token ids must be integers, got booleans")
        if arr.ndim != 1:
            raise ValueError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.config.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"token id {int(arr[i])} at index {i} is outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        return [int(t) for t in arr]

    def _prefill(self, token_ids, *, all_logits: bool, sample: dict | None = None
                 ) -> np.ndarray | None:
        ids = self._validate_ids(token_ids)
        if not ids:
            raise ValueError("prefill needs at least one token id")
        self._check_room(len(ids))
        out = []
        for s in range(0, len(ids), self.prefill_chunk):
            chunk = ids[s:s + self.prefill_chunk]
            last = s + self.prefill_chunk >= len(ids)
            logits = self._feed(chunk, all_logits=all_logits, logits=last or all_logits,
                                sample=sample if last else None)
            if all_logits:
                out.append(logits)
            elif last:
                out.append(logits)
            self.prefilled_tokens_total += len(chunk)
        return np.concatenate(out) if all_logits else out[-1]

    def _check_room(self, n: int) -> None:
        if self.position + n > self.context_length:
            raise ContextLengthError(
                f"feeding {n} tokens after {self.position} would exceed the context "
                f"length {self.context_length}; call reset() or load with a larger context_length")

    def _feed_guarded(self, call, ids: list[int]):
        """Run one backend step feeding ``ids``, keeping ``_history`` equal to the backend's
        state however the call ends: an interrupt that lands after the step finished still
        records the tokens; a device failure that left the state invalid resets the model."""
        before, hist = self._backend.position, len(self._history)
        try:
            out = call()
            self._history.extend(ids)
            return out
        except BaseException:
            if not getattr(self._backend, "valid", True):
                self._reset()
            elif self._backend.position == before + len(ids) and len(self._history) == hist:
                self._history.extend(ids)
                self._last_logits = None
            elif self._backend.position != before + len(self._history) - hist:
                self._reset()
            raise

    def _feed(self, ids: list[int], *, all_logits: bool, sample: dict | None = None,
              logits: bool = True) -> np.ndarray | None:
        """Feed ids to the backend. ``logits=False`` (a prefill chunk that is not the last) lets
        engine backends skip the final norm and lm_head; returns None then. ``sample`` (engine
        backends): also sample the last position on the device (``backend.last_token``); the
        logits stay on the device and None is returned."""
        self._check_room(len(ids))
        arr = np.asarray(ids, dtype=np.int64)
        kw = {}
        if sample is not None:
            kw["sample"] = sample
            kw["fetch"] = False
        if not logits and getattr(self._backend, "skips_logits", False):
            kw["logits"] = False
        logits = self._feed_guarded(
            lambda: self._backend.forward(arr, all_logits=all_logits, **kw), ids)
        if logits is None:
            self._last_logits = None
            self._logits_on_device = sample is not None
            return None
        self._logits_on_device = False
        if getattr(self._backend, "keeps_logits", False):
            # Engine backends: `logits` is a fresh array the caller owns; the device still holds
            # the last row (_current_logits() copies it when needed).
            self._last_logits, self._logits_on_device = None, True
            return logits
        # Our own copy: callers may edit what they get back (e.g. a repetition penalty).
        self._last_logits = (logits[-1] if all_logits else logits).copy()
        return logits


class _Guarded:
    """Wraps the generation generator so that the model is released however iteration ends
    (exhausted, closed early, garbage-collected, or an exception)."""

    def __init__(self, gen: Iterator[GenerationChunk], model: Model):
        self._gen, self._model = gen, model
        self._released = False

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
