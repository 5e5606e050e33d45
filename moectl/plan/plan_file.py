"""plan.yaml (`moectl-plan-v1`): written here, read by `moectl/artifacts/plan.py: load_plan / plan_slots` (the one
reader, shared by `simulate --plan` and the runtime through the resolver, `moectl/setting/resolve.py`).

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

from ..artifacts.versioned import write_descriptor
from ..artifacts.plan import PLAN_FORMAT, PLAN_NAME, check_plan_model  # noqa: F401

PLAN_VERSION = 1


def write_plan(path, plan: dict, fingerprint: str | None) -> Path:
    from .. import __version__

    head = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "fingerprint": fingerprint,
            "created_by": f"moectl {__version__}"}
    return write_descriptor(path, head | plan)
