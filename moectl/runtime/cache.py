"""DeviceCache: the shared cache bookkeeping (`moectl/cache_model.py`) + the tensor copies it implies.

Legend: L = MoE layers, S_l = slots of layer l, N = bytes of one packed expert (`ExpertFormat.nbytes`).

Which expert sits in which slot, what is pinned or protected, which one goes, and every hit/miss
counter live in `CacheState`, whose rules the simulator obeys too. This file only moves bytes: a miss
copies the expert's packed host buffer into the slot the state chose; a hit returns the slot as it is.
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

import time

import torch

from ..cache_model import PHASES, CacheState, split_slots
from ..errors import MoectlError
from ..policies.base import ReplacementPolicy
from ..store.expert_store import ExpertStore
from ..store.memory import host_empty

__all__ = ["CacheFront", "CacheStats", "DeviceCache", "split_slots"]


class CacheStats:
    """Byte and wait-time counters of the copies; hit/miss/prefetch counts come from the state."""

    def __init__(self, state: CacheState, expert_nbytes: int):
        self.state, self.expert_nbytes = state, expert_nbytes
        self.load_wait_s = 0.0          # time the forward waited for demand loads
        self._pending_events: list = []

    @property
    def hits(self) -> int:
        return self.state.totals()["hits"]

    @property
    def misses(self) -> int:
        return self.state.totals()["misses"]

    @property
    def prefetches(self) -> int:
        return self.state.totals()["prefetches"]

    def as_dict(self) -> dict:
        t = self.state.totals()
        n = t["hits"] + t["misses"]
        return {"hits": t["hits"], "misses": t["misses"], "hit_rate": t["hits"] / n if n else 0.0,
                "bytes_loaded": (t["misses"] + t["prefetches"]) * self.expert_nbytes,   # demand + prefetch
                "load_wait_s": self.load_wait_s, "prefetches": t["prefetches"],
                "prefetch_bytes": t["prefetches"] * self.expert_nbytes,
                "prefetch_used": t["prefetch_used"], "evictions": t["evictions"],
                **{ph: {k: v for k, v in self.state.totals(ph).items() if k in ("hits", "misses", "evictions")}
                   for ph in PHASES}}


class CacheFront:
    """The calls the runtime makes on its expert cache, answered by the shared `CacheState` (`state`);
    subclasses add where the weights are (`acquire`, `prefetch`)."""

    state: CacheState
    stats: CacheStats

    # --- bookkeeping: the shared state --------------------------------------------------
    def resident(self, layer: int) -> list[int]:
        return self.state.resident(layer)

    def contains(self, layer: int, expert: int) -> bool:
        return self.state.contains(layer, expert)

    def pin(self, layer: int, experts) -> None:
        self.state.pin(layer, experts)

    def unpin(self, layer: int, experts) -> None:
        self.state.unpin(layer, experts)

    def begin_request(self, name: str) -> None:
        self.state.begin_request(name)

    def begin_step(self, phase: str) -> None:
        self.state.begin_step(phase)

    def route(self, layer: int, chosen: list[int], weights: list[float] | None = None) -> None:
        self.state.route(layer, chosen, weights)

    def chunks(self, layer: int, experts: list[int]) -> list[list[int]]:
        return self.state.chunks(layer, experts)

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
                 policy: ReplacementPolicy):
        if len(slots_per_layer) != store.num_layers:
            raise MoectlError(f"cache plan has {len(slots_per_layer)} layers, the model has {store.num_layers} MoE layers")
        self.store, self.device, self.policy = store, torch.device(device), policy
        self.slots_per_layer = [max(1, min(int(s), store.num_experts)) for s in slots_per_layer]
        self.state = CacheState(self.slots_per_layer, policy)
        N, self.format = store.expert_nbytes, store.format
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.pool = [torch.empty(s, N, dtype=torch.uint8, device=self.device) for s in self.slots_per_layer]
        else:
            self.pool = [host_empty((s, N), torch.uint8, "allocating cache slots", touch=True)
                         for s in self.slots_per_layer]
        # CUDA + disk tier: each slot's pinned host buffer, the target of its shard reads.
        self.staging = [host_empty((s, N), torch.uint8, "allocating pinned staging buffers", pin=True)
                        for s in self.slots_per_layer] if self.cuda and store.buffers is None else None
        self.pending: dict = {}                                             # (layer, slot) -> Future of a read
        self.stats = CacheStats(self.state, store.expert_nbytes)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready: dict[tuple[int, int], torch.cuda.Event] = {}            # (layer, slot) -> copy done
        # Typed views of every slot's parts, made once: the hot path only indexes them.
        self.views = [[self.format.views(pool[s]) for s in range(len(pool))] for pool in self.pool]

    # --- copies -------------------------------------------------------------------------
    def _settle(self, layer: int, slot: int) -> None:
        """Wait for a background read into `slot` (and, CUDA, for its last copy out of the staging buffer)."""
        fut = self.pending.pop((layer, slot), None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            self.stats.load_wait_s += time.perf_counter() - t0

    def _copy_in(self, layer: int, expert: int, slot: int, stream, background: bool = False) -> None:
        """Fill `slot` with the expert: a copy of its RAM-tier buffer, or its shard bytes read into the slot."""
        self._settle(layer, slot)
        dst = self.pool[layer][slot]
        if not self.cuda:
            if background:
                self.pending[(layer, slot)] = self.store.load_async(layer, expert, dst)
            else:
                self.store.load_into(layer, expert, dst, parallel=True)
            return
        if self.staging is None:
            self._to_device(layer, slot, self.store.host(layer, expert), stream)
            return
        staging = self.staging[layer][slot]
        last = self.ready.pop((layer, slot), None)
        if last is not None:                # the previous copy out of this staging buffer must be done
            last.synchronize()
        if background:
            self.pending[(layer, slot)] = self.store.load_async(
                layer, expert, staging, then=lambda: self._to_device(layer, slot, staging, stream))
        else:
            self.store.load_into(layer, expert, staging, parallel=True)
            self._to_device(layer, slot, staging, stream)

    def _to_device(self, layer: int, slot: int, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            self.pool[layer][slot].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        self.ready[(layer, slot)] = ev

    def acquire(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Weights of (layer, expert) on the device (`ExpertFormat.weights`: dequantised on the device for a
        low-bit copy), loading on a miss. The caller pins it first."""
        a = self.state.access(layer, expert)
        if not a.hit:
            t0 = time.perf_counter()
            if self.cuda:
                cur = torch.cuda.current_stream(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(cur)
                self._copy_in(layer, expert, a.slot, cur)
                end.record(cur)
                self.stats._pending_events.append((start, end))
            else:
                self._copy_in(layer, expert, a.slot, None)
                self.stats.load_wait_s += time.perf_counter() - t0
        else:
            self._settle(layer, a.slot)             # a prefetch read into this slot may still be running
        ev = self.ready.pop((layer, a.slot), None)
        if ev is not None:                          # a prefetch into this slot may still be in flight
            torch.cuda.current_stream(self.device).wait_event(ev)
        return self.format.weights(self.views[layer][a.slot])

    def prefetch(self, layer: int, expert: int) -> bool:
        """Start loading (layer, expert) off the critical path. False if resident or no slot can be
        freed without evicting an in-use or another predicted expert."""
        a = self.state.prefetch(layer, expert)
        if a is None:
            return False
        self._copy_in(layer, expert, a.slot, self.copy_stream, background=True)
        return True
