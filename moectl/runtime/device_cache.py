"""DeviceCache: the expert cache with slots on the device (`cache.py: ExpertCache`, its copying kind).

Legend: L = MoE layers, S_l = slots of layer l, N = bytes of one packed expert (`ExpertFormat.nbytes`).

Which expert sits in which slot, what is pinned or protected, which one goes, and every hit/miss
counter live in `CacheState`, whose rules the simulator obeys too. This file only moves bytes: a miss
copies the expert's packed host buffer into the slot the state chose; a hit returns the slot as it is.
Every copy, demand or prefetch, goes through one `Loader` (runtime/loader.py): two priorities, a demand
load overtakes queued prefetches at the next chunk boundary, a chunk = a row range of one weight matrix (format
part), at most `chunk_bytes`. On CUDA its worker thread issues the
chunks on a copy stream with one event per chunk and compute waits per matrix; on CPU the same queue runs
synchronously (a copy runs when its expert is used), so the ordering the tests check is the ordering the GPU gets.
With low-bit copies (`--lowbit`) every layer has a second pool of smaller slots (`LOW`), filled from the
store's low-bit tier; `plan` says which copy serves each routed expert (a resident copy of either precision,
else the precision policy's choice: full, low or skip), and a low-bit slot is dequantised where it is computed.
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

from ..core.cache_model import FULL, LOW, CacheState
from ..core.copy_chunks import CHUNK_BYTES, split_rows
from ..core.sizing import prefetch_precision
from ..errors import MoectlError
from ..policies.base import ReplacementPolicy
from ..policies.precision import PrecisionPolicy
from ..store.expert_store import ExpertStore
from ..store.memory import host_empty
from .cache import CacheStats, ExpertCache
from .loader import DEMAND, PREFETCH, CopyJob, Loader


class DeviceCache(ExpertCache):
    in_place = False

    def __init__(self, store: ExpertStore, slots_per_layer: list[int], device: torch.device,
                 policy: ReplacementPolicy, low_slots: list[int] | None = None,
                 precision: PrecisionPolicy | None = None, stream_prefill: bool = False, staging: int = 0):
        if len(slots_per_layer) != store.num_layers:
            raise MoectlError(f"cache plan has {len(slots_per_layer)} layers, the model has {store.num_layers} MoE layers")
        self.store, self.device, self.policy = store, torch.device(device), policy
        # full slots [0] * L with a low-bit pool (lowbit-only, `sizing.split_pools`): no full-precision pool at all
        no_full = low_slots is not None and not any(int(s) for s in slots_per_layer)
        self.slots_per_layer = [0 if no_full else max(1, min(int(s), store.num_experts)) for s in slots_per_layer]
        slots, policies = ({}, {}) if no_full else ({FULL: self.slots_per_layer}, {FULL: policy})
        if low_slots is not None:
            if store.lowbit is None:
                raise MoectlError("a low-bit cache pool needs the store's low-bit copies (--lowbit)")
            slots[LOW] = [max(1, min(int(s), store.num_experts)) for s in low_slots]
            policies[LOW] = policy if no_full else copy.deepcopy(policy)    # the same kind of policy, its own state
        # prefetches, staging buffers and the streamed prefill hold this precision's copies (the simulator's rule)
        self.pf_precision = prefetch_precision(slots)
        if precision is not None:
            if precision.uses_lowbit and LOW not in slots:
                raise MoectlError(f"{precision.describe()} needs low-bit copies: give --lowbit (see moectl quantize)")
            self.precision = precision
        # Staged prefetches (`staging` buffers, RAM tier): a prediction copies into a staging buffer, never a slot
        in_ram = store.buffers is not None or self.pf_precision == LOW      # staged copies are read from RAM
        staging = staging if in_ram else 0
        self.state = CacheState(slots, policies, staging)
        self.cuda = self.device.type == "cuda"
        # Per precision: [L] of uint8 [S_l, N] slot pools, and typed views of every slot made once.
        self.pools: dict[str, list[torch.Tensor]] = {}
        self.views: dict[str, list[list[dict]]] = {}
        self.rows: dict[str, list[list[torch.Tensor]]] = {}                # ... and each slot's bytes [N]
        for p, per_layer in slots.items():
            N = store.nbytes(p)
            if self.cuda:
                pool = [torch.empty(s, N, dtype=torch.uint8, device=self.device) for s in per_layer]
            else:
                pool = [host_empty((s, N), torch.uint8, "allocating cache slots", touch=True) for s in per_layer]
            self.pools[p] = pool
            self.rows[p] = [[buf[s] for s in range(len(buf))] for buf in pool]
            self.views[p] = [[store.format_of(p).views(r) for r in rows] for rows in self.rows[p]]
        self.pool = self.pools.get(FULL)                                    # the full-precision slots (if any)
        # CUDA + disk tier: each full slot's pinned host buffer, the target of its shard reads (low-bit copies
        # are in RAM: copied straight from there).
        self.staging = [host_empty((s, store.expert_nbytes), torch.uint8, "allocating pinned staging buffers",
                                   pin=True)
                        for s in self.slots_per_layer] if self.cuda and store.buffers is None and not no_full else None
        self.pending: dict = {}                                 # (precision, layer, slot) -> Future of a read
        self.stats = CacheStats(self.state, {p: store.nbytes(p) for p in dict.fromkeys([FULL, *slots])})
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.format = store.format_of(self.pf_precision)                    # the staged / streamed copies'
        # One copy engine for demand loads and prefetches (threaded on CUDA, synchronous on the CPU).
        self.loader = Loader(threaded=self.cuda, stream=self.copy_stream)
        self.chunk_bytes = CHUNK_BYTES                          # the largest chunk a copy is cut into
        self.emulated_gbps = None               # emulated device: copies paced to this link speed (benchmarks)
        self.jobs: dict[tuple, CopyJob] = {}                    # (precision, layer, slot) -> its last copy
        # Staging buffers, RAM tier only (they are filled by copies): the streamed prefill's two (double buffering),
        # the same ones for staged prefetches in decode. A staged prefetch that its layer uses is installed by swapping
        # its buffer with the slot it takes (`acquire`): typed views are per slot, so no bytes move.
        self.streaming = stream_prefill and in_ram
        n_stage = max(2 if self.streaming else 0, staging)
        self.stage_views = []
        self.stage_jobs: dict[tuple[int, int], CopyJob] = {}        # (layer, expert) -> its staged prefetch's copy
        if n_stage:
            N = store.nbytes(self.pf_precision)
            stage = (torch.empty(n_stage, N, dtype=torch.uint8, device=self.device) if self.cuda else
                     host_empty((n_stage, N), torch.uint8, "allocating staging buffers", touch=True))
            self.stage_bufs = stage
            self.stage_rows = [stage[i] for i in range(n_stage)]
            self.stage_views = [self.format.views(r) for r in self.stage_rows]

    def landing(self, layer: int, expert: int, precision: str = FULL) -> int:
        """0 landed, 1 a prefetch's copy issued earlier (in flight, or queued), 2 a demand load of this layer."""
        s = self.state.slot(layer, expert, precision)
        job = self.jobs.get((precision, layer, s)) if s is not None else None
        if job is None or (job.finished and all(ev.query() for ev in job.events)):   # CUDA: issued is not landed
            return 0
        return 1 if job.prefetch else 2

    def resident_weights(self, layer: int, expert: int) -> dict | None:
        for p in self.precisions:
            slot = self.state.slot(layer, expert, p)
            if slot is None or (p, layer, slot) in self.pending or self.landing(layer, expert, p) != 0:
                continue
            return self.store.format_of(p).weights(self.views[p][layer][slot])
        return None

    def backlog_bytes(self) -> float:
        """Bytes the copy engine has committed to now: the unrun chunks of every copy queued or in flight. On the
        CPU the synchronous queue runs a prefetch only when its expert is used, so every prefetch not used yet
        counts (the emulated device has no copy engine running beside compute)."""
        jobs = [(p, j) for (p, _, _), j in self.jobs.items()] + [(self.pf_precision, j)
                                                                  for j in self.stage_jobs.values()]
        return sum(self.stats.nbytes[p] * (len(j.chunks) - j.done) / len(j.chunks)
                   for p, j in jobs if not j.finished and j.chunks)

    def slot_bytes(self, layer: int, expert: int, precision: str = FULL) -> torch.Tensor:
        """The packed bytes [N] of a resident expert's slot (staged prefetches swap buffers: not `pools[p][layer][s]`)."""
        return self.rows[precision][layer][self.state.slot(layer, expert, precision)]

    def device_nbytes(self) -> int:
        stage = self.stage_bufs.numel() if self.stage_views else 0
        return sum(t.numel() * t.element_size() for pool in self.pools.values() for t in pool) + stage

    # --- copies -------------------------------------------------------------------------
    def _settle(self, key: tuple) -> None:
        """Wait for a background read into slot `key` (precision, layer, slot)."""
        fut = self.pending.pop(key, None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            self.stats.load_wait_s += time.perf_counter() - t0

    def _free(self, key: tuple) -> None:
        """Slot `key` (precision, layer, slot) gets a new expert: a queued copy of its old one is dropped, a read
        into it finished first."""
        self._settle(key)                       # first: a finished disk read may queue its copy (CUDA)
        job = self.jobs.pop(key, None)
        if job is not None:
            self._drop(job, key[0])

    def _drop(self, job: CopyJob, p: str) -> None:
        """Cancel a copy of precision `p` whose target is reused: unrun chunks never run (a prefetch's count as
        uncopied bytes); on CUDA its issued chunks land first (the target buffer, or the pinned one it reads)."""
        self.loader.cancel(job)
        if job.prefetch and job.done < len(job.chunks):           # chunks that will never run
            self.stats.uncopied_bytes += self.stats.nbytes[p] * (len(job.chunks) - job.done) / len(job.chunks)
        for ev in job.events:
            ev.synchronize()

    def _copy_job(self, p: str, layer: int, expert: int, slot: int, src: torch.Tensor, priority: int,
                  dst: dict | None = None) -> CopyJob:
        """The copy of a packed host buffer `src` [N] into `slot` of pool `p` (or the views `dst`: a staging
        buffer), queued: each format part in row ranges of at most `chunk_bytes` (`split_rows`), one chunk each,
        named by the part (and its rows when cut)."""
        fmt = self.store.format_of(p)
        srcv = fmt.views(src)
        staged = dst is not None
        dst = dst if staged else self.views[p][layer][slot]
        stream = self.copy_stream

        def run(job, i, name, rows):
            d, s = dst[name][rows[0]:rows[1]], srcv[name][rows[0]:rows[1]]
            if not self.cuda:
                t0 = time.perf_counter()
                d.copy_(s)
                if self.emulated_gbps:                      # a chunk takes what the emulated link would
                    time.sleep(max(0.0, t0 + d.nbytes / (self.emulated_gbps * 1e9) - time.perf_counter()))
                return None
            with torch.cuda.stream(stream):
                if i == 0 and job.after is not None:       # compute still reading the slot's old expert
                    stream.wait_event(job.after)
                d.copy_(s, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            return ev

        job = CopyJob(layer, expert, slot, priority)
        for name, view in srcv.items():                      # each part [rows, ...] in row ranges
            spans = split_rows(view.shape[0], view.nbytes // view.shape[0], self.chunk_bytes)
            for r in spans:
                label = name if len(spans) == 1 else f"{name}[{r[0]}:{r[1]}]"
                job.chunks.append((label, lambda j, i, n=name, r=r: run(j, i, n, r)))
            job.last[name] = len(job.chunks) - 1
        if self.cuda:
            job.after = torch.cuda.current_stream(self.device).record_event()
        if not staged:
            self.jobs[(p, layer, slot)] = job
        return self.loader.submit(job)

    # --- streamed prefill (DuoServe) ---------------------------------------------------------
    def stream(self, layer: int, experts: list[int]):
        """Yield (expert, weights) for a prefill's missed `experts` (of `pf_precision`: low-bit at lowbit-only),
        streamed through two staging buffers: the next expert's copy is queued before the current one is computed,
        so (CUDA) it lands while that computes. Nothing enters the cache; each is one miss (`CacheState.stream`)."""
        p = self.pf_precision

        def issue(i: int) -> CopyJob:
            self.state.stream(layer, experts[i], p)
            return self._copy_job(p, layer, experts[i], -1, self.store.host(layer, experts[i], p), DEMAND,
                                  dst=self.stage_views[i % 2])
        nxt = issue(0) if experts else None
        for i, e in enumerate(experts):
            job = nxt
            nxt = issue(i + 1) if i + 1 < len(experts) else None
            yield e, self.store.format_of(p, layer).weights(_Landing(self, job, self.stage_views[i % 2]))

    def _copy_in(self, p: str, layer: int, expert: int, slot: int, priority: int) -> None:
        """Fill `slot` of pool `p` with the expert: its host buffer (RAM tier, low-bit copies) copied through the
        loader; disk tier: its shard bytes read into the slot (CPU) or into the slot's pinned staging buffer and
        copied through the loader (CUDA). Prefetch reads run on the store's background reader thread."""
        key = (p, layer, slot)
        self._free(key)
        if p != FULL or self.store.buffers is not None:
            self._copy_job(p, layer, expert, slot, self.store.host(layer, expert, p), priority)
            return
        dst = self.rows[FULL][layer][slot] if not self.cuda else self.staging[layer][slot]
        if priority == PREFETCH:
            then = None if not self.cuda else (lambda: self._copy_job(FULL, layer, expert, slot, dst, PREFETCH))
            self.pending[key] = self.store.load_async(layer, expert, dst, then=then)
        else:
            t0 = time.perf_counter()
            self.store.load_into(layer, expert, dst, parallel=True)     # the forward waits for this read
            self.stats.load_wait_s += time.perf_counter() - t0
            if self.cuda:
                self._copy_job(FULL, layer, expert, slot, dst, priority)

    def _landed(self, key: tuple):
        """Slot `key`'s typed views; while its copy is pending, views whose every part waits for its own chunk when
        read (CPU: runs the loader's queue up to it; CUDA: the compute stream waits for that chunk's event)."""
        self._settle(key)
        p, layer, slot = key
        job = self.jobs.get(key)
        if job is None or job.finished:
            self.jobs.pop(key, None)
            return self.views[p][layer][slot]
        return _Landing(self, job, self.views[p][layer][slot])

    def acquire(self, layer: int, expert: int, precision: str = FULL) -> dict[str, torch.Tensor]:
        """Weights of (layer, expert) from pool `precision` on the device (`ExpertFormat.weights`: dequantised on
        the device for a low-bit copy), loading on a miss. The caller pins it first."""
        a = self.state.access(layer, expert, precision)
        key = (precision, layer, a.slot)
        if a.staged is not None:
            self._install(key, expert, a.staged)
        elif not a.hit:
            self._copy_in(precision, layer, expert, a.slot, DEMAND)
        return self.store.format_of(precision, layer).weights(self._landed(key))

    def _install(self, key: tuple, expert: int, buf: int) -> None:
        """A staged prefetch its layer uses becomes slot `key`'s expert: the staging buffer and the slot swap their
        views (the slot's old bytes, its evicted expert's, are the free staging buffer now), and its copy, landed or
        not, becomes the slot's."""
        p, layer, slot = key
        self._free(key)                                         # a copy still writing the evicted expert stops
        self.views[p][layer][slot], self.stage_views[buf] = self.stage_views[buf], self.views[p][layer][slot]
        self.rows[p][layer][slot], self.stage_rows[buf] = self.stage_rows[buf], self.rows[p][layer][slot]
        job = self.stage_jobs.pop((layer, expert), None)
        if job is not None and not job.finished:
            self.jobs[key] = job

    def _unstage(self, layer: int, expert: int) -> None:
        """A staged prefetch no access took: its copy stops (the chunks not run yet are never copied)."""
        job = self.stage_jobs.pop((layer, expert), None)
        if job is not None:
            self._drop(job, self.pf_precision)

    def preload(self, sets: dict) -> int:
        """Load a plan's hot set {precision: [[experts] per layer]} into free slots (`CacheState.preload`) and wait
        for every copy: load-time work, timed in `stats.preload_s`, its bytes in `stats.preload_bytes`, never a
        miss or a per-token byte. Returns the experts loaded."""
        t0, wait0 = time.perf_counter(), self.stats.load_wait_s
        filled = self.state.preload(sets)
        for layer, p, expert, slot in filled:
            self._copy_in(p, layer, expert, slot, DEMAND)
            self.stats.preload_bytes += self.store.nbytes(p)
        self.loader.drain()
        for key in list(self.jobs):
            self._landed(key)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.stats.load_wait_s = wait0                  # no forward waited: the reads were load time
        self.stats.preload_s += time.perf_counter() - t0
        return len(filled)

    def fill(self, layer: int, expert: int, precision: str = FULL) -> None:
        """Copy in a miss the CPU just computed, in the background: one access of the cache state (a miss that
        takes a slot, evicting as a demand load would), its copy queued at prefetch priority so it never delays a
        demand load. The layer calls it only while the copy engine has nothing committed (`OffloadedExperts._fill`). On the
        CPU the synchronous queue would run it only when its expert is next used, blocking every later fill, so it
        runs now: an emulated device's copy engine is this thread (the CPU worker computes its experts meanwhile)."""
        a = self.state.access(layer, expert, precision, fill=True)      # a fill, not a use: the CPU miss counted
        self._copy_in(precision, layer, expert, a.slot, PREFETCH)
        self.stats.fills += 1
        job = self.jobs.get((precision, layer, a.slot))
        if not self.cuda and job is not None:
            self.loader.wait(job)

    def prefetch(self, layer: int, expert: int) -> bool:
        """Start loading (layer, expert) off the critical path, in `pf_precision` (full; low-bit at lowbit-only, as
        the simulator's prefetches). False if resident or no slot can be freed without evicting an in-use or another
        predicted expert."""
        p = self.pf_precision
        a = self.state.prefetch(layer, expert, p)
        if a is None:
            return False
        if a.staged is not None:                                # into a staging buffer: nothing evicted
            self.stage_jobs[(layer, expert)] = self._copy_job(p, layer, expert, -1, self.store.host(layer, expert, p),
                                                              PREFETCH, dst=self.stage_views[a.staged])
            return True
        self._copy_in(p, layer, expert, a.slot, PREFETCH)
        return True


class _Landing:
    """A slot's weights by name while its copy is pending; reading a matrix waits for that matrix's last chunk
    only, so the first matrix's product can start while the second still lands. CPU: the wait runs the loader's queue
    (demand loads first) and counts as load wait. CUDA: the compute stream waits for the chunk's event; the wait
    is timed with a pair of events on the compute stream (resolved by `snapshot`)."""

    def __init__(self, cache: DeviceCache, job: CopyJob, views: dict):
        self.cache, self.job, self.views = cache, job, views

    def __getitem__(self, name: str) -> torch.Tensor:
        i, job, cache = self.job.last.get(name), self.job, self.cache      # the matrix's last chunk
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
