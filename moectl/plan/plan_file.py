"""What `simulate --plan` takes from a plan.yaml (its file: `artifacts/plan.py`)."""

from __future__ import annotations

from ..artifacts.plan import check_plan_model


def apply_plan(plan: dict, trace, opts):
    """What `simulate --plan` takes from a plan: {precision: slots per layer} when it has low-bit slots (else the
    caller's `capacities` already read `slots`), its policies for every option `opts` (a RuntimeOptions) left unset
    (changed in place, `RuntimeOptions.take_plan`: the runtime's rule), and its sensitivity gating (a GatingPolicy,
    or None)."""
    check_plan_model(plan, trace.fingerprint, trace.num_layers, trace.num_experts, f"the trace ({trace.model})",
                     trace.top_k)
    gating = opts.take_plan(plan)
    caps = None
    if plan.get("slots_low"):
        from ..core.cache_model import FULL
        from ..policies.precision import LOW

        caps = {FULL: [int(s) for s in plan["slots"]], LOW: [int(s) for s in plan["slots_low"]]}
    return caps, gating
