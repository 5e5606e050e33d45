"""Trace-driven discrete-event simulator of an expert cache with prefetch.

Two timelines:
  compute  - per step (one decode token, or a whole prefill) and layer: attention/router, then the
             layer's experts, resident ones first, arriving ones as they land.
  copy     - one host->GPU transfer at a time. Demand loads (an expert the router chose that is not
             resident) go before queued prefetches; a transfer already started is never interrupted.
A prefetch is issued right after a router runs, for later layers of the same token. It helps only
if it lands before its layer's experts run: a late one (in flight when needed) is not a demand load,
but the wait for it is stall. A prefetch still queued (not started) when its expert is needed is
promoted to a demand load. Prefetched experts are pinned until their layer ran.

The simulator drives the same ReplacementPolicy / PrefetchPolicy objects as the runtime.

Legend: N = trace rows, L = MoE layers, K = top-k, E = experts, D = hidden size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from ..policies.aux_gate import AFTER_TOKEN, AuxGatePrefetch
from ..policies.base import PrefetchPolicy, ReplacementPolicy
from ..trace import PREFILL, Trace
from .cost import CostModel, FixedCost


@dataclass
class Step:
    request: str
    first_of_request: bool
    prefill: bool
    rows: np.ndarray                       # trace rows in this step
    chosen: list[list[int]]                # per layer: experts used (union over rows for prefill)
    weights: list[list[float] | None]      # per layer: gate weights (decode rows only)
    tokens_per_expert: list[dict[int, int]] | None   # prefill: per layer, tokens routed to each expert


def trace_steps(trace: Trace) -> list[Step]:
    """Group trace rows into simulation steps: a request's prefill rows are one batched step,
    every decode row is its own step."""
    steps: list[Step] = []
    ex, w = trace.experts, trace.weights
    for req, sl in trace.request_slices():
        rows = np.arange(sl.start, sl.stop)
        pre = rows[trace.phase[rows] == PREFILL]
        first = True
        if len(pre):
            chosen, counts = [], []
            for l in range(trace.num_layers):
                ids, n = np.unique(ex[pre, l], return_counts=True)
                keep = ids >= 0
                chosen.append([int(i) for i in ids[keep]])
                counts.append({int(i): int(c) for i, c in zip(ids[keep], n[keep])})
            steps.append(Step(req, True, True, pre, chosen, [None] * trace.num_layers, counts))
            first = False
        for r in rows[trace.phase[rows] != PREFILL]:
            chosen, weights = [], []
            for l in range(trace.num_layers):
                ok = ex[r, l] >= 0
                chosen.append([int(i) for i in ex[r, l][ok]])
                weights.append(None if w is None else [float(x) for x in w[r, l][ok]])
            steps.append(Step(req, first, False, np.array([r]), chosen, weights, None))
            first = False
    return steps


@dataclass
class SimResult:
    hit_rate: float
    belady_hit_rate: float | None
    demand_loads_per_token: float
    prefetch_loads_per_token: float
    wasted_prefetch_fraction: float
    bytes_per_token: float
    stall_ms_per_token: float
    ms_per_token: float
    lower_bound_ms_per_token: float
    tokens: int
    late_prefetches_per_token: float = 0.0
    prefill_ms: float = 0.0
    replacement: str = ""
    prefetch: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


class _Slot:
    __slots__ = ("ready", "prefetched", "used")

    def __init__(self, ready: float | None, prefetched: bool):
        self.ready = ready            # arrival time; None = prefetch queued, not started
        self.prefetched = prefetched
        self.used = False


class Simulator:
    """One run of `steps` through per-layer pools of `capacities[l]` slots."""

    def __init__(self, capacities: list[int], replacement: ReplacementPolicy,
                 prefetch: PrefetchPolicy | None = None, cost: CostModel | None = None,
                 max_prefetch_per_layer: int | None = None):
        self.cap = list(capacities)
        self.L = len(capacities)
        self.repl = replacement
        self.pf = prefetch if prefetch is not None else PrefetchPolicy()
        self.cost = cost if cost is not None else FixedCost()
        self.max_pf = max_prefetch_per_layer

    # ------------------------------------------------------------------ copy engine
    def _advance(self, t: float) -> None:
        """Start every queued prefetch the copy engine reaches before time t."""
        while self.queue and self.free_at < t:
            l, e, t_enq = self.queue.popleft()
            slot = self.pools[l].get(e)
            if slot is None or slot.ready is not None:      # evicted or promoted meanwhile
                continue
            start = max(self.free_at, t_enq)
            slot.ready = self.free_at = start + self.load_s
            self.n_prefetch += 1

    def _demand(self, t: float) -> float:
        start = max(t, self.free_at)
        self.free_at = start + self.load_s
        self.n_demand += 1
        return self.free_at

    def _make_room(self, l: int, protected: set[int], now: float) -> bool:
        pool = self.pools[l]
        if len(pool) < self.cap[l]:
            return True
        cands = [e for e in pool if e not in protected]
        if not cands:
            return False
        v = self.repl.victim(l, cands, now)
        slot = pool.pop(v)
        if slot.prefetched and not slot.used:
            self.n_wasted += 1
        self.repl.on_evict(l, v, now)
        return True

    def _issue(self, tl: int, e: int, protected: set[int], now: int, clock: float) -> None:
        """Queue a prefetch of expert e of layer tl (pinned via `protected`) unless it is resident."""
        protected.add(e)
        if e in self.pools[tl] or not self._make_room(tl, protected, now):
            return
        self.pools[tl][e] = _Slot(None, True)
        self.repl.on_insert(tl, e, now)
        self.queue.append((tl, e, clock))

    # ------------------------------------------------------------------ main loop
    def run(self, steps: list[Step], hidden_of=None, final_hidden_of=None) -> dict:
        """Simulate; `hidden_of(row, layer)` / `final_hidden_of(row)` give hidden states for
        prefetch policies that need them (gate reuse, MLP)."""
        L, cost = self.L, self.cost
        self.load_s = cost.load_s()
        self.pools: list[dict[int, _Slot]] = [dict() for _ in range(L)]
        self.queue: deque = deque()
        self.free_at = 0.0
        self.n_demand = self.n_prefetch = self.n_wasted = 0
        if self.repl.needs_future:
            self.repl.set_future([s.chosen for s in steps])
        hits = accesses = late = 0
        clock = stall = compute_only = prefill_time = 0.0
        decode_tokens = 0
        demand_decode = 0
        now = 0
        context = 0
        next_first: set[int] = set()      # layer-0 experts the aux gate prefetched for the next token
        for i_step, step in enumerate(steps):
            if step.first_of_request:
                self.repl.on_request_start(step.request)
                self.pf.reset()
                context = 0
            t_step = clock
            protected: list[set[int]] = [set() for _ in range(L)]   # predicted for later layers
            if not step.first_of_request:
                protected[0] |= next_first
            next_first = set()
            n_tok = len(step.rows)
            demand_before = self.n_demand
            step_stall = step_compute = 0.0
            for l in range(L):
                attn = cost.attention_s(n_tok, context)
                clock += attn
                step_compute += attn
                chosen = step.chosen[l]
                self.repl.on_route(l, chosen, step.weights[l])
                self._advance(clock)
                pinned = set(chosen) | protected[l]
                ready: list[tuple[float, float]] = []      # (ready time, compute time)
                pool = self.pools[l]
                for e in chosen:
                    now += 1
                    c = cost.expert_s(step.tokens_per_expert[l][e] if step.prefill else 1)
                    step_compute += c
                    if not step.prefill:
                        accesses += 1
                    slot = pool.get(e)
                    if slot is not None and slot.ready is not None:
                        if slot.ready <= clock:
                            hits += not step.prefill
                        else:
                            late += not step.prefill
                        slot.used = True
                        self.repl.on_hit(l, e, now)
                        ready.append((slot.ready, c))
                    elif slot is not None:                   # queued prefetch, not started: promote
                        slot.ready = self._demand(clock)
                        slot.prefetched = False
                        slot.used = True
                        self.repl.on_hit(l, e, now)
                        ready.append((slot.ready, c))
                    else:
                        t_ready = self._demand(clock)
                        if self._make_room(l, pinned, now):
                            s = _Slot(t_ready, False)
                            s.used = True
                            pool[e] = s
                            self.repl.on_insert(l, e, now)
                        ready.append((t_ready, c))            # no free slot: streamed, not kept
                # prefetch decisions: right after the router, behind this layer's demand loads
                if not step.prefill:
                    h = hidden_of(step.rows[0], l) if hidden_of else None
                    self.pf.observe(l, chosen, step.weights[l], h)
                    per_layer: dict[int, int] = {}
                    for tl, e, _score in self.pf.predict(l):
                        if not (l < tl < L):
                            continue
                        if self.max_pf is not None and per_layer.get(tl, 0) >= self.max_pf:
                            continue
                        per_layer[tl] = per_layer.get(tl, 0) + 1
                        self._issue(tl, e, protected[tl], now, clock)
                # queued prefetches for this layer that never started are useless now: cancel them
                for e in protected[l]:
                    slot = pool.get(e)
                    if slot is not None and slot.ready is None:
                        del pool[e]
                        self.repl.on_evict(l, e, now)
                # experts run: resident first, arrivals in order of landing
                t = clock
                for r, c in sorted(ready):
                    t = max(t, r) + c
                step_stall += (t - clock) - sum(c for _, c in ready)
                clock = t
            head = cost.lm_head_s(1)
            clock += head
            step_compute += head
            if step.prefill:
                prefill_time += clock - t_step
            else:
                decode_tokens += 1
                stall += step_stall
                compute_only += step_compute
                demand_decode += self.n_demand - demand_before
            context += n_tok
            if not step.prefill:
                self.pf.end_token(final_hidden_of(step.rows[0]) if final_hidden_of else None)
                # AdapMoE aux gate: the next token's first layer, loaded while this token's lm_head runs
                nxt = steps[i_step + 1] if i_step + 1 < len(steps) else None
                if isinstance(self.pf, AuxGatePrefetch) and nxt is not None and not nxt.first_of_request:
                    for tl, e, _score in self.pf.predict(AFTER_TOKEN):
                        if tl == 0:
                            self._issue(0, e, next_first, now, clock - head)   # final hidden: before lm_head
            self.repl.on_token_end(now)
        for pool in self.pools:                             # prefetched, never used: wasted
            self.n_wasted += sum(1 for s in pool.values() if s.prefetched and not s.used)
        n = max(decode_tokens, 1)
        ms = 1e3
        return dict(
            hits=hits, accesses=accesses, late=late, demand=demand_decode, decode_tokens=decode_tokens,
            prefetch=self.n_prefetch, wasted=self.n_wasted,
            hit_rate=hits / max(accesses, 1),
            demand_loads_per_token=demand_decode / n,
            prefetch_loads_per_token=self.n_prefetch / n,
            late_prefetches_per_token=late / n,
            wasted_prefetch_fraction=self.n_wasted / max(self.n_prefetch, 1),
            bytes_per_token=(demand_decode + self.n_prefetch) * (cost.expert_bytes) / n,
            stall_ms_per_token=stall * ms / n,
            stall_s=stall, decode_s=clock - prefill_time, prefill_s=prefill_time, compute_only_s=compute_only,
            ms_per_token=(clock - prefill_time) * ms / n, lower_bound_ms_per_token=compute_only * ms / n,
            prefill_ms=prefill_time * ms,
        )
