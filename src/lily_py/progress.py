"""Progress of long operations: loading weights onto a device, long prefills.

``LoadProgress`` draws one self-overwriting line on a terminal while an engine backend reads and
uploads the checkpoint (bytes and shards). It stays silent when the stream is not a terminal
(logs, pipes, CI) or with ``verbose=False``; ``verbose=True`` forces it on.

A long prefill reports through a plain callback instead (``Model.prefill(ids, progress=cb)``,
``Model.generate(..., prefill_progress=cb)``): ``cb(done_tokens, total_tokens)`` after each chunk,
so a UI can draw its own bar. :func:`prefill_bar` is such a callback for a terminal.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

ProgressCallback = Callable[[int, int], None]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def wants_progress(verbose: bool | None, stream: TextIO) -> bool:
    """Show progress on ``stream``? verbose=None: only when it is a terminal."""
    if verbose is not None:
        return bool(verbose)
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # closed or not a file
        return False


class LoadProgress:
    """``update(done_bytes, shards_read)`` while uploading ``total_bytes`` from ``shards`` files;
    ``close()`` ends the line. Redraws at most every ``interval`` seconds."""

    def __init__(self, total_bytes: int, shards: int, *, verbose: bool | None = None,
                 stream: TextIO | None = None, label: str = "loading weights", interval: float = 0.1):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = wants_progress(verbose, self.stream) and total_bytes > 0
        self.total, self.shards, self.label, self.interval = total_bytes, max(shards, 1), label, interval
        self.t0 = time.perf_counter()
        self._last = -1.0
        self._drawn = False

    def update(self, done_bytes: int, shards_read: int = 1, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        pct = 100.0 * done_bytes / self.total
        dt = now - self.t0
        rate = f", {_gb(done_bytes / dt)}/s" if dt > 0.5 else ""
        self.stream.write(f"\r{self.label}: {_gb(done_bytes)} / {_gb(self.total)} ({pct:5.1f}%), "
                          f"{shards_read}/{self.shards} shards{rate}   ")
        self.stream.flush()
        self._drawn = True

    def close(self, done_bytes: int | None = None) -> None:
        if not self.enabled:
            return
        self.update(self.total if done_bytes is None else done_bytes, self.shards, force=True)
        self.stream.write(f"in {time.perf_counter() - self.t0:.1f} s\n")
        self.stream.flush()


def prefill_bar(stream: TextIO | None = None, label: str = "prefill") -> ProgressCallback:
    """A prefill progress callback drawing ``prefill: 4096 / 32768 tokens`` on a terminal."""
    out = sys.stderr if stream is None else stream

    def cb(done: int, total: int) -> None:
        out.write(f"\r{label}: {done} / {total} tokens" + ("\n" if done >= total else ""))
        out.flush()
    return cb
