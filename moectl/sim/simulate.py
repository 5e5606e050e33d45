"""High-level simulation: traces + cache sizes + policy names + hardware -> the metrics `moectl simulate` prints.

Cache sizes per layer come from one of:
  fraction F       round(F * E) slots in every layer (at least top-k, so one token's experts fit)
  experts N        N slots in all, split evenly over the layers (the first N % L layers get one more)
  plan.yaml        `{format: moectl-plan-v1, fingerprint: <model fp or null>, slots: [per layer],
                   slots_low: [per layer, optional]}` (written by `moectl plan-cache`: moectl/plan/plan_file.py;
                   `simulate --plan` also applies its policies there, `apply_plan`)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..artifacts.plan import PLAN_FORMAT, load_plan, plan_preload, plan_slots  # noqa: F401
from ..core.cache_model import FULL, split_slots
from ..errors import MoectlError
from ..policies import PolicyInputs, build_prefetch, build_replacement, eams_from_traces, make_replacement
from ..policies.admission import make_admission, prefetch_staging
from ..policies.placement import ComputePlacement
from ..policies.precision import LOW, PrecisionPolicy, make_precision
from ..core.sizing import ModelSizes, budget_pools, lowbit_fraction_for, split_budget, split_pools, staging_nbytes
from ..core.trace import Trace
from .cost import (CostModel, expert_bytes, load_hardware, load_shape, parse_lowbit, shape_for_trace_model,
                   shape_from_hf_config)
from .simulator import SimResult, Simulator, trace_steps



def capacities(trace: Trace, fraction: float | None = None, experts: int | None = None,
               plan: str | Path | dict | None = None, budget: float | None = None,
               cost: CostModel | None = None, facts: ModelSizes | None = None, staging: int = 0,
               min_slot_bytes: float | None = None, low_bytes: float | None = None,
               lowbit_fraction: float = 0.0) -> list[int] | dict:
    """Full-precision slots per layer. `budget` (bytes of device memory) is split as the runtime splits it
    (`moectl/core/sizing.py`: dense weights, KV reserve, workspace, `staging` bytes of staging buffers) and the rest
    filled with experts of `cost`'s size, or with `low_bytes` low-bit copies too ({precision: slots per layer},
    `sizing.budget_pools`); `budget_sizing` gives those from the options, as the runtime takes them. `facts` (a
    checkpoint's, `store/facts.py: model_sizes`) or, without, estimated from `cost`'s shape; `min_slot_bytes`:
    the smallest slot served (default `cost`'s expert)."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    given = sum(x is not None for x in (fraction, experts, plan, budget))
    if given != 1:
        raise MoectlError("give exactly one of --cache-fraction, --cache-experts, --plan, --budget")
    if budget is not None:
        if facts is None:
            from ..setting.model_sizes import shape_sizes

            facts = shape_sizes(cost.shape, L, E, K, expert_nbytes=cost.expert_bytes)
        split = split_budget(int(budget), facts, min_slot_bytes=min_slot_bytes or cost.expert_bytes,
                             staging=int(staging))
        pools = budget_pools(split, L, E, cost.expert_bytes, low_bytes, lowbit_fraction)
        return pools if low_bytes is not None else pools[FULL]
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise MoectlError(f"--cache-fraction must be in (0, 1], got {fraction}")
        return [min(E, max(K, round(fraction * E)))] * L
    if experts is not None:
        return split_slots(experts, L, E)
    d = plan if isinstance(plan, dict) else load_plan(plan)
    slots = plan_slots(d, None if isinstance(plan, dict) else plan)
    if len(slots) != L:
        raise MoectlError(f"plan has {len(slots)} layers of slots, the trace has {L} MoE layers")
    fp = d.get("fingerprint")
    if fp and trace.fingerprint and fp != trace.fingerprint:
        raise MoectlError(f"plan was made for model {fp}, the trace is of {trace.fingerprint}")
    return [min(E, s) for s in slots]


def budget_sizing(cost: CostModel, prefetch: str, cpu_experts: str, buffers: int | None = None,
                  precision: str = "full", lowbit: str | None = None, lowbit_fraction: float | None = None) -> dict:
    """`capacities`' sizing arguments for a budget, as the runtime takes them (`runtime/load.py: size_cache`): with
    prefetch, `buffers` (default `prefetch_staging(cpu_experts)`) staging buffers of what prefetches load
    (`sizing.staging_nbytes`: low-bit at lowbit-only, where the smallest slot is low-bit too), none without; with
    a low-bit precision, the low-bit copy's bytes and their share of the cache (`sizing.lowbit_fraction_for`)."""
    pooled = precision != "full" and lowbit is not None
    low = expert_bytes(cost.shape, *parse_lowbit(lowbit)) if pooled else None
    low_only = pooled and precision == "lowbit-only"
    if lowbit_fraction is not None and not 0 <= lowbit_fraction < 1:
        raise MoectlError(f"--lowbit-fraction {lowbit_fraction:g}: give a share of the cache's bytes in [0, 1)")
    n = 0 if prefetch in (None, "none") else prefetch_staging(cpu_experts) if buffers is None else int(buffers)
    return {"staging": staging_nbytes(n, cost.expert_bytes, low, low_only),
            "min_slot_bytes": low if low_only else cost.expert_bytes, "low_bytes": low,
            "lowbit_fraction": lowbit_fraction_for(precision, pooled, lowbit_fraction)}


def model_shape(trace: Trace, name: str | None = None) -> dict:
    """The shape used for byte and time costs: --model-shape, else the recipe listing the trace's model
    in trace_names, else the trace's own HF config (profiled traces)."""
    if name:
        shape = load_shape(name)
    else:
        shape = shape_for_trace_model(trace.model)
        if shape is None and isinstance(trace.extra.get("config"), dict):
            shape = shape_from_hf_config(trace.extra["config"])
        if shape is None:
            shape = _shape_from_checkpoint(trace.model)
        if shape is None:
            raise MoectlError(f"no recipe lists trace model {trace.model!r} in trace_names; "
                              f"pass --model-shape NAME (a recipe with a shape: block)")
    if (shape.get("num_experts"), shape.get("moe_layers", shape.get("num_layers"))) != (trace.num_experts, trace.num_layers):
        raise MoectlError(f"shape {shape.get('name')} has {shape.get('moe_layers')} MoE layers x "
                          f"{shape.get('num_experts')} experts, the trace has {trace.num_layers} x {trace.num_experts}")
    return shape


def _shape_from_checkpoint(model: str) -> dict | None:
    """Profiled traces name their model (a recipe or a checkpoint dir): read its config.json if it exists
    (never builds anything)."""
    import json

    try:
        from ..core.recipes import resolve_model

        ref = resolve_model(model, None)
        cfg = Path(ref.path) / "config.json"
        return shape_from_hf_config(json.loads(cfg.read_text())) if cfg.is_file() else None
    except Exception:          # unknown model name: the caller asks for --model-shape
        return None


def concat(traces: list[Trace]) -> Trace:
    """Several traces of one model as one stream of requests (request ids made unique)."""
    if len(traces) == 1:
        return traces[0]
    t0 = traces[0]
    for t in traces[1:]:
        if (t.num_layers, t.num_experts) != (t0.num_layers, t0.num_experts):
            raise MoectlError(f"traces of different models: {t0.model} and {t.model}")
    K = max(t.top_k for t in traces)
    pad = [np.pad(t.experts, ((0, 0), (0, 0), (0, K - t.top_k)), constant_values=-1) for t in traces]
    w = None
    if all(t.weights is not None for t in traces):
        w = np.concatenate([np.pad(t.weights, ((0, 0), (0, 0), (0, K - t.top_k))) for t in traces])
    hidden = None
    if all(t.hidden is not None for t in traces):
        from ..core.trace import HiddenSamples

        off = np.cumsum([0] + [t.num_tokens for t in traces])
        hidden = HiddenSamples(np.concatenate([t.hidden.token_index + o for t, o in zip(traces, off)]),
                               np.concatenate([t.hidden.moe_inputs for t in traces]),
                               np.concatenate([t.hidden.prev_final for t in traces]))
    return Trace(t0.model, t0.num_layers, t0.num_experts, K,
                 [f"{i}:{r}" for i, t in enumerate(traces) for r in t.request],
                 np.concatenate([t.pos for t in traces]), np.concatenate([t.phase for t in traces]),
                 np.concatenate(pad), w, t0.fingerprint, list(t0.moe_layer_ids), hidden, t0.routers,
                 t0.router_bias, t0.source, dict(t0.extra))


def hidden_lookup(trace: Trace):
    """hidden_of(row, layer) -> [D] when the trace has every row's MoE inputs, else None."""
    h = trace.hidden
    if h is None:
        return None
    index = -np.ones(trace.num_tokens, dtype=np.int64)
    index[h.token_index] = np.arange(len(h.token_index))
    if (index < 0).any():
        return None
    return lambda row, layer: h.moe_inputs[index[row], layer].astype(np.float32)


def final_hidden_lookup(trace: Trace):
    """final_hidden_of(row) -> [D], the final hidden state after `row` (the next row's prev_final; None at a
    request's last row), when the trace has every row's hidden samples, else None."""
    h = trace.hidden
    if hidden_lookup(trace) is None:
        return None
    index = -np.ones(trace.num_tokens, dtype=np.int64)
    index[h.token_index] = np.arange(len(h.token_index))
    N = trace.num_tokens

    def final_hidden_of(row: int):
        nxt = row + 1
        if nxt >= N or trace.request[nxt] != trace.request[row]:
            return None
        return h.prev_final[index[nxt]].astype(np.float32)
    return final_hidden_of


def policy_inputs(trace: Trace, train_traces: list[Trace] | None = None, mlp=None, routing=None,
                  aux_gate=None) -> PolicyInputs:
    """What the simulator knows for the policy builder: the trace's routers and hidden states, trained
    predictors, and the request EAMs of `train_traces` (MoE-Infinity's collection)."""
    return PolicyInputs(trace.num_layers, trace.num_experts, trace.top_k, routers=trace.routers,
                        router_bias=trace.router_bias, hidden_states=hidden_lookup(trace) is not None,
                        mlp=mlp, routing=routing, aux_gate=aux_gate, eamc=eams_from_traces(train_traces or []),
                        future=[s.chosen for s in trace_steps(trace) if not s.prefill],
                        predictor_hint=" (--predictor DIR from `moectl train-predictor`; a routing predictor "
                                       "can also be trained on other traces of the model with --train-on PATH)")


def precision_pools(caps: list[int], precision: PrecisionPolicy, full_bytes: float, low_bytes: float | None,
                    num_experts: int, lowbit_fraction: float | None = None) -> dict[str, list[int]]:
    """Per-precision pools from full-precision slots `caps`, split as the runtime splits them (`sizing.split_pools`:
    `lowbit_fraction` of the bytes to low-bit slots; full: all full; lowbit-only: all of them low-bit, no full pool).
    `caps` already {precision: per-layer slots} (a plan's own split) is taken as it is."""
    if isinstance(caps, dict):
        return {p: list(c) for p, c in caps.items() if sum(c) > 0}
    if not precision.uses_lowbit:
        return {FULL: list(caps)}
    if low_bytes is None:
        raise MoectlError(f"--precision {precision.name} needs --lowbit (the low-bit copy set, e.g. q4g64)")
    if lowbit_fraction is not None and not 0 <= lowbit_fraction < 1:
        raise MoectlError(f"--lowbit-fraction {lowbit_fraction:g}: give a share of the cache's bytes in [0, 1)")
    f = lowbit_fraction_for(precision.name, True, lowbit_fraction)
    L = len(caps)
    for p, share, nbytes in ((FULL, 1 - f, full_bytes), (LOW, f, low_bytes)):
        if 0 < share < 1 and int(share * sum(caps) * full_bytes // nbytes) < L:
            raise MoectlError(f"the {p} pool gets {int(share * sum(caps) * full_bytes // nbytes)} slots from "
                              f"{share:.0%} of the expert budget, below one per MoE layer ({L}); change "
                              f"--lowbit-fraction or give more memory")
    full, low = split_pools(list(caps), num_experts, full_bytes, low_bytes, f)   # lowbit-only: no full pool
    return {p: c for p, c in ((FULL, full), (LOW, low)) if sum(c) > 0}


def simulate(trace: Trace, caps, replacement: str, prefetch: str, cost: CostModel,
             predictor=None, train_traces: list[Trace] | None = None, depth: int | None = None,
             per_layer: int | None = None, min_score: float | None = None, belady: bool = True,
             replacement_kw: dict | None = None, aux_gate=None, precision: PrecisionPolicy | None = None,
             lowbit: str | None = None, lowbit_fraction: float | None = None, cpu_experts: str = "never",
             admission: str = "off", preload: dict | None = None, staging: int | None = None,
             draft=None) -> SimResult:
    """One configuration on one (possibly concatenated) trace. `predictor`: the routing predictor for
    --prefetch routing, else the mlp one. `caps`: full-precision slots per layer; with a low-bit `precision`
    their bytes are split into per-precision pools (`precision_pools`). `preload`: a plan's hot set, resident
    before the first step (`CacheState.preload`). `staging`: prefetch staging buffers per pool (0: prefetches copy
    into cache slots, evicting; default `prefetch_staging(cpu_experts)`, as the runtime). `draft` (a
    sim/spec_passes.py DraftSpec): replayed in verification passes, its figures under `SimResult.draft`."""
    steps = trace_steps(trace)
    inputs = policy_inputs(trace, train_traces, mlp=None if prefetch == "routing" else predictor,
                           routing=predictor if prefetch == "routing" else None, aux_gate=aux_gate)
    precision = precision or PrecisionPolicy()
    nbytes = {FULL: cost.expert_bytes}
    if lowbit is not None:
        bits, group = parse_lowbit(lowbit)
        nbytes[LOW] = expert_bytes(cost.shape, bits, group)
    pools = precision_pools(caps, precision, cost.expert_bytes, nbytes.get(LOW), trace.num_experts, lowbit_fraction)
    hidden_of = hidden_lookup(trace) if prefetch in ("gate-reuse", "mlp", "aux-gate") else None
    final_of = final_hidden_lookup(trace) if prefetch == "aux-gate" else None
    placement = ComputePlacement(cpu_experts, cost)
    staging = prefetch_staging(cpu_experts) if staging is None else staging

    def make_sim(kind=Simulator):
        repl = {p: build_replacement(replacement, inputs, **(replacement_kw or {})) for p in pools}
        return kind(pools, repl, build_prefetch(prefetch, inputs, depth, per_layer, min_score), cost,
                    precision=precision, nbytes=nbytes, placement=placement if cpu_experts != "never" else None,
                    admission=make_admission(admission, cost, trace.top_k, cpu_experts=cpu_experts,
                                             staged=staging > 0), preload=preload, staging=staging)
    if draft is None:
        r = make_sim().run(steps, hidden_of=hidden_of, final_hidden_of=final_of)
    else:
        from .spec_passes import PassSimulator, check_draftable, run_draft

        check_draftable(replacement, prefetch)
        r = run_draft(lambda: make_sim(PassSimulator), trace, draft, hidden_of, final_of)
    note = ""
    if replacement == "moe-infinity" and not train_traces and len(trace.request_slices()) < 2:
        note = ("moe-infinity without --train-on on a single-request trace has an empty request collection: "
                "its pEAM is the live request's own, i.e. sequence LFU; seed it with --train-on TRACES")
    if precision.name == "hobbit" and trace.weights is None:
        note = "the trace has no gate weights: every miss scores 0, so HOBBIT loads every one in full precision"
    bel = None
    if belady and list(pools) == [FULL]:
        bel = Simulator(caps, make_replacement("belady"), None, cost).run(steps)["hit_rate"]
    return SimResult(
        hit_rate=r["hit_rate"], belady_hit_rate=bel, demand_loads_per_token=r["demand_loads_per_token"],
        prefetch_loads_per_token=r["prefetch_loads_per_token"], wasted_prefetch_fraction=r["wasted_prefetch_fraction"],
        bytes_per_token=r["bytes_per_token"], stall_ms_per_token=r["stall_ms_per_token"],
        ms_per_token=r["ms_per_token"], lower_bound_ms_per_token=r["lower_bound_ms_per_token"],
        tokens=r["decode_tokens"], late_prefetches_per_token=r["late_prefetches_per_token"],
        prefill_ms=r["prefill_ms"], replacement=replacement, prefetch=prefetch, misses=r["misses"],
        prefill_misses=r["prefill_misses"], cache=r["cache"], note=note,
        full_loads_per_token=r["full_loads_per_token"], lowbit_loads_per_token=r["lowbit_loads_per_token"],
        skipped_per_token=r["skipped_per_token"], cpu_experts_per_token=r["cpu_experts_per_token"],
        cpu_ms_per_token=r["cpu_ms_per_token"], fill_copies_per_token=r["fill_copies_per_token"], slots={p: sum(c) for p, c in pools.items()},
        stall_ms_per_layer=r["stall_ms_per_layer"], draft=r.get("draft"))



def cost_for(trace: Trace, hardware: str, model_shape_name: str | None = None, bits: float | None = None) -> CostModel:
    return CostModel(load_hardware(hardware), model_shape(trace, model_shape_name), bits)
