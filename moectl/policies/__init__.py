"""Cache replacement and prefetch policies, shared by the runtime and the simulator.

`make_replacement(name, **kw)` / `make_prefetch(name, **kw)` build one by name; keyword arguments a
policy does not take are ignored, so a driver can pass everything it knows (num_layers, num_experts,
predictor, routers, ...) to any policy.
"""

from __future__ import annotations

import inspect

from ..errors import MoectlError
from .aux_gate import AuxGatePrefetch
from .base import LRU, PrefetchPolicy, ReplacementPolicy
from .prefetch import EAMPrefetch, GateReuse, MLPPrefetch, RoutingPrefetch, eams_from_traces
from .replacement import LFU, Belady, Hobbit, MoEInfinity, Ours

REPLACEMENTS = {"lru": LRU, "lfu": LFU, "moe-infinity": MoEInfinity, "hobbit": Hobbit, "belady": Belady,
                "ours": Ours}
PREFETCHES = {"none": PrefetchPolicy, "gate-reuse": GateReuse, "eam": EAMPrefetch, "routing": RoutingPrefetch,
              "mlp": MLPPrefetch, "aux-gate": AuxGatePrefetch}
REPLACEMENT_NAMES = list(REPLACEMENTS)
PREFETCH_NAMES = list(PREFETCHES)


def _build(cls, kw: dict):
    params = inspect.signature(cls.__init__).parameters
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


__all__ = ["ReplacementPolicy", "PrefetchPolicy", "LRU", "LFU", "MoEInfinity", "Hobbit", "Belady", "Ours",
           "AuxGatePrefetch", "GateReuse", "EAMPrefetch", "RoutingPrefetch", "MLPPrefetch", "eams_from_traces",
           "make_replacement", "make_prefetch", "REPLACEMENT_NAMES", "PREFETCH_NAMES"]
