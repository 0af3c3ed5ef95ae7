"""The NumPy reference model as a backend (``backend="reference"``): slow, exact, any machine."""
from __future__ import annotations

import numpy as np

from ..checkpoint import ModelWeights
from ..config import ModelConfig


class ReferenceBackend:
    """The NumPy reference model as a backend (slow, exact, any machine)."""
    name = "reference"

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, *, deltanet: str = "chunked"):
        from ..reference.model import ReferenceModel
        self.model = ReferenceModel(cfg, weights, deltanet=deltanet)
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
        return self.state.fork()

    def restore(self, snap) -> None:
        self.state = snap.fork()
