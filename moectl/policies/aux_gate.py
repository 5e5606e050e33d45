"""AdapMoE's first-layer auxiliary gate as a prefetch policy, optionally stacked on another policy.

Nothing inside a token can predict its first MoE layer: the aux gate predicts it from the previous
token's final hidden state. At `end_token(final_hidden)` it scores layer 0's experts for the next
token; the driver asks for them with `predict_after_token()` when the next decode step begins. Every
other layer is left to `inner` (e.g. the MLP or routing predictor), so `aux-gate` never costs a layer
coverage.
"""

from __future__ import annotations

import numpy as np

from .base import PrefetchPolicy


class AuxGatePrefetch(PrefetchPolicy):
    name = "aux-gate"

    def __init__(self, predictor, inner: PrefetchPolicy | None = None, per_layer: int = 2,
                 min_score: float = 0.0) -> None:
        self.gate, self.inner = predictor, inner or PrefetchPolicy()
        self.per_layer, self.min_score = per_layer, min_score
        self.first: np.ndarray | None = None               # [E] scores of layer 0 for the next token

    def reset(self):
        self.first = None
        self.inner.reset()

    def observe(self, layer, chosen, weights=None, hidden=None):
        self.inner.observe(layer, chosen, weights, hidden)

    def end_token(self, final_hidden=None):
        self.inner.end_token(final_hidden)
        self.first = None if final_hidden is None else np.asarray(self.gate.predict_scores(final_hidden))

    def predict(self, layer):
        return self.inner.predict(layer)

    def predict_after_token(self):
        if self.first is None:
            return []
        order = np.argsort(-self.first)[: self.per_layer]
        return [(0, int(e), float(self.first[e])) for e in order if self.first[e] >= self.min_score]
