"""The user-facing model: ``lily_py.load`` and ``Model`` (prefill / decode / reset / generate).

A ``Model`` owns one conversation state (KV cache, DeltaNet state, conv windows) on its backend
and remembers the token ids it has fed, so a new prompt that extends them (the next turn of a
chat) only prefills the new tokens. Around it, one module per concern: ``prompts`` (messages
into ids and snapshot points), ``generate_args`` (generate()'s arguments checked),
``generation_loop`` (prefill, the token loop, stop strings, parsing), ``generation`` (the chunk
and result objects), ``prompt_cache`` (the snapshots), ``defaults``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from typing import Iterator, Sequence

import numpy as np

from . import generate_args
from ._devices import auto_backend
from .backends import BACKENDS, built_with_metal, make_backend, resolve_kv_dtype  # noqa: F401  (BACKENDS: a public name)
from .batch import DEFAULT_PREFILL_STEP, BatchGeneration, generate_batch
from .checkpoint import ModelWeights, load_weights
from .config import ModelConfig
from .defaults import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_CHUNK, DEFAULT_PROMPT_CACHE_BYTES
from .errors import BusyError, ContextLengthError
from .generation import GenerationChunk, GenerationResult
from .generation_loop import Cancelled, Guarded, stream
from .parsing import OutputParser, prompt_opens_reasoning
from .progress import ProgressCallback  # noqa: F401  (annotations)
from .prompt_cache import PromptCache
from .prompts import chat_prompt
from .tokenizer import check_text

log = logging.getLogger("lily_py")


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
            backend, why = auto_backend()
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

    @property
    def _active_prompt_cache(self):
        """The prompt cache, or None when it is off (max_bytes 0): generate and the Batcher."""
        return self.prompt_cache if self.prompt_cache.max_bytes > 0 else None

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
        lp_top = generate_args.logprobs_top(logprobs, top_logprobs)
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
        params = generate_args.sampling_params(temperature, top_p, top_k, min_p, seed)
        max_tokens = generate_args.max_tokens_arg(max_tokens)
        stops = generate_args.stop_strings(stop)
        chat_template_kwargs = generate_args.template_kwargs(chat_template_kwargs)
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
            gen = stream(self, ids, points, params, max_tokens, stops, parser, prefill_progress,
                         lp_top, constraint)
        except BaseException:
            self._generating = False
            raise
        return Guarded(gen, self, len(ids))

    def generate_batch(self, prompts, *, max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                       stop: Sequence[str] | str | None = None, enable_thinking: bool | None = None,
                       tools: list | None = None, chat_template_kwargs: dict | None = None,
                       parse_output: bool | None = None, max_batch: int | None = None,
                       prefill_step: int = DEFAULT_PREFILL_STEP) -> "BatchGeneration":
        """Generate for several prompts at once: an iterator of ``(index, GenerationChunk)``,
        ``index`` being the prompt's position in ``prompts`` (docs/batching.md).

        Each item of ``prompts`` is what ``generate`` takes (a string, chat messages, token ids)
        or a dict with a ``"prompt"`` key and any of ``max_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``min_p``, ``seed``, ``stop``, ``enable_thinking``, ``tools``,
        ``chat_template_kwargs``, ``parse_output`` for that request alone; the keyword arguments
        are the defaults of every request and mean what they mean for ``generate``. Up to
        ``max_batch`` requests (default and most: the engine's ``max_batch``, 8) decode together,
        one token each per step, every weight byte read once per step; the rest wait in order
        and start as places free. A prompt that starts while others decode is prefilled
        ``prefill_step`` tokens between two of their steps. The model's own conversation is
        left as it was (each request runs on a sequence of its own). ``cancel(index)`` on the
        returned object ends one request ("cancelled") and leaves the others; ``close()`` ends
        all. Engine backends only (``emu``, ``metal``, ``cuda``): NotImplementedError on the
        reference backend. A prompt's longest prefix in the prompt cache is restored, as in
        ``generate``. Not taken here: logprobs, response_format and tool_choice (``generate``
        has them).
        """
        return generate_batch(self, prompts, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, min_p=min_p, seed=seed, stop=stop, enable_thinking=enable_thinking,
                              tools=tools, chat_template_kwargs=chat_template_kwargs,
                              parse_output=parse_output, max_batch=max_batch, prefill_step=prefill_step)

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
        reasoning, tool calls and, with ``logprobs=True``, each token's logprobs (see
        ``GenerationResult``)."""
        parts, reasoning, raw, tokens, calls, errors, last = [], [], [], [], [], [], None
        logprobs = [] if kwargs.get("logprobs") else None
        for chunk in self.generate(prompt, **kwargs):
            parts.append(chunk.text)
            reasoning.append(chunk.reasoning)
            raw.append(chunk.raw)
            calls += chunk.tool_calls
            errors += chunk.tool_call_errors
            if chunk.token is not None:
                tokens.append(chunk.token)
                if logprobs is not None:
                    logprobs.append(chunk.logprobs)
            last = chunk
        return GenerationResult("".join(parts), tokens, last.finish_reason, last.stats,
                                "".join(reasoning), calls, errors, "".join(raw),
                                getattr(last, "error", ""), logprobs)

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

        Snapshot points: for a chat, :func:`lily_py.prompts.chat_prompt`'s; otherwise the whole
        prompt."""
        points: list[int] = []
        text = None
        if isinstance(prompt, str):
            text = prompt
            check_text(prompt, "the prompt")
            ids = self._require_tokenizer().encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and not isinstance(
                prompt[0], (int, float, np.number, list, tuple, np.ndarray)):
            ids, points, text = chat_prompt(self._require_tokenizer(), prompt,
                                            enable_thinking=enable_thinking, tools=tools,
                                            chat_template_kwargs=chat_template_kwargs)
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
                raise Cancelled
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
