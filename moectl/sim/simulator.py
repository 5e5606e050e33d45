"""Trace-driven discrete-event simulator of an expert cache with prefetch.

What is resident, what is evicted and every hit/miss count come from `moectl/core/cache_model.py:
CacheState`, driven by the rule set in its docstring exactly as the runtime drives it (a prefill's
experts in chunks of the slot count, resident first; prefetch in decode steps only; predictions
spent when their layer routes). This file adds time. Two timelines:
  compute  - per step (one decode token, or a whole prefill) and layer: attention/router, then the
             layer's experts, resident ones first, arriving ones as they land.
  copy     - one host->GPU transfer at a time, in the runtime loader's chunks (`runtime/loader.py`: each matrix
             in pieces of at most CHUNK_BYTES). Demand loads (an expert the router chose that is not resident)
             go before queued prefetches and fills (first come first served, as the runtime queues them); a chunk
             in flight is never interrupted, so a demand load waits at most one chunk, and a copy it overtakes
             keeps the chunks it ran.
A prefetch is issued right after a router runs, for later layers of the same token. It helps only
if it lands before its layer's experts run: a late one (started, not landed when needed) is not a demand
load, but the wait for it is stall. A prefetch not finished when its expert is needed has its remaining
chunks promoted to demand priority: counted in `demand` when it had not started (not as a miss: the cache
state holds it), in `late` when it had.
Timing-only counters (`hits` on time, `late`, `demand` copies, `prefetch` copies started) live here;
`misses` and the per-layer, per-phase counters are the cache state's.

The simulator drives the same ReplacementPolicy / PrefetchPolicy objects as the runtime, and the same
PrecisionPolicy (full / low-bit / skip on a miss, one cache pool per precision, copies timed by their bytes),
ComputePlacement (a miss computed on the CPU: serial on the CPU, beside the device's experts; the layer ends
at the later of the two; the expert is copied into the cache in the background while the engine idles) and
prefetch admission (policies/admission.py: a prediction is copied only when it pays for itself).

Legend: N = trace rows, L = MoE layers, K = top-k, E = experts, D = hidden size.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..core.cache_model import COUNTERS, FULL, PHASES, CacheState
from ..core.copy_chunks import CHUNK_BYTES, chunk_count
from ..policies.admission import AdmitAll, PrefetchGate
from ..policies.base import PrefetchPolicy
from ..policies.miss import DEVICE, FETCH, decide_miss
from ..policies.placement import CPU, ComputePlacement, LayerQueue
from ..policies.precision import LOW, SKIP, PrecisionPolicy, rank_scores
from .cost import CostModel, FixedCost
from .steps import Step, tokens_of


class _Copy:
    __slots__ = ("ready", "prefetched", "nbytes", "chunks", "done", "chunk_s")

    def __init__(self, ready: float | None, prefetched: bool, dur: float, nbytes: float, chunks: int = 1):
        self.ready = ready            # landing time once every chunk is scheduled; None while some still wait
        self.prefetched = prefetched
        self.nbytes = nbytes          # size (per precision)
        self.chunks, self.done = chunks, 0      # chunks in all; chunks run or scheduled
        self.chunk_s = dur / chunks             # one chunk's copy time

    @property
    def dur(self) -> float:
        """Copy time still to run (all of it before the first chunk starts)."""
        return (self.chunks - self.done) * self.chunk_s


class Simulator:
    """One run of `steps` through per-layer pools of `capacities[l]` slots.

    `capacities` / `replacement`: one pool (full precision) or {precision: per-layer slots} / {precision: policy}.
    `precision` (policies/precision.py) decides full / low-bit / skip on a miss; `nbytes` {precision: bytes of
    one expert copy} (default: the cost model's expert); `placement` (policies/placement.py) computes a miss on
    the CPU instead of fetching it; `admission` (policies/admission.py) filters prefetches; `preload` (a plan's
    {precision: [[experts] per layer]}) is resident before the first step, as the runtime loads it."""

    def __init__(self, capacities, replacement, prefetch: PrefetchPolicy | None = None,
                 cost: CostModel | None = None, max_prefetch_per_layer: int | None = None,
                 precision: PrecisionPolicy | None = None, nbytes: dict | None = None,
                 placement: ComputePlacement | None = None, admission: AdmitAll | None = None,
                 preload: dict | None = None, chunk_bytes: float = CHUNK_BYTES, staging: int = 0):
        self.caps = capacities if isinstance(capacities, dict) else {FULL: list(capacities)}
        self.pools = [p for p in (FULL, LOW) if p in self.caps and sum(self.caps[p]) > 0]
        self.L = len(self.caps[self.pools[0]])
        self.repl = replacement if isinstance(replacement, dict) else {FULL: replacement}
        self.pf = prefetch if prefetch is not None else PrefetchPolicy()
        self.cost = cost if cost is not None else FixedCost()
        self.max_pf = max_prefetch_per_layer
        self.precision = precision if precision is not None else PrecisionPolicy()
        self.nbytes = dict(nbytes) if nbytes else {FULL: self.cost.expert_bytes}
        self.placement = placement
        self.admission = admission if admission is not None else AdmitAll()
        self.pf_prec = FULL if FULL in self.pools else LOW      # prefetches load this precision
        self.preload = preload or {}                            # a plan's hot set, resident before the first step
        self.chunk_bytes = chunk_bytes                          # the largest chunk of a copy (the runtime loader's)
        self.staging = staging                                  # prefetch staging buffers per pool (0: into slots)

    def _pool(self, want: str) -> str:
        """The pool a load of precision `want` goes to (the other one when this run has no such pool)."""
        return want if want in self.pools else self.pools[0]

    # ------------------------------------------------------------------ copy engine
    # One transfer at a time, cut into the runtime loader's chunks (`chunk_count`, of equal time here). A demand load
    # is scheduled when its layer needs it and starts when the chunk in flight ends. Queued prefetches and fills run
    # chunk by chunk, first come first served, whenever no demand load is scheduled (`_advance`); one overtaken keeps
    # its progress.

    def _head(self):
        """The queued copy whose next chunk runs when the engine is free (copies evicted or promoted meanwhile are
        dropped)."""
        while self.queue:
            key, t_enq, copy = self.queue[0]
            if self.copies.get(key) is copy and copy.ready is None:
                return t_enq, copy
            self.queue.popleft()
        return None

    def _advance(self, t: float) -> None:
        """Run the queued chunks the copy engine starts before time t."""
        while self.free_at < t and (head := self._head()) is not None:
            t_enq, copy = head
            start = max(self.free_at, t_enq)
            if start >= t:
                return
            if copy.done == 0:
                self.n_prefetch += copy.prefetched
            left = copy.chunks - copy.done
            n = left if copy.chunk_s <= 0 else min(left, max(1, math.ceil((t - start) / copy.chunk_s)))
            self._run(copy, n, start)

    def _run(self, copy: _Copy, n: int, start: float) -> float:
        """Schedule `copy`'s next n chunks from `start`; returns when they end (and the copy lands if they are its
        last)."""
        copy.done += n
        self.free_at = start + n * copy.chunk_s
        self.bytes_copied += copy.nbytes * n / copy.chunks
        if copy.done == copy.chunks:
            copy.ready = self.free_at
        return self.free_at

    def _demand(self, t: float, copy: _Copy) -> float:
        """The rest of `copy`, needed at time t, at demand priority: after the chunk in flight (and earlier demand
        loads). Returns its landing time. A copy not started yet counts as a demand load; the rest of a started
        prefetch is `late`."""
        self._advance(t)
        if copy.ready is None:
            self.n_demand += copy.done == 0
            self._run(copy, copy.chunks - copy.done, max(t, self.free_at))
        return copy.ready

    def _backlog(self, t: float) -> float:
        """Copy-engine time committed at time t: the chunk or demand loads in flight plus the queued copies' chunks."""
        queued = sum(c.dur for key, _, c in self.queue if self.copies.get(key) is c and c.ready is None)
        return max(self.free_at - t, 0.0) + queued

    def _new_copy(self, p: str, prefetched: bool) -> _Copy:
        nbytes = self.nbytes[p]
        return _Copy(None, prefetched, self.cost.load_s(nbytes), nbytes, chunk_count(nbytes, self.chunk_bytes))

    def _issue(self, tl: int, e: int, t: float, p: str) -> bool:
        """Prefetch expert e of layer tl into pool p: the cache state protects/inserts it, the copy is queued
        at time t. True when a copy was queued."""
        a = self.state.prefetch(tl, e, p)
        if a is None:
            return False
        if a.victim is not None:
            self.copies.pop((tl, p, a.victim), None)
        copy = self.copies[(tl, p, e)] = self._new_copy(p, True)
        self.queue.append(((tl, p, e), t, copy))
        return True

    def _predicted(self, l: int, preds, t: float, routed=()) -> None:
        """Candidates (target layer, expert, score) predicted after layer l (-1: after the previous token), through
        the gate the runtime uses too: a resident one is protected, a missing one copied if admission admits it."""
        p = self.pf_prec

        def issue(tl: int, e: int, held: str | None) -> bool:
            if held is not None:
                self.state.prefetch(tl, e, held)
                return False
            return self._issue(tl, e, t, p)
        self.gate.offer(self.state, l, preds, self.cost.load_s(self.nbytes[p]), self._backlog(t), issue, p, routed)

    # ------------------------------------------------------------------ main loop
    def run(self, steps: list[Step], hidden_of=None, final_hidden_of=None) -> dict:
        """Simulate; `hidden_of(row, layer)` / `final_hidden_of(row)` give hidden states for
        prefetch policies that need them (gate reuse, MLP, aux gate)."""
        self._start(steps)
        for step in steps:
            self._step(step, hidden_of, final_hidden_of)
        return self._results()

    def _start(self, steps: list[Step]) -> None:
        self.state = state = CacheState({p: self.caps[p] for p in self.pools},
                                        {p: self.repl[p] for p in self.pools}, self.staging)
        self.copies: dict[tuple[int, str, int], _Copy] = {}     # resident (layer, precision, expert) -> its copy
        for l, p, e, _ in state.preload(self.preload):          # copied at load time: landed at 0, not counted
            self.copies[(l, p, e)] = _Copy(0.0, False, 0.0, self.nbytes[p])
        self.queue: deque = deque()                             # prefetches and fills [(key, time queued, copy)]
        self.free_at = 0.0
        self.n_demand = self.n_prefetch = 0
        self.bytes_copied = 0.0
        top_k = max((len(c) for s in steps if not s.prefill for c in s.chosen), default=1)
        self.gate = PrefetchGate(self.admission, top_k, self.max_pf)
        for p in self.pools:
            if self.repl[p].needs_future:
                self.repl[p].set_future([s.chosen for s in steps])
        self.hits = self.accesses = self.late = 0
        self.clock = self.stall = self.compute_only = self.prefill_time = self.cpu_busy = 0.0
        self.decode_tokens = self.demand_decode = self.fills = 0
        self.bytes_decode = 0.0
        self.n_loads = {FULL: 0, LOW: 0, SKIP: 0, CPU: 0}       # decode misses by what was done
        self.stall_layer = np.zeros(self.L)                     # decode stall by the layer that waited
        self.context = 0
        self.t_final = 0.0                # when the previous step's final hidden state was ready

    def _step(self, step: Step, hidden_of, final_hidden_of) -> None:
        """One decode token, or a whole prefill: every layer, then the head."""
        state, cost = self.state, self.cost
        if step.first_of_request:
            state.begin_request(step.request)
            self.pf.reset()
            self.gate.reset()
            self.context = 0
        state.begin_step("prefill" if step.prefill else "decode")
        if not step.prefill:              # the aux gate: loads issued while the previous lm_head ran
            self._predicted(-1, self.pf.predict_after_token(), min(self.t_final, self.clock))
        t_step = self.clock
        demand_before, bytes_before = self.n_demand, self.bytes_copied
        self.step_stall = self.step_compute = 0.0
        for l in range(self.L):
            self._layer(step, l, hidden_of)
        head = cost.lm_head_s(1 if step.prefill else len(step.rows))     # a verification pass scores every row
        self.t_final = self.clock
        self.clock += head
        self.step_compute += head
        if step.prefill:
            self.prefill_time += self.clock - t_step
        else:
            self.decode_tokens += step.produced
            self.stall += self.step_stall
            self.compute_only += self.step_compute
            self.demand_decode += self.n_demand - demand_before
            self.bytes_decode += self.bytes_copied - bytes_before
            self.pf.end_token(final_hidden_of(step.rows[step.produced - 1]) if final_hidden_of else None)
        self.context += len(step.rows) if step.prefill else step.produced    # a pass's rejected rows roll back
        for tl, sp, e, _ in state.end_step():
            self.copies.pop((tl, sp, e), None)

    def _layer(self, step: Step, l: int, hidden_of) -> None:
        """Attention and router, prefetch decisions, then the layer's experts: the CPU's beside the device's."""
        state, cost = self.state, self.cost
        attn = cost.attention_s(len(step.rows), self.context)
        self.clock += attn
        self.step_compute += attn
        chosen, weights = step.chosen[l], step.weights[l]
        for p in self.pools:
            for tl, sp, e, _ in state.route(l, chosen, weights, p):
                self.copies.pop((tl, sp, e), None)            # a wasted staged copy stops
        self.gate.route(l, chosen)
        self._advance(self.clock)
        # prefetch decisions: right after the router; their copies queue behind this layer's demand loads
        if not step.prefill:
            h = hidden_of(step.rows[0], l) if hidden_of else None
            self.pf.observe(l, chosen, weights, h)
            self._predicted(l, self.pf.predict(l), self.clock, chosen)
        layer_demand = self.n_demand
        on_device, on_cpu = self._place(step, l)
        t_cpu = self._cpu_side(step, l, on_cpu)
        stall_before = self.step_stall
        t = self._device_side(step, l, on_device)
        if not step.prefill:
            self.stall_layer[l] += self.step_stall - stall_before
        self._fill(step, l, on_cpu, t)
        self.clock = max(t, t_cpu)
        if not step.prefill:
            self.gate.layer_done(self.n_demand - layer_demand, len(on_cpu))

    def _place(self, step: Step, l: int) -> tuple[dict[str, list[int]], list[tuple[int, str]]]:
        """Where each chosen expert runs (`policies/miss.py: decide_miss`, the runtime's rule): a resident copy of
        either precision on the device; else the precision policy's choice, skipped, fetched or computed on the
        CPU."""
        state, chosen, weights = self.state, step.chosen[l], step.weights[l]
        if step.scores is not None:       # several rows (prefill, verification pass): each expert's lowest score
            scores = [step.scores[l].get(e, 0.0) for e in chosen]
        else:
            scores = rank_scores(weights) if weights else [0.0] * len(chosen)
        on_device: dict[str, list[int]] = {p: [] for p in self.pools}
        on_cpu: list[tuple[int, str]] = []
        queue = LayerQueue()
        for e, s in zip(chosen, scores):
            held = next((p for p in self.pools if state.contains(l, e, p)), None) or state.staged_in(l, e)
            wanted = self.precision.decide(s) if held is None else held
            p = self._pool(wanted) if wanted != SKIP else SKIP
            tok = tokens_of(step, l, e)
            where, p = decide_miss(held, p, self.placement, tok, self.nbytes.get(p), queue=queue)
            if where == DEVICE:
                on_device[p].append(e)
                continue
            self.n_loads[CPU if where == CPU else p if where == FETCH else SKIP] += not step.prefill
            if where == CPU:                  # a miss, computed from host RAM: counted as one (hit rate, counters)
                state.cpu_miss(l, p)
                self.accesses += not step.prefill
                on_cpu.append((e, p))
            elif where == FETCH:
                on_device[p].append(e)
        return on_device, on_cpu

    def _cpu_side(self, step: Step, l: int, on_cpu: list[tuple[int, str]]) -> float:
        """The CPU's experts run serially from host RAM, alongside the device's: when they end."""
        t_cpu = self.clock
        for e, p in on_cpu:
            tok = tokens_of(step, l, e)
            c = self.cost.cpu_expert_s(tok, self.nbytes[p], p == LOW)
            t_cpu += c
            self.cpu_busy += c * (not step.prefill)
            self.step_compute += self.cost.expert_s(tok, self.nbytes[p], p == LOW)    # the bound: as if resident
        return t_cpu

    def _device_side(self, step: Step, l: int, on_device: dict[str, list[int]]) -> float:
        """The device's experts in the cache's chunks: resident first; a chunk's loads start when the last one ran.
        Returns when the last one ends."""
        state, t = self.state, self.clock
        for p in self.pools:
            for chunk in state.chunks(l, on_device[p], p):
                state.pin(l, chunk, p)
                ready: list[tuple[float, float]] = []      # (ready time, compute time)
                for e in chunk:
                    c = self.cost.expert_s(tokens_of(step, l, e), self.nbytes[p], p == LOW)
                    self.step_compute += c
                    self.accesses += not step.prefill
                    a = state.access(l, e, p)
                    if a.victim is not None:
                        self.copies.pop((l, p, a.victim), None)
                    copy = self.copies.get((l, p, e)) if a.hit else None
                    if copy is None:                         # a miss: a demand load into the victim's slot
                        copy = self.copies[(l, p, e)] = self._new_copy(p, False)
                    else:
                        self._advance(t)
                        if copy.ready is not None and copy.ready <= t:
                            self.hits += not step.prefill
                        elif copy.ready is not None or copy.done:  # started, not landed: the wait is stall
                            self.late += not step.prefill
                    # a new miss, or a copy queued or overtaken: (the rest of) it at demand priority
                    ready.append((self._demand(t, copy), c))
                state.unpin(l, chunk, p)
                t0 = t
                for r, c in sorted(ready):                 # arrivals in order of landing
                    t = max(t, r) + c
                # the wait: the chunk's span less its compute (>= 0; float rounding could make it -1e-17 s)
                self.step_stall += max((t - t0) - sum(c for _, c in ready), 0.0)
        return t

    def _fill(self, step: Step, l: int, on_cpu: list[tuple[int, str]], clock: float) -> None:
        """A miss the CPU computed is copied into the cache in the background, when the copy engine is idle once the
        device's experts of the layer ran (`clock`), as the runtime checks it (one at a time; a demand load
        overtakes it at a chunk boundary)."""
        state = self.state
        for e, p in on_cpu:                          # a staged prefetch the CPU outran: installed as it is
            if (l, p, e) in state.staged:
                self.copies.pop((l, p, state.access(l, e, p, fill=True).victim), None)
        for e, p in on_cpu:
            if self._backlog(clock) > 0:
                break
            if state.contains(l, e, p):
                continue
            a = state.access(l, e, p, fill=True)
            if a.victim is not None:
                self.copies.pop((l, p, a.victim), None)
            copy = self.copies[(l, p, e)] = self._new_copy(p, False)
            self.queue.append(((l, p, e), clock, copy))
            self.fills += not step.prefill
            self._advance(clock + 1e-12)

    def _results(self) -> dict:
        state, n, ms = self.state, max(self.decode_tokens, 1), 1e3
        dec = {k: sum(state.totals("decode", p)[k] for p in self.pools) for k in COUNTERS}
        pre = {k: sum(state.totals("prefill", p)[k] for p in self.pools) for k in COUNTERS}
        issued = dec["prefetches"] + pre["prefetches"]
        wasted = issued - dec["prefetch_used"] - pre["prefetch_used"]      # spent unused, or never reached
        cache = {ph: state.per_layer(ph, self.pools[0]) for ph in PHASES}
        decode_s = self.clock - self.prefill_time
        return dict(
            hits=self.hits, accesses=self.accesses, late=self.late, demand=self.demand_decode,
            decode_tokens=self.decode_tokens, misses=dec["misses"], prefill_misses=pre["misses"],
            prefetch=self.n_prefetch, prefetches_issued=issued, wasted=wasted,
            cache=cache if len(self.pools) == 1 else {p: {ph: state.per_layer(ph, p) for ph in PHASES}
                                                      for p in self.pools},
            hit_rate=self.hits / max(self.accesses, 1),
            cpu_misses=dec["cpu_misses"],
            demand_loads_per_token=dec["misses"] / n, fill_copies_per_token=self.fills / n,
            prefetch_loads_per_token=self.n_prefetch / n,
            late_prefetches_per_token=self.late / n,
            wasted_prefetch_fraction=wasted / max(issued, 1),
            # copies made in decode steps: demand loads and the prefetches started then
            bytes_per_token=self.bytes_decode / n,
            full_loads_per_token=self.n_loads[FULL] / n, lowbit_loads_per_token=self.n_loads[LOW] / n,
            skipped_per_token=self.n_loads[SKIP] / n, cpu_experts_per_token=self.n_loads[CPU] / n,
            cpu_ms_per_token=self.cpu_busy * ms / n,
            stall_ms_per_token=self.stall * ms / n, stall_ms_per_layer=(self.stall_layer * ms / n).tolist(),
            stall_s=self.stall, decode_s=decode_s, prefill_s=self.prefill_time, compute_only_s=self.compute_only,
            ms_per_token=decode_s * ms / n, lower_bound_ms_per_token=self.compute_only * ms / n,
            prefill_ms=self.prefill_time * ms,
        )
