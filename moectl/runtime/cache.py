"""DeviceCache: the shared cache bookkeeping (`moectl/cache_model.py`) + the tensor copies it implies.

Legend: L = MoE layers, S_l = slots of layer l, N = bytes of one packed expert (`ExpertFormat.nbytes`).

Which expert sits in which slot, what is pinned or protected, which one goes, and every hit/miss
counter live in `CacheState`, whose rules the simulator obeys too. This file only moves bytes: a miss
copies the expert's packed host buffer into the slot the state chose; a hit returns the slot as it is.
Every copy, demand or prefetch, goes through one `Loader` (runtime/loader.py): two priorities, a demand
load overtakes queued prefetches, one chunk per weight matrix. On CUDA its worker thread issues the chunks on a
copy stream with one event per chunk and compute waits per matrix; on CPU the same queue runs synchronously
(a copy runs when its expert is used), so the ordering the tests check is the ordering the GPU gets.
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
from .loader import DEMAND, PREFETCH, CopyJob, Loader

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
                 policy: ReplacementPolicy, stream_prefill: bool = False):
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
        # One copy engine for demand loads and prefetches (threaded on CUDA, synchronous on the CPU).
        self.loader = Loader(threaded=self.cuda, stream=self.copy_stream)
        self.jobs: dict[tuple[int, int], CopyJob] = {}                      # (layer, slot) -> its last copy
        # Typed views of every slot's parts (the format's), made once: the hot path only indexes them.
        self.views = [[self.format.views(pool[s]) for s in range(len(pool))] for pool in self.pool]
        # Streamed prefill: two staging buffers (double buffering), RAM tier only (they are filled by copies).
        self.streaming = stream_prefill and store.buffers is not None
        self.stage_views = []
        if self.streaming:
            stage = (torch.empty(2, N, dtype=torch.uint8, device=self.device) if self.cuda else
                     host_empty((2, N), torch.uint8, "allocating staging buffers", touch=True))
            self.stage_views = [self.format.views(stage[i]) for i in range(2)]

    def landing(self, layer: int, expert: int) -> int:
        """0 landed, 1 a prefetch's copy issued earlier (in flight, or queued), 2 a demand load of this layer."""
        s = self.state.slot(layer, expert)
        job = self.jobs.get((layer, s)) if s is not None else None
        if job is None or (job.finished and all(ev.query() for ev in job.events)):   # CUDA: issued is not landed
            return 0
        return 1 if job.prefetch else 2

    # --- copies -------------------------------------------------------------------------
    def _settle(self, layer: int, slot: int) -> None:
        """Wait for a background read into `slot` (disk tier: the reader thread fills the slot or its staging)."""
        fut = self.pending.pop((layer, slot), None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            self.stats.load_wait_s += time.perf_counter() - t0

    def _free(self, layer: int, slot: int) -> None:
        """`slot` gets a new expert: a queued copy of its old one is dropped, a read into it finished first."""
        self._settle(layer, slot)               # first: a finished disk read may queue its copy (CUDA)
        job = self.jobs.pop((layer, slot), None)
        if job is not None:
            self.loader.cancel(job)
            for ev in job.events:               # CUDA: an issued copy out of the staging buffer must land first
                ev.synchronize()

    def _copy_job(self, layer: int, expert: int, slot: int, src: torch.Tensor, priority: int,
                  dst: dict | None = None) -> CopyJob:
        """The copy of a packed host buffer `src` [P] into `slot` (or the views `dst`: a staging buffer), one chunk
        per weight matrix, queued."""
        srcv = self.format.views(src)
        staged = dst is not None
        dst = dst if staged else self.views[layer][slot]
        stream = self.copy_stream

        def run(job, i, name):
            if not self.cuda:
                dst[name].copy_(srcv[name])
                return None
            with torch.cuda.stream(stream):
                if i == 0 and job.after is not None:       # compute still reading the slot's old expert
                    stream.wait_event(job.after)
                dst[name].copy_(srcv[name], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            return ev

        job = CopyJob(layer, expert, slot, priority,
                      [(p.name, lambda j, i, n=p.name: run(j, i, n)) for p in self.format.parts])
        if self.cuda:
            job.after = torch.cuda.current_stream(self.device).record_event()
        if not staged:
            self.jobs[(layer, slot)] = job
        return self.loader.submit(job)

    # --- streamed prefill (DuoServe) ---------------------------------------------------------
    def stream(self, layer: int, experts: list[int]):
        """Yield (expert, weights) for a prefill's missed `experts`, streamed through two staging buffers: the
        next expert's copy is queued before the current one is computed, so (CUDA) it lands while that computes.
        Nothing enters the cache; each is one miss (`CacheState.stream`)."""
        def issue(i: int) -> CopyJob:
            self.state.stream(layer, experts[i])
            return self._copy_job(layer, experts[i], -1, self.store.host(layer, experts[i]), DEMAND,
                                  dst=self.stage_views[i % 2])
        nxt = issue(0) if experts else None
        for i, e in enumerate(experts):
            job = nxt
            nxt = issue(i + 1) if i + 1 < len(experts) else None
            yield e, self.format.weights(_Landing(self, job, self.stage_views[i % 2]))

    def _copy_in(self, layer: int, expert: int, slot: int, priority: int) -> None:
        """Fill `slot` with the expert: its RAM-tier buffer copied through the loader; disk tier: its shard bytes
        read into the slot (CPU) or into the slot's pinned staging buffer and copied through the loader (CUDA).
        Prefetch reads run on the store's background reader thread."""
        self._free(layer, slot)
        background = priority == PREFETCH
        if self.store.buffers is not None:
            self._copy_job(layer, expert, slot, self.store.host(layer, expert), priority)
            return
        dst = self.pool[layer][slot] if not self.cuda else self.staging[layer][slot]
        if background:
            then = None if not self.cuda else (lambda: self._copy_job(layer, expert, slot, dst, PREFETCH))
            self.pending[(layer, slot)] = self.store.load_async(layer, expert, dst, then=then)
        else:
            self.store.load_into(layer, expert, dst, parallel=True)
            if self.cuda:
                self._copy_job(layer, expert, slot, dst, priority)

    def _landed(self, layer: int, slot: int):
        """The slot's weights; while its copy is pending, views whose every matrix waits for its own chunk when
        read (CPU: runs the loader's queue up to it; CUDA: the compute stream waits for that chunk's event)."""
        self._settle(layer, slot)
        job = self.jobs.get((layer, slot))
        if job is None or job.finished:
            self.jobs.pop((layer, slot), None)
            return self.views[layer][slot]
        return _Landing(self, job, self.views[layer][slot])

    def acquire(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Weights of (layer, expert) on the device (`ExpertFormat.weights`: dequantised on the device for a
        low-bit copy), loading on a miss. The caller pins it first."""
        a = self.state.access(layer, expert)
        if not a.hit:
            self._copy_in(layer, expert, a.slot, DEMAND)
        return self.format.weights(self._landed(layer, a.slot))

    def prefetch(self, layer: int, expert: int) -> bool:
        """Start loading (layer, expert) off the critical path. False if resident or no slot can be
        freed without evicting an in-use or another predicted expert."""
        a = self.state.prefetch(layer, expert)
        if a is None:
            return False
        self._copy_in(layer, expert, a.slot, PREFETCH)
        return True


class _Landing:
    """A slot's weights by name while its copy is pending; reading a matrix waits for that matrix's chunk only,
    so the first matrix's product can start while the second still lands. CPU: the wait runs the loader's queue
    (demand loads first) and counts as load wait. CUDA: the compute stream waits for the chunk's event; the wait
    is timed with a pair of events on the compute stream (resolved by `snapshot`)."""

    def __init__(self, cache: DeviceCache, job: CopyJob, views: dict):
        self.cache, self.job, self.views = cache, job, views
        self.index = {n: i for i, (n, _) in enumerate(job.chunks)}

    def __getitem__(self, name: str) -> torch.Tensor:
        i, job, cache = self.index.get(name), self.job, self.cache
        if i is None or job.cancelled:
            return self.views[name]
        if not cache.cuda:
            if job.done <= i:
                t0 = time.perf_counter()
                cache.loader.wait(job, i)
                cache.stats.load_wait_s += time.perf_counter() - t0
            return self.views[name]
        cache.loader.wait(job, i)                                # the worker has issued the chunk
        cur = torch.cuda.current_stream(cache.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        cur.wait_event(job.events[i])
        end.record(cur)
        cache.stats._pending_events.append((start, end))
        return self.views[name]

    def keys(self):
        return self.views.keys()

    def items(self):
        return [(n, self[n]) for n in self.views]
