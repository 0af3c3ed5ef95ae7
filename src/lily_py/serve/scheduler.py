"""The model's worker thread: requests decode together in batches, in FIFO order.

The HTTP handlers run on the asyncio loop; the model runs on one worker thread. A ``Job`` carries
the request to the worker and the chunks back (``loop.call_soon_threadsafe`` into an
``asyncio.Queue``).

On an engine backend the worker drives a ``lily_py.batch.Batcher``: up to ``max_batch`` jobs
decode in one step each, and a new job's prompt is prefilled in chunks between the steps of the
running ones (docs/serving.md, "Several clients at once"). A job that asks for what the batched
path does not do (logprobs, ``response_format``, a forcing ``tool_choice``) runs alone through
``model.generate`` once the running batch has drained; jobs behind it wait, so the order stays
FIFO. With ``max_batch`` 1, or a model without the batched step, every job runs alone.

``Job.cancel()`` (a client went away) takes a waiting job out of the queue at once, or stops a
running one: a batched job at the next step (the others go on); a job running alone through
``model.cancel()`` where the model has it, and the worker closes the generator at the next chunk
either way, which frees the model.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Any

from ..batch import DEFAULT_PREFILL_STEP, REQUEST_KEYS, Batcher, make_request

log = logging.getLogger("lily_py.serve")

# Events a job sends to its handler.
START, CHUNK, ERROR, DONE = "start", "chunk", "error", "done"


def batchable(job: "Job") -> bool:
    """Whether the batched path serves this job's arguments (else it runs alone)."""
    return set(job.kwargs) <= set(REQUEST_KEYS)


class QueueFull(Exception):
    pass


class ShuttingDown(QueueFull):
    pass


class Job:
    def __init__(self, prompt: Any, kwargs: dict, loop: asyncio.AbstractEventLoop):
        self.prompt, self.kwargs, self.loop = prompt, kwargs, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.scheduler: Scheduler | None = None
        self.finished = False       # set by the worker once the generator is closed

    def post(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:        # the loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        if not self.cancelled.is_set() and not self.finished:
            self.cancelled.set()
            if self.scheduler is not None:
                self.scheduler._cancel(self)


def batcher_for(model, max_batch: int | None, prefill_step: int):
    """A Batcher for ``model``, or None where jobs run alone: ``max_batch`` 1, or (with the
    default None) a model without the batched step. An explicit ``max_batch`` above 1 that the
    model cannot batch is a ValueError."""
    if max_batch == 1:
        return None
    try:
        return Batcher(model, max_batch, prefill_step)
    except (NotImplementedError, AttributeError) as e:
        if max_batch is None:
            return None
        raise ValueError(f"--max-batch {max_batch}: {e}") from None


class Scheduler:
    """Runs the jobs on one worker thread, in FIFO order: batched where it can (``batcher``),
    else ``model.generate(job.prompt, **job.kwargs)`` one job at a time. At most ``max_queue``
    jobs wait behind the running ones; ``submit`` raises ``QueueFull`` beyond that."""

    def __init__(self, model, max_queue: int, max_batch: int | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP):
        self.model, self.max_queue = model, max_queue
        self.batcher = batcher_for(model, max_batch, prefill_step)
        self.max_batch = self.batcher.max_batch if self.batcher is not None else 1
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None            # a job running alone
        self._batched: set[Job] = set()             # jobs in the batcher
        self._stopping = False
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self._thread = threading.Thread(target=self._loop, name="lily-py-serve-worker",
                                        daemon=True)
        self._thread.start()

    # ---- called from the event loop -----------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            # Free places take jobs at once: they do not count against the queue.
            free = self.max_batch - len(self._batched) - (self._running is not None)
            if len(self._waiting) >= self.max_queue + max(free, 0):
                self.counts["rejected"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting behind the "
                                "running ones); retry later")
            job.scheduler = self
            self._waiting.append(job)
            self._cond.notify()

    def status(self) -> dict:
        with self._cond:
            b = self.batcher
            return {"running": len(self._batched) + (self._running is not None),
                    "queued": len(self._waiting), "max_queue": self.max_queue,
                    "max_batch": self.max_batch, "batched_steps": b.steps if b else 0,
                    "peak_batch": b.peak if b else 0, **self.counts}

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what waits and what runs, then end the worker."""
        with self._cond:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = [self._running] if self._running is not None else []
            running += list(self._batched)
            self._cond.notify_all()
        for job in waiting:
            job.cancelled.set()
            job.post(ERROR, ShuttingDown("the server is shutting down"))
        for job in running:
            job.cancel()
        self._thread.join(timeout)

    def _cancel(self, job: Job) -> None:
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1
                return
            if job in self._batched:
                self.batcher.cancel(job)            # ends at the next step; the others go on
                return
            cancel = getattr(self.model, "cancel", None)
            if self._running is job and not job.finished and cancel is not None:
                # Under the lock: the worker cannot have started the next job yet.
                cancel()        # also interrupts a long prefill (lily_py's API, thread-safe)

    # ---- the worker thread ------------------------------------------------------------------
    def _loop(self) -> None:
        b = self.batcher
        while True:
            alone, admitted = None, []
            with self._cond:
                while not self._waiting and (b is None or b.idle) and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                # FIFO: batchable jobs join while there is room; a job that must run alone
                # waits at the head until the batch has drained, and the jobs behind it wait too.
                while self._waiting:
                    job = self._waiting[0]
                    if b is None or not batchable(job):
                        if b is None or (b.idle and not admitted):
                            alone = self._running = self._waiting.popleft()
                        break
                    if b.load >= b.max_batch:
                        break
                    admitted.append(self._waiting.popleft())
                    self._batched.add(admitted[-1])
            if alone is not None:
                try:
                    self._run(alone)
                finally:
                    with self._cond:
                        self._running = None
                continue
            for job in admitted:
                self._admit(job)
            if b is not None and not b.idle:
                self._step()
        if b is not None:
            b.close()
            for job in list(self._batched):
                self._done(job, "cancelled")

    def _admit(self, job: Job) -> None:
        try:
            r = make_request(self.model, job, job.prompt, job.kwargs)
        except Exception as e:      # validation: bad arguments, prompt past the context, ...
            self._done(job, "failed", e, started=False)
            return
        self.batcher.add(r)
        job.post(START, len(r.ids))

    def _step(self) -> None:
        try:
            chunks = self.batcher.step()
        except Exception as e:      # a device error: every running job fails, the model is free
            log.exception("batched generation failed")
            for job in list(self._batched):
                self._done(job, "failed", e)
            return
        for job, chunk in chunks:
            if job.cancelled.is_set():
                if chunk.finish_reason is not None:
                    self._done(job, "cancelled")
                else:
                    self.batcher.cancel(job)        # cancelled before it was in the batcher
                continue
            job.post(CHUNK, chunk)
            if chunk.finish_reason is not None:
                self._done(job, "cancelled" if chunk.finish_reason == "cancelled" else "completed")

    def _done(self, job: Job, outcome: str, error: Exception | None = None,
              started: bool = True) -> None:
        """A batched job ends: ERROR (if any), then DONE once its START went out."""
        with self._cond:
            self._batched.discard(job)
            job.finished = True
            self.counts[outcome] += 1
        if error is not None:
            job.post(ERROR, error)
        if started:
            job.post(DONE)

    def _run(self, job: Job) -> None:
        try:
            gen = self.model.generate(job.prompt, **job.kwargs)
        except Exception as e:      # validation: bad arguments, prompt past the context, ...
            with self._cond:
                job.finished = True
                self.counts["failed"] += 1
            job.post(ERROR, e)
            return
        job.post(START, getattr(gen, "prompt_tokens", None))
        outcome = "completed"
        try:
            for chunk in gen:
                if job.cancelled.is_set():
                    outcome = "cancelled"
                    break
                job.post(CHUNK, chunk)
            else:
                if job.cancelled.is_set():
                    outcome = "cancelled"
        except Exception as e:
            log.exception("generation failed")
            outcome = "failed"
            job.post(ERROR, e)
        finally:
            gen.close()             # frees the model now, whatever happened
            with self._cond:
                job.finished = True
                self.counts[outcome] += 1
            job.post(DONE)

