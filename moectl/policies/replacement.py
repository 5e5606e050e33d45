"""Replacement policies: which resident expert of a layer's pool to evict.

Every policy sees the same events from the runtime's DeviceCache and from the simulator:
on_route (the router's choice, every access), on_hit / on_insert / on_evict, on_token_end,
on_request_start, and victim(layer, candidates, now). Candidates never include pinned experts
(in use by the current layer, or predicted for the next layers). Pools are per layer, so layer
distance terms (HOBBIT's FLD, MoE-Infinity's 1 - l/L) only matter for a pool shared by layers.

Legend: L = MoE layers, E = experts per layer.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

import numpy as np

from .base import LRU, ReplacementPolicy


class LFU(ReplacementPolicy):
    """Sequence-level LFU: fewest uses in the current request goes; ties go to the least recent."""

    name = "lfu"

    def __init__(self) -> None:
        self.count: dict[tuple[int, int], int] = defaultdict(int)
        self.last: dict[tuple[int, int], float] = {}

    def on_request_start(self, request):
        self.count.clear()

    def on_route(self, layer, chosen, weights=None):
        for e in chosen:
            self.count[(layer, e)] += 1

    def on_hit(self, layer, expert, now):
        self.last[(layer, expert)] = now

    on_insert = on_hit

    def victim(self, layer, candidates, now):
        return min(candidates, key=lambda e: (self.count.get((layer, e), 0), self.last.get((layer, e), -1.0)))


class MoEInfinity(ReplacementPolicy):
    """MoE-Infinity Algorithm 1: evict the lowest (pEAM[l][e] + eps) * (1 - l/L) / rowsum(pEAM[l]).

    pEAM = row-normalised sum of the `match_k` request EAMs of the collection (EAMC) closest by
    cosine distance to the live request's EAM. The EAMC holds finished requests' decode EAMs
    (bounded, replacing the most similar entry when full, as in the paper's App. B.1); it can be
    seeded from calibration traces. With an empty EAMC the live request's own EAM is the prediction.
    """

    name = "moe-infinity"

    def __init__(self, num_layers: int, num_experts: int, capacity: int = 256, match_k: int = 1,
                 eps: float = 1e-3, eamc: list[np.ndarray] | None = None) -> None:
        self.L, self.E, self.capacity, self.match_k, self.eps = num_layers, num_experts, capacity, match_k, eps
        self.eamc: list[np.ndarray] = []                 # each [L, E] float
        self.cur = np.zeros((num_layers, num_experts))   # live request's EAM
        self.last: dict[tuple[int, int], float] = {}
        self._peam: np.ndarray | None = None             # cached per routing event
        for m in eamc or []:
            self.add_eam(np.asarray(m, dtype=np.float64))

    def add_eam(self, eam: np.ndarray) -> None:
        if eam.sum() <= 0:
            return
        if len(self.eamc) >= self.capacity:             # replace the most similar entry: keeps it diverse
            d = self._cosine_distance(np.stack(self.eamc), eam)
            self.eamc[int(np.argmin(d))] = eam
        else:
            self.eamc.append(eam)

    @staticmethod
    def _cosine_distance(stack: np.ndarray, q: np.ndarray) -> np.ndarray:
        S, v = stack.reshape(len(stack), -1), q.reshape(-1)
        return 1 - (S @ v) / (np.linalg.norm(S, axis=1) * np.linalg.norm(v) + 1e-9)

    def predict_eam(self) -> np.ndarray:
        """pEAM [L, E], row-normalised."""
        if self._peam is None:
            if self.eamc and self.cur.sum() > 0:
                d = self._cosine_distance(np.stack(self.eamc), self.cur)
                agg = np.stack(self.eamc)[np.argsort(d)[: self.match_k]].sum(0)
            else:
                agg = self.cur
            self._peam = agg / np.maximum(agg.sum(1, keepdims=True), 1e-9)
        return self._peam

    def on_request_start(self, request):
        self.add_eam(self.cur.copy())
        self.cur[:] = 0
        self._peam = None

    def on_route(self, layer, chosen, weights=None):
        for e in chosen:
            self.cur[layer, e] += 1
        self._peam = None

    def on_hit(self, layer, expert, now):
        self.last[(layer, expert)] = now

    on_insert = on_hit

    def victim(self, layer, candidates, now):
        row = self.predict_eam()[layer]
        ntok = max(row.sum(), 1e-9)
        decay = 1 - layer / self.L
        return min(candidates, key=lambda e: ((row[e] + self.eps) * decay / ntok, self.last.get((layer, e), -1.0)))


class Hobbit(ReplacementPolicy):
    """HOBBIT Eq. 3: evict the lowest w_lru*R/T + w_lfu*F/T + w_lhu*H/T + w_fld*FLD.

    R = token index of last use, F = uses in this sequence, H = high-precision uses (a use is low
    precision when the gate weights say so: the sum of the higher-ranked weights > t1, HOBBIT's
    Eq. 2; without weights every use is high precision), T = tokens so far, FLD = forward layer
    distance from the layer being served. Statistics reset per request (sequence level).
    The paper gives no weight values; the defaults (recency first) are our guess, not tuned: a grid
    search with the simulator on calibration traces is the paper's way to set them.
    """

    name = "hobbit"

    def __init__(self, num_layers: int, w_lru: float = 0.5, w_lfu: float = 0.3, w_lhu: float = 0.1,
                 w_fld: float = 0.1, t1: float = 0.6) -> None:
        self.L, self.t1 = num_layers, t1
        self.w = (w_lru, w_lfu, w_lhu, w_fld)
        self.R: dict[tuple[int, int], int] = {}
        self.F: dict[tuple[int, int], int] = defaultdict(int)
        self.H: dict[tuple[int, int], int] = defaultdict(int)
        self.T = 1
        self.cur_layer = 0

    def on_request_start(self, request):
        self.R.clear(), self.F.clear(), self.H.clear()
        self.T = 1

    def on_route(self, layer, chosen, weights=None):
        self.cur_layer = layer
        order = list(range(len(chosen)))
        if weights is not None:
            order.sort(key=lambda i: -weights[i])
            total = sum(weights) or 1.0
        above = 0.0
        for i in order:
            e = chosen[i]
            self.R[(layer, e)] = self.T
            self.F[(layer, e)] += 1
            if weights is None or above <= self.t1:
                self.H[(layer, e)] += 1
            if weights is not None:
                above += weights[i] / total

    def on_token_end(self, now):
        self.T += 1

    def score(self, layer: int, e: int) -> float:
        w_lru, w_lfu, w_lhu, w_fld = self.w
        fld = 1 - ((layer - self.cur_layer + self.L) % self.L) / self.L
        k = (layer, e)
        return (w_lru * self.R.get(k, 0) + w_lfu * self.F.get(k, 0) + w_lhu * self.H.get(k, 0)) / self.T + w_fld * fld

    def victim(self, layer, candidates, now):
        return min(candidates, key=lambda e: self.score(layer, e))


class Belady(ReplacementPolicy):
    """MIN: evict the expert whose next use is farthest in the future. Simulation only.

    The simulator calls `set_future(steps)` with, per step (a decode token, or a whole prefill), the
    experts each layer will use, and `on_token_end` after each step. Never-used-again experts go first.
    """

    name = "belady"
    needs_future = True

    def __init__(self) -> None:
        self.uses: dict[tuple[int, int], list[int]] = {}
        self.step = 0

    def set_future(self, steps: list[list[list[int]]]) -> None:
        uses: dict[tuple[int, int], list[int]] = defaultdict(list)
        for s, layers in enumerate(steps):
            for l, experts in enumerate(layers):
                for e in experts:
                    uses[(l, int(e))].append(s)
        self.uses, self.step = dict(uses), 0

    def next_use(self, layer: int, expert: int) -> float:
        u = self.uses.get((layer, expert))
        if not u:
            return math.inf
        i = bisect.bisect_left(u, self.step)
        return u[i] if i < len(u) else math.inf

    def on_token_end(self, now):
        self.step += 1

    def victim(self, layer, candidates, now):
        return max(candidates, key=lambda e: self.next_use(layer, e))


class Ours(ReplacementPolicy):
    """Decayed frequency plus "what came next last time": evict the lowest
        lrfu(e) + beta * next_vote(e)
    lrfu(e)      = sum over this request's uses of lam^(tokens ago) (LRU as lam -> 0, sequence LFU as lam -> 1)
    next_vote(e) = how often e ran at this layer in the `horizon` tokens that FOLLOWED the `neighbours`
                   earlier tokens of the request whose routing at the layers seen so far best matches the
                   current token's (token-level matching: the same token / context tends to recur, and
                   decodes loop), weighted by match quality and decaying with distance.
    Everything is computed from routing events only; no training data needed.
    """

    name = "ours"

    def __init__(self, num_layers: int, num_experts: int, lam: float = 0.97, beta: float = 4.0,
                 neighbours: int = 8, horizon: int = 4, gamma: float = 0.6, max_history: int = 2048) -> None:
        self.L, self.E, self.max_history = num_layers, num_experts, max_history
        self.lam, self.beta, self.m, self.horizon, self.gamma = lam, beta, neighbours, horizon, gamma
        self.score: dict[tuple[int, int], float] = {}
        self.stamp: dict[tuple[int, int], int] = {}
        self.t = 0
        self._reset_history()

    def _reset_history(self) -> None:
        self.hist = np.zeros((64, self.L, self.E), dtype=np.float32)    # [capacity, L, E] multi-hot per token
        self.H = 0
        self.cur = np.zeros((self.L, self.E), dtype=np.float32)
        self.sim = np.zeros(0, dtype=np.float32)
        self._vote: dict[int, np.ndarray] = {}

    def on_request_start(self, request):
        self._reset_history()

    def on_route(self, layer, chosen, weights=None):
        ids = [int(e) for e in chosen if e >= 0]
        for e in ids:
            k = (layer, e)
            self.score[k] = self._value(k) + 1.0
            self.stamp[k] = self.t
        self.cur[layer, ids] = 1.0
        if self.H:
            self.sim = self.gamma * self.sim + self.hist[: self.H, layer, ids].sum(1) / max(len(ids), 1)
        self._vote.pop(layer, None)

    def _value(self, k) -> float:
        s = self.score.get(k)
        if s is None:
            return 0.0
        return s * self.lam ** (self.t - self.stamp[k])

    def on_token_end(self, now):
        self.t += 1
        if self.H == self.max_history:                 # long chats: keep the recent half
            keep = self.max_history // 2
            self.hist[:keep] = self.hist[self.H - keep: self.H]
            self.H = keep
        if self.H == len(self.hist):
            self.hist = np.concatenate([self.hist, np.zeros_like(self.hist)])
        self.hist[self.H] = self.cur
        self.H += 1
        self.cur = np.zeros_like(self.cur)
        self.sim = np.zeros(self.H, dtype=np.float32)
        self._vote = {}

    def next_vote(self, layer: int) -> np.ndarray:
        """[E] expected use of each expert at `layer` over the next tokens, from matched earlier tokens."""
        v = self._vote.get(layer)
        if v is None:
            v = np.zeros(self.E, dtype=np.float32)
            n = self.H - 1                                    # neighbours need at least one successor
            if n > 0:
                s = self.sim[:n] + 1e-4 * np.arange(n) / n    # ties -> most recent
                top = np.argpartition(-s, self.m - 1)[: self.m] if n > self.m else np.arange(n)
                w = s[top] / max(s[top].max(), 1e-9)
                for h in range(1, self.horizon + 1):
                    ok = top + h < self.H
                    v += (0.7 ** (h - 1)) * (w[ok, None] * self.hist[top[ok] + h, layer]).sum(0)
                v /= max(w.sum(), 1e-9)
            self._vote[layer] = v
        return v

    def victim(self, layer, candidates, now):
        vote = self.next_vote(layer) if self.beta else None
        return min(candidates, key=lambda e: self._value((layer, e)) + (self.beta * vote[e] if vote is not None else 0.0))


__all__ = ["LRU", "LFU", "MoEInfinity", "Hobbit", "Belady", "Ours"]
