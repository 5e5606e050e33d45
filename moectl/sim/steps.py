"""A trace as the simulator's steps (one decode token, or one request's whole prefill) and what a run reports.

Legend: N = trace rows, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..core.trace import PREFILL, Trace
from ..policies.draft_length import pass_order


@dataclass
class Step:
    request: str
    first_of_request: bool
    prefill: bool
    rows: np.ndarray                       # trace rows in this step
    chosen: list[list[int]]                # per layer: experts used (union over rows for prefill)
    weights: list[list[float] | None]      # per layer: gate weights (decode rows only)
    tokens_per_expert: list[dict[int, int]] | None   # prefill: per layer, tokens routed to each expert
    scores: list[dict[int, float]] | None = None     # prefill: per layer, each expert's lowest rank score over the
    #                                                  rows (the precision a miss loads is the best any row asks for)
    produced: int = 1                      # decode: tokens the step adds to the output (a verification pass: the
    #                                        accepted drafts + 1; its rejected rows ran but leave the context)


def tokens_of(step: Step, l: int, e: int) -> int:
    """Tokens of `step` routed to expert e in layer l (1 in a one-token decode step)."""
    return step.tokens_per_expert[l][e] if step.tokens_per_expert else 1


def multi_token_step(trace: Trace, rows: np.ndarray, request: str, first: bool, prefill: bool,
                     produced: int = 1) -> Step:
    """One step over several rows at once (a prefill, or a verification pass over the last accepted token and its
    drafts): per layer the union of their experts (ascending in a prefill; `pass_order` in a pass), with the tokens routed to each and its lowest rank
    score (when the trace has gate weights)."""
    ex, w = trace.experts, trace.weights
    chosen, counts = [], []
    for l in range(trace.num_layers):
        ids, n = np.unique(ex[rows, l], return_counts=True)
        keep = ids >= 0
        chosen.append([int(i) for i in ids[keep]] if prefill else pass_order(ex[rows, l].tolist()))
        counts.append({int(i): int(c) for i, c in zip(ids[keep], n[keep])})
    return Step(request, first, prefill, rows, chosen, [None] * trace.num_layers, counts,
                None if w is None else prefill_scores(ex[rows], w[rows]), produced)


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
            steps.append(multi_token_step(trace, pre, req, True, True))
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


def prefill_scores(experts: np.ndarray, weights: np.ndarray) -> list[dict[int, float]]:
    """Per layer, {expert: its lowest rank score over the rows} of prefill rows `experts`/`weights` [N, L, K]."""
    from ..policies.precision import rank_scores

    out = []
    for l in range(experts.shape[1]):
        best: dict[int, float] = {}
        for ids, ws in zip(experts[:, l], weights[:, l]):
            ok = ids >= 0
            for e, s in zip(ids[ok], rank_scores([float(x) for x in ws[ok]])):
                best[int(e)] = min(best.get(int(e), 1.0), s)
        out.append(best)
    return out


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
    full_loads_per_token: float = 0.0      # decode misses loaded in full precision
    lowbit_loads_per_token: float = 0.0    # ... loaded as low-bit copies
    skipped_per_token: float = 0.0         # ... skipped (precision policy)
    cpu_experts_per_token: float = 0.0     # ... computed on the CPU from host RAM
    cpu_ms_per_token: float = 0.0          # CPU busy time (overlaps the device's)
    fill_copies_per_token: float = 0.0     # CPU-computed misses copied into the cache while the engine idled
    slots: dict | None = None              # {precision: slots in all}
    stall_ms_per_layer: list | None = None     # decode stall per token by the layer that waited (sums to the stall)
    draft: dict | None = None              # a replay in verification passes (sim/spec_passes.py): passes, tokens and
    #                                        accepted drafts per pass, draft ms/token, the acceptance, auto's by_k

    def to_dict(self) -> dict:
        return asdict(self)
