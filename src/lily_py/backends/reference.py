"""The NumPy reference model as a backend (``backend="reference"``): slow, exact, any machine."""
from __future__ import annotations

import numpy as np

from ..checkpoint import ModelWeights
from ..config import ModelConfig


class ReferenceBackend:
    """The NumPy reference model as a backend (slow, exact, any machine)."""
    name = "reference"

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, *, deltanet: str = "chunked",
                 kv_dtype: str | None = None):
        from ..reference.model import ReferenceModel
        self.model = ReferenceModel(cfg, weights, deltanet=deltanet, kv_dtype=kv_dtype)
        self.state = self.model.new_state()

    def forward(self, ids: np.ndarray, *, all_logits: bool) -> np.ndarray:
        # All or nothing: run on a fork and keep it only if every layer finished, so an
        # exception (or Ctrl-C) mid-step leaves the previous state intact.
        state = self.state.fork()
        out = self.model.forward(ids, state, all_logits=all_logits)
        self.state = state
        return out

    def reset(self) -> None:
        self.state = self.model.new_state()

    @property
    def position(self) -> int:
        return self.state.position

    valid = True          # forward is all-or-nothing: the state is always consistent

    def snapshot(self):
        """A copy of the state that later steps can never write into: the KV rows are copied out
        of the growing buffers (a plain fork shares them, and a sibling fork restored from an
        earlier snapshot would overwrite rows a longer snapshot still reads)."""
        snap = self.state.fork()
        for c in snap.kv.values():
            if c.k is not None:
                c.k, c.v = c.k[:c.length].copy(), c.v[:c.length].copy()
        return snap

    def restore(self, snap) -> None:
        # The snapshot's KV buffers are exactly full: the next append reallocates.
        self.state = snap.fork()

    @staticmethod
    def snapshot_nbytes(snap) -> int:
        n = sum(c.k.nbytes + c.v.nbytes for c in snap.kv.values() if c.k is not None)
        n += sum(a.nbytes for a in snap.conv.values()) + sum(a.nbytes for a in snap.recurrent.values())
        return n

    @staticmethod
    def snapshot_bytes(snap) -> bytes:
        """Every state array, concatenated in layer order (for comparing states bit for bit)."""
        parts = []
        for i in sorted(set(snap.kv) | set(snap.conv) | set(snap.recurrent)):
            if i in snap.kv and snap.kv[i].k is not None:
                c = snap.kv[i]
                parts += [c.k[:c.length].tobytes(), c.v[:c.length].tobytes()]
            for d in (snap.conv, snap.recurrent):
                if i in d:
                    parts.append(np.ascontiguousarray(d[i]).tobytes())
        return b"".join(parts)
