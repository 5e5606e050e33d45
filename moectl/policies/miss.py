"""The miss decision: what happens to one routed expert of one layer, for the runtime and the simulator alike.

    resident (or staged) copy of either precision -> DEVICE, that copy, landed or still in flight
    else the precision policy's choice (FULL / LOW / SKIP on the expert's rank score):
         SKIP                                      -> SKIP (its weight dropped, the token's others renormalised)
         the placement (--cpu-experts) says CPU    -> CPU, from the host copy of that precision
         else                                      -> FETCH, a demand load of that precision into a slot

The in-flight rule: an expert whose copy is resident but still landing (a prefetch, a fill) runs on the device
after its copy, never on the CPU, in both the runtime and the simulator (the runtime cannot price the rest of a
copy it does not time; the simulator once did, and so disagreed with it). No torch, no device code.
"""

from __future__ import annotations

from .placement import CPU
from .precision import LOW, SKIP

DEVICE, FETCH = "device", "fetch"


def decide_miss(held: str | None, wanted: str, placement=None, tokens: int = 1, nbytes: float | None = None,
                host_copy: bool = True, queue=None) -> tuple[str, str | None]:
    """(DEVICE | FETCH | CPU | SKIP, precision) for one routed expert. `held`: the precision of its resident or
    staged copy (None: a miss); `wanted`: the precision policy's choice for a miss (FULL, LOW or SKIP);
    `placement`: the ComputePlacement (None: misses are fetched); `tokens`: tokens routed to it; `nbytes`: bytes of
    the `wanted` copy; `host_copy`: the host holds a copy of that precision to compute from (the disk tier keeps
    no full one); `queue`: the layer's `placement.LayerQueue` (one per layer and step, in the routed order: the
    runtime and the simulator decide a layer's misses in the same order)."""
    if held is not None:
        return DEVICE, held
    if wanted == SKIP:
        return SKIP, None
    if placement is not None and host_copy and placement.decide(tokens, nbytes, wanted == LOW, queue) == CPU:
        return CPU, wanted
    return FETCH, wanted
