"""The user-facing model: ``lily_py.load`` and ``Model`` (prefill / decode / reset / generate).

A ``Model`` owns one conversation state (KV cache, DeltaNet state, conv windows) on its backend
and remembers the token ids it has fed, so a new prompt that extends them (the next turn of a
chat) only prefills the new tokens.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import secrets
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .checkpoint import ModelWeights, load_weights
from .config import ModelConfig
from .errors import BusyError, ContextLengthError
from .generation import GenerationChunk, GenerationStats, StopMatcher, TokenLogprob
from .parsing import OutputParser, ToolCall, ToolCallError, prompt_opens_reasoning
from .prompt_cache import DEFAULT_PROMPT_CACHE_BYTES, PromptCache
from .progress import ProgressCallback  # noqa: F401  (annotations)
from .sampling import MAX_LOGPROBS, SamplingParams, sample, unpack_mask
from .sampling import logprobs as token_logprobs
from .backends import BACKENDS, auto_backend, built_with_metal, make_backend, resolve_auto, resolve_kv_dtype  # noqa: F401  (BACKENDS, auto_backend: public names)

log = logging.getLogger("lily_py")

DEFAULT_PREFILL_CHUNK = 4096
DEFAULT_CONTEXT = 32768        # the context `lily-py info` sizes its memory line for
DEFAULT_ENGINE_CONTEXT = DEFAULT_CONTEXT      # old name
DEFAULT_MAX_TOKENS = 256       # generate()'s and the CLI's --max-tokens default
# A system prompt / tool list at least this long gets its own prompt-cache snapshot.
SYSTEM_SNAPSHOT_MIN_TOKENS = 128
_ROLES = ("system", "user", "assistant", "tool")


class _Cancelled(Exception):
    """model.cancel() was called while generate() was prefilling."""


def load(path_or_repo_id: str | os.PathLike | None = None, *, backend: str = "auto",
         context_length: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
         revision: str | None = None, verbose: bool | None = None,
         prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES, activations: str | None = None,
         weights: str = "auto", kv_block_tokens: int | None = None, kv_dtype: str | None = None) -> "Model":
    """Load a qwen3_5_moe checkpoint.

    ``path_or_repo_id``: a local folder, a Hugging Face repo id (``org/name``, downloaded through
    huggingface_hub, text weights only), or None for the small demo model shipped with lily_py.
    ``context_length``: maximum tokens in the conversation state, on every backend (default: the
    config's ``max_position_embeddings``, 262,144 for Qwen3.6-35B-A3B; engine backends allocate
    the KV cache in blocks as the conversation grows, docs/memory.md). ``prefill_chunk``: long prompts are
    prefilled in chunks of this many tokens. ``prompt_cache_bytes``: budget of the prompt cache
    (state snapshots reused across ``generate`` calls, default 1 GiB; 0 turns it off).
    ``verbose``: show progress (bytes and shards) on stderr while engine backends read and upload
    the weights; None (default) = only when stderr is a terminal. ``activations``: the engine
    backends' activation dtype, ``"bfloat16"`` or ``"float32"``; None (default): the checkpoint's
    (its scales' dtype), as MLX computes it. Accumulation, the DeltaNet state and the logits are
    float32 either way (docs/kernels.md, activation dtypes). ``weights``: how engine backends
    get the weights: ``"auto"`` (default) binds every tensor it can at its offset in the mapped
    checkpoint files (zero copy: Metal and the emulator; the rest is copied), ``"copy"`` copies
    every tensor into device buffers, ``"map"`` is ``"auto"`` that fails when nothing can be mapped
    (docs/tools.md, zero copy). ``kv_block_tokens``: tokens per KV cache block on engine backends
    (a power of two >= 32; None: 1024, docs/memory.md); tests pick small blocks. ``kv_dtype``: the
    KV cache's element type, ``"int8"`` (symmetric int8 with a float32 scale per row and KV head:
    about half the cache's bytes, docs/memory.md; head_dim 64, 128 or 256), ``"float32"`` (K and V
    unrounded, twice the bytes: with ``activations="float32"`` the engine computes what the float32
    reference does) or ``"bfloat16"``; None (default): bfloat16, the model's precision, as mlx-lm
    and llama.cpp keep theirs. The reference backend quantizes its cache as the int8 option does
    and otherwise keeps float32 rows.
    """
    from . import hub
    from .resources import demo_path
    from .tokenizer import Tokenizer

    folder = demo_path() if path_or_repo_id is None else hub.resolve(path_or_repo_id,
                                                                     revision=revision)
    cfg, weights_ = load_weights(folder)
    tok = Tokenizer.from_dir(folder) if os.path.exists(os.path.join(folder, "tokenizer.json")) \
        else None
    if tok is None:
        log.warning("lily_py: %s has no tokenizer.json; only token-id prompts work", folder)
    return Model(folder, cfg, weights_, tok, backend=backend, context_length=context_length,
                 prefill_chunk=prefill_chunk, prompt_cache_bytes=prompt_cache_bytes, verbose=verbose,
                 activations=activations, weights_mode=weights, kv_block_tokens=kv_block_tokens,
                 kv_dtype=kv_dtype)


@dataclass
class GenerationResult:
    """What ``Model.generate_text`` returns: the answer ``text`` (without reasoning and tool
    calls when the output is parsed), the sampled ``tokens``, ``finish_reason``, ``stats``, the
    ``reasoning``, the parsed ``tool_calls`` and malformed ones (``tool_call_errors``), and
    ``raw_text``, the model's whole text before parsing (stop strings removed). A constraint
    that reaches a dead end ends with ``finish_reason`` "error" and the reason in ``error``."""
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[ToolCallError] = field(default_factory=list)
    raw_text: str = ""
    error: str = ""             # finish_reason "error": why (a constraint that admits no token)


class Model:
    """One model with one conversation state. Not thread-safe for concurrent generation: a
    second ``generate`` while one is running raises ``BusyError``."""

    def __init__(self, path: str, config: ModelConfig, weights: ModelWeights, tokenizer, *,
                 backend: str = "auto", context_length: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES, verbose: bool | None = None,
                 activations: str | None = None, weights_mode: str = "auto",
                 kv_block_tokens: int | None = None, kv_dtype: str | None = None):
        if backend == "auto":
            backend, why = resolve_auto()
            log.info("lily_py: backend 'auto' selected %r", backend)
            if why is not None and built_with_metal():
                # A Mac build whose GPU path is unusable: say so once, then run on the reference.
                warnings.warn(f"lily_py: backend='auto' runs on 'reference' (slow): the Metal device "
                              f"is not usable: {why}", RuntimeWarning, stacklevel=3)
        if context_length is None:
            # One default for every backend: the model's whole context. Engine backends take KV
            # cache blocks as positions advance (docs/memory.md), not the whole context at load.
            context_length = config.max_position_embeddings
        if not isinstance(context_length, int) or not 1 <= context_length <= \
                config.max_position_embeddings:
            raise ValueError(f"context_length must be an integer in [1, "
                             f"{config.max_position_embeddings}] (the model's "
                             f"max_position_embeddings), got {context_length!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        prefill_chunk = min(prefill_chunk, context_length)   # scratch is sized from it
        kv_dtype = resolve_kv_dtype(config, kv_dtype)
        self.path = path
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.prefill_chunk = prefill_chunk
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self._backend = make_backend(backend, config, weights, context_length=context_length,
                                      prefill_chunk=prefill_chunk, verbose=verbose, activations=activations,
                                      weights_mode=weights_mode, kv_block_tokens=kv_block_tokens,
                                      kv_dtype=kv_dtype)
        self.kv_dtype = kv_dtype
        self._history: list[int] = []
        self._last_logits: np.ndarray | None = None
        # Engine backends: the last step's logits are still on the device (fetched on demand by
        # _current_logits(); generation never copies them per token).
        self._logits_on_device = False
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()   # one explicit prefill/decode/reset at a time
        self._generating = False
        # Engine backends apply a constraint's token mask in the device sampler (False: sample
        # constrained tokens on the host from a copied logits row, one step at a time).
        self._device_masks = True
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
        threads, commits, waits_in_step, host_waits, tokens, encode_ns) and of the load
        (engine backends, also before the first step: load_s, weights_mode, weight_bytes,
        weights_mapped_bytes (served from the checkpoint's pages), weights_copied_bytes,
        mapped_file_bytes, resident_bytes (copied weights, state and scratch at load)) and of the
        KV cache now (engine backends: kv_bytes allocated, kv_bytes_in_use by the positions so
        far; docs/memory.md); None for the reference backend."""
        st = getattr(self._backend, "last_stats", None)
        load = getattr(self._backend, "load_stats", None)
        if load is None:
            return st
        return {**(st or {}), **load, **getattr(self._backend, "kv_stats", {})}

    def __repr__(self) -> str:
        return (f"<lily_py.Model {self.config.summary()}; backend={self.backend}, "
                f"{self.position}/{self.context_length} tokens in state, path={self.path!r}>")

    # ---- explicit stepping --------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int] | np.ndarray, *, all_logits: bool = False,
                progress: "ProgressCallback | None" = None) -> np.ndarray:
        """Feed ``token_ids`` after the current state. Returns float32 logits of the last
        position ``[vocab]``, or of every fed position ``[T, vocab]`` with ``all_logits``.

        ``progress(done_tokens, total_tokens)`` is called after each prefill chunk (of
        ``prefill_chunk`` tokens), ending with ``done_tokens == total_tokens``. An exception it
        raises stops the prefill after that chunk; the chunks already fed stay in the state."""
        with self._exclusive():
            return self._prefill(token_ids, all_logits=all_logits, progress=progress)

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
    def generate(self, prompt, *, max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 stop: Sequence[str] | str | None = None, enable_thinking: bool | None = None,
                 tools: list | None = None, chat_template_kwargs: dict | None = None,
                 parse_output: bool | None = None,
                 prefill_progress: "ProgressCallback | None" = None, logprobs: bool = False,
                 top_logprobs: int = 0, response_format: dict | None = None,
                 tool_choice: str | dict | None = None,
                 parallel_tool_calls: bool = True) -> Iterator[GenerationChunk]:
        """Stream a completion as ``GenerationChunk`` objects.

        ``prompt``: a string (fed as raw text), a list of chat messages
        (``[{"role": "user", "content": "..."}]``, rendered with the checkpoint's chat template
        and a generation prompt; ``enable_thinking``, ``tools`` and every key of
        ``chat_template_kwargs`` go to the template unchanged), or a list of token ids.

        The output of a chat prompt is parsed (``parse_output=None``; True/False forces it):
        ``chunk.reasoning`` carries the text inside ``<think>...</think>``, ``chunk.text`` the
        answer, and ``chunk.tool_calls`` the tool calls (``ToolCall``, arguments as JSON typed
        by the ``tools`` schemas) on the chunk that completes them; malformed calls arrive as
        ``chunk.tool_call_errors``. Unparsed, everything is in ``chunk.text``.

        The longest prefix of the prompt already in the state or in the prompt cache is not
        prefilled again (``chunk.stats.reused_tokens``, ``cached_tokens``). Generation ends at an
        EOS token or a ``stop`` string (not included in the text; finish_reason "stop", or
        "tool_calls" after a tool call), ``max_tokens`` ("length"), a full context
        ("context_length") or ``cancel()`` ("cancelled"). Closing the generator early leaves the
        model usable.
        ``prefill_progress(done_tokens, total_tokens)``: called after each chunk of the prompt's
        prefill (tokens reused from the state or the prompt cache are not counted), as
        ``Model.prefill``'s ``progress``.
        ``logprobs=True``: every chunk that carries a token also carries ``chunk.logprobs``
        (``TokenLogprob``: the token's log-probability and the ``top_logprobs`` (0..20) most
        likely tokens), from the model's distribution ``log_softmax(logits)`` before temperature
        and filters; engine backends compute them on the device (docs/structured.md).
        ``response_format``: constrain the answer (after ``</think>`` when the prompt opens
        reasoning) to ``{"type": "json_schema", "json_schema": {"schema": ...}}``,
        ``{"type": "json_object"}``, ``{"type": "regex", "regex": ...}``, ``{"type": "grammar",
        "grammar": <Lark>}`` or ``{"type": "choice", "choices": [...]}`` (llguidance, the
        ``structured`` extra). A bad schema / grammar raises ValueError with the compiler's
        message; a constraint that admits no token ends with finish_reason "error".
        ``tool_choice``: "auto" (the default, None: the model decides), "none" (no tool call: the
        tools are not given to the template), "required" (one or more calls of the ``tools``) or
        ``{"type": "function", "function": {"name": N}}`` (exactly one call of N). The last two
        constrain the answer (after ``</think>``, as ``response_format``) to well-formed Qwen3.6
        tool calls whose arguments match the tool's parameter schema (llguidance).
        ``parallel_tool_calls=False``: "required" forces exactly one call.
        The generator's ``prompt_tokens`` is the prompt's length in tokens, known before the
        first chunk (the prompt is rendered and tokenized by this call; prefill starts at the
        first ``next``).
        """
        if not isinstance(logprobs, bool):
            raise TypeError(f"logprobs must be True or False, got {logprobs!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) \
                or not 0 <= top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top_logprobs!r}")
        if top_logprobs and not logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        constraint = None
        forced = tool_choice not in (None, "auto", "none")
        if tool_choice == "none":
            tools = None
        if forced and response_format is not None:
            raise ValueError("give response_format or a forcing tool_choice ('required' / a named "
                             "function), not both")
        if response_format is not None or forced:
            from .constraints import Constraint, tool_call_grammar
            tk = self._require_tokenizer()
            lark = tool_call_grammar(tools, tool_choice, tk, parallel=parallel_tool_calls) \
                if forced else None
            constraint = Constraint(response_format, tk, min(self._eos_ids()),
                                    min(tk.vocab_size, self.config.vocab_size), lark=lark,
                                    what="tool_choice" if forced else "response_format")
        params = SamplingParams(_real("temperature", temperature), top_k, _real("top_p", top_p),
                                _real("min_p", min_p), seed)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(stop, str):
            stops = [stop]
        elif stop is None:
            stops = []
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError("chat_template_kwargs must be a dict of template variables, got "
                            f"{type(chat_template_kwargs).__name__}")
        ids, points, text = self._prompt(prompt, enable_thinking=enable_thinking, tools=tools,
                                         chat_template_kwargs=chat_template_kwargs)
        chat = text is not None and not isinstance(prompt, str)
        parser = None
        if parse_output or (parse_output is None and chat):
            if text is None:
                text = self._require_tokenizer().decode(ids[-16:])
            parser = OutputParser(reasoning=prompt_opens_reasoning(text), tools=tools)
        if constraint is not None:
            if text is None:
                text = self._require_tokenizer().decode(ids[-16:])
            constraint.think_end = self.tokenizer.token_to_id("</think>")
            constraint.active = not (chat and prompt_opens_reasoning(text))
        with self._lock:
            if self._generating:
                raise BusyError("this model is already generating; finish or close the other "
                                "generator first (g.close(), or `with model.generate(...) as g:`); "
                                "one model runs one generation at a time")
            self._generating = True
            self._cancel.clear()
        try:
            gen = self._generate(ids, points, params, max_tokens, stops, parser, prefill_progress,
                                 top_logprobs if logprobs else -1, constraint)
        except BaseException:
            self._generating = False
            raise
        return _Guarded(gen, self, len(ids))

    def cancel(self) -> None:
        """Stop the running generation from any thread: it ends at the next token (or between
        prefill chunks) with a last chunk whose finish_reason is "cancelled". No effect when
        nothing is generating."""
        with self._lock:
            if self._generating:
                self._cancel.set()

    def prompt_ids(self, prompt, *, enable_thinking: bool | None = None, tools: list | None = None,
                   chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids ``generate`` feeds for ``prompt`` (rendered with the chat template for a
        list of messages). Raises like ``generate`` (ContextLengthError, ChatTemplateError...)."""
        return self._prompt(prompt, enable_thinking=enable_thinking, tools=tools,
                            chat_template_kwargs=chat_template_kwargs)[0]

    def generate_text(self, prompt, **kwargs) -> GenerationResult:
        """Non-streaming ``generate``: the answer text, sampled tokens, finish reason, stats,
        reasoning, tool calls (see ``GenerationResult``)."""
        parts, reasoning, raw, tokens, calls, errors, last = [], [], [], [], [], [], None
        for chunk in self.generate(prompt, **kwargs):
            parts.append(chunk.text)
            reasoning.append(chunk.reasoning)
            raw.append(chunk.raw)
            calls += chunk.tool_calls
            errors += chunk.tool_call_errors
            if chunk.token is not None:
                tokens.append(chunk.token)
            last = chunk
        return GenerationResult("".join(parts), tokens, last.finish_reason, last.stats,
                                "".join(reasoning), calls, errors, "".join(raw),
                                getattr(last, "error", ""))

    def _generate(self, ids: list[int], points: list[int], params: SamplingParams,
                  max_tokens: int, stops: list[str], parser: OutputParser | None,
                  progress=None, lp_top: int = -1, constraint=None) -> Iterator[GenerationChunk]:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        t0 = time.perf_counter()
        cache = self.prompt_cache if self.prompt_cache.max_bytes > 0 else None
        reuse = self._reusable_prefix(ids)
        entry = cache.lookup(ids, count=False) if cache is not None else None
        cached = 0
        if entry is not None and len(entry.tokens) > reuse:
            # A snapshot covers more of the prompt than the live state: restore it. (Hybrid
            # state cannot be rolled back, so this is how an earlier conversation, a shared
            # system prompt, or the previous turn before its reply is picked up again.)
            self._backend.restore(entry.state)
            self._history = list(entry.tokens)
            self._last_logits, self._logits_on_device = entry.logits, False
            reuse = cached = len(entry.tokens)
            cache.hits += 1
        else:
            if cache is not None:
                cache.misses += 1
            if reuse == 0 and self._history:
                self._reset()
        # The embedding/lm_head may have more rows than the tokenizer has ids (padding): those
        # ids can never be sampled.
        n_ids = self.tokenizer.vocab_size if self.tokenizer is not None else self.config.vocab_size
        # A constraint's allowed set depends on the previous token. Engine backends sample those
        # generations on the device too (`masked`, below); the reference backend (and an engine
        # with `_device_masks` False) samples each token on the host from the step's logits row
        # with the mask (lily_py.sampling.sample, bit-identical to the device sampler with the
        # same mask), one step at a time.
        device_sampler = getattr(self._backend, "samples_on_device", False)
        masked = device_sampler and constraint is not None and self._device_masks
        on_device = device_sampler and (constraint is None or masked)

        def sample_args(step: int) -> dict:
            return dict(temperature=params.temperature,
                        top_k=min(int(params.top_k), self.config.vocab_size), top_p=params.top_p,
                        min_p=params.min_p, seed=int(seed) & 0xFFFFFFFFFFFFFFFF, step=step,
                        valid_vocab=min(n_ids, self.config.vocab_size), logprobs=lp_top)

        # Engine backends sample the first token on the device, in the command buffer of the
        # prompt's last prefill step (its logits stay on the device). With a constraint the
        # prefill's last step leaves its row on the device unsampled (the prompt cache may still
        # copy it), and a sampler of its own applies the first allowed set.
        first = sample_args(0) if on_device and not masked else None
        first_tok = None
        # prefill_progress: one count over every prefill call below (tokens reused from the
        # state or the prompt cache are not counted).
        start, total = len(self._history), len(ids) - len(self._history)
        if progress is not None:
            user_cb = progress
            progress = lambda done, _n: user_cb(len(self._history) - start, total)  # noqa: E731
        try:
            # Prefill up to each snapshot point in turn and snapshot there (the end of a long
            # system prompt / tool list, the end of the conversation before the generation
            # prompt), then the rest.
            for p in points:
                if len(self._history) < p:
                    whole = p == len(ids)
                    self._prefill(ids[len(self._history):p], all_logits=False, cancellable=True,
                                  sample=first if whole else None, progress=progress,
                                  fetch=not masked)
                    if whole and first is not None:
                        first_tok = self._backend.last_token
                if cache is not None and len(self._history) == p and tuple(ids[:p]) not in cache:
                    snap = self._backend.snapshot()
                    cache.insert(ids[:p], snap, self._current_logits(),
                                 self._backend.snapshot_nbytes(snap))
            if first_tok is not None:
                logits = None
            elif len(self._history) == len(ids):
                # with a constraint, a row left on the device is sampled there
                on_dev = masked and self._last_logits is None and self._backend.has_last_logits
                logits = None if on_dev else self._current_logits()
            elif first is not None:
                self._prefill(ids[len(self._history):], all_logits=False, cancellable=True,
                              sample=first, progress=progress)
                logits, first_tok = None, self._backend.last_token
            elif masked:
                self._prefill(ids[len(self._history):], all_logits=False, cancellable=True,
                              progress=progress, fetch=False)
                logits = None
            else:
                logits = self._prefill(ids[len(self._history):], all_logits=False,
                                       cancellable=True, progress=progress)
            if self._cancel.is_set():
                raise _Cancelled
        except _Cancelled:
            yield GenerationChunk("", None, "cancelled", GenerationStats(
                len(ids), reuse, len(ids) - reuse, 0, time.perf_counter() - t0, 0.0,
                self.backend, cached))
            return
        t_prefill = time.perf_counter() - t0
        eos = self._eos_ids()
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        matcher = StopMatcher(stops)
        t1 = time.perf_counter()

        def stats(n: int) -> GenerationStats:
            return GenerationStats(len(ids), reuse, len(ids) - reuse, n, t_prefill,
                                   time.perf_counter() - t1, self.backend, cached)

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
            c, top_ids, top_lps = self._backend.last_logprobs()
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
            if masked:      # a masked sampler leaves -inf in its row: not the model's logits
                self._logits_on_device = bool(self._backend.has_last_logits)

        base = len(self._history)

        def feed_last(n: int) -> None:
            # Generation stopped at token n (EOS / stop string): make it part of the state on
            # every backend (the engine's pipelined step usually fed it already).
            if len(self._history) == base + n and self.position < self.context_length:
                self._feed([tok], all_logits=False)

        try:
            for n in range(max_tokens):
                if n == 0 and masked:
                    # Token 0 under the first allowed set; the step that feeds it is committed
                    # right behind (from the slot) before the host waits.
                    mask0 = None
                    if constraint.active:
                        mask0 = constraint.allowed()
                        if constraint.dead_end or not mask0.any():
                            yield GenerationChunk("", None, "error", stats(0), error=_dead_end(constraint))
                            return
                    room = max_tokens > 1 and self.position + 1 <= self.context_length
                    if logits is None:
                        self._backend.submit_sampler(sampling, 0, mask0)
                        if room:
                            self._backend.submit_logits()           # feeds token 0 from the slot
                        tok = self._backend.complete_token()
                    else:
                        tok = self._backend.sample_row(logits, sample_args(0), mask=mask0)
                        if room:
                            self._backend.submit_logits(tok)        # feeds token 0 from the host
                    in_flight += room
                    self._last_logits, self._logits_on_device = None, False
                    lp = device_logprob(tok) if lp_top >= 0 else None
                elif n == 0 and first_tok is not None:
                    tok = first_tok
                    lp = device_logprob(tok) if lp_top >= 0 else None
                elif n == 0 and on_device:
                    # the prompt added no token (a prompt-cache hit or the state itself): the
                    # logits row is on the host; the device samples it (the sampler alone)
                    tok = self._backend.sample_row(logits, sample_args(0))
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
                            yield GenerationChunk("", None, "error", stats(n), error=_dead_end(constraint))
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
                    if n < max_tokens - 1 and self.position + in_flight + 1 <= self.context_length:
                        self._backend.submit_next(sampling, n + 1)   # feeds token n
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
                cancelled = self._cancel.is_set()
                if n == max_tokens - 1 or self.position >= self.context_length or cancelled:
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
                                                  error=_dead_end(constraint))
                            return
                    self._backend.submit_sampler(sampling, n + 1, words)
                    if n + 1 < max_tokens - 1 and self.position + in_flight + 1 <= self.context_length:
                        self._backend.submit_logits()               # feeds token n + 1 from the slot
                        in_flight += 1
                    yield chunk(text, tok)
                    continue
                yield chunk(text, tok)
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
            self._cancel.clear()
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

    def _current_logits(self) -> np.ndarray | None:
        """Logits of the last fed position (from the device when the last step left them there)."""
        if self._last_logits is None and self._logits_on_device:
            self._logits_on_device = False
            self._last_logits = self._backend.last_logits()
        return self._last_logits

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

    def _prompt(self, prompt, *, enable_thinking, tools, chat_template_kwargs=None
                ) -> tuple[list[int], list[int], str | None]:
        """Token ids of the prompt, the positions where generate() snapshots the state into the
        prompt cache, and the prompt's text (None for token ids).

        Snapshot points: for a chat, the end of the system message / tool list when it is at
        least SYSTEM_SNAPSHOT_MIN_TOKENS long, and the end of the conversation before the
        generation prompt (every later turn starts with it); otherwise the whole prompt."""
        points: list[int] = []
        text = None
        if isinstance(prompt, str):
            text = prompt
            ids = self._require_tokenizer().encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and not isinstance(
                prompt[0], (int, float, np.number, list, tuple, np.ndarray)):
            tok = self._require_tokenizer()
            _check_messages(prompt)
            prompt = _json_tool_arguments(prompt)
            kw = dict(chat_template_kwargs or {})
            clash = {"tools", "messages", "documents", "add_generation_prompt"} & set(kw)
            if clash:
                raise TypeError(f"chat_template_kwargs cannot set {sorted(clash)}: pass tools= "
                                "to generate(); generate() sets the others")
            if enable_thinking is not None:
                kw["enable_thinking"] = enable_thinking
            text = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tools=tools,
                                           **kw)
            ids = tok.encode(text)
            head = tok.encode(tok.apply_chat_template(list(prompt), add_generation_prompt=False,
                                                      tools=tools, **kw))
            if head == ids[:len(head)]:
                sys_end = self._system_end(prompt, ids, tools)
                if SYSTEM_SNAPSHOT_MIN_TOKENS <= sys_end < len(head):
                    points.append(sys_end)
                points.append(len(head))
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
        return ids, points or [len(ids)], text

    def _system_end(self, messages, ids: list[int], tools) -> int:
        """Where the system turn (the system message and/or the tool list) ends in ``ids``:
        after its end-of-turn token and the newline that follows; 0 when there is none."""
        first = messages[0]
        role = first.get("role") if isinstance(first, dict) else getattr(first, "role", None)
        if role != "system" and not tools:
            return 0
        end = self.tokenizer.token_to_id("<|im_end|>")
        if end is None or end not in ids:
            return 0
        i = ids.index(end) + 1
        if i < len(ids) and self.tokenizer.decode([ids[i]]) == "\n":
            i += 1
        return i

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

    def _prefill(self, token_ids, *, all_logits: bool, sample: dict | None = None,
                 cancellable: bool = False, progress=None, fetch: bool = True) -> np.ndarray | None:
        ids = self._validate_ids(token_ids)
        if not ids:
            raise ValueError("prefill needs at least one token id")
        self._check_room(len(ids))
        out = []
        for s in range(0, len(ids), self.prefill_chunk):
            if cancellable and self._cancel.is_set():
                raise _Cancelled
            chunk = ids[s:s + self.prefill_chunk]
            last = s + self.prefill_chunk >= len(ids)
            logits = self._feed(chunk, all_logits=all_logits, logits=last or all_logits,
                                sample=sample if last else None, fetch=fetch)
            if all_logits:
                out.append(logits)
            elif last:
                out.append(logits)
            self.prefilled_tokens_total += len(chunk)
            if progress is not None:
                progress(min(s + self.prefill_chunk, len(ids)), len(ids))
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
              logits: bool = True, fetch: bool = True) -> np.ndarray | None:
        """Feed ids to the backend. ``logits=False`` (a prefill chunk that is not the last) lets
        engine backends skip the final norm and lm_head; returns None then. ``sample`` (engine
        backends): also sample the last position on the device (``backend.last_token``); the
        logits stay on the device and None is returned. ``fetch=False`` (engine backends): the
        logits stay on the device, None is returned."""
        self._check_room(len(ids))
        arr = np.asarray(ids, dtype=np.int64)
        kw = {}
        keeps = getattr(self._backend, "keeps_logits", False)
        if sample is not None:
            kw["sample"] = sample
            kw["fetch"] = False
        elif not fetch and keeps and not all_logits:
            kw["fetch"] = False
        logits_wanted = logits or all_logits
        if not logits and getattr(self._backend, "skips_logits", False):
            kw["logits"] = False
        logits = self._feed_guarded(
            lambda: self._backend.forward(arr, all_logits=all_logits, **kw), ids)
        if logits is None:
            self._last_logits = None
            self._logits_on_device = "fetch" in kw and logits_wanted
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


def _dead_end(constraint) -> str:
    """The error of a generation whose constraint admits no token (not at an accepting state)."""
    return ("the constraint admits no token here (a dead end: no allowed continuation and not at "
            "an accepting state" + (f"; {constraint.error}" if constraint.error else "") + ")")


def _real(name: str, value) -> float:
    """A sampling parameter as a float: a real number (not a string, not a bool), finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _check_messages(messages) -> None:
    """Clear errors for what the chat template would reject confusingly (or not at all)."""
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            role, content = m.get("role"), m.get("content")
            tool_calls = m.get("tool_calls")
        else:
            role = getattr(m, "role", None)
            content, tool_calls = getattr(m, "content", None), getattr(m, "tool_calls", None)
        if role is None and not isinstance(m, dict) and not hasattr(m, "role"):
            continue            # not a message-like object: the template layer explains
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}] needs a string 'role' (one of {', '.join(_ROLES)}), "
                             f"got {role!r}")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; the chat template takes "
                             f"{', '.join(repr(r) for r in _ROLES)}")
        if content is None and not (role == "assistant" and tool_calls):
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'"
                             + ("" if role != "assistant" else " and no 'tool_calls'"))
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise TypeError(f"messages[{i}]['content'] must be a string or a list of content "
                            f"parts, got {type(content).__name__}")


def _json_tool_arguments(messages):
    """OpenAI messages carry tool-call arguments as JSON text; the chat template iterates them as
    a mapping. Parse such text into a dict (in a copy; other messages are passed as they are)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls and isinstance(calls, (list, tuple)):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ValueError(f"tool call {fn.get('name')!r}: arguments are not valid "
                                         f"JSON: {args[:80]!r}") from None
                    c = {**c, "function": {**fn, "arguments": parsed}}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


class _Guarded:
    """Wraps the generation generator so that the model is released however iteration ends
    (exhausted, closed early, garbage-collected, or an exception)."""

    def __init__(self, gen: Iterator[GenerationChunk], model: Model, prompt_tokens: int):
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
