"""One generation at a time per model: a worker thread and a bounded FIFO queue.

The HTTP handlers run on the asyncio loop; the model runs on one worker thread. A ``Job`` carries
the request to the worker and the chunks back (``loop.call_soon_threadsafe`` into an
``asyncio.Queue``). ``Job.cancel()`` (a client went away) takes a waiting job out of the queue at
once, or makes the worker stop a running one: ``model.cancel()`` where the model has it, and the
worker closes the generator at the next chunk either way, which frees the model.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Any

log = logging.getLogger("lily_py.serve")

# Events a job sends to its handler.
START, CHUNK, ERROR, DONE = "start", "chunk", "error", "done"


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


class Scheduler:
    """Runs ``model.generate(job.prompt, **job.kwargs)`` for one job at a time, in FIFO order.
    At most ``max_queue`` jobs wait behind the running one; ``submit`` raises ``QueueFull``
    beyond that."""

    def __init__(self, model, max_queue: int):
        self.model, self.max_queue = model, max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
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
            # An idle model takes the next job at once: it does not count against the queue.
            if len(self._waiting) >= self.max_queue + (self._running is None):
                self.counts["rejected"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting behind the "
                                "running one); retry later")
            job.scheduler = self
            self._waiting.append(job)
            self._cond.notify()

    def status(self) -> dict:
        with self._cond:
            return {"running": int(self._running is not None), "queued": len(self._waiting),
                    "max_queue": self.max_queue, **self.counts}

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what waits and what runs, then end the worker."""
        with self._cond:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = self._running
            self._cond.notify_all()
        for job in waiting:
            job.cancelled.set()
            job.post(ERROR, ShuttingDown("the server is shutting down"))
        if running is not None:
            running.cancel()
        self._thread.join(timeout)

    def _cancel(self, job: Job) -> None:
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1
                return
            cancel = getattr(self.model, "cancel", None)
            if self._running is job and not job.finished and cancel is not None:
                # Under the lock: the worker cannot have started the next job yet.
                cancel()        # also interrupts a long prefill (lily_py's API, thread-safe)

    # ---- the worker thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

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

