"""Everything plan-cache and the scoreboard replay: model facts, the budget split, the cost model, the traces
(gated by the workdir's stored T_g when there is one), predictors and the policies they resolve to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import MoectlError
from ..core.sizing import BudgetSplit, ModelSizes, split_budget
from .planner import Policies, Replay


@dataclass
class Setup:
    facts: ModelSizes
    split: BudgetSplit
    cost: object
    replay: Replay | None
    policies: Policies
    workdir: Path | None          # None: a bare trace (simulate --preset), no workdir artifacts
    hardware: str
    budget: str
    raw_trace: object = None      # before gating (presets gate their own way)


def workdir_of(model: str, workdir) -> Path:
    from ..core.recipes import moectl_home, resolve_model

    if workdir:
        return Path(workdir).expanduser()
    try:
        return resolve_model(model, None).workdir
    except MoectlError:
        return moectl_home() / model


def load_traces(paths, wd: Path):
    from ..sim.simulate import concat
    from ..core.trace import load_trace

    if not paths:
        default = wd / "traces"
        paths = [default] if (default / "meta.json").exists() else []
    return concat([load_trace(p) for p in paths]) if paths else None


def plan_setup(model: str, budget: str, hardware: str, kv_tokens: int, traces, replacement: str, prefetch: str,
               depth: int | None, workdir=None, lowbit_only: str | None = None) -> Setup:
    """`lowbit_only`: the low-bit copy set of a lowbit-only plan, whose smallest slot (the budget's minimum) is
    low-bit, as the runtime's."""
    from ..sim.cost import CostModel, load_hardware
    from ..policies import check_names
    from ..core.trace import check_trace_fits
    from ..store.facts import model_sizes

    check_names(replacement, prefetch)                  # a plan is for the runtime: what the runtime takes
    wd = workdir_of(model, workdir)
    facts = model_sizes(model, workdir)
    if lowbit_only is not None:
        from ..setting.model_sizes import lowbit_nbytes

        split = split_budget(budget, facts, kv_tokens, min_slot_bytes=lowbit_nbytes(facts, lowbit_only))
    else:
        split = split_budget(budget, facts, kv_tokens)
    cost = CostModel(load_hardware(hardware), facts.shape)
    cost.expert_bytes = facts.expert_bytes()
    trace = load_traces(traces, wd)
    pol = Policies(replacement=replacement, depth=depth)
    if trace is None:
        if prefetch not in ("auto", "none"):
            pol.prefetch = prefetch
        return Setup(facts, split, cost, None, pol, wd, hardware, budget)
    check_trace_fits(trace, facts.num_layers, facts.num_experts, facts.top_k, f"--model {model}", facts.fingerprint)
    replay = Replay(trace, cost)
    raw = replay.raw = trace
    gated = stored_gating(wd, facts, trace)
    if gated is not None:
        pol.gating, pol.sensitivities, replay.trace = gated
    pol.prefetch = _prefetch(prefetch, replay, wd, facts)
    return Setup(facts, split, cost, replay, pol, wd, hardware, budget, raw)


def stored_gating(wd: Path, facts: ModelSizes, trace):
    """(T_g, gated trace) from the workdir's sensitivity.json when it stores a threshold and the trace has weights."""
    from ..calib.sensitivity import JSON_NAME, load_sensitivity
    from ..policies.gating import gate_trace, parse_gating

    f = wd / JSON_NAME
    if not f.exists() or trace.weights is None:
        return None
    meta = load_sensitivity(f, facts.fingerprint, facts.num_layers)
    if not meta.get("threshold"):
        return None
    policy = parse_gating(None, None, meta["sensitivities"], meta["threshold"])
    return (float(meta["threshold"]), list(meta["sensitivities"]), gate_trace(trace, policy)) if policy else None


def _prefetch(name: str, replay: Replay, wd: Path | None, facts: ModelSizes) -> str:
    """Resolve --prefetch auto the way the runtime does, on what the traces can replay (`wd` None: no workdir,
    no predictors)."""
    from ..predict.predictors_file import JSON_NAME, load_predictors
    from ..sim.simulate import hidden_lookup

    tr = replay.trace
    hidden = hidden_lookup(tr) is not None
    preds = load_predictors(wd, facts.fingerprint) if wd is not None and (wd / JSON_NAME).exists() else None
    if preds is not None:
        replay.aux_gate = preds.aux_gate
    if name == "auto":
        kinds = set(preds.kinds) if preds else set()
        name = ("aux-gate" if {"mlp", "aux_gate"} <= kinds and hidden else "mlp" if "mlp" in kinds and hidden
                else "gate-reuse" if hidden and tr.routers else "routing" if "routing" in kinds else "none")
    if name in ("mlp", "aux-gate"):
        replay.predictor = preds.mlp if preds else None
    elif name == "routing":
        replay.predictor = preds.routing if preds else None
    return name


def setup_from_trace(trace, budget: str, hardware: str, model_shape: str | None = None, kv_tokens: int = 4096,
                     replacement: str = "ours", prefetch: str = "auto") -> Setup:
    """A setup for `simulate --preset`: the model's facts from the trace's shape (recipe or --model-shape)."""
    from ..setting.model_sizes import shape_sizes
    from ..sim.cost import CostModel, load_hardware
    from ..sim.simulate import model_shape as shape_of

    shape = shape_of(trace, model_shape)
    facts = shape_sizes(shape, trace.num_layers, trace.num_experts, trace.top_k, name=shape.get("name", trace.model),
                        fingerprint=trace.fingerprint)
    split = split_budget(budget, facts, kv_tokens)
    cost = CostModel(load_hardware(hardware), shape)
    replay = Replay(trace, cost)
    replay.raw = trace
    pol = Policies(replacement=replacement, cpu_experts="auto")     # moectl's default: the fastest lossless setting
    pol.prefetch = _prefetch(prefetch, replay, None, facts)
    return Setup(facts, split, cost, replay, pol, None, hardware, budget, trace)
