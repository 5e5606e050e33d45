"""The cache a setting holds: slots per precision and layer, prefetch staging buffers, the budget's split. Called by
the resolver (`setting/resolve.py`) for the runtime and `simulate` alike, on `core/sizing.py`'s arithmetic:

    slots   a plan's pools as they are  |  a budget's bytes (`budget_pools`)  |  --cache-experts N, a plan's or a
            trace's per-layer slots, or every expert (`cache_slots`), their bytes then split over the precisions
            (`precision_pools`)
    staging buffers prefetches copy into instead of cache slots: --staging-buffers, a plan's (the runtime), else
            `prefetch_staging(cpu_experts)`; copies from RAM only; their bytes come off the budget when prefetching
            (and a streamed prefill's two)

A live run (the runtime) gives loaded low-bit copies a pool whatever the precision and every layer at least one slot
of each; a replay pools them for a precision that loads them and calls a pool below one slot per layer an error.
No torch.
"""

from __future__ import annotations

from ..core.cache_model import FULL, LOW
from ..core.recipes import format_bytes
from ..core.sizing import (
    ModelSizes,
    budget_pools,
    cache_slots,
    lowbit_fraction_for,
    split_budget,
    split_pools,
    staging_nbytes,
)
from ..errors import MoectlError
from ..policies.admission import STAGING_BUFFERS, prefetch_staging


def check_lowbit_fraction(fraction: float | None) -> None:
    if fraction is not None and not 0.0 <= fraction < 1.0:
        raise MoectlError(f"--lowbit-fraction {fraction:g}: give a share of the cache's bytes in [0, 1)")


def precision_pools(caps, precision, full_bytes: float, low_bytes: float | None, num_experts: int,
                    lowbit_fraction: float | None = None, *, live: bool = False) -> dict[str, list[int]]:
    """Per-precision pools from full-precision slots `caps`: their bytes split as `sizing.split_pools` splits them
    (`lowbit_fraction` of the bytes to low-bit slots; full: all full; lowbit-only: all of them low-bit, no full
    pool). `caps` already {precision: per-layer slots} (a plan's own split) is taken as it is. `live`: loaded copies
    (`low_bytes`) get a pool even when the precision never loads them, and no pool is checked against one slot per
    layer (`split_pools` gives each layer one)."""
    if isinstance(caps, dict):
        return {p: list(c) for p, c in caps.items() if sum(c) > 0}
    if not (precision.uses_lowbit or (live and low_bytes is not None)):
        return {FULL: list(caps)}
    if low_bytes is None:
        raise MoectlError(f"--precision {precision.name} needs --lowbit (the low-bit copy set, e.g. q4g64)")
    check_lowbit_fraction(lowbit_fraction)
    f = lowbit_fraction_for(precision.name, precision.uses_lowbit, lowbit_fraction)
    L = len(caps)
    for p, share, nbytes in ((FULL, 1 - f, full_bytes), (LOW, f, low_bytes)):
        if not live and 0 < share < 1 and int(share * sum(caps) * full_bytes // nbytes) < L:
            raise MoectlError(f"the {p} pool gets {int(share * sum(caps) * full_bytes // nbytes)} slots from "
                              f"{share:.0%} of the expert budget, below one per MoE layer ({L}); change "
                              f"--lowbit-fraction or give more memory")
    full, low = split_pools(list(caps), num_experts, full_bytes, low_bytes, f)   # lowbit-only: no full pool
    return {p: c for p, c in ((FULL, full), (LOW, low)) if sum(c) > 0}


def size_cache(o, sizes: ModelSizes, precision, expert_nbytes: float, low_nbytes: float | None, *, live: bool,
               in_place: bool, kv_tokens: int) -> tuple[dict, list | None, int, object]:
    """({precision: slots per layer}, the full-precision slots asked before the precision split or None, staging
    buffers, BudgetSplit or None) of options `o` (resolved names) for a model of `sizes` whose experts weigh
    `expert_nbytes` (full) and `low_nbytes` (the low-bit copy, None without one). In place (a CPU computing from RAM)
    nothing is cached: the full pool is what the host-memory check counts."""
    L, E = sizes.num_layers, sizes.num_experts
    plan = o.plan_data or {}
    plan_low = [int(s) for s in plan.get("slots_low") or []]
    plan_pools = any(plan_low) and not in_place                     # the plan's split of the bytes, as it is
    pooled = low_nbytes is not None and not in_place and (live or precision.uses_lowbit)
    low_only = not any(o.slots_per_layer) if plan_pools else pooled and precision.name == "lowbit-only"
    stage_nbytes = low_nbytes if low_only else expert_nbytes        # one copy of what prefetches load
    staging = o.staging
    if staging is None and live and o.plan_data is not None:        # a plan's budget says whether it paid for them
        staging = int(((plan.get("budget") or {}).get("staging") or 0) // stage_nbytes)
    from_ram = not in_place and (o.offload == "ram" or low_only)   # staged copies come from RAM only
    buffers = (prefetch_staging(o.cpu_experts) if staging is None else int(staging)) if from_ram else 0
    prefetching = o.prefetch not in (None, "none")
    staging_bytes = staging_nbytes(max(STAGING_BUFFERS if o.prefill == "stream" else 0, buffers if prefetching else 0),
                                   expert_nbytes, low_nbytes, low_only)
    split = None
    if o.budget is not None:
        what = None                                 # a --budget's error names it
        if o.budget_note:                           # no --budget: the device's free memory (`resolve.py`) is it
            what = (f"the device's free memory less its margin ({format_bytes(int(o.budget))}); free device "
                    f"memory, or run on the CPU (--device cpu)")
        split = split_budget(o.budget, sizes, kv_tokens, staging=staging_bytes, min_slot_bytes=stage_nbytes,
                             what=what)
    full = None
    if plan_pools:                                      # checked by `plan_slots`: a layer's full slots may be 0
        pools = {p: c for p, c in ((FULL, [min(int(s), E) for s in o.slots_per_layer]), (LOW, plan_low)) if sum(c)}
    elif in_place and o.plan_data is not None:          # a plan's slots do not apply in place (a lowbit-only plan's
        pools = {FULL: [max(1, min(int(s), E)) for s in o.slots_per_layer]}     # may be 0)
    elif pooled and split is not None:                  # the budget's bytes split over the pools
        fraction = lowbit_fraction_for(precision.name, precision.uses_lowbit, o.lowbit_fraction)
        pools = budget_pools(split, L, E, expert_nbytes, low_nbytes, fraction)
    else:
        full = cache_slots(L, E, o.cache_experts, split, expert_nbytes, o.slots_per_layer)
        pools = {FULL: full} if in_place else \
            precision_pools(full, precision, expert_nbytes, low_nbytes, E, o.lowbit_fraction, live=live)
    return pools, full, buffers, split
