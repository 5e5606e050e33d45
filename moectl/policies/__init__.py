"""Cache replacement and prefetch policies, shared by the runtime and the simulator, and the one builder
both use.

`build_replacement(name, inputs, **options)` / `build_prefetch(name, inputs, **options)` build a policy by
name from `PolicyInputs` (what the driver knows about the model: sizes, router weights, trained
predictors, a MoE-Infinity request collection) plus user options. Model facts a policy does not use are
ignored; an option a policy does not take is an error. `make_replacement(name, **kw)` /
`make_prefetch(name, **kw)` are the low-level form (facts and options as keywords, same checks).
`REPLACEMENT_NAMES` / `PREFETCH_NAMES` are the registry the CLI help lists.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..artifacts.versioned import check_shape
from ..errors import MoectlError
from .aux_gate import AuxGatePrefetch
from .base import LRU, PrefetchPolicy, ReplacementPolicy
from .prefetch import EAMPrefetch, GateReuse, MLPPrefetch, OraclePrefetch, RoutingPrefetch, eams_from_traces
from .replacement import LFU, Belady, Hobbit, MoEInfinity, Ours

REPLACEMENTS = {"lru": LRU, "lfu": LFU, "moe-infinity": MoEInfinity, "hobbit": Hobbit, "belady": Belady,
                "ours": Ours}
PREFETCHES = {"none": PrefetchPolicy, "gate-reuse": GateReuse, "eam": EAMPrefetch, "routing": RoutingPrefetch,
              "mlp": MLPPrefetch, "aux-gate": AuxGatePrefetch, "oracle": OraclePrefetch}
REPLACEMENT_NAMES = list(REPLACEMENTS)          # what the simulator takes
PREFETCH_NAMES = list(PREFETCHES)
# what the runtime (and a plan, which is for the runtime) takes: belady and oracle know the future; auto is resolved
# by the driver (the model's trained predictors, else gate reuse) before a policy is built
RUNTIME_REPLACEMENT_NAMES = [n for n in REPLACEMENT_NAMES if n != "belady"]
RUNTIME_PREFETCH_NAMES = ["auto"] + [n for n in PREFETCH_NAMES if n != "oracle"]
# keywords that describe the model rather than configure a policy: passed where a policy takes them
FACTS = {"num_layers", "num_experts", "routers", "bias", "eamc", "predictor", "inner", "future"}


def _build(cls, kw: dict):
    params = inspect.signature(cls.__init__).parameters
    takes = [n for n in params if n != "self"]
    unknown = sorted(k for k in kw if k not in params and k not in FACTS)
    if unknown:
        raise MoectlError(f"policy {cls.name!r} has no option {', '.join(unknown)}"
                          + (f"; its options: {', '.join(t for t in takes if t not in FACTS)}" if takes else ""))
    missing = [n for n, p in params.items()
               if n != "self" and p.default is inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD
               and kw.get(n) is None]
    if missing:
        raise MoectlError(f"policy {cls.name!r} needs {', '.join(missing)}")
    return cls(**{k: v for k, v in kw.items() if k in params and v is not None})


def make_replacement(name: str, **kw) -> ReplacementPolicy:
    if name not in REPLACEMENTS:
        raise MoectlError(f"unknown replacement policy {name!r}; choose one of {', '.join(REPLACEMENT_NAMES)}")
    return _build(REPLACEMENTS[name], kw)


def make_prefetch(name: str, **kw) -> PrefetchPolicy:
    if name not in PREFETCHES:
        raise MoectlError(f"unknown prefetch policy {name!r}; choose one of {', '.join(PREFETCH_NAMES)}")
    return _build(PREFETCHES[name], kw)


@dataclass
class PolicyInputs:
    """What a driver (runtime or simulator) knows that policies may need."""

    num_layers: int
    num_experts: int
    top_k: int
    routers: dict | None = None          # MoE layer -> router weight [E, D] (gate reuse)
    router_bias: dict | None = None      # MoE layer -> [E]
    hidden_states: bool = True           # the driver can give each layer's hidden state (gate reuse, mlp, aux gate)
    mlp: object | None = None            # trained predictors (moectl/predict)
    routing: object | None = None
    aux_gate: object | None = None
    eamc: list | None = None             # request EAMs seeding MoE-Infinity's collection
    predictor_hint: str = ""             # how to get a missing predictor, for the error message
    future: list | None = None           # simulation only: each decode step's experts per layer (oracle prefetch)


def check_names(replacement: str | None, prefetch: str | None, runtime: bool = True) -> None:
    """--replacement / --prefetch against what the driver takes (the runtime's lists, or the simulator's: the
    policy builder's inputs say which, by knowing the future or not); an unknown one is one error listing them."""
    repl, pf = (RUNTIME_REPLACEMENT_NAMES, RUNTIME_PREFETCH_NAMES) if runtime else (REPLACEMENT_NAMES, PREFETCH_NAMES)
    for what, name, names in (("replacement", replacement, repl), ("prefetch", prefetch, pf)):
        if name is None or name in names:
            continue
        if runtime and name in (REPLACEMENTS if what == "replacement" else PREFETCHES):
            raise MoectlError(f"--{what} {name} knows the future: it exists in `moectl simulate` only; the runtime "
                              f"takes {', '.join(names)}")
        raise MoectlError(f"unknown {what} policy {name!r}; choose one of {', '.join(names)}")


def build_replacement(name: str, inputs: PolicyInputs, **options) -> ReplacementPolicy:
    check_names(name, None, runtime=inputs.future is None)
    return make_replacement(name, num_layers=inputs.num_layers, num_experts=inputs.num_experts, eamc=inputs.eamc,
                            **options)


def build_prefetch(name: str, inputs: PolicyInputs, depth: int | None = None, per_layer: int | None = None,
                   min_score: float | None = None, **options) -> PrefetchPolicy | None:
    """The prefetch policy `name`, None for 'none'. depth None = the policy's best default (gate reuse 1 layer:
    deeper router reuse is less accurate and its loads queue ahead of the next layer's; mlp the predictor's
    lookaheads; routing all its lookaheads; eam 2). 'aux-gate': AdapMoE's first-layer gate for layer 0, the
    mlp predictor (when there is one) for the rest."""
    check_names(None, name, runtime=inputs.future is None)
    if name == "none":
        if options or depth is not None or per_layer is not None or min_score is not None:
            raise MoectlError("--prefetch none takes no options")
        return None
    kw = dict(per_layer=per_layer or inputs.top_k, min_score=min_score, depth=depth, **options)
    hint = inputs.predictor_hint
    if name in ("gate-reuse", "mlp", "aux-gate") and not inputs.hidden_states:
        raise MoectlError(f"{name} prefetch needs every token's hidden states (profile with --hidden-samples all); "
                          f"routing-only traces can use --prefetch routing or eam")
    if name == "gate-reuse":
        if not inputs.routers:
            raise MoectlError("gate-reuse prefetch needs the router weights (a trace profiled by moectl keeps "
                              "them); routing-only traces can use --prefetch routing or eam")
        kw.update(routers=inputs.routers, bias=inputs.router_bias, depth=depth or 1)
    elif name == "eam":
        kw.update(num_layers=inputs.num_layers, num_experts=inputs.num_experts, eamc=inputs.eamc or [],
                  depth=depth or 2)
    elif name == "oracle":                # check_names let it through: the driver knows the future
        kw.update(future=inputs.future, depth=depth or 1)
        kw.pop("min_score", None)
    elif name == "mlp" and inputs.mlp is not None:
        kw["depth"] = depth or max(getattr(inputs.mlp, "lookaheads", None) or [2])
    pred = {"mlp": inputs.mlp, "routing": inputs.routing, "aux-gate": inputs.aux_gate}.get(name)
    if name in ("mlp", "routing", "aux-gate") and pred is None:
        need = {"mlp": "an mlp predictor", "routing": "a routing predictor", "aux-gate": "an aux gate"}[name]
        raise MoectlError(f"--prefetch {name} needs {need}{hint}")
    if hasattr(pred, "config"):           # predictors of another model's traces would name experts it lacks
        cfg = pred.config()
        check_shape(f"the {name} predictor", (cfg.get("num_layers", inputs.num_layers), cfg.get("num_experts")),
                    "the model", (inputs.num_layers, inputs.num_experts),
                    "train predictors on this model's traces (`moectl train-predictor --model M`)")
    if name == "aux-gate":
        inner = build_prefetch("mlp", inputs, depth, per_layer, min_score) if inputs.mlp is not None else None
        return make_prefetch("aux-gate", predictor=pred, inner=inner, per_layer=kw["per_layer"],
                             min_score=min_score, **options)
    if pred is not None:
        kw["predictor"] = pred
    return make_prefetch(name, **kw)


__all__ = ["ReplacementPolicy", "PrefetchPolicy", "LRU", "LFU", "MoEInfinity", "Hobbit", "Belady", "Ours",
           "AuxGatePrefetch", "GateReuse", "EAMPrefetch", "RoutingPrefetch", "MLPPrefetch", "eams_from_traces",
           "make_replacement", "make_prefetch", "REPLACEMENT_NAMES", "PREFETCH_NAMES", "RUNTIME_REPLACEMENT_NAMES",
           "RUNTIME_PREFETCH_NAMES", "check_names", "PolicyInputs",
           "build_replacement", "build_prefetch"]
