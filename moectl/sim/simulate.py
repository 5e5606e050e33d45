"""High-level simulation: traces + cache sizes + policy names + hardware -> the metrics `moectl simulate` prints.

Cache sizes per layer come from the resolver (`setting/resolve.py`: a plan's pools, a budget's, or the slots a replay
asks for by share or count, `capacities`: round(F * E) slots in every layer, or N in all split evenly), as the
runtime's do; `simulate` splits full-precision slots into per-precision pools the same way (`setting/pools.py:
precision_pools`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.cache_model import FULL, split_slots
from ..core.shapes import expert_bytes, load_shape, parse_lowbit, shape_for_trace_model, shape_from_hf_config
from ..core.trace import Trace
from ..errors import MoectlError
from ..policies import PolicyInputs, build_prefetch, build_replacement, eams_from_traces, make_replacement
from ..policies.admission import make_admission, prefetch_staging
from ..policies.placement import ComputePlacement
from ..policies.precision import LOW, PrecisionPolicy
from ..setting.pools import precision_pools
from .cost import CostModel, load_hardware
from .simulator import Simulator
from .steps import SimResult, trace_steps


def capacities(trace: Trace, fraction: float | None = None, experts: int | None = None) -> list[int]:
    """Full-precision slots per layer a replay asks for by share or count (a plan's, a budget's: the resolver,
    `setting/resolve.py`): `fraction` of each layer's experts (at least top-k, so one token's experts fit), or
    `experts` slots in all, split evenly over the layers (`cache_model.split_slots`)."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    if (fraction is None) == (experts is None):
        raise MoectlError("give exactly one of --cache-fraction, --cache-experts, --plan, --budget")
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise MoectlError(f"--cache-fraction must be in (0, 1], got {fraction}")
        return [min(E, max(K, round(fraction * E)))] * L
    return split_slots(experts, L, E)


def model_shape(trace: Trace, name: str | dict | None = None) -> dict:
    """The shape used for byte and time costs: --model-shape (a recipe or checkpoint name, or a shape already read,
    as a GGUF file's is by `plan/simulation.py` from `store/gguf/shape.py`), else the recipe listing the trace's model in
    trace_names, else the trace's own HF config (profiled traces)."""
    if isinstance(name, dict):
        shape = dict(name)
    elif name:
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



def cost_for(trace: Trace, hardware: str, model_shape_name: str | dict | None = None,
             bits: float | None = None) -> CostModel:
    return CostModel(load_hardware(hardware), model_shape(trace, model_shape_name), bits)
