"""DeviceCache: the shared cache bookkeeping (`moectl/cache_model.py`) + the tensor copies it implies.

Legend: L = MoE layers, S_l = slots of layer l, N = bytes of one packed expert (`ExpertFormat.nbytes`).

Which expert sits in which slot, what is pinned or protected, which one goes, and every hit/miss
counter live in `CacheState`, whose rules the simulator obeys too. This file only moves bytes: a miss
copies the expert's packed host buffer into the slot the state chose; a hit returns the slot as it is.
With low-bit copies (`--lowbit`) every layer has a second pool of smaller slots (`LOW`), filled from the
store's low-bit tier; `plan` says which copy serves each routed expert (a resident copy of either precision,
else the precision policy's choice: full, low or skip), and a low-bit slot is dequantised where it is computed.
On CUDA, prefetches run on a separate copy stream and each slot carries a ready event that the
compute stream waits on; on CPU every copy is synchronous and the same bookkeeping runs, so the logic
the tests exercise is the logic the GPU runs.
Slots are allocated and written once at start-up, so the cache costs its memory once and a first use
is never a page-fault storm. A disk-tier load reads the shard bytes straight into the slot (CUDA: into
the slot's pinned staging buffer, then one async copy); prefetch reads run on the store's background
thread, and any wait for them is counted as load wait. (On a CPU without `--emulate-device` the runtime
uses `InPlaceExperts` instead: no slots, no copies.)
"""

from __future__ import annotations

import copy
import time

import torch

from ..cache_model import FULL, LOW, PHASES, CacheState, split_slots
from ..errors import MoectlError
from ..policies.base import ReplacementPolicy
from ..policies.precision import SKIP, PrecisionPolicy
from ..store.expert_store import ExpertStore
from ..store.memory import host_empty

__all__ = ["CacheFront", "CacheStats", "DeviceCache", "split_slots"]


class CacheStats:
    """Byte and wait-time counters of the copies; hit/miss/prefetch counts come from the state, summed over
    its pools (`nbytes`: bytes of one copy per precision)."""

    def __init__(self, state: CacheState, expert_nbytes: int | dict):
        self.state = state
        self.nbytes = expert_nbytes if isinstance(expert_nbytes, dict) else {FULL: expert_nbytes}
        self.expert_nbytes = self.nbytes[FULL]
        self.load_wait_s = 0.0          # time the forward waited for demand loads
        self.skips = 0                  # routed experts the precision policy dropped on a miss
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
        loaded = sum((c["misses"] + c["prefetches"]) * self.nbytes[p] for p, c in per.items())  # demand + prefetch
        out = {"hits": t["hits"], "misses": t["misses"], "hit_rate": t["hits"] / n if n else 0.0,
               "bytes_loaded": loaded, "load_wait_s": self.load_wait_s, "prefetches": t["prefetches"],
               "prefetch_bytes": sum(c["prefetches"] * self.nbytes[p] for p, c in per.items()),
               "prefetch_used": t["prefetch_used"], "evictions": t["evictions"],
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

    # --- precision: which copy serves each routed expert --------------------------------------
    @property
    def precisions(self) -> list[str]:
        return list(self.state.counts)

    def plan(self, layer: int, expert: int, scores: list[float]) -> str:
        """FULL, LOW or SKIP for `expert` of `layer`, `scores` its rank scores for the tokens that chose it
        (`policies/precision.py: rank_scores`). A resident copy of either precision is always used; else the
        precision policy decides, per token, and the copy loaded is the best any token asks for (a token that
        would skip it skips it only if every token does; the driver renormalises)."""
        if self.state.contains(layer, expert, FULL):
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
        return self.state.contains(layer, expert, precision)

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
            self.state.route(layer, chosen, weights, p)

    def chunks(self, layer: int, experts: list[int], precision: str = FULL) -> list[list[int]]:
        return self.state.chunks(layer, experts, precision)

    def end_token(self) -> None:
        self.state.end_step()

    def snapshot(self) -> dict:
        """Stats as a dict; on CUDA this resolves the timed demand-load events (a sync)."""
        if self.stats._pending_events:
            torch.cuda.synchronize(self.device)
            for start, end in self.stats._pending_events:
                self.stats.load_wait_s += start.elapsed_time(end) / 1000.0
            self.stats._pending_events.clear()
        return self.stats.as_dict()


class DeviceCache(CacheFront):
    def __init__(self, store: ExpertStore, slots_per_layer: list[int], device: torch.device,
                 policy: ReplacementPolicy, low_slots: list[int] | None = None,
                 precision: PrecisionPolicy | None = None):
        if len(slots_per_layer) != store.num_layers:
            raise MoectlError(f"cache plan has {len(slots_per_layer)} layers, the model has {store.num_layers} MoE layers")
        self.store, self.device, self.policy = store, torch.device(device), policy
        self.slots_per_layer = [max(1, min(int(s), store.num_experts)) for s in slots_per_layer]
        slots, policies = {FULL: self.slots_per_layer}, {FULL: policy}
        if low_slots is not None:
            if store.lowbit is None:
                raise MoectlError("a low-bit cache pool needs the store's low-bit copies (--lowbit)")
            slots[LOW] = [max(1, min(int(s), store.num_experts)) for s in low_slots]
            policies[LOW] = copy.deepcopy(policy)           # the same kind of policy, its own state
        if precision is not None:
            if precision.uses_lowbit and LOW not in slots:
                raise MoectlError(f"{precision.describe()} needs low-bit copies: give --lowbit (see moectl quantize)")
            self.precision = precision
        self.state = CacheState(slots, policies)
        self.cuda = self.device.type == "cuda"
        # Per precision: [L] of uint8 [S_l, N] slot pools, and typed views of every slot made once.
        self.pools: dict[str, list[torch.Tensor]] = {}
        self.views: dict[str, list[list[dict]]] = {}
        for p, per_layer in slots.items():
            N = store.nbytes(p)
            if self.cuda:
                pool = [torch.empty(s, N, dtype=torch.uint8, device=self.device) for s in per_layer]
            else:
                pool = [host_empty((s, N), torch.uint8, "allocating cache slots", touch=True) for s in per_layer]
            self.pools[p] = pool
            self.views[p] = [[store.format_of(p).views(buf[s]) for s in range(len(buf))] for buf in pool]
        self.pool = self.pools[FULL]                                        # the full-precision slots
        # CUDA + disk tier: each full slot's pinned host buffer, the target of its shard reads (low-bit copies
        # are in RAM: copied straight from there).
        self.staging = [host_empty((s, store.expert_nbytes), torch.uint8, "allocating pinned staging buffers",
                                   pin=True)
                        for s in self.slots_per_layer] if self.cuda and store.buffers is None else None
        self.pending: dict = {}                                 # (precision, layer, slot) -> Future of a read
        self.stats = CacheStats(self.state, {p: store.nbytes(p) for p in slots})
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready: dict[tuple, torch.cuda.Event] = {}          # (precision, layer, slot) -> copy done

    # --- copies -------------------------------------------------------------------------
    def _settle(self, key: tuple) -> None:
        """Wait for a background read into slot `key` (precision, layer, slot)."""
        fut = self.pending.pop(key, None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            self.stats.load_wait_s += time.perf_counter() - t0

    def _copy_in(self, p: str, layer: int, expert: int, slot: int, stream, background: bool = False) -> None:
        """Fill `slot` of pool `p` with the expert: a copy of its host buffer, or its shard bytes read into the slot."""
        key = (p, layer, slot)
        self._settle(key)
        dst = self.pools[p][layer][slot]
        if not self.cuda:
            if background:
                self.pending[key] = self.store.load_async(layer, expert, dst, precision=p)
            else:
                self.store.load_into(layer, expert, dst, parallel=True, precision=p)
            return
        if p != FULL or self.staging is None:
            self._to_device(key, self.store.host(layer, expert, p), stream)
            return
        staging = self.staging[layer][slot]
        last = self.ready.pop(key, None)
        if last is not None:                # the previous copy out of this staging buffer must be done
            last.synchronize()
        if background:
            self.pending[key] = self.store.load_async(
                layer, expert, staging, then=lambda: self._to_device(key, staging, stream))
        else:
            self.store.load_into(layer, expert, staging, parallel=True)
            self._to_device(key, staging, stream)

    def _to_device(self, key: tuple, src: torch.Tensor, stream) -> None:
        p, layer, slot = key
        with torch.cuda.stream(stream):
            self.pools[p][layer][slot].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        self.ready[key] = ev

    def acquire(self, layer: int, expert: int, precision: str = FULL) -> dict[str, torch.Tensor]:
        """Weights of (layer, expert) from pool `precision` on the device (`ExpertFormat.weights`: dequantised on
        the device for a low-bit copy), loading on a miss. The caller pins it first."""
        a = self.state.access(layer, expert, precision)
        key = (precision, layer, a.slot)
        if not a.hit:
            t0 = time.perf_counter()
            if self.cuda:
                cur = torch.cuda.current_stream(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(cur)
                self._copy_in(precision, layer, expert, a.slot, cur)
                end.record(cur)
                self.stats._pending_events.append((start, end))
            else:
                self._copy_in(precision, layer, expert, a.slot, None)
                self.stats.load_wait_s += time.perf_counter() - t0
        else:
            self._settle(key)                       # a prefetch read into this slot may still be running
        ev = self.ready.pop(key, None)
        if ev is not None:                          # a prefetch into this slot may still be in flight
            torch.cuda.current_stream(self.device).wait_event(ev)
        return self.store.format_of(precision).weights(self.views[precision][layer][a.slot])

    def prefetch(self, layer: int, expert: int) -> bool:
        """Start loading (layer, expert) in full precision off the critical path. False if resident or no slot
        can be freed without evicting an in-use or another predicted expert."""
        a = self.state.prefetch(layer, expert)
        if a is None:
            return False
        self._copy_in(FULL, layer, expert, a.slot, self.copy_stream, background=True)
        return True
