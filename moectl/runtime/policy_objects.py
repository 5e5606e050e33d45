"""The runtime's policy objects from the resolved setting (`setting/resolve.py`): replacement and prefetch (through the
policy builder the simulator uses; the predictors read here, checked against the model), where a miss runs
(placement), prefetch admission."""

from __future__ import annotations

import torch

from ..errors import MoectlError
from ..policies.admission import PrefetchGate
from ..policies.base import PrefetchPolicy, ReplacementPolicy


def build_policies(replacement, prefetch, model, adapter, predictor_dir, fingerprint: str,
              num_layers: int) -> tuple[ReplacementPolicy, PrefetchPolicy | None]:
    """Replacement and prefetch policies by name (or given objects; `--prefetch auto` is resolved already), through
    the policy builder the simulator uses. 'gate-reuse' reads the model's routers; 'mlp', 'routing', 'aux-gate' load
    the predictors artifact in `predictor_dir` (the model workdir unless --predictor says)."""
    from ..policies import PolicyInputs, build_prefetch, build_replacement

    inputs = PolicyInputs(num_layers, adapter.num_experts, adapter.top_k,
                          predictor_hint=f" in {predictor_dir}: run `moectl train-predictor --kind {prefetch}`")
    if replacement == "belady":
        raise MoectlError("belady needs the future: it exists in `moectl simulate` only")
    policy = replacement if isinstance(replacement, ReplacementPolicy) else build_replacement(replacement, inputs)
    if prefetch is None or isinstance(prefetch, PrefetchPolicy):
        return policy, prefetch
    from ..predictors.file import load_predictors

    if prefetch == "gate-reuse":
        inputs.routers, inputs.router_bias = {}, {}
        for moe_idx, (_, block) in enumerate(adapter.moe_blocks(model)):
            r = adapter.router(block)
            inputs.routers[moe_idx] = r.weight.detach().float().cpu().numpy()
            if getattr(r, "bias", None) is not None:
                inputs.router_bias[moe_idx] = r.bias.detach().float().cpu().numpy()
    elif prefetch in ("mlp", "routing", "aux-gate"):
        preds = load_predictors(predictor_dir, expect_fingerprint=fingerprint,
                                expect_shape=(num_layers, adapter.num_experts))
        inputs.mlp, inputs.routing, inputs.aux_gate = preds.mlp, preds.routing, preds.aux_gate
    return policy, build_prefetch(prefetch, inputs)


def placement(mode: str, cost, config, dev: torch.device, in_place: bool):
    """The ComputePlacement behind --cpu-experts (None when nothing can miss: experts computed in place). `auto`
    without a cost model prices with this machine's measured figures (`moectl/runtime/machine.py`, cached per machine)."""
    from ..policies.placement import CPU_EXPERT_MODES, ComputePlacement

    if mode not in CPU_EXPERT_MODES:
        ComputePlacement(mode)                                   # the clear error naming the choices
    if mode == "never" or in_place:
        return None
    if mode == "auto" and cost is None:
        cost = machine_cost(config, dev)
    return ComputePlacement(mode, cost)


def admission_gate(mode: str, cost, config, dev: torch.device, top_k: int, expert_nbytes: int, in_place: bool,
               prefetch, cpu_experts: str = "never", staged: bool = False):
    """(the PrefetchGate behind --admission, one expert's copy time): `on` prices copies and layer compute with
    `cost`, or this machine's measured figures (as `placement` does); `staged`: prefetches copy into staging
    buffers (they evict nothing)."""
    from ..policies.admission import make_admission

    if mode == "off" or in_place or prefetch is None:
        return PrefetchGate(make_admission("off"), top_k), 0.0
    cost = cost if cost is not None else machine_cost(config, dev)
    return (PrefetchGate(make_admission(mode, cost, top_k, cpu_experts=cpu_experts, staged=staged), top_k),
            cost.load_s(expert_nbytes))


def machine_cost(config, dev: torch.device):
    """This machine's CostModel for the model (`moectl/runtime/machine.py` figures, measured once and cached)."""
    from ..core.shapes import shape_from_hf_config
    from ..sim.cost import CostModel
    from .machine import machine_figures, machine_hardware

    return CostModel(machine_hardware(machine_figures(dev.type)), shape_from_hf_config(config.to_dict()))
