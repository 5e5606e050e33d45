"""plan-cache: measured (or analytic) per-layer curves -> DP over layers and bytes -> a plan, simulated.

    sizes + budget split  (plan/inputs.py: the model's sizes and the setting resolved for a replay)
    curves f_l(n)         (plan/curves.py: the simulator on the traces with these policies, or the seed's model)
    slots per layer       (plan/dp.py: allocate over budget units, at least one slot per layer)
    predicted             (the whole plan replayed through the simulator: hit rate, ms/token, stall)
    uniform               (the same bytes split evenly, replayed the same way: the margin the plan must beat)
    kept                  (keep_best: the DP's slots if they beat the even split, else replay-checked slot moves
                           from them or from the even split, else the even split; plan.yaml's `dp` holds the DP's
                           own slots and margin either way)

Legend: L = MoE layers, E = experts, C = budget units (slots of one precision, or 1/8 low-bit slot: dp_plan).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..core.sizing import BudgetSplit, ModelSizes, budget_pools, lowbit_fraction_for, staging_nbytes
from ..errors import MoectlError
from .curves import Curves, analytic_curves, coarse_grid, extend_curves, measure_curves, slot_grid
from .dp import allocate


@dataclass
class Policies:
    """The policies a plan is measured with and records (what `simulate --plan` and the runtime apply)."""

    replacement: str = "ours"
    prefetch: str = "none"           # resolved name (gate-reuse, mlp, aux-gate, routing, eam, none)
    depth: int | None = None
    per_layer: int | None = None
    gating: float | None = None      # T_g of sensitivity gating (None: off)
    sensitivities: list | None = None    # the values the T_g applies to (so a plan's gating replays without the
                                         # workdir): `stored_gating`'s, by gating_rule
    gating_rule: str | None = None   # which values they are: fisher | ablation
    gating_cost: dict | None = None  # what `moectl sensitivity` measured at this T_g (ppl delta, experts/token)
    precision: str = "full"          # full | hobbit | lowbit-only (moectl/policies/precision.py)
    t1: float = 0.6
    t2: float = 0.9
    lowbit: str | None = None        # e.g. q4g64
    cpu_experts: str = "never"
    admission: str = "off"           # prefetch admission (policies/admission.py): on | off

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
    draft: object = None             # sim/spec_passes.py DraftSpec: replayed in verification passes (plan/speculative.py)

    def run(self, caps, pol: Policies, belady: bool = False, replacement: str | None = None,
            prefetch: str | None = None, preload: dict | None = None):
        """`caps`: full-precision slots per layer, or {precision: slots per layer} (a plan's pools); `preload`: the
        plan's hot set, resident before the first step."""
        from ..policies.precision import make_precision
        from ..sim.simulate import simulate

        p = prefetch or pol.prefetch
        return simulate(self.trace, caps, replacement or pol.replacement, p, self.cost,
                        predictor=self.predictor if p in ("mlp", "aux-gate", "routing") else None,
                        train_traces=self.train_traces, depth=pol.depth, per_layer=pol.per_layer,
                        belady=belady, aux_gate=self.aux_gate, precision=make_precision(pol.precision, pol.t1, pol.t2),
                        lowbit=pol.lowbit, cpu_experts=pol.cpu_experts, admission=pol.admission, preload=preload,
                        draft=self.draft)

    def run_warm(self, caps: dict, pol: Policies, **kw):
        """`run` with pools `caps` starting with their hot set resident (`hot`), as the runtime starts with a plan."""
        return self.run(caps, pol, preload=self.hot(caps), **kw)

    def hot(self, caps: dict) -> dict:
        """The preload of pools `caps` {precision: per-layer slots}: the experts this replay's decode rows use
        most (`cache_model.hot_experts`)."""
        from ..core.cache_model import hot_experts
        from ..core.trace import DECODE

        tr = self.trace
        return hot_experts(tr.experts[tr.phase == DECODE] if (tr.phase == DECODE).any() else tr.experts, caps)


def objective(pol: Policies) -> str:
    """What a plan minimises: the stall; with CPU compute of misses the whole ms/token (CPU time overlapping the
    device is not stall, the longer of the two is the layer's time)."""
    return "ms_per_token" if pol.cpu_experts != "never" else "stall_ms_per_token"


def pools_of(pol: Policies, n_hi, n_lo) -> dict:
    """{precision: per-layer slots} for the simulator from per-layer (n_hi, n_lo)."""
    from ..core.cache_model import FULL
    from ..policies.precision import LOW

    out = {}
    if pol.precision != "lowbit-only":
        out[FULL] = list(n_hi)
    if pol.precision != "full":
        out[LOW] = list(n_lo)
    return out


def layer_runner(replay: Replay, pol: Policies, nbytes: dict):
    """run_uniform(n_hi, n_lo) for measure_curves. Per layer and decode token: the stall the replay measured at that
    layer (the wait for its demand loads and late prefetches: the per-layer terms of the very sum the plan's replay
    minimises; a wasted prefetch costs only where its copy delayed one of them); with CPU compute of misses, every
    non-resident use times the cheaper of computing it on the CPU and fetching it."""
    from ..core.trace import DECODE

    tr, cost = replay.trace, replay.cost
    L = tr.num_layers
    dec = tr.experts[tr.phase == DECODE]
    uses = (dec >= 0).sum(-1).sum(0).astype(np.float64)            # [L] expert uses in decode rows

    def run(n_hi: int, n_lo: int):
        r = replay.run_warm(pools_of(pol, [n_hi] * L, [n_lo] * L), pol)    # warm, as the plan is replayed and run
        n = max(r.tokens, 1)
        per_pool = r.cache if set(r.cache) - {"prefill", "decode"} else {next(iter(nbytes)): r.cache}
        stall = np.array(r.stall_ms_per_layer, dtype=np.float64) / 1e3
        loads, hits = np.zeros(L), np.zeros(L)
        for p, c in per_pool.items():
            loads += np.array(c["decode"]["misses"], dtype=np.float64) / n
            hits += np.array(c["decode"]["hits"], dtype=np.float64) / n
        if pol.cpu_experts != "never":
            low = pol.precision == "lowbit-only"
            b = nbytes["low" if low else "full"]
            per_miss = min(cost.cpu_expert_s(1, b, low), cost.load_s(b) + cost.expert_s(1, b))
            loads = np.maximum(uses / n - hits, 0.0)
            stall = loads * per_miss
        return stall, loads
    return run


def build_curves(facts: ModelSizes, replay: Replay | None, pol: Policies, load_s: float, nbytes: dict,
                 progress=None) -> Curves:
    if replay is None:
        if pol.precision == "hobbit":
            raise MoectlError("the analytic model has one precision: a hobbit plan needs traces (--traces)")
        return analytic_curves(facts.num_layers, facts.num_experts, facts.top_k, load_s,
                               prefetch=pol.prefetch != "none")
    E = facts.num_experts
    two = pol.precision == "hobbit"
    hi = coarse_grid(E) if two else [0] if pol.precision == "lowbit-only" else slot_grid(E)
    lo = coarse_grid(E) if two else slot_grid(E) if pol.precision == "lowbit-only" else [0]
    return measure_curves(layer_runner(replay, pol, nbytes), facts.num_layers, hi, lo, progress=progress,
                          label=f"{pol.replacement}/{pol.prefetch}, precision {pol.precision} on "
                                f"{replay.trace.num_tokens} trace rows, {len(hi) * len(lo)} grid points")


def dp_slots(curves: Curves, num_layers: int, num_experts: int, budget_slots: int, min_slots: int = 1) -> list[int]:
    """Full-precision slots per layer minimising the summed curve, within `budget_slots` slots."""
    C = min(budget_slots, num_layers * num_experts)
    if C < num_layers * min_slots:
        raise MoectlError(f"the expert budget holds {C} slots, below one per MoE layer ({num_layers})")
    choices = list(range(min_slots, num_experts + 1))
    idx, _ = allocate(curves.table([(t, 0) for t in choices]), np.array(choices), C)
    return [choices[i] for i in idx]


def choices_for(pol: Policies, E: int) -> list[tuple[int, int]]:
    """(n_hi, n_lo) a layer may take: at least one slot in every pool the precision policy uses."""
    if pol.precision == "full":
        return [(h, 0) for h in range(1, E + 1)]
    if pol.precision == "lowbit-only":
        return [(0, w) for w in range(1, E + 1)]
    return [(h, w) for h in range(1, E) for w in range(1, E - h + 1)]


MEASURE_ROUNDS = 3             # DP -> measure the chosen slot counts off the grid -> DP again, at most this often
MAX_UNITS = 4000               # budget resolution of the DP (units per full slot grow with the budget's size)


def dp_plan(curves: Curves, pol: Policies, L: int, E: int, experts_bytes: int, nbytes: dict) -> tuple[list, list]:
    """(n_hi per layer, n_lo per layer) minimising the summed curves within `experts_bytes`."""
    from ..policies.precision import LOW

    b_hi, b_lo = nbytes["full"], nbytes.get(LOW, nbytes["full"])
    small = min(b_hi if pol.precision != "lowbit-only" else b_lo, b_lo if pol.precision != "full" else b_hi)
    unit = max(small / (1 if pol.precision != "hobbit" else 8), experts_bytes / MAX_UNITS)
    C = int(experts_bytes // unit)
    ch = choices_for(pol, E)
    w = np.array([int(np.ceil(h * b_hi / unit - 1e-9)) + int(np.ceil(lo * b_lo / unit - 1e-9)) for h, lo in ch])
    if w.min() * L > C:
        raise MoectlError(f"the expert budget holds less than one slot per MoE layer ({L}) at this precision")
    idx, _ = allocate(curves.table(ch), w, C)
    return [ch[i][0] for i in idx], [ch[i][1] for i in idx]


def uniform_pools(pol: Policies, L: int, E: int, experts_bytes: int, nbytes: dict) -> tuple[list, list]:
    """The even split of the same bytes, as the runtime and `simulate` make it from a budget without a plan
    (`sizing.budget_pools`: HOBBIT gives the default low-bit share of the bytes to low-bit slots, lowbit-only all of
    them, with no full pool)."""
    from ..policies.precision import LOW

    low = nbytes[LOW] if pol.precision != "full" else None
    pools = budget_pools(BudgetSplit(experts_bytes, 0, 0, 0, 0, experts_bytes), L, E, nbytes["full"], low,
                         lowbit_fraction_for(pol.precision, low is not None, None))
    return pools.get("full", [0] * L), pools.get(LOW, [0] * L)


def spend_spare(slots: list[int], spare: int, E: int) -> list[int]:
    """Slots the DP left unspent go one at a time to the layer with the fewest, up to E. The curves, measured on the
    planning trace, gain nothing from them (that trace never used more experts there), but another trace of the
    model uses experts this one did not, and an unused slot is budget wasted (Qwen1.5-MoE at q4: 897 of 1280)."""
    out = list(slots)
    for _ in range(max(spare, 0)):
        open_ = [l for l in range(len(out)) if out[l] < E]
        if not open_:
            break
        out[min(open_, key=lambda l: out[l])] += 1
    return out


REFINE_ROUNDS, REFINE_TRIES = 3, 4


def refine(replay: Replay, pol: Policies, curves: Curves, hi: list[int], lo: list[int], res, target: float, E: int,
           key: str = "stall_ms_per_token"):
    """When the replayed plan does not beat the even split (layers interact through prefetch, policy clocks, the
    copy engine and the CPU, which the per-layer curves leave out): move one slot at a time from the layer that
    loses least by the curves to the one that gains most, keeping a move only if the replay improves; at most
    REFINE_ROUNDS rounds of REFINE_TRIES candidate moves. Moves the low-bit slots of a lowbit-only plan, else the
    full ones. Returns (hi, lo, result, moves kept)."""
    low = pol.precision == "lowbit-only"
    slots = list(lo if low else hi)
    L = len(slots)

    def f(l, s):
        return curves.at(l, 0, s) if low else curves.at(l, s, lo[l])

    def caps(sl):
        return pools_of(pol, hi, sl) if low else pools_of(pol, sl, lo)
    moves = 0
    for _ in range(REFINE_ROUNDS):
        gain = [f(l, s) - f(l, s + 1) if s < E else -np.inf for l, s in enumerate(slots)]
        loss = [f(l, s - 1) - f(l, s) if s > 1 else np.inf for l, s in enumerate(slots)]
        pairs = sorted(((gain[b] - loss[a], a, b) for a in range(L) for b in range(L) if a != b), reverse=True)
        best = None
        for _, a, b in pairs[:REFINE_TRIES]:
            if not (np.isfinite(gain[b]) and np.isfinite(loss[a])):
                continue
            cand = list(slots)
            cand[a], cand[b] = cand[a] - 1, cand[b] + 1
            r = replay.run_warm(caps(cand), pol)
            if getattr(r, key) < getattr(best[1] if best else res, key):
                best = (cand, r)
        if best is None:
            break
        slots, res = best
        moves += 1
        if getattr(res, key) < target:
            break
    return (hi, slots, res, moves) if low else (slots, lo, res, moves)


def margin(res, uni, key: str) -> float:
    """How much lower `res`'s objective is than the even split's (negative: higher)."""
    base = getattr(uni, key)
    return 1 - getattr(res, key) / base if base else 0.0


def keep_best(replay: Replay, pol: Policies, curves: Curves, dp: tuple, uniform: tuple, E: int, key: str):
    """The plan to keep, replay-checked: the DP's slots when they replay no worse than the even split of the same
    bytes; else the DP's refined by replayed slot moves (`refine`); else the even split refined the same way; else
    the even split itself, so a plan never replays worse than the split it is judged against. Returns (hi, lo,
    result, which one: dp | dp+refine | uniform+refine | uniform, moves kept)."""
    hi, lo, res = dp
    target = getattr(uniform[2], key)
    if getattr(res, key) <= target:                             # a tie is the even split's figure: no worse
        return hi, lo, res, "dp", 0
    if pol.precision != "hobbit":               # refine moves one pool's slots: full, or a lowbit-only plan's low ones
        hi, lo, res, moves = refine(replay, pol, curves, hi, lo, res, target, E, key)
        if getattr(res, key) < target:
            return hi, lo, res, "dp+refine", moves
        hi, lo, res, moves = refine(replay, pol, curves, *uniform, float("-inf"), E, key)
        if getattr(res, key) < target:
            return hi, lo, res, "uniform+refine", moves
    return *uniform, "uniform", 0


def summary(res, cost) -> dict:
    """What a plan (or a scoreboard row) reports of one simulated configuration."""
    return {"hit_rate": res.hit_rate, "ms_per_token": res.ms_per_token,
            "tokens_per_s": 1e3 / res.ms_per_token if res.ms_per_token > 0 else 0.0,
            "stall_ms_per_token": res.stall_ms_per_token, "bytes_per_token": res.bytes_per_token,
            "misses_per_token": res.demand_loads_per_token, "prefetches_per_token": res.prefetch_loads_per_token,
            "lower_bound_ms_per_token": res.lower_bound_ms_per_token, "tokens": res.tokens,
            "full_loads_per_token": res.full_loads_per_token, "lowbit_loads_per_token": res.lowbit_loads_per_token,
            "skipped_per_token": res.skipped_per_token, "cpu_experts_per_token": res.cpu_experts_per_token,
            "cpu_ms_per_token": res.cpu_ms_per_token}


def expert_nbytes(facts: ModelSizes, pol: Policies) -> dict:
    """{precision: bytes of one expert copy} the plan uses."""
    from ..policies.precision import LOW
    from ..setting.model_sizes import lowbit_nbytes

    out = {"full": facts.expert_bytes()}
    if pol.precision != "full":
        if pol.lowbit is None:
            raise MoectlError(f"--precision {pol.precision} needs --lowbit (the low-bit copy set, e.g. q4g64)")
        out[LOW] = lowbit_nbytes(facts, pol.lowbit)
    return out


def reserve_staging(split: BudgetSplit, pol: Policies, nbytes: dict, num_layers: int) -> BudgetSplit:
    """The budget less the staging buffers the runtime gives prefetches under these policies (`prefetch_staging`:
    two copies of what prefetches load when misses are fetched, `sizing.staging_nbytes`), when what is left still
    holds a slot per layer."""
    from ..policies.admission import prefetch_staging
    from ..policies.precision import LOW

    n = prefetch_staging(pol.cpu_experts) if pol.prefetch != "none" else 0
    stage = staging_nbytes(n, nbytes["full"], nbytes.get(LOW), pol.precision == "lowbit-only")
    if stage == 0 or split.experts - stage < num_layers * min(nbytes.values()):
        return split
    return replace(split, experts=split.experts - stage, staging=stage)


def make_plan(facts: ModelSizes, split: BudgetSplit, cost, replay: Replay | None, pol: Policies,
              hardware: str, progress=None) -> dict:
    """The plan as plan.yaml holds it (without format/fingerprint headers: see artifacts/plan.py: write_plan)."""
    t0 = time.perf_counter()
    L, E = facts.num_layers, facts.num_experts
    nbytes = expert_nbytes(facts, pol)
    split = reserve_staging(split, pol, nbytes, L)
    curves = build_curves(facts, replay, pol, cost.load_s(), nbytes, progress)
    u_hi, u_lo = uniform_pools(pol, L, E, split.experts, nbytes)
    low = pol.precision == "lowbit-only"
    if replay is not None and pol.precision != "hobbit":       # the even split's counts measured, not interpolated
        curves = extend_curves(curves, layer_runner(replay, pol, nbytes), u_lo if low else u_hi, low)
    t_curves = time.perf_counter() - t0
    hi, lo = dp_plan(curves, pol, L, E, split.experts, nbytes)
    for _ in range(MEASURE_ROUNDS if replay is not None and pol.precision != "hobbit" else 0):
        before = curves
        curves = extend_curves(curves, layer_runner(replay, pol, nbytes), lo if low else hi, low)
        if curves is before:                                   # every chosen count is a measured point
            break
        hi, lo = dp_plan(curves, pol, L, E, split.experts, nbytes)
    if pol.precision != "hobbit":
        pool = "low" if low else "full"
        spare = int(split.experts // nbytes[pool]) - sum(lo if low else hi)
        lo, hi = (spend_spare(lo, spare, E), hi) if low else (lo, spend_spare(hi, spare, E))
    t_dp = time.perf_counter() - t0 - t_curves

    def curve_ms(h, w):
        return 1e3 * float(sum(curves.at(l, a, b) for l, (a, b) in enumerate(zip(h, w))))
    used = sum(hi) * nbytes["full"] + sum(lo) * nbytes.get("low", 0)
    plan = {
        "model": facts.name, "num_layers": L, "num_experts": E, "top_k": facts.top_k,
        "slots": hi, **({"slots_low": lo} if pol.precision != "full" else {}),
        "expert_bytes": nbytes, "lowbit": pol.lowbit,
        # experts_used: the bytes of the slots placed (what the plan holds); all_experts: every expert of the model
        # at full precision (a budget whose expert bytes exceed it holds the whole model)
        "budget": split.to_dict() | {"experts_used": int(used), "all_experts": int(L * E * nbytes["full"])},
        "policies": pol.to_dict(), "hardware": hardware, "curves": curves.source, "objective": objective(pol),
        "curve_ms_per_token": {"plan": curve_ms(hi, lo), "uniform": curve_ms(u_hi, u_lo)},
        "uniform_slots": u_hi, **({"uniform_slots_low": u_lo} if pol.precision != "full" else {}),
        "timing_s": {"curves": round(t_curves, 3), "dp": round(t_dp, 3)},
    }
    if replay is not None:
        key = objective(pol)
        # both start with their pools' hot set loaded, as the runtime does with a plan
        uni = replay.run_warm(pools_of(pol, u_hi, u_lo), pol)
        res = replay.run_warm(pools_of(pol, hi, lo), pol)
        plan["dp"] = {"slots": hi, **({"slots_low": lo} if pol.precision != "full" else {}), key: getattr(res, key),
                      "margin": margin(res, uni, key)}
        hi, lo, res, plan["kept"], plan["refined_moves"] = keep_best(replay, pol, curves, (hi, lo, res),
                                                                      (u_hi, u_lo, uni), E, key)
        plan["slots"] = hi
        if pol.precision != "full":
            plan["slots_low"] = lo
        plan["budget"]["experts_used"] = int(sum(hi) * nbytes["full"] + sum(lo) * nbytes.get("low", 0))
        plan["curve_ms_per_token"]["plan"] = curve_ms(hi, lo)
        plan["preload"] = replay.hot(pools_of(pol, hi, lo))
        plan["predicted"] = summary(res, cost)
        plan["uniform"] = summary(uni, cost)
        plan["traces"] = replay.trace.source or replay.trace.model
        plan["timing_s"]["replay"] = round(time.perf_counter() - t0 - t_curves - t_dp, 3)
    else:
        plan["predicted"] = {"stall_ms_per_token": plan["curve_ms_per_token"]["plan"],
                             "misses_per_token": float(sum(curves.misses[l, curves.hi.index(s), 0]
                                                           for l, s in enumerate(hi))),
                             "hit_rate": None, "ms_per_token": None, "note": "analytic model: stall only"}
    return plan
