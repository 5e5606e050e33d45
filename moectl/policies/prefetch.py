"""Prefetch policies: after layer l's router ran, which experts of layers l+1..l+depth to load now.

All return (target layer, expert, score), best first; the driver (runtime or simulator) skips
experts already resident, pins the predicted ones until their layer ran, and queues the loads
behind demand loads. `per_layer` caps the experts predicted per target layer, `min_score` drops
unlikely ones (a wrong prefetch costs PCIe time and evicts something).

Legend: L = MoE layers, E = experts, D = hidden size.
"""

from __future__ import annotations

import numpy as np

from .base import PrefetchPolicy


def _top(scores: np.ndarray, n: int, min_score: float) -> list[tuple[int, float]]:
    order = np.argsort(-scores)[:n]
    return [(int(e), float(scores[e])) for e in order if scores[e] >= min_score]


class GateReuse(PrefetchPolicy):
    """AdapMoE / HOBBIT: apply the next layers' routers to the current layer's MoE input.

    `routers[j]` is layer j's router weight [E, D] (optionally `bias[j]` [E]). Scores are the
    softmax probabilities of layer j's router on the current hidden state.
    """

    name = "gate-reuse"

    def __init__(self, routers: dict[int, np.ndarray], bias: dict[int, np.ndarray] | None = None,
                 depth: int = 1, per_layer: int = 2, min_score: float = 0.0) -> None:
        self.routers = {int(j): np.asarray(w, dtype=np.float32) for j, w in routers.items()}
        self.bias = {int(j): np.asarray(b, dtype=np.float32) for j, b in (bias or {}).items()}
        self.depth, self.per_layer, self.min_score = depth, per_layer, min_score
        self.hidden: np.ndarray | None = None
        self.layer = -1

    def reset(self):
        self.hidden = None

    def observe(self, layer, chosen, weights=None, hidden=None):
        self.layer = layer
        self.hidden = None if hidden is None else np.asarray(hidden, dtype=np.float32).reshape(-1)

    def predict(self, layer):
        if self.hidden is None:
            return []
        out = []
        for j in range(layer + 1, layer + 1 + self.depth):
            if j not in self.routers:
                continue
            logits = self.routers[j] @ self.hidden + self.bias.get(j, 0.0)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            out += [(j, e, s) for e, s in _top(p, self.per_layer, self.min_score)]
        return out


class MLPPrefetch(PrefetchPolicy):
    """ProMoE-style learned hidden-state predictor. `predictor.predict_scores(layer, hidden[D])` returns
    {target layer: scores [E]} (higher = more likely); see moectl/predictors/mlp.py."""

    name = "mlp"

    def __init__(self, predictor, depth: int = 2, per_layer: int = 2, min_score: float = 0.0) -> None:
        self.predictor, self.depth, self.per_layer, self.min_score = predictor, depth, per_layer, min_score
        self.scores: dict[int, np.ndarray] = {}

    def reset(self):
        self.scores = {}

    def observe(self, layer, chosen, weights=None, hidden=None):
        if hidden is None:
            self.scores = {}
            return
        h = np.asarray(hidden, dtype=np.float32).reshape(-1)
        # a set trained with use_chosen also reads this layer's own choice
        self.scores = (self.predictor.predict_scores(layer, h, chosen) if getattr(self.predictor, "use_chosen", False)
                       else self.predictor.predict_scores(layer, h))

    def predict(self, layer):
        out = []
        for j in sorted(self.scores):
            if layer < j <= layer + self.depth:
                out += [(j, e, s) for e, s in _top(np.asarray(self.scores[j]), self.per_layer, self.min_score)]
        return out


class EAMPrefetch(PrefetchPolicy):
    """MoE-Infinity: match the live request's activation matrix (rEAM so far + this token's iEAM) against
    a bounded collection of past request EAMs by cosine distance; prefetch by the matched, row-normalised,
    proximity-decayed pEAM: score(j, e) = pEAM[j, e] * (1 - (j - l) / L).

    The collection is seeded from calibration traces (`eamc`) and grows online: a finished request's EAM
    is added (replacing its most similar entry when full). With an empty collection it predicts from the
    live request's own EAM.
    """

    name = "eam"

    def __init__(self, num_layers: int, num_experts: int, eamc: list[np.ndarray] | None = None,
                 capacity: int = 256, match_k: int = 3, depth: int = 2, per_layer: int = 2,
                 min_score: float = 0.05) -> None:
        self.L, self.E = num_layers, num_experts
        self.capacity, self.match_k = capacity, match_k
        self.depth, self.per_layer, self.min_score = depth, per_layer, min_score
        self.eamc: list[np.ndarray] = []
        for m in eamc or []:
            self._add(np.asarray(m, dtype=np.float64))
        self.req = np.zeros((num_layers, num_experts))
        self.tok = np.zeros((num_layers, num_experts))

    def _add(self, eam: np.ndarray) -> None:
        if eam.sum() <= 0:
            return
        if len(self.eamc) >= self.capacity:
            S = np.stack(self.eamc).reshape(len(self.eamc), -1)
            v = eam.reshape(-1)
            d = 1 - S @ v / (np.linalg.norm(S, axis=1) * np.linalg.norm(v) + 1e-9)
            self.eamc[int(np.argmin(d))] = eam
        else:
            self.eamc.append(eam)

    def reset(self):
        self._add(self.req + self.tok)
        self.req = np.zeros((self.L, self.E))
        self.tok = np.zeros((self.L, self.E))

    def observe(self, layer, chosen, weights=None, hidden=None):
        for e in chosen:
            self.tok[layer, e] += 1

    def end_token(self, final_hidden=None):
        self.req += self.tok
        self.tok[:] = 0

    def predict_eam(self, layer: int) -> np.ndarray:
        q = self.req + self.tok
        if self.eamc:
            # compare only the rows seen in this token (l <= layer) plus the request so far
            S = np.stack(self.eamc)
            Sv, v = S.reshape(len(S), -1), q.reshape(-1)
            d = 1 - Sv @ v / (np.linalg.norm(Sv, axis=1) * np.linalg.norm(v) + 1e-9)
            agg = S[np.argsort(d)[: self.match_k]].sum(0) + q
        else:
            agg = q
        return agg / np.maximum(agg.sum(1, keepdims=True), 1e-9)

    def predict(self, layer):
        peam = self.predict_eam(layer)
        out = []
        for j in range(layer + 1, min(layer + 1 + self.depth, self.L)):
            s = peam[j] * (1 - (j - layer) / self.L)
            out += [(j, e, v) for e, v in _top(s, self.per_layer, self.min_score)]
        return out


class RoutingPrefetch(PrefetchPolicy):
    """Learned routing-only predictor (moectl/predictors/routing.py): P(e at l+d) from this token's routing
    so far and the previous tokens'; prefetch the `per_layer` most likely experts above `min_score`."""

    name = "routing"

    def __init__(self, predictor, depth: int | None = None, per_layer: int = 2, min_score: float = 0.5) -> None:
        self.pred = predictor
        self.depths = [d for d in predictor.lookahead if depth is None or d <= depth]
        self.per_layer, self.min_score = per_layer, min_score
        self.state = predictor.new_state()

    def reset(self):
        self.state.reset()

    def observe(self, layer, chosen, weights=None, hidden=None):
        self.state.observe(layer, chosen)

    def end_token(self, final_hidden=None):
        self.state.end_token()

    def predict(self, layer):
        out = []
        for d in self.depths:
            p = self.pred.predict(self.state, d)
            if p is not None:
                out += [(layer + d, e, s) for e, s in _top(p, self.per_layer, self.min_score)]
        return out


def eams_from_traces(traces, chunk: int = 64) -> list[np.ndarray]:
    """Request EAMs of calibration traces (decode rows), long requests cut into `chunk`-token pieces so a
    single long trace still gives the collection several entries."""
    from ..core.trace import PREFILL, expert_activation_matrix

    out = []
    for tr in traces:
        for _, sl in tr.request_slices():
            rows = np.arange(sl.start, sl.stop)
            rows = rows[tr.phase[rows] != PREFILL]
            for i in range(0, len(rows), chunk):
                r = rows[i: i + chunk]
                if len(r):
                    out.append(expert_activation_matrix(tr, slice(int(r[0]), int(r[-1]) + 1)).astype(np.float64))
    return out


class OraclePrefetch(PrefetchPolicy):
    """Perfect prefetch (simulation only, the limit beside Belady): after layer l's router, exactly the experts
    layers l+1..l+depth of this token will use; before a token's first layer, that layer's experts.

    `future`: per decode step in replay order, the experts each layer uses (the simulator's decode steps)."""

    name = "oracle"

    def __init__(self, future: list[list[list[int]]], depth: int = 1, per_layer: int = 2) -> None:
        self.future, self.depth, self.per_layer = future, depth, per_layer
        self.step = 0
        self.layer = -1

    def observe(self, layer, chosen, weights=None, hidden=None):
        self.layer = layer

    def _at(self, layer: int) -> list[tuple[int, int, float]]:
        if self.step >= len(self.future) or layer >= len(self.future[self.step]):
            return []
        return [(layer, int(e), 1.0) for e in self.future[self.step][layer][:self.per_layer]]

    def predict(self, layer):
        return [p for j in range(layer + 1, layer + 1 + self.depth) for p in self._at(j)]

    def end_token(self, final_hidden=None):
        self.step += 1

    def predict_after_token(self):
        return self._at(0)
