"""What the expert cache is doing right now, for live views (`moectl serve`'s cache page and /metrics).

Legend: L = MoE layers, E = experts, K = top-k.

`layer_hits` reads the per-layer hit/miss counters of the cache state (`moectl/cache_model.py`), the same
counters `DeviceCache.stats` sums.
`residency` lists which experts each layer holds on the device and at what precision.
"""

from __future__ import annotations


def layer_hits(cache) -> list[dict]:
    """Per MoE layer: hits, misses and hit rate so far, both phases, from the cache's own counters."""
    from ..cache_model import PHASES

    counts = [cache.state.per_layer(ph) for ph in PHASES]
    hits = [sum(c["hits"][layer] for c in counts) for layer in range(len(cache.slots_per_layer))]
    misses = [sum(c["misses"][layer] for c in counts) for layer in range(len(cache.slots_per_layer))]
    return [{"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else 0.0} for h, m in zip(hits, misses)]


def precision_name(dtype) -> str:
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype), str(dtype))


def residency(cache) -> list[dict]:
    """Per MoE layer: slot count and the resident experts with their precision (all experts share the
    store's dtype today; a mixed-precision cache reports each slot's own)."""
    precision = precision_name(cache.store.dtype)
    return [{"slots": slots, "resident": {int(e): precision for e in sorted(cache.resident(layer))}}
            for layer, slots in enumerate(cache.slots_per_layer)]
