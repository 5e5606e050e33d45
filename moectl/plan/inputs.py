"""Everything plan-cache and the scoreboard replay: the model's sizes, the setting resolved for a replay
(`setting/resolve.py`: the budget's split, the stored T_g that gates the traces, what `--prefetch auto` stands for),
the cost model, the traces and the predictors they replay with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.sizing import BudgetSplit, ModelSizes
from ..errors import MoectlError
from ..setting.options import RuntimeOptions
from ..setting.resolve import resolve
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
    from ..artifacts.trace_dir import load_trace
    from ..sim.simulate import concat

    if not paths:
        default = wd / "traces"
        paths = [default] if (default / "meta.json").exists() else []
    return concat([load_trace(p) for p in paths]) if paths else None


def plan_setup(model: str, budget: str, hardware: str, kv_tokens: int, traces, replacement: str, prefetch: str,
               depth: int | None, workdir=None, precision: str = "full", lowbit: str | None = None, t1: float = 0.6,
               t2: float = 0.9, cpu_experts: str = "never", admission: str = "off") -> Setup:
    """plan-cache's inputs for `model` at `budget`: its sizes (`store/facts.py: model_sizes`), the traces (default the
    workdir's profiled ones), and the setting resolved on them. The budget's split keeps no staging buffers: the
    planner buys them when they fit (`planner.reserve_staging`). At lowbit-only the budget's smallest slot is
    low-bit, as the runtime's."""
    from ..core.trace import check_trace_fits
    from ..policies import check_names
    from ..sim.cost import CostModel, load_hardware
    from ..store.facts import model_sizes

    check_names(replacement, prefetch)                  # a plan is for the runtime: what the runtime takes
    wd = workdir_of(model, workdir)
    facts = model_sizes(model, workdir)
    trace = load_traces(traces, wd)
    if trace is not None:
        check_trace_fits(trace, facts.num_layers, facts.num_experts, facts.top_k, f"--model {model}",
                         facts.fingerprint)
    gated = trace is not None and trace.weights is not None         # the stored T_g gates traces with weights
    opts = RuntimeOptions(replacement=replacement, prefetch=prefetch, precision=precision, lowbit=lowbit, t1=t1, t2=t2,
                          cpu_experts=cpu_experts, admission=admission, budget=budget, staging=0,
                          gating="auto" if gated else None)
    setting = resolve(opts, facts, wd, live=False, trace=trace, kv_tokens=kv_tokens)
    cost = CostModel(load_hardware(hardware), facts.shape)
    cost.expert_bytes = facts.expert_bytes()
    pol = policies_of(setting, opts, depth)
    if trace is None:
        return Setup(facts, setting.split, cost, None, pol, wd, hardware, budget)
    replay = Replay(trace, cost)
    replay.raw = trace
    if setting.gating is not None:
        from ..policies.gating import gate_trace

        g = setting.gating                              # `stored_gating`'s T_g and values, through the resolver
        pol.gating, pol.sensitivities, pol.gating_rule, pol.gating_cost = (g.threshold, list(g.sensitivities),
                                                                           g.rule, g.cost)
        replay.trace = gate_trace(trace, setting.gating)
    attach_predictors(replay, pol.prefetch, wd, facts.fingerprint)
    return Setup(facts, setting.split, cost, replay, pol, wd, hardware, budget, trace)


def policies_of(setting, opts: RuntimeOptions, depth: int | None) -> Policies:
    """The planner's Policies of a resolved setting (what the plan is measured with and records)."""
    return Policies(replacement=setting.replacement, prefetch=setting.prefetch, depth=depth,
                    precision=setting.precision.name, t1=opts.t1, t2=opts.t2, lowbit=setting.lowbit,
                    cpu_experts=setting.cpu_experts, admission=setting.admission)


def attach_predictors(replay: Replay, prefetch: str, wd: Path | None, fingerprint: str | None) -> None:
    """The workdir's trained predictors the replay runs with (`wd` None: no workdir, none): the aux gate, and the
    predictor `prefetch` names."""
    from ..artifacts.predictors import JSON_NAME
    from ..predictors.file import load_predictors

    preds = load_predictors(wd, fingerprint) if wd is not None and (wd / JSON_NAME).exists() else None
    if preds is None:
        return
    replay.aux_gate = preds.aux_gate
    if prefetch in ("mlp", "aux-gate"):
        replay.predictor = preds.mlp
    elif prefetch == "routing":
        replay.predictor = preds.routing


def setup_from_trace(trace, budget: str, hardware: str, model_shape: str | None = None, kv_tokens: int = 4096,
                     replacement: str = "ours", prefetch: str = "auto") -> Setup:
    """A setup for `simulate --preset`: the model's sizes from the trace's shape (recipe or --model-shape)."""
    from ..setting.model_sizes import shape_sizes
    from ..sim.cost import CostModel, load_hardware
    from ..sim.simulate import model_shape as shape_of

    shape = shape_of(trace, model_shape)
    facts = shape_sizes(shape, trace.num_layers, trace.num_experts, trace.top_k, name=shape.get("name", trace.model),
                        fingerprint=trace.fingerprint)
    opts = RuntimeOptions(replacement=replacement, prefetch=prefetch, cpu_experts="auto", budget=budget, staging=0)
    setting = resolve(opts, facts, None, live=False, trace=trace, kv_tokens=kv_tokens)
    cost = CostModel(load_hardware(hardware), shape)
    replay = Replay(trace, cost)
    replay.raw = trace
    pol = policies_of(setting, opts, None)               # moectl's default: the fastest lossless setting
    return Setup(facts, setting.split, cost, replay, pol, None, hardware, budget, trace)
