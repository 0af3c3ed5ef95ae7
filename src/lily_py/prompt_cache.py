"""Prompt cache: snapshots of the whole model state (KV cache, DeltaNet recurrent state, conv
windows) at chosen token boundaries, kept in a prefix tree keyed by token ids.

Qwen3.6 is a hybrid model: the recurrent state of its Gated DeltaNet layers cannot be rolled back
to an earlier position, so a prompt that shares a prefix with an earlier one can only skip the
shared part by restoring a snapshot taken exactly at the end of that prefix. ``Model.generate``
takes snapshots at the end of every chat prompt before the generation prompt and at the end of a
long system prompt / tool list, and restores the longest cached prefix of a new prompt.

The tree is a radix tree (edges labelled with runs of token ids), so a 100K-token prompt costs a
few nodes, not one per token. Entries are evicted least-recently-used first when their total size
goes over ``max_bytes``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .defaults import DEFAULT_PROMPT_CACHE_BYTES


@dataclass
class CacheEntry:
    """A snapshot of the state after feeding ``tokens`` and the logits of the last one."""
    tokens: tuple[int, ...]
    state: Any
    logits: np.ndarray | None
    nbytes: int
    last_used: int = 0


@dataclass
class _Node:
    children: dict[int, tuple[tuple[int, ...], "_Node"]] = field(default_factory=dict)
    entry: CacheEntry | None = None


class PromptCache:
    """Prefix tree of state snapshots with LRU eviction by bytes.

    ``max_bytes``: budget for all snapshots (0 disables the cache). ``lookup(ids)`` returns the
    entry with the longest token prefix of ``ids`` (or None), ``insert(tokens, state, logits,
    nbytes)`` adds one. ``hits`` / ``misses`` count lookups; ``nbytes`` is the size held now.
    """

    def __init__(self, max_bytes: int = DEFAULT_PROMPT_CACHE_BYTES):
        self.max_bytes = max_bytes
        self._root = _Node()
        self._entries: dict[tuple[int, ...], CacheEntry] = {}
        self._clock = itertools.count(1)
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"prompt cache size must be a non-negative integer (bytes), "
                             f"got {value!r}")
        self._max_bytes = value
        if hasattr(self, "_entries"):
            self._evict(0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._entries

    def entries(self) -> list[CacheEntry]:
        """The entries, least recently used first."""
        return sorted(self._entries.values(), key=lambda e: e.last_used)

    def clear(self) -> None:
        self._root = _Node()
        self._entries.clear()
        self.nbytes = 0

    def __repr__(self) -> str:
        return (f"<PromptCache {len(self)} snapshots, {self.nbytes} / {self.max_bytes} bytes, "
                f"{self.hits} hits, {self.misses} misses>")

    # ---- lookup / insert -----------------------------------------------------------------------
    def lookup(self, ids: Sequence[int], *, count: bool = True) -> CacheEntry | None:
        """The entry whose tokens are the longest prefix of ``ids`` (marked recently used)."""
        node, pos, best = self._root, 0, None
        ids = list(ids)
        while True:
            if node.entry is not None:
                best = node.entry
            if pos >= len(ids):
                break
            child = node.children.get(ids[pos])
            if child is None:
                break
            edge, nxt = child
            if list(edge) != ids[pos:pos + len(edge)]:
                break
            node, pos = nxt, pos + len(edge)
        if count:
            if best is None:
                self.misses += 1
            else:
                self.hits += 1
        if best is not None:
            best.last_used = next(self._clock)
        return best

    def insert(self, tokens: Sequence[int], state: Any, logits: np.ndarray | None,
               nbytes: int) -> CacheEntry | None:
        """Add (or replace) the snapshot after ``tokens``; evicts LRU entries to stay within
        ``max_bytes``. Returns the entry, or None when it alone is over the budget."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            raise ValueError("a prompt cache entry needs at least one token")
        if logits is not None:
            nbytes += logits.nbytes
        if nbytes > self.max_bytes:
            return None
        if tokens in self._entries:
            self._remove(tokens)
        self._evict(nbytes)
        entry = CacheEntry(tokens, state, logits, nbytes, next(self._clock))
        self._node_for(tokens).entry = entry
        self._entries[tokens] = entry
        self.nbytes += nbytes
        return entry

    def remove(self, tokens: Sequence[int]) -> bool:
        tokens = tuple(tokens)
        if tokens not in self._entries:
            return False
        self._remove(tokens)
        return True

    # ---- internals -----------------------------------------------------------------------------
    def _evict(self, incoming: int) -> None:
        while self._entries and self.nbytes + incoming > self.max_bytes:
            lru = min(self._entries.values(), key=lambda e: e.last_used)
            self._remove(lru.tokens)
            self.evictions += 1

    def _node_for(self, tokens: tuple[int, ...]) -> _Node:
        """The node for ``tokens``, creating it (splitting an edge if needed)."""
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = _Node()
                node.children[tokens[pos]] = (tokens[pos:], new)
                return new
            edge, nxt = child
            n = 0
            while n < len(edge) and pos + n < len(tokens) and edge[n] == tokens[pos + n]:
                n += 1
            if n == len(edge):
                node, pos = nxt, pos + n
                continue
            mid = _Node()                                   # split the edge at n
            mid.children[edge[n]] = (edge[n:], nxt)
            node.children[tokens[pos]] = (edge[:n], mid)
            node, pos = mid, pos + n
        return node

    def _remove(self, tokens: tuple[int, ...]) -> None:
        entry = self._entries.pop(tokens)
        self.nbytes -= entry.nbytes
        path: list[tuple[_Node, int]] = []            # (parent, first token of the edge)
        node, pos = self._root, 0
        while pos < len(tokens):
            edge, nxt = node.children[tokens[pos]]
            path.append((node, tokens[pos]))
            node, pos = nxt, pos + len(edge)
        node.entry = None
        # Prune: drop empty leaves, merge single-child pass-through nodes into their edge.
        while path:
            parent, key = path.pop()
            edge, child = parent.children[key]
            if child.entry is None and not child.children:
                del parent.children[key]
            elif child.entry is None and len(child.children) == 1:
                (sub_edge, grand), = child.children.values()
                parent.children[key] = (edge + sub_edge, grand)
            else:
                break
