"""DeviceCache: a fixed pool of expert slots per MoE layer on the compute device.

Legend: L = MoE layers, S_l = slots of layer l, P = numel of one packed expert.

A miss copies the expert's packed host buffer into a slot (evicting the replacement policy's
victim); a hit returns the slot as it is. Experts in use by the running layer and experts a
prefetch policy predicted are pinned: the policy only ever sees unpinned candidates.
Slots are allocated and written once at start-up, so the cache costs its memory once and a first use
is never a page-fault storm. A disk-tier load reads the shard bytes straight into the slot (CUDA:
into the slot's pinned staging buffer, then one async copy); prefetch reads run on the store's
background thread, and any wait for them is counted as load wait.
On CUDA, prefetch copies run on a separate copy stream and each slot carries a ready event that the
compute stream waits on; on CPU (`--emulate-device`) demand copies are synchronous and the same
bookkeeping runs, so the logic the tests exercise is the logic the GPU runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import MoectlError
from ..policies.base import ReplacementPolicy
from ..store.expert_store import ExpertStore
from ..store.memory import host_empty


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_loaded: int = 0           # demand loads and prefetches together
    load_wait_s: float = 0.0        # time the forward waited for demand loads
    prefetches: int = 0
    prefetch_bytes: int = 0
    prefetch_used: int = 0          # prefetched experts later hit before eviction
    _pending_events: list = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate,
                "bytes_loaded": self.bytes_loaded, "load_wait_s": self.load_wait_s,
                "prefetches": self.prefetches, "prefetch_bytes": self.prefetch_bytes,
                "prefetch_used": self.prefetch_used}


def split_slots(total: int, num_layers: int, num_experts: int) -> list[int]:
    """`total` slots split evenly over the layers (earlier layers get the remainder), capped at E."""
    if total < num_layers:
        raise MoectlError(f"--cache-experts {total} is below the minimum of one slot per MoE layer ({num_layers})")
    base, extra = divmod(total, num_layers)
    return [min(num_experts, base + (1 if i < extra else 0)) for i in range(num_layers)]


class DeviceCache:
    def __init__(self, store: ExpertStore, slots_per_layer: list[int], device: torch.device,
                 policy: ReplacementPolicy):
        if len(slots_per_layer) != store.num_layers:
            raise MoectlError(f"cache plan has {len(slots_per_layer)} layers, the model has {store.num_layers} MoE layers")
        self.store, self.device, self.policy = store, torch.device(device), policy
        self.slots_per_layer = [max(1, min(int(s), store.num_experts)) for s in slots_per_layer]
        P = store.layout.numel
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.pool = [torch.empty(s, P, dtype=store.dtype, device=self.device) for s in self.slots_per_layer]
        else:
            self.pool = [host_empty((s, P), store.dtype, "allocating cache slots", touch=True)
                         for s in self.slots_per_layer]
        # CUDA + disk tier: each slot's pinned host buffer, the target of its shard reads.
        self.staging = [host_empty((s, P), store.dtype, "allocating pinned staging buffers", pin=True)
                        for s in self.slots_per_layer] if self.cuda and store.buffers is None else None
        self.pending: dict = {}                                             # (layer, slot) -> Future of a read
        self.slot_of: list[dict[int, int]] = [{} for _ in self.pool]        # expert -> slot
        self.free: list[list[int]] = [list(range(s))[::-1] for s in self.slots_per_layer]
        self.pinned: set[tuple[int, int]] = set()
        self.prefetched: set[tuple[int, int]] = set()                       # loaded by prefetch, not yet used
        self.stats = CacheStats()
        self.clock = 0.0
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready: dict[tuple[int, int], torch.cuda.Event] = {}            # (layer, slot) -> copy done
        # Named views (gate_up, down, ...) of every slot, made once: the hot path only indexes them.
        self.views = [[store.layout.views(pool[s]) for s in range(len(pool))] for pool in self.pool]

    # --- bookkeeping --------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return sum(self.slots_per_layer)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.store.expert_nbytes

    def resident(self, layer: int) -> list[int]:
        return list(self.slot_of[layer])

    def contains(self, layer: int, expert: int) -> bool:
        return expert in self.slot_of[layer]

    def pin(self, layer: int, experts) -> None:
        self.pinned.update((layer, int(e)) for e in experts)

    def unpin(self, layer: int, experts) -> None:
        self.pinned.difference_update((layer, int(e)) for e in experts)

    def _tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def _take_slot(self, layer: int) -> int | None:
        """A free slot of `layer`, evicting the policy's victim if needed; None if all are pinned."""
        if self.free[layer]:
            return self.free[layer].pop()
        candidates = [e for e in self.slot_of[layer] if (layer, e) not in self.pinned]
        # Predicted experts are protected until their layer runs, unless nothing else can go.
        unpredicted = [e for e in candidates if (layer, e) not in self.prefetched]
        candidates = unpredicted or candidates
        if not candidates:
            return None
        victim = self.policy.victim(layer, candidates, self.clock)
        slot = self.slot_of[layer].pop(victim)
        self.prefetched.discard((layer, victim))
        self.policy.on_evict(layer, victim, self.clock)
        return slot

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

    # --- the two entry points -----------------------------------------------------------
    def acquire(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Weights of (layer, expert) on the device, loading on a miss. The caller pins it first."""
        now = self._tick()
        slot = self.slot_of[layer].get(expert)
        if slot is not None:
            self.stats.hits += 1
            if (layer, expert) in self.prefetched:
                self.prefetched.discard((layer, expert))
                self.stats.prefetch_used += 1
            self.policy.on_hit(layer, expert, now)
            self._settle(layer, slot)               # a prefetch read into this slot may still be running
        else:
            slot = self._take_slot(layer)
            if slot is None:
                raise RuntimeError(f"layer {layer}: every slot is pinned; the runtime pins at most the slot count")
            self.stats.misses += 1
            self.stats.bytes_loaded += self.store.expert_nbytes
            t0 = time.perf_counter()
            if self.cuda:
                cur = torch.cuda.current_stream(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(cur)
                self._copy_in(layer, expert, slot, cur)
                end.record(cur)
                self.stats._pending_events.append((start, end))
            else:
                self._copy_in(layer, expert, slot, None)
                self.stats.load_wait_s += time.perf_counter() - t0
            self.slot_of[layer][expert] = slot
            self.policy.on_insert(layer, expert, now)
        ev = self.ready.pop((layer, slot), None)
        if ev is not None:                          # a prefetch into this slot may still be in flight
            torch.cuda.current_stream(self.device).wait_event(ev)
        return self.views[layer][slot]

    def prefetch(self, layer: int, expert: int) -> bool:
        """Start loading (layer, expert) off the critical path. False if resident or no slot can be
        freed without evicting an in-use or another predicted expert."""
        if expert in self.slot_of[layer]:
            return False
        if not self.free[layer] and all((layer, e) in self.pinned or (layer, e) in self.prefetched
                                        for e in self.slot_of[layer]):
            return False
        slot = self._take_slot(layer)
        if slot is None:
            return False
        self._copy_in(layer, expert, slot, self.copy_stream, background=True)
        self.slot_of[layer][expert] = slot
        self.prefetched.add((layer, expert))
        self.stats.prefetches += 1
        self.stats.prefetch_bytes += self.store.expert_nbytes
        self.stats.bytes_loaded += self.store.expert_nbytes
        self.policy.on_insert(layer, expert, self._tick())
        return True

    def layer_done(self, layer: int) -> None:
        """Layer `layer` ran: its predictions are spent, unused prefetches become ordinary residents."""
        self.prefetched = {(l, e) for (l, e) in self.prefetched if l != layer}

    def end_token(self) -> None:
        self.policy.on_token_end(self.clock)

    def snapshot(self) -> dict:
        """Stats as a dict; on CUDA this resolves the timed demand-load events (a sync)."""
        if self.stats._pending_events:
            torch.cuda.synchronize(self.device)
            for start, end in self.stats._pending_events:
                self.stats.load_wait_s += start.elapsed_time(end) / 1000.0
            self.stats._pending_events.clear()
        return self.stats.as_dict()
