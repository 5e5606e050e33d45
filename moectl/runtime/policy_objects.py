"""The runtime's policy objects from the resolved options: replacement and prefetch (through the policy builder
the simulator uses), where a miss runs (placement), prefetch admission, gating, the precision of a miss. The
artifacts they read (predictors.json, sensitivity.json, the low-bit copies) are read here, checked against the
model."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MoectlError
from ..policies.admission import PrefetchGate
from ..policies.base import PrefetchPolicy, ReplacementPolicy
from ..policies.gating import GatingPolicy


def build_policies(replacement, prefetch, model, adapter, predictor_dir, fingerprint: str,
              num_layers: int) -> tuple[ReplacementPolicy, PrefetchPolicy | None]:
    """Replacement and prefetch policies by name (or given objects), through the policy builder the
    simulator uses. Prefetch 'auto': the calibrated predictors when the workdir has them (aux gate + mlp,
    or mlp), else gate reuse; 'gate-reuse' reads the model's routers; 'mlp', 'routing', 'aux-gate' load the
    predictors artifact in `predictor_dir` (the model workdir unless --predictor says)."""
    from ..policies import PolicyInputs, build_prefetch, build_replacement

    inputs = PolicyInputs(num_layers, adapter.num_experts, adapter.top_k,
                          predictor_hint=f" in {predictor_dir}: run `moectl train-predictor --kind {prefetch}`")
    if replacement == "belady":
        raise MoectlError("belady needs the future: it exists in `moectl simulate` only")
    policy = replacement if isinstance(replacement, ReplacementPolicy) else build_replacement(replacement, inputs)
    if prefetch is None or isinstance(prefetch, PrefetchPolicy):
        return policy, prefetch
    from ..predictors.file import JSON_NAME, load_predictors

    if prefetch == "auto":
        preds = (load_predictors(predictor_dir, fingerprint, (num_layers, adapter.num_experts))
                 if (Path(predictor_dir) / JSON_NAME).exists() else None)
        kinds = set(preds.kinds) if preds else set()
        prefetch = "aux-gate" if {"mlp", "aux_gate"} <= kinds else "mlp" if "mlp" in kinds else "gate-reuse"
        inputs.predictor_hint = ""
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
    from .machine import machine_figures, machine_hardware
    from ..core.shapes import shape_from_hf_config
    from ..sim.cost import CostModel

    return CostModel(machine_hardware(machine_figures(dev.type)), shape_from_hf_config(config.to_dict()))


def make_gating(gating, threshold: float | None, workdir, fingerprint: str, num_layers: int) -> GatingPolicy | None:
    """A GatingPolicy object, None (off), or a spec: 'auto' (the T_g stored by `moectl sensitivity --target-ppl-delta`
    in the workdir's sensitivity.json, when there is one), 'score:TAU', 'sensitivity:T_G', 'none';
    `threshold` (--gating-threshold T_g, 0 = off) overrides the stored T_g."""
    if isinstance(gating, GatingPolicy):
        return gating
    from ..artifacts.sensitivity import JSON_NAME, load_sensitivity, rule_sensitivities
    from ..policies.gating import parse_gating

    spec = None if gating in (None, "auto") else gating
    if gating is None and threshold is None:
        return None
    f = Path(workdir) / JSON_NAME
    needs = threshold is not None or gating == "auto" or (spec or "").startswith("sensitivity")
    meta = load_sensitivity(f, fingerprint, num_layers) if needs and f.exists() else None
    policy = parse_gating(threshold, spec, rule_sensitivities(meta) if meta else None,
                          meta.get("threshold") if meta and gating == "auto" else None)
    if policy is not None and gating == "auto" and threshold is None:
        policy.source = str(f)          # on by default: the status lines say where it came from
    return policy


def make_precision_copies(opts, workdir, fingerprint, adapter, num_layers, dtype):
    """(precision policy, low-bit format or None) from the resolved --precision/--t1/--t2/--lowbit, checked before
    loading; a plan with low-bit pools needs its copy set."""
    from ..policies.precision import make_precision

    fraction = opts.lowbit_fraction
    if fraction is not None and not 0.0 <= fraction < 1.0:
        raise MoectlError(f"--lowbit-fraction {fraction:g}: give a share of the cache's bytes in [0, 1)")
    prec = make_precision(opts.precision or ("hobbit" if opts.lowbit else "full"), opts.t1, opts.t2)
    plan = opts.plan_data or {}
    if any(int(s) for s in plan.get("slots_low") or []):
        want = plan.get("lowbit") or (plan.get("policies") or {}).get("lowbit")
        if not opts.lowbit or (want and want != opts.lowbit):
            raise MoectlError(f"plan {plan['_path']} serves low-bit copies ({want}): pass --lowbit {want} "
                              f"(made by `moectl quantize --bits ...`), or --no-plan")
    if prec.uses_lowbit and not opts.lowbit:
        raise MoectlError(f"--precision {prec.name} loads low-bit copies: give --lowbit q<bits>g<group> "
                          f"(made by `moectl quantize`)")
    if not opts.lowbit:
        return prec, None
    from ..store.lowbit import lowbit_format, read_lowbit_meta

    meta, path = read_lowbit_meta(workdir, opts.lowbit, fingerprint, num_layers, adapter.num_experts)
    return prec, lowbit_format(meta, adapter, dtype, path)
