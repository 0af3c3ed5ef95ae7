"""Several conversations at once: ``Model.generate_batch``, and the ``Batcher`` that
``lily-py serve`` drives.

Each request gets a sequence of its own on the engine (its own DeltaNet state, conv windows and
KV blocks; ``_core.Engine.add_sequence``), apart from the model's conversation, which is left as
it was. A ``Batcher`` keeps up to ``max_batch`` requests decoding: one batched step
(``Engine.submit_batch``) feeds each its last token and samples its next one, so every weight
byte is read once for the whole batch. Requests join at any time (``add``); one
that arrives while others decode is prefilled ``prefill_step`` tokens at a time (short prompts
share that budget), between two decode steps, so the running streams keep their pace; a request that ends (EOS, stop
string, ``max_tokens``, a full context, ``cancel(key)``) frees its place for the next one.

A prompt's longest prefix in the model's prompt cache is restored into its sequence instead of
prefilled, and its snapshot points are snapshotted into the cache, as ``generate`` does.

Each row of a decode step is sampled on the device (``Engine.submit_batch``: the sampler that
``generate`` uses, with the request's own parameters, seed and step), so a request's tokens equal
those ``generate`` samples for it alone, up to the batched matmuls' rounding (the qmv route over B
rows instead of qmv1 with the norms fused in; docs/batching.md). No logits leave the device, and
two decode steps are in flight, as in ``generate``: step N + 1 is committed, fed from the device
slot, before the host waits for step N's tokens, so the host's part of a step (encoding,
detokenizing, stop strings) overlaps the GPU. A request that ends at step N unforeseen (EOS, a
stop string, a cancel) leaves one wasted row in step N + 1; whenever the rows change (a request
ends, is admitted or prefilled) the steps in flight are waited for first, and a round that
prefills runs one decode step, not pipelined.
The first token of a prompt is sampled on the host from the prefill's last row
(``lily_py.sampling.sample``, bit-identical to the device sampler).
"""
from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

import numpy as np

from . import generate_args
from .errors import BusyError, ContextLengthError
from .generation import GenerationChunk, GenerationStats, StopMatcher
from .parsing import OutputParser, prompt_opens_reasoning
from .sampling import SamplingParams, int_param, sample

# Keys a request dict may carry besides "prompt" (generate()'s, with the same meaning).
REQUEST_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                "enable_thinking", "tools", "chat_template_kwargs", "parse_output")
DEFAULT_PREFILL_STEP = 512   # prompt tokens prefilled between two decode steps while others run
DEFAULTS = dict(max_tokens=None, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                stop=None, enable_thinking=None, tools=None, chat_template_kwargs=None,
                parse_output=None)


@dataclass
class Request:
    """One checked, tokenized request (``make_request``); ``key`` names it in the chunks."""
    key: Hashable
    ids: list[int]
    points: list[int]             # where to snapshot the state into the prompt cache
    params: SamplingParams
    seed: int
    max_tokens: int
    stops: list[str]
    parser: OutputParser | None
    seq: int = -1                 # engine sequence, -1 before admission
    fed: int = 0                  # prompt tokens in the sequence's state
    cached: int = 0               # of those, restored from the prompt cache
    first: np.ndarray | None = None  # logits of a whole prompt restored from the cache
    looked_up: bool = False       # the prompt cache was consulted
    n: int = 0                    # tokens sampled (and handed out)
    sub: int = 0                  # ... and those of the decode steps in flight
    tok: int = -1                 # the last sampled token (fed by the next decode step)
    sampling: object = None       # the device sampler's parameters (_core.Sampling), at admission
    ended: bool = False           # finished: its rows in flight are dropped
    detok: object = None
    matcher: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    t0: float = 0.0
    t_prefill: float = 0.0
    t1: float = 0.0


def make_request(m, key: Hashable, prompt, kwargs: dict) -> Request:
    """Check and tokenize one request (``kwargs``: any of REQUEST_KEYS; the rest of generate()'s
    defaults apply). TypeError / ValueError / ContextLengthError say what is wrong."""
    bad = sorted(set(kwargs) - set(REQUEST_KEYS))
    if bad:
        raise TypeError(f"unknown keys {bad}; a request takes 'prompt' and {', '.join(REQUEST_KEYS)}")
    kw = {**DEFAULTS, **kwargs}
    if kw["max_tokens"] is None:
        kw["max_tokens"] = m.context_length
    params = generate_args.sampling_params(kw["temperature"], kw["top_p"], kw["top_k"],
                                           kw["min_p"], kw["seed"])
    max_tokens = generate_args.max_tokens_arg(kw["max_tokens"])
    stops = generate_args.stop_strings(kw["stop"])
    ids, points, text = m._prompt(
        prompt, enable_thinking=kw["enable_thinking"], tools=kw["tools"],
        chat_template_kwargs=generate_args.template_kwargs(kw["chat_template_kwargs"]))
    if len(ids) + 1 > m.context_length:
        raise ContextLengthError(f"a prompt of {len(ids)} tokens leaves no room in "
                                 f"context_length {m.context_length}")
    chat = text is not None and not isinstance(prompt, str)
    parser = None
    if kw["parse_output"] or (kw["parse_output"] is None and chat):
        if text is None:
            text = m._require_tokenizer().decode(ids[-16:])
        parser = OutputParser(reasoning=prompt_opens_reasoning(text), tools=kw["tools"])
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return Request(key, list(ids), sorted(set(points)), params, int(seed), max_tokens, stops,
                   parser)


def check_batch_args(m, max_batch, prefill_step) -> tuple[int, int]:
    """``max_batch`` (None: the engine's most) and ``prefill_step`` checked; NotImplementedError
    on a backend without the batched step."""
    engine = getattr(m._backend, "engine", None)
    if engine is None or not hasattr(engine, "decode_batch"):
        raise NotImplementedError(f"batched generation needs an engine backend (emu, metal, cuda); this "
                                  f"model runs on {m.backend!r}: load it with backend='emu' (or 'metal' "
                                  "on a Mac)")
    limit = int(engine.max_batch)
    max_batch = int_param("max_batch", limit if max_batch is None else max_batch)
    if not 1 <= max_batch <= limit:
        raise ValueError(f"max_batch must be in [1, {limit}] (the engine's batched step), got {max_batch}")
    prefill_step = int_param("prefill_step", prefill_step)
    if prefill_step < 1:
        raise ValueError(f"prefill_step must be a positive number of tokens, got {prefill_step}")
    return max_batch, prefill_step


class Batcher:
    """Continuous batching on one model. One thread drives it: ``add`` (a ``Request``), ``step``
    (one round: admit waiting requests, run one prefill chunk, hand out one batched decode
    step's tokens, with the next step already committed when the rows stay the same; returns
    the ``(key, GenerationChunk)`` pairs it made) and ``close``; ``cancel(key)`` may come from any
    thread. While requests run, the Batcher holds the model (``generate`` raises BusyError); it
    lets go whenever it is idle, so a driver can run ``generate`` between two batches."""

    def __init__(self, m, max_batch: int | None = None, prefill_step: int = DEFAULT_PREFILL_STEP):
        self.max_batch, self.prefill_step = check_batch_args(m, max_batch, prefill_step)
        self._m = m
        self._e = m._backend.engine
        self._eos = m._eos_ids()
        n_ids = m.tokenizer.vocab_size if m.tokenizer is not None else m.config.vocab_size
        self._valid = min(n_ids, m.config.vocab_size)
        self._queue: collections.deque[Request] = collections.deque()
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        self._flights: collections.deque[list[Request]] = collections.deque()  # decode steps in flight
        self._ended: list[Request] = []   # finished; their sequences go once nothing is in flight
        self._cancelled: set = set()
        self._lock = threading.Lock()
        self._home = -1               # the model's own sequence while the Batcher holds the model
        self.steps = 0                # batched decode steps run
        self.peak = 0                 # the most sequences decoded in one step
        self._first: np.ndarray | None = None   # logits of the prompt prefilled last

    # ---- any thread ---------------------------------------------------------------------------
    def cancel(self, key: Hashable) -> None:
        with self._lock:
            self._cancelled.add(key)

    def _is_cancelled(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._cancelled

    # ---- the driving thread -------------------------------------------------------------------
    @property
    def running(self) -> int:
        """Requests admitted (prefilling or decoding)."""
        return len(self._prefilling) + len(self._decoding)

    @property
    def load(self) -> int:
        """Requests admitted or waiting for a place."""
        return self.running + len(self._queue)

    @property
    def idle(self) -> bool:
        return self.load == 0

    def add(self, r: Request) -> None:
        self._queue.append(r)

    def hold(self) -> None:
        """Take the model (BusyError if it is generating); ``step`` does this itself."""
        if self._home >= 0:
            return
        m = self._m
        with m._lock:
            if m._generating:
                raise BusyError("this model is already generating; finish or close the other generator first")
            m._generating = True
        self._home = self._e.active_sequence
        m._backend.last_token = None   # the device's token slot is not the conversation's any more

    def _release(self) -> None:
        if self._home >= 0:
            home, self._home = self._home, -1
            try:
                self._e.select_sequence(home)
            finally:
                self._m._generating = False

    def step(self) -> list[tuple[Hashable, GenerationChunk]]:
        out: list[tuple[Hashable, GenerationChunk]] = []
        if self.idle and not self._flights:
            return out
        self.hold()
        try:
            if self._admitting() or self._prefilling:
                self._drain(out)      # a new sequence, a prefill chunk: nothing may be in flight
            self._admit(out)
            if self._prefilling:
                self._prefill(out)
            if self._decoding:
                # one decode step between two prefill chunks (no follower to wait for next round)
                self._decode(out, follow=not self._prefilling and not self._admitting())
            if not self._decoding and self._flights:
                self._drain(out)      # every row in flight ended
        except BaseException:
            self.close()
            raise
        if not self._flights:
            self._drop_ended()
            self._e.select_sequence(self._home)   # the conversation is active between steps
            if self.idle:
                self._release()
        return out

    def close(self) -> None:
        """End every request and free its sequence (no chunks); the model goes back as it was."""
        self._queue.clear()
        try:
            while self._flights:   # wait out the steps in flight; their tokens are dropped
                self._flights.popleft()
                try:
                    self._e.complete_batch()
                except Exception:   # a failed step (the engine dropped the others) or a bad row
                    if self._e.in_flight == 0:
                        self._flights.clear()
            if self._home >= 0:
                self._e.select_sequence(self._home)
                for r in self._prefilling + self._decoding + self._ended:
                    if r.seq >= 0 and r.seq != self._home:
                        self._e.drop_sequence(r.seq)
        except Exception:   # a device error left steps unfinished: the next reset cleans up
            pass
        finally:
            self._prefilling, self._decoding, self._ended = [], [], []
            self._flights.clear()
            self._release()

    # ---- one round ----------------------------------------------------------------------------
    def _admitting(self) -> bool:
        """Whether a waiting request gets a place this round (a new sequence: nothing in flight)."""
        return bool(self._queue) and self.running < self.max_batch

    def _admit(self, out: list) -> None:
        for r in [r for r in self._queue if self._is_cancelled(r.key)]:
            self._queue.remove(r)
            out.append((r.key, self._chunk(r, "", None, "cancelled")))
        while self._queue and self.running < self.max_batch:
            r = self._queue.popleft()
            r.seq = self._e.add_sequence()
            p = r.params
            r.sampling = self._m._backend.sampling(dict(
                temperature=p.temperature, top_k=min(int(p.top_k), self._m.config.vocab_size),
                top_p=p.top_p, min_p=p.min_p, seed=r.seed & 0xFFFFFFFFFFFFFFFF, step=0,
                valid_vocab=self._valid))
            r.t0 = time.perf_counter()
            r.detok = self._m.tokenizer.detokenizer() if self._m.tokenizer is not None else None
            r.matcher = StopMatcher(r.stops)
            self._prefilling.append(r)
        for r in [r for r in self._prefilling if self._is_cancelled(r.key)]:
            self._prefilling.remove(r)
            self._finish(r)
            r.t_prefill = r.t1 = time.perf_counter() - r.t0
            out.append((r.key, self._chunk(r, "", None, "cancelled")))

    def _restore(self, r: Request) -> None:
        """Restore the longest cached prefix of r's prompt into its sequence."""
        cache = self._m._active_prompt_cache
        if cache is None:
            return
        entry = cache.lookup(r.ids, count=False)
        if entry is not None and len(entry.tokens) == len(r.ids) and entry.logits is None:
            entry = cache.lookup(r.ids[:-1], count=False)   # leave a token whose logits we need
        if entry is None:
            cache.misses += 1
            return
        cache.hits += 1
        self._e.select_sequence(r.seq)
        self._m._backend.restore(entry.state)
        r.fed = r.cached = len(entry.tokens)
        if r.fed == len(r.ids):
            r.first = np.array(entry.logits, dtype=np.float32).reshape(-1)

    def _prefill(self, out: list) -> None:
        """Prefill the waiting prompts in order, up to ``prefill_step`` tokens in all while
        others decode (``prefill_chunk`` while none does), each chunk stopping at a snapshot
        point that the prompt cache lacks."""
        m = self._m
        budget = min(self.prefill_step, m.prefill_chunk) if self._decoding else m.prefill_chunk
        while self._prefilling and budget > 0:
            r = self._prefilling[0]
            n = self._prefill_chunk(r, budget)
            budget -= n
            if r.fed < len(r.ids):
                continue              # the budget is spent, or a snapshot point was reached
            self._prefilling.remove(r)
            r.t_prefill = time.perf_counter() - r.t0
            r.t1 = time.perf_counter()
            c = self._sample(r, self._first, len(r.ids))
            r.sub = r.n
            if c.finish_reason is None:
                self._decoding.append(r)
            else:
                self._finish(r)
            out.append((r.key, c))

    def _prefill_chunk(self, r: Request, budget: int) -> int:
        """Feed up to ``budget`` more tokens of r's prompt (one engine step); the tokens fed. The
        logits of its last token go to ``self._first`` when the prompt is complete."""
        m, e = self._m, self._e
        if not r.looked_up:           # at its first chunk, so that it finds what the prompts
            r.looked_up = True        # prefilled before it (in this round too) snapshotted
            self._restore(r)
        if r.fed == len(r.ids):       # the whole prompt came from the prompt cache
            self._first = r.first
            return 0
        cache = self._m._active_prompt_cache
        end = min(r.fed + budget, len(r.ids))
        snap = False
        for p in r.points:
            if r.fed < p <= end and cache is not None and tuple(r.ids[:p]) not in cache:
                end, snap = p, True
                break
        part = np.asarray(r.ids[r.fed:end], dtype=np.uint32)
        want = snap or end == len(r.ids)
        e.select_sequence(r.seq)
        logits, _ = e.forward(part, False, None, False, want, want)
        r.fed = end
        if snap:
            state = m._backend.snapshot()
            cache.insert(r.ids[:end], state, np.array(logits[-1]), m._backend.snapshot_nbytes(state))
        self._first = logits[-1] if want else None
        return len(part)

    def _decode(self, out: list, follow: bool = True) -> None:
        """Commit the next decode step (fed from the device slot when it follows the step in
        flight with the same rows, else from the host's tokens once the steps in flight are
        done), then hand out the oldest step's tokens: two steps in flight in the steady state.
        ``follow`` False: no step fed from the slot (the next round must wait for the device)."""
        if self._flights and not self._follows(self._flights[-1]):
            self._drain(out)
        if not self._flights:
            if not self._decoding:
                return
            self._submit(list(self._decoding), from_slot=False)
        if follow and self._follows(self._flights[-1]):
            self._submit(self._flights[-1], from_slot=True)
        self._complete(out)

    def _follows(self, rows: list[Request]) -> bool:
        """Whether a step fed from the device slot may follow ``rows`` (the newest step in
        flight): the same requests decoding in the same order, each wanting another token that
        fits its context."""
        if len(rows) != len(self._decoding) or any(a is not b for a, b in zip(rows, self._decoding)):
            return False
        ctx = self._m.context_length
        return all(r.sub < r.max_tokens and len(r.ids) + r.sub <= ctx and not self._is_cancelled(r.key)
                   for r in rows)

    def _submit(self, rows: list[Request], from_slot: bool) -> None:
        seqs = np.array([r.seq for r in rows], dtype=np.uint32)
        steps = np.array([r.sub for r in rows], dtype=np.uint32)
        ids = None if from_slot else np.array([r.tok for r in rows], dtype=np.uint32)
        self._e.submit_batch(seqs, ids, [r.sampling for r in rows], steps)
        for r in rows:
            r.sub += 1
        self._flights.append(rows)
        self.steps += 1
        self.peak = max(self.peak, len(rows))

    def _complete(self, out: list) -> None:
        """Wait for the oldest step in flight and hand out its tokens (rows of requests that
        ended meanwhile are dropped)."""
        rows = self._flights.popleft()
        toks = self._e.complete_batch()
        for r, tok in zip(rows, toks):
            if r.ended:
                continue
            c = self._sample(r, None, len(r.ids) + r.n, int(tok))
            if c.finish_reason is not None:
                self._decoding.remove(r)
                self._finish(r)
            out.append((r.key, c))

    def _drain(self, out: list) -> None:
        """Hand out every step in flight, then free the sequences of the requests that ended."""
        while self._flights:
            self._complete(out)
        self._drop_ended()

    def _finish(self, r: Request) -> None:
        r.ended = True
        self._ended.append(r)

    def _drop_ended(self) -> None:
        if not self._ended:
            return
        self._e.select_sequence(self._home)
        for r in self._ended:
            self._e.drop_sequence(r.seq)
            r.seq = -1
        self._ended = []

    # ---- chunks -------------------------------------------------------------------------------
    def _chunk(self, r: Request, text: str, tok: int | None, finish: str | None = None) -> GenerationChunk:
        stats = None
        if finish is not None:
            stats = GenerationStats(len(r.ids), r.cached, r.fed - r.cached, r.n, r.t_prefill,
                                    time.perf_counter() - r.t1 if r.t1 else 0.0,
                                    self._m.backend, r.cached)
        stop = r.matcher.matched if finish == "stop" else ""
        if r.parser is None:
            return GenerationChunk(text, tok, finish, stats, raw=text, stop_sequence=stop)
        d = r.parser.push(text)
        section = r.parser.section
        if finish is not None:
            d += r.parser.finish()
            if finish == "stop" and r.parser.n_tool_calls:
                finish = "tool_calls"
        return GenerationChunk(d.text, tok, finish, stats, d.reasoning, d.tool_calls, d.errors,
                               raw=text, stop_sequence=stop, section=section)

    def _pick(self, r: Request, row: np.ndarray) -> int:
        """r's next token from its logits row on the host (the first token, from the prefill)."""
        if self._valid < row.shape[-1]:
            row = row.copy()
            row[self._valid:] = -np.inf
        return sample(row, r.params, r.n, r.seed)

    def _sample(self, r: Request, row: np.ndarray, position: int, tok: int | None = None) -> GenerationChunk:
        """Sample r's next token from its logits row (``tok``: already picked); the chunk it
        makes (finished or not)."""
        if tok is None:
            tok = self._pick(r, row)
        r.tok = tok
        r.n += 1
        if tok in self._eos:
            rest = r.detok.finalize() if r.detok else ""
            text, _ = r.matcher.push(rest)
            return self._chunk(r, text + r.matcher.flush(), tok, "stop")
        piece = r.detok.add(tok) if r.detok else ""
        text, stopped = r.matcher.push(piece)
        if stopped:
            return self._chunk(r, text, tok, "stop")
        # the next decode step writes row `position` of this sequence's cache
        full = position + 1 > self._m.context_length
        cancelled = self._is_cancelled(r.key)
        if r.n == r.max_tokens or full or cancelled:
            rest = r.detok.finalize() if r.detok else ""
            more, stopped = r.matcher.push(rest)
            text += more
            if not stopped:
                text += r.matcher.flush()
            why = ("stop" if stopped else "cancelled" if cancelled else
                   "length" if r.n == r.max_tokens else "context_length")
            return self._chunk(r, text, tok, why)
        return self._chunk(r, text, tok)


class BatchGeneration:
    """What ``Model.generate_batch`` returns: an iterator of ``(index, GenerationChunk)`` pairs,
    ``index`` being the request's position in the list given. Each request's chunks arrive in
    order and its last chunk has a ``finish_reason`` and ``stats``. ``cancel(index)`` (from any
    thread) ends that request at the next step with finish_reason "cancelled", leaving the
    others running; ``close()`` (or leaving a ``with`` block) ends them all and frees their
    sequences. ``prompt_tokens``: each request's prompt length in tokens."""

    def __init__(self, batcher: Batcher, requests: list[Request]):
        self._batcher = batcher
        self.prompt_tokens = [len(r.ids) for r in requests]
        for r in requests:
            batcher.add(r)
        self._gen = self._run()

    def _run(self) -> Iterator[tuple[int, GenerationChunk]]:
        try:
            while not self._batcher.idle:
                yield from self._batcher.step()
        finally:
            self._batcher.close()

    def cancel(self, index: int) -> None:
        if not 0 <= index < len(self.prompt_tokens):
            raise IndexError(f"no request {index}: the batch has {len(self.prompt_tokens)}")
        self._batcher.cancel(index)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, GenerationChunk]:
        return next(self._gen)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._gen.close()
        self._batcher.close()

    def __del__(self):
        if getattr(self, "_batcher", None) is not None:
            self.close()


def generate_batch(m, prompts, *, max_batch, prefill_step, **shared) -> BatchGeneration:
    """``Model.generate_batch``: every request checked and tokenized before anything runs
    (TypeError / ValueError / ContextLengthError naming the request's index)."""
    batcher = Batcher(m, max_batch, prefill_step)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError("generate_batch takes a non-empty list of prompts (strings, message lists, "
                        "token-id lists, or dicts with a 'prompt' key)")
    requests = []
    for i, p in enumerate(prompts):
        kw = dict(shared)
        if isinstance(p, dict):
            if "prompt" not in p:
                raise TypeError(f"request {i}: a dict request needs a 'prompt' key")
            kw.update({k: v for k, v in p.items() if k != "prompt"})
            p = p["prompt"]
        try:
            requests.append(make_request(m, i, p, kw))
        except (TypeError, ValueError, ContextLengthError) as e:
            raise type(e)(f"request {i}: {e}") from None
    batcher.hold()      # BusyError now, not at the first next()
    return BatchGeneration(batcher, requests)
