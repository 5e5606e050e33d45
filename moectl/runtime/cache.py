"""The expert cache as the layers' experts see it: one declared interface, `ExpertCache`, and its two kinds.

Legend: L = MoE layers, E = experts per layer, N = bytes of one packed expert.

What the cache holds (which expert sits in which slot, what is pinned or protected, which one goes, every hit/miss
counter) is `CacheState` (`moectl/core/cache_model.py`), whose rules the simulator obeys too; `ExpertCache` answers
the bookkeeping calls from it (`route`, `plan`, `chunks`, `pin`, `contains`, ...). Where the weights are is the kind's:

  DeviceCache     (`device_cache.py`) slot pools on the device, filled by copies through the one copy engine
                  (`loader.py`): a miss is a demand load, a prediction a prefetch, a CPU-computed miss a fill.
  InPlaceExperts  (here) CPU device with the experts in RAM (the default there): the host store is the device,
                  every (layer, expert) a view of its buffer made once; every access is a hit, nothing is copied.

The kind is declared, never probed: `in_place` (no slots: no copies, no fills, no CPU side, views valid for the
whole forward) and `streaming` (a prefill's misses stream through staging buffers: `stream`). `CacheStats` is the
counters and bytes a run reports.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod

import torch

from ..core.cache_model import FULL, LOW, PHASES, CacheState, hit_rate
from ..policies.base import ReplacementPolicy
from ..policies.precision import SKIP, PrecisionPolicy
from ..store.expert_store import ExpertStore


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
        """Uses of experts that were not resident: demand loads and misses computed on the CPU."""
        t = self._sum()
        return t["misses"] + t["cpu_misses"]

    @property
    def prefetches(self) -> int:
        return self._sum()["prefetches"]

    def as_dict(self) -> dict:
        t = self._sum()
        per = {p: self.state.totals(None, p) for p in self.state.counts}
        # bytes copied: demand loads, fills + prefetches, less those a reused slot cancelled before they ran (CPU: a
        # prefetch runs only when its expert is used, so a wrong one is usually never copied)
        pf_bytes = sum(c["prefetches"] * self.nbytes[p] for p, c in per.items()) - self.uncopied_bytes
        loaded = sum((c["misses"] + c["fills"]) * self.nbytes[p] for p, c in per.items()) + pf_bytes
        # misses: every use of an expert that was not resident, copied in (demand_loads) or computed on the CPU
        out = {"hits": t["hits"], "misses": t["misses"] + t["cpu_misses"], "hit_rate": hit_rate(t),
               "demand_loads": t["misses"], "cpu_misses": t["cpu_misses"],
               "bytes_loaded": int(round(loaded)), "load_wait_s": self.load_wait_s, "prefetches": t["prefetches"],
               "prefetch_bytes": int(round(pf_bytes)),
               "prefetch_used": t["prefetch_used"], "evictions": t["evictions"],
               "preload_bytes": self.preload_bytes, "preload_s": self.preload_s, "fills": self.fills,
               **{ph: _phase(self._sum(ph)) for ph in PHASES}}
        if LOW in per:
            out |= {"low_hits": per[LOW]["hits"], "low_misses": per[LOW]["misses"] + per[LOW]["cpu_misses"],
                    "skips": self.skips,
                    "full_misses": per.get(FULL, {}).get("misses", 0) + per.get(FULL, {}).get("cpu_misses", 0)}
        return out


def _phase(t: dict) -> dict:
    """A phase's hits, misses (demand loads and CPU-computed) and evictions."""
    return {"hits": t["hits"], "misses": t["misses"] + t["cpu_misses"], "evictions": t["evictions"]}


class ExpertCache(ABC):
    """Every call the layers' experts (`offloaded.py`) and the engine make on their expert cache. The bookkeeping
    half is answered here from the shared `state`; the weights half (`acquire`, `prefetch`, `resident_weights`, and
    for a cache with slots `landing`, `fill`, `stream`, `preload`) is the kind's."""

    # --- declared facts -------------------------------------------------------------------
    in_place: bool                          # no slots: weights used where the store holds them (InPlaceExperts)
    streaming: bool = False                 # a prefill's misses stream through two staging buffers (`stream`)
    state: CacheState
    stats: CacheStats
    store: ExpertStore
    device: torch.device
    slots_per_layer: list[int]              # full-precision slots per layer (in place: E)
    precision: PrecisionPolicy = PrecisionPolicy()       # always full unless the runtime sets another
    pf_precision: str = FULL                             # the copy prefetches load (low-bit when no full pool)

    # --- where the weights are: the kind's ---------------------------------------------------
    @abstractmethod
    def acquire(self, layer: int, expert: int, precision: str = FULL) -> dict:
        """The weights of (layer, expert) from pool `precision` (`ExpertFormat.weights`), one access of the state
        (a hit, or a miss that loads it); the caller pins its chunk first."""

    @abstractmethod
    def prefetch(self, layer: int, expert: int) -> bool:
        """Start loading (layer, expert) off the critical path; False when nothing was started."""

    @abstractmethod
    def resident_weights(self, layer: int, expert: int) -> dict | None:
        """The weights of a copy of (layer, expert) on the device now and landed (full precision first), or None.
        Changes nothing: no access counted, no policy told, nothing copied or waited for (`--draft cached`)."""

    def landing(self, layer: int, expert: int, precision: str = FULL) -> int:
        """0 landed, 1 a prefetch's copy issued earlier (in flight, or queued), 2 a demand load of this layer.
        Without copies everything has landed."""
        return 0

    def fill(self, layer: int, expert: int, precision: str = FULL) -> None:
        """Copy in a miss the CPU just computed (caches with slots; in place nothing misses)."""
        raise NotImplementedError(f"{type(self).__name__} has no slots to fill")

    def stream(self, layer: int, experts: list[int]):
        """(expert, weights) for a prefill's missed experts through staging buffers (only where `streaming`)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def preload(self, sets: dict) -> int:
        """Copy a plan's hot set into free slots at load time (caches with slots)."""
        raise NotImplementedError(f"{type(self).__name__} has no slots to preload")

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
        would skip it skips it only if every token does; the layer renormalises)."""
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


class InPlaceExperts(ExpertCache):
    """No GPU, experts in RAM (`--device cpu --offload ram`, the default there): the experts are computed where they
    lie, each (layer, expert) a view of the RAM-tier buffer uint8 [E, N] made once (a low-bit copy dequantised from
    its packed bytes where they lie, `ExpertFormat.weights`). Every acquire is a hit and no slot memory exists, so RSS
    is the checkpoint and decode runs as fast at any --cache-experts as with all experts resident (`--emulate-device`
    gives the CPU slots instead: `DeviceCache`, the cache logic the tests and simulator checks exercise).
    `precision`: a policy that uses low-bit copies (`--precision lowbit-only`) computes every expert from its low-bit
    buffer in place; any other computes from the full copies, all resident (HOBBIT's choice only matters on a miss,
    and in place there is none)."""

    in_place = True                 # views stay valid for the whole forward (offloaded.py may defer computing them)

    def __init__(self, store: ExpertStore, policy: ReplacementPolicy, precision: PrecisionPolicy | None = None):
        # the full copies in the RAM tier, the low-bit ones, or both (lowbit-only leaves the full ones in the file)
        pools = ([FULL] if store.buffers is not None else []) + ([LOW] if store.lowbit is not None else [])
        if not pools or (precision is not None and precision.name != "lowbit-only" and FULL not in pools):
            raise ValueError("in-place experts need the RAM tier")
        self.store, self.policy, self.device = store, policy, torch.device("cpu")
        if precision is not None:
            self.precision = precision
        self.slots_per_layer = [store.num_experts] * store.num_layers
        self.state = CacheState({p: self.slots_per_layer for p in pools}, {p: copy.deepcopy(policy) for p in pools})
        self.state.policies[pools[0]] = policy
        self.views, self.formats = {}, {}
        for p in pools:
            self.state.fill(p)                      # every expert resident from the start: accesses only hit
            self.formats[p] = store.format_of(p)
            buffers = store.buffers if p == FULL else store.lowbit.buffers
            # per layer: a GGUF's experts repacked for the CPU int4 kernel differ in parts by layer (moectl/store/gguf/cpu.py)
            self.views[p] = [[store.format_of(p, layer).views(buf[e]) for e in range(store.num_experts)]
                             for layer, buf in enumerate(buffers)]
        self.stats = CacheStats(self.state, {p: store.nbytes(p) for p in dict.fromkeys([FULL] + pools)})

    def plan(self, layer: int, expert: int, scores) -> str:
        return LOW if self.precision.name == "lowbit-only" else FULL

    def acquire(self, layer: int, expert: int, precision: str = FULL) -> dict:
        self.state.access(layer, expert, precision)      # counts the hit (and ticks the policies' clock)
        return self.store.format_of(precision, layer).weights(self.views[precision][layer][expert])

    def prefetch(self, layer: int, expert: int) -> bool:
        return False                                # always resident

    def resident_weights(self, layer: int, expert: int) -> dict:
        p = self.plan(layer, expert, [])                # the host is the device: every expert is resident
        return self.formats[p].weights(self.views[p][layer][expert])
