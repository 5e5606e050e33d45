"""plan-cache: measured (or analytic) per-layer curves -> DP over layers and bytes -> a plan, simulated.

    facts + budget split  (plan/budget.py)
    curves f_l(n)         (plan/curves.py: the simulator on the traces with these policies, or the seed's model)
    slots per layer       (plan/dp.py: allocate over budget units, at least one slot per layer)
    predicted             (the whole plan replayed through the simulator: hit rate, ms/token, stall)
    uniform               (the same bytes split evenly, replayed the same way: the margin the plan must beat)

Legend: L = MoE layers, E = experts, C = budget units (full-precision expert slots).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from ..cache_model import split_slots
from ..errors import MoectlError
from .budget import BudgetSplit, ModelFacts
from .curves import Curves, analytic_curves, measure_curves, slot_grid
from .dp import allocate


@dataclass
class Policies:
    """The policies a plan is measured with and records (what `simulate --plan` and the runtime apply)."""

    replacement: str = "ours"
    prefetch: str = "none"           # resolved name (gate-reuse, mlp, aux-gate, routing, eam, none)
    depth: int | None = None
    per_layer: int | None = None
    gating: float | None = None      # T_g of sensitivity gating (None: off)
    precision: str = "full"          # full | hobbit | lowbit-only (moectl/policies/precision.py)
    t1: float = 0.6
    t2: float = 0.9
    lowbit: str | None = None        # e.g. q4g64
    cpu_experts: str = "never"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Replay:
    """How one configuration is replayed: the trace (gated already), its cost model, predictors."""

    trace: object
    cost: object
    predictor: object = None         # mlp or routing predictor (by policies.prefetch)
    aux_gate: object = None
    train_traces: list | None = None
    raw: object = None               # the trace before gating (presets gate their own way)

    def run(self, caps: list[int], pol: Policies, belady: bool = False, replacement: str | None = None,
            prefetch: str | None = None):
        from ..sim.run import simulate

        p = prefetch or pol.prefetch
        return simulate(self.trace, caps, replacement or pol.replacement, p, self.cost,
                        predictor=self.predictor if p in ("mlp", "aux-gate", "routing") else None,
                        train_traces=self.train_traces, depth=pol.depth, per_layer=pol.per_layer,
                        belady=belady, aux_gate=self.aux_gate)


def layer_runner(replay: Replay, pol: Policies):
    """run_uniform(n_hi, n_lo) for measure_curves: per-layer (demand loads + wasted prefetches) per decode token x
    copy time: the copy-engine time of the layer that hid no load."""
    L = replay.trace.num_layers

    def run(n_hi: int, n_lo: int):
        r = replay.run([n_hi] * L, pol)
        dec = r.cache["decode"]
        n = max(r.tokens, 1)
        loads = np.array(dec["misses"], dtype=np.float64) / n
        wasted = np.array(dec["prefetch_wasted"], dtype=np.float64) / n      # copy-engine time that hid nothing
        return (loads + wasted) * replay.cost.load_s(), loads
    return run


def build_curves(facts: ModelFacts, replay: Replay | None, pol: Policies, load_s: float, progress=None) -> Curves:
    if replay is None:
        return analytic_curves(facts.num_layers, facts.num_experts, facts.top_k, load_s,
                               prefetch=pol.prefetch != "none")
    grid = slot_grid(facts.num_experts)
    return measure_curves(layer_runner(replay, pol), facts.num_layers, grid,
                          progress=progress, label=f"{pol.replacement}/{pol.prefetch} on {replay.trace.num_tokens} "
                                                   f"trace rows, {len(grid)} slot counts")


def dp_slots(curves: Curves, num_layers: int, num_experts: int, budget_slots: int, min_slots: int = 1) -> list[int]:
    """Full-precision slots per layer minimising the summed curve, within `budget_slots` slots."""
    C = min(budget_slots, num_layers * num_experts)
    if C < num_layers * min_slots:
        raise MoectlError(f"the expert budget holds {C} slots, below one per MoE layer ({num_layers})")
    choices = list(range(min_slots, num_experts + 1))
    costs = curves.table([(t, 0) for t in choices])
    idx, _ = allocate(costs, np.array(choices), C)
    return [choices[i] for i in idx]


REFINE_ROUNDS, REFINE_TRIES = 6, 6


def refine(replay: Replay, pol: Policies, curves: Curves, slots: list[int], res, target: float, E: int):
    """When the replayed plan does not beat the even split (layers interact through prefetch, policy clocks and
    the copy engine, which the per-layer curves leave out): move one slot at a time from the layer that loses
    least by the curves to the one that gains most, keeping a move only if the replay's stall drops; at most
    REFINE_ROUNDS rounds of REFINE_TRIES candidate moves. Returns (slots, result, moves kept)."""
    L = len(slots)
    moves = 0
    for _ in range(REFINE_ROUNDS):
        gain = [curves.at(l, s) - curves.at(l, s + 1) if s < E else -np.inf for l, s in enumerate(slots)]
        loss = [curves.at(l, s - 1) - curves.at(l, s) if s > 1 else np.inf for l, s in enumerate(slots)]
        pairs = sorted(((gain[b] - loss[a], a, b) for a in range(L) for b in range(L) if a != b), reverse=True)
        best = None
        for _, a, b in pairs[:REFINE_TRIES]:
            if not (np.isfinite(gain[b]) and np.isfinite(loss[a])):
                continue
            cand = list(slots)
            cand[a], cand[b] = cand[a] - 1, cand[b] + 1
            r = replay.run(cand, pol)
            if r.stall_ms_per_token < (best[1].stall_ms_per_token if best else res.stall_ms_per_token):
                best = (cand, r)
        if best is None:
            break
        slots, res = best
        moves += 1
        if res.stall_ms_per_token < target:
            break
    return slots, res, moves


def summary(res, cost) -> dict:
    """What a plan (or a scoreboard row) reports of one simulated configuration."""
    return {"hit_rate": res.hit_rate, "ms_per_token": res.ms_per_token,
            "tokens_per_s": 1e3 / res.ms_per_token if res.ms_per_token > 0 else 0.0,
            "stall_ms_per_token": res.stall_ms_per_token, "bytes_per_token": res.bytes_per_token,
            "misses_per_token": res.demand_loads_per_token, "prefetches_per_token": res.prefetch_loads_per_token,
            "lower_bound_ms_per_token": res.lower_bound_ms_per_token, "tokens": res.tokens}


def make_plan(facts: ModelFacts, split: BudgetSplit, cost, replay: Replay | None, pol: Policies,
              hardware: str, progress=None) -> dict:
    """The plan as plan.yaml holds it (without format/fingerprint headers: see plan/artifact.py)."""
    t0 = time.perf_counter()
    B = facts.expert_bytes()
    C = int(split.experts // B)
    curves = build_curves(facts, replay, pol, cost.load_s(), progress)
    t_curves = time.perf_counter() - t0
    slots = dp_slots(curves, facts.num_layers, facts.num_experts, C)
    t_dp = time.perf_counter() - t0 - t_curves
    uniform = split_slots(max(C, facts.num_layers), facts.num_layers, facts.num_experts, "--budget")
    plan = {
        "model": facts.name, "num_layers": facts.num_layers, "num_experts": facts.num_experts, "top_k": facts.top_k,
        "slots": slots, "expert_bytes": {"full": B},
        "budget": split.to_dict() | {"experts_used": sum(slots) * B},
        "policies": pol.to_dict(), "hardware": hardware, "curves": curves.source,
        "curve_ms_per_token": {"plan": 1e3 * float(sum(curves.at(l, s) for l, s in enumerate(slots))),
                               "uniform": 1e3 * float(sum(curves.at(l, s) for l, s in enumerate(uniform)))},
        "uniform_slots": uniform,
        "timing_s": {"curves": round(t_curves, 3), "dp": round(t_dp, 3)},
    }
    if replay is not None:
        uni = replay.run(uniform, pol)
        res = replay.run(slots, pol)
        if res.stall_ms_per_token >= uni.stall_ms_per_token:
            slots, res, moves = refine(replay, pol, curves, slots, res, uni.stall_ms_per_token, facts.num_experts)
            plan["slots"], plan["refined_moves"] = slots, moves
            plan["curve_ms_per_token"]["plan"] = 1e3 * float(sum(curves.at(l, s) for l, s in enumerate(slots)))
        plan["predicted"] = summary(res, cost)
        plan["uniform"] = summary(uni, cost)
        plan["traces"] = replay.trace.source or replay.trace.model
        plan["timing_s"]["replay"] = round(time.perf_counter() - t0 - t_curves - t_dp, 3)
    else:
        plan["predicted"] = {"stall_ms_per_token": plan["curve_ms_per_token"]["plan"],
                             "misses_per_token": float(sum(curves.misses[l, curves.hi.index(s), 0]
                                                           for l, s in enumerate(slots))),
                             "hit_rate": None, "ms_per_token": None, "note": "analytic model: stall only"}
    return plan
