"""plan.yaml (`moectl-plan-v1`): written here, read by `moectl/sim/run.py: load_plan / plan_slots` (the one
reader, shared by `simulate --plan` and the runtime).

    format: moectl-plan-v1        version: 1            fingerprint: <model fp, or null for a recipe shape>
    model, num_layers, num_experts, top_k
    slots: [full-precision slots per MoE layer]
    slots_low: [low-bit slots per layer]          (only when the plan serves low-bit copies)
    preload: {full: [[experts] per layer], low: ...}   (the experts the planning trace used most, up to each
                                                  pool's slots: loaded at start-up, `CacheState.preload`)
    expert_bytes: {full: B, low: b}, lowbit: q4g64
    budget: {total, dense, kv, kv_tokens, workspace, experts, experts_used}
    policies: {replacement, prefetch, depth, per_layer, gating (T_g), precision, t1, t2, lowbit, cpu_experts}
    hardware, curves (measured/analytic and on what), traces
    predicted / uniform: {hit_rate, ms_per_token, tokens_per_s, stall_ms_per_token, bytes_per_token,
                          misses_per_token, ...}  (the plan and the even split of the same bytes, simulated)
"""

from __future__ import annotations

from pathlib import Path

from ..artifact import check_shape, write_descriptor
from ..errors import MoectlError
from ..sim.run import PLAN_FORMAT

PLAN_VERSION = 1
PLAN_NAME = "plan.yaml"


def write_plan(path, plan: dict, fingerprint: str | None) -> Path:
    from .. import __version__

    head = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "fingerprint": fingerprint,
            "created_by": f"moectl {__version__}"}
    return write_descriptor(path, head | plan)


def check_plan_model(plan: dict, fingerprint: str | None, num_layers: int, num_experts: int, what: str,
                     top_k: int | None = None) -> None:
    """A plan made for another model is a clear error: its fingerprint (when both are known), else its shape
    (MoE layers, experts, and top-k when the caller gives one)."""
    src = plan.get("_path", "plan")
    fp = plan.get("fingerprint")
    if fp and fingerprint and fp != fingerprint:
        raise MoectlError(f"plan {src} was made for model {fp} ({plan.get('model')}), but {what} is {fingerprint}; "
                          f"re-run `moectl plan-cache` for this model")
    if plan.get("num_layers") is not None:
        have = (plan.get("num_layers"), plan.get("num_experts")) + ((plan["top_k"],) if plan.get("top_k") else ())
        check_shape(f"plan {src} ({plan.get('model')})", have, what, (num_layers, num_experts) +
                    (() if top_k is None else (top_k,)), "re-run `moectl plan-cache` for this model")


def apply_plan(plan: dict, trace, opts: dict):
    """What `simulate --plan` takes from a plan: {precision: slots per layer} when it has low-bit slots (else the
    caller's `capacities` already read `slots`), its policies for every option left None in `opts` (changed in
    place), and its sensitivity gating (a GatingPolicy, or None)."""
    check_plan_model(plan, trace.fingerprint, trace.num_layers, trace.num_experts, f"the trace ({trace.model})",
                     trace.top_k)
    pol = plan.get("policies") or {}
    for k in ("replacement", "prefetch", "precision", "lowbit", "cpu_experts", "admission"):
        if opts.get(k) is None and pol.get(k) is not None:
            opts[k] = pol[k]
    if pol.get("precision") == opts.get("precision") and pol.get("precision") == "hobbit":
        opts["t1"], opts["t2"] = pol.get("t1", opts.get("t1")), pol.get("t2", opts.get("t2"))
    caps = None
    if plan.get("slots_low"):
        from ..cache_model import FULL
        from ..policies.precision import LOW

        caps = {FULL: [int(s) for s in plan["slots"]], LOW: [int(s) for s in plan["slots_low"]]}
    gating = None
    if pol.get("gating") and pol.get("sensitivities"):
        from ..policies.gating import SensitivityGating

        gating = SensitivityGating(float(pol["gating"]), pol["sensitivities"])
    return caps, gating
