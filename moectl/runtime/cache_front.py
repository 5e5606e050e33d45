"""CacheFront: the calls the runtime makes on its expert cache (route, plan, chunks, pin, counters), answered by the
shared `CacheState` (`moectl/core/cache_model.py`, the simulator's bookkeeping too); `DeviceCache` (slots, copies) and
`InPlaceExperts` (no slots) add where the weights are. CacheStats: the counters and bytes a run reports."""

from __future__ import annotations

import torch

from ..core.cache_model import FULL, LOW, PHASES, CacheState
from ..policies.precision import SKIP, PrecisionPolicy


class CacheStats:
    """Byte and wait-time counters of the copies; hit/miss/prefetch counts come from the state, summed over
    its pools (`nbytes`: bytes of one copy per precision)."""

    def __init__(self, state: CacheState, expert_nbytes: int | dict):
        self.state = state
        self.nbytes = expert_nbytes if isinstance(expert_nbytes, dict) else {FULL: expert_nbytes}
        self.expert_nbytes = self.nbytes[FULL]
        self.load_wait_s = 0.0          # time the forward waited for demand loads
        self.skips = 0                  # routed experts the precision policy dropped on a miss
        self.uncopied_bytes = 0.0       # bytes of prefetches cancelled before their copy ran (slot reused first)
        self.preload_s = 0.0            # load time spent copying a plan's hot set (not per-token work)
        self.preload_bytes = 0
        self.fills = 0                  # misses the CPU computed, then copied in while the copy engine idled
        self._pending_events: list = []

    def _sum(self, phase: str | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.state.counts:
            for k, v in self.state.totals(phase, p).items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def hits(self) -> int:
        return self._sum()["hits"]

    @property
    def misses(self) -> int:
        return self._sum()["misses"]

    @property
    def prefetches(self) -> int:
        return self._sum()["prefetches"]

    def as_dict(self) -> dict:
        t = self._sum()
        per = {p: self.state.totals(None, p) for p in self.state.counts}
        n = t["hits"] + t["misses"]
        # bytes copied: demand loads + prefetches, less those a reused slot cancelled before they ran (CPU: a
        # prefetch runs only when its expert is used, so a wrong one is usually never copied)
        pf_bytes = sum(c["prefetches"] * self.nbytes[p] for p, c in per.items()) - self.uncopied_bytes
        loaded = sum(c["misses"] * self.nbytes[p] for p, c in per.items()) + pf_bytes
        out = {"hits": t["hits"], "misses": t["misses"], "hit_rate": t["hits"] / n if n else 0.0,
               "bytes_loaded": int(round(loaded)), "load_wait_s": self.load_wait_s, "prefetches": t["prefetches"],
               "prefetch_bytes": int(round(pf_bytes)),
               "prefetch_used": t["prefetch_used"], "evictions": t["evictions"],
               "preload_bytes": self.preload_bytes, "preload_s": self.preload_s, "fills": self.fills,
               **{ph: {k: v for k, v in self._sum(ph).items() if k in ("hits", "misses", "evictions")}
                  for ph in PHASES}}
        if LOW in per:
            out |= {"low_hits": per[LOW]["hits"], "low_misses": per[LOW]["misses"], "skips": self.skips,
                    "full_misses": per.get(FULL, {}).get("misses", 0)}
        return out


class CacheFront:
    """The calls the runtime makes on its expert cache, answered by the shared `CacheState` (`state`);
    subclasses add where the weights are (`acquire`, `prefetch`)."""

    state: CacheState
    stats: CacheStats
    precision: PrecisionPolicy = PrecisionPolicy()       # always full unless the runtime sets another
    pf_precision: str = FULL                             # the copy prefetches load (low-bit when no full pool)

    def device_nbytes(self) -> int:
        """Bytes of device memory the expert cache holds (its slot pools); none when experts are used in place."""
        return 0

    def backlog_bytes(self) -> float:
        """Bytes the copy engine has committed to now (none without slots to copy into)."""
        return 0.0

    # --- precision: which copy serves each routed expert --------------------------------------
    @property
    def precisions(self) -> list[str]:
        return list(self.state.counts)

    def plan(self, layer: int, expert: int, scores: list[float]) -> str:
        """FULL, LOW or SKIP for `expert` of `layer`, `scores` its rank scores for the tokens that chose it
        (`policies/precision.py: rank_scores`). A resident copy of either precision is always used; else the
        precision policy decides, per token, and the copy loaded is the best any token asks for (a token that
        would skip it skips it only if every token does; the driver renormalises)."""
        if self.contains(layer, expert, FULL) or self.state.staged_in(layer, expert) == FULL:
            return FULL
        low = LOW in self.state.counts
        if low and self.state.contains(layer, expert, LOW):
            return LOW
        ds = {self.precision.decide(s) for s in scores}
        d = FULL if FULL in ds or not low else LOW if LOW in ds else SKIP
        if d == SKIP:
            self.stats.skips += 1
        return d

    # --- bookkeeping: the shared state --------------------------------------------------
    def resident(self, layer: int, precision: str = FULL) -> list[int]:
        return self.state.resident(layer, precision) if precision in self.state.counts else []

    def contains(self, layer: int, expert: int, precision: str = FULL) -> bool:
        return precision in self.state.counts and self.state.contains(layer, expert, precision)

    def pin(self, layer: int, experts, precision: str = FULL) -> None:
        self.state.pin(layer, experts, precision)

    def unpin(self, layer: int, experts, precision: str = FULL) -> None:
        self.state.unpin(layer, experts, precision)

    def begin_request(self, name: str) -> None:
        self.state.begin_request(name)

    def begin_step(self, phase: str) -> None:
        self.state.begin_step(phase)

    def route(self, layer: int, chosen: list[int], weights: list[float] | None = None) -> None:
        for p in self.state.counts:
            for _, _, e, _ in self.state.route(layer, chosen, weights, p):
                self._unstage(layer, e)

    def chunks(self, layer: int, experts: list[int], precision: str = FULL) -> list[list[int]]:
        return self.state.chunks(layer, experts, precision)

    def end_token(self) -> None:
        for layer, _, e, _ in self.state.end_step():
            self._unstage(layer, e)

    def _unstage(self, layer: int, expert: int) -> None:
        """A staged prefetch no access took (none without staging buffers)."""

    def snapshot(self) -> dict:
        """Stats as a dict; on CUDA this resolves the timed demand-load events (a sync)."""
        if self.stats._pending_events:
            torch.cuda.synchronize(self.device)
            for start, end in self.stats._pending_events:
                self.stats.load_wait_s += start.elapsed_time(end) / 1000.0
            self.stats._pending_events.clear()
        return self.stats.as_dict()
