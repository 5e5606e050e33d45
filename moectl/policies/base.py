"""Policy interfaces. No device code here: the runtime and the simulator drive the same objects.

Events carry (layer, expert, now). `layer` is the trace/MoE layer index (0..L-1, MoE layers only),
`now` the logical clock of `moectl/core/cache_model.py: CacheState` (one tick per access and per prefetch
insert), which the runtime and the simulator share, so policies behave identically in both. That
module's docstring is the rule set: event order, phases, counting, when predicted experts may go.
Prefetch policies see decode steps only (observe, predict, end_token, predict_after_token).
"""

from __future__ import annotations


class ReplacementPolicy:
    """Chooses which resident expert of a layer's slot pool to evict. One object per cache."""

    name = "base"
    needs_future = False             # True only for Belady/MIN: the simulator calls set_future()

    def on_route(self, layer: int, chosen: list[int], weights: list[float] | None = None) -> None:
        """Layer `layer`'s router chose `chosen` for the current token (every access, hit or miss;
        never called for prefetches). Frequency-based policies count here."""

    def on_hit(self, layer: int, expert: int, now: float) -> None: ...

    def on_insert(self, layer: int, expert: int, now: float) -> None: ...

    def on_evict(self, layer: int, expert: int, now: float) -> None: ...

    def on_token_end(self, now: float) -> None:
        """A token finished all its layers (sequence-level policies count here)."""

    def on_request_start(self, request: str) -> None:
        """A new request begins (sequence-level statistics reset here)."""

    def victim(self, layer: int, candidates: list[int], now: float) -> int:
        """Pick one expert id from `candidates` (resident, not pinned) to evict."""
        raise NotImplementedError


class LRU(ReplacementPolicy):
    """Least recently used (mixtral-offloading's policy)."""

    name = "lru"

    def __init__(self) -> None:
        self.last: dict[tuple[int, int], float] = {}

    def on_hit(self, layer, expert, now):
        self.last[(layer, expert)] = now

    on_insert = on_hit

    def on_evict(self, layer, expert, now):
        self.last.pop((layer, expert), None)

    def victim(self, layer, candidates, now):
        return min(candidates, key=lambda e: self.last.get((layer, e), -1.0))


class PrefetchPolicy:
    """Predicts experts of later layers so loads start before those layers run."""

    name = "none"

    def reset(self) -> None:
        """A new request begins."""

    def observe(self, layer: int, chosen: list[int], weights: list[float] | None = None,
                hidden=None) -> None:
        """Layer `layer`'s router just chose `chosen`; `hidden` is its MoE-block input [D] when known."""

    def predict(self, layer: int) -> list[tuple[int, int, float]]:
        """After observing `layer`: (target layer, expert, score) to prefetch, best first."""
        return []

    def end_token(self, final_hidden=None) -> None:
        """The token is done; `final_hidden` [D] is its final hidden state when known."""

    def predict_after_token(self) -> list[tuple[int, int, float]]:
        """After `end_token`: (target layer, expert, score) to load before the next token's first layer
        (AdapMoE's aux gate); the driver issues them when the next decode step of the request begins."""
        return []
