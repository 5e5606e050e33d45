"""Trace-driven discrete-event simulator of an expert cache with prefetch.

What is resident, what is evicted and every hit/miss count come from `moectl/cache_model.py:
CacheState`, driven by the rule set in its docstring exactly as the runtime drives it (a prefill's
experts in chunks of the slot count, resident first; prefetch in decode steps only; predictions
spent when their layer routes). This file adds time. Two timelines:
  compute  - per step (one decode token, or a whole prefill) and layer: attention/router, then the
             layer's experts, resident ones first, arriving ones as they land.
  copy     - one host->GPU transfer at a time. Demand loads (an expert the router chose that is not
             resident) go before queued prefetches; a transfer already started is never interrupted.
A prefetch is issued right after a router runs, for later layers of the same token. It helps only
if it lands before its layer's experts run: a late one (in flight when needed) is not a demand load,
but the wait for it is stall. A prefetch still queued (not started) when its expert is needed is
promoted to a demand-priority copy (counted in `demand`, not as a miss: the cache state holds it).
Timing-only counters (`hits` on time, `late`, `demand` copies, `prefetch` copies started) live here;
`misses` and the per-layer, per-phase counters are the cache state's.

The simulator drives the same ReplacementPolicy / PrefetchPolicy objects as the runtime.

Legend: N = trace rows, L = MoE layers, K = top-k, E = experts, D = hidden size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from ..cache_model import PHASES, CacheState
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
    misses: int = 0                        # decode misses (= demand_loads_per_token x tokens)
    prefill_misses: int = 0
    cache: dict | None = None              # {phase: {counter: [per layer]}} of the cache state
    note: str = ""                         # what the configuration cannot do on this input, if anything

    def to_dict(self) -> dict:
        return asdict(self)


class _Copy:
    __slots__ = ("ready", "prefetched")

    def __init__(self, ready: float | None, prefetched: bool):
        self.ready = ready            # arrival time; None = prefetch queued, not started
        self.prefetched = prefetched


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
            l, e, t_enq, copy = self.queue.popleft()
            if self.copies.get((l, e)) is not copy or copy.ready is not None:   # evicted or promoted meanwhile
                continue
            start = max(self.free_at, t_enq)
            copy.ready = self.free_at = start + self.load_s
            self.n_prefetch += 1

    def _demand(self, t: float) -> float:
        start = max(t, self.free_at)
        self.free_at = start + self.load_s
        self.n_demand += 1
        return self.free_at

    def _issue(self, tl: int, e: int, t: float) -> None:
        """Prefetch expert e of layer tl: the cache state protects/inserts it, the copy is queued at time t."""
        a = self.state.prefetch(tl, e)
        if a is None:
            return
        if a.victim is not None:
            self.copies.pop((tl, a.victim), None)
        copy = self.copies[(tl, e)] = _Copy(None, True)
        self.queue.append((tl, e, t, copy))

    # ------------------------------------------------------------------ main loop
    def run(self, steps: list[Step], hidden_of=None, final_hidden_of=None) -> dict:
        """Simulate; `hidden_of(row, layer)` / `final_hidden_of(row)` give hidden states for
        prefetch policies that need them (gate reuse, MLP, aux gate)."""
        L, cost = self.L, self.cost
        self.load_s = cost.load_s()
        self.state = state = CacheState(self.cap, self.repl)
        self.copies: dict[tuple[int, int], _Copy] = {}          # resident (layer, expert) -> its copy
        self.queue: deque = deque()
        self.free_at = 0.0
        self.n_demand = self.n_prefetch = 0
        if self.repl.needs_future:
            self.repl.set_future([s.chosen for s in steps])
        hits = accesses = late = 0
        clock = stall = compute_only = prefill_time = 0.0
        decode_tokens = 0
        demand_decode = 0
        context = 0
        t_final = 0.0                     # when the previous step's final hidden state was ready
        for step in steps:
            if step.first_of_request:
                state.begin_request(step.request)
                self.pf.reset()
                context = 0
            state.begin_step("prefill" if step.prefill else "decode")
            if not step.prefill:          # the aux gate: loads issued while the previous lm_head ran
                for tl, e, _score in self.pf.predict_after_token():
                    if 0 <= tl < L:
                        self._issue(tl, e, min(t_final, clock))
            t_step = clock
            n_tok = len(step.rows)
            demand_before = self.n_demand
            step_stall = step_compute = 0.0
            for l in range(L):
                attn = cost.attention_s(n_tok, context)
                clock += attn
                step_compute += attn
                chosen = step.chosen[l]
                state.route(l, chosen, step.weights[l])
                self._advance(clock)
                # prefetch decisions: right after the router; their copies queue behind this layer's demand loads
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
                        self._issue(tl, e, clock)
                # experts run in the cache's chunks: resident first; a chunk's loads start when the last one ran
                t = clock
                for chunk in state.chunks(l, chosen):
                    state.pin(l, chunk)
                    ready: list[tuple[float, float]] = []      # (ready time, compute time)
                    for e in chunk:
                        c = cost.expert_s(step.tokens_per_expert[l][e] if step.prefill else 1)
                        step_compute += c
                        accesses += not step.prefill
                        a = state.access(l, e)
                        copy = self.copies.get((l, e)) if a.hit else None
                        if copy is not None and copy.ready is not None:
                            if copy.ready <= t:
                                hits += not step.prefill
                            else:
                                late += not step.prefill
                        elif copy is not None:                   # queued prefetch, not started: promote
                            copy.ready = self._demand(t)
                        else:
                            if a.victim is not None:
                                self.copies.pop((l, a.victim), None)
                            copy = self.copies[(l, e)] = _Copy(self._demand(t), False)
                        ready.append((copy.ready, c))
                    state.unpin(l, chunk)
                    t0 = t
                    for r, c in sorted(ready):                 # arrivals in order of landing
                        t = max(t, r) + c
                    step_stall += (t - t0) - sum(c for _, c in ready)
                clock = t
            head = cost.lm_head_s(1)
            t_final = clock
            clock += head
            step_compute += head
            if step.prefill:
                prefill_time += clock - t_step
            else:
                decode_tokens += 1
                stall += step_stall
                compute_only += step_compute
                demand_decode += self.n_demand - demand_before
                self.pf.end_token(final_hidden_of(step.rows[0]) if final_hidden_of else None)
            context += n_tok
            state.end_step()
        n = max(decode_tokens, 1)
        ms = 1e3
        dec, pre = state.totals("decode"), state.totals("prefill")
        issued = dec["prefetches"] + pre["prefetches"]
        wasted = issued - dec["prefetch_used"] - pre["prefetch_used"]      # spent unused, or never reached
        return dict(
            hits=hits, accesses=accesses, late=late, demand=demand_decode, decode_tokens=decode_tokens,
            misses=dec["misses"], prefill_misses=pre["misses"],
            prefetch=self.n_prefetch, prefetches_issued=issued, wasted=wasted,
            cache={ph: state.per_layer(ph) for ph in PHASES},
            hit_rate=hits / max(accesses, 1),
            demand_loads_per_token=dec["misses"] / n,
            prefetch_loads_per_token=self.n_prefetch / n,
            late_prefetches_per_token=late / n,
            wasted_prefetch_fraction=wasted / max(issued, 1),
            bytes_per_token=(demand_decode + self.n_prefetch) * (cost.expert_bytes) / n,
            stall_ms_per_token=stall * ms / n,
            stall_s=stall, decode_s=clock - prefill_time, prefill_s=prefill_time, compute_only_s=compute_only,
            ms_per_token=(clock - prefill_time) * ms / n, lower_bound_ms_per_token=compute_only * ms / n,
            prefill_ms=prefill_time * ms,
        )
