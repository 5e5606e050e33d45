"""What the expert cache is doing right now, for live views (`moectl serve`'s cache page and /metrics).

Legend: L = MoE layers, E = experts, K = top-k.

`layer_hits` reads the per-layer hit/miss counters of the cache state (`moectl/core/cache_model.py`), the same
counters `DeviceCache.stats` sums.
`residency` lists which experts each layer holds on the device and at what precision; `layer_rows` both, per layer.
"""

from __future__ import annotations


def layer_rows(cache) -> list[dict]:
    """Per MoE layer: `residency` and `layer_hits` in one row; a cache with no `CacheState` (`state` None: the
    torch-free engine's `graph_engine.py: InPlaceCounters`) gives its own rows."""
    if cache.state is None:
        return cache.layer_rows()
    return [r | h for r, h in zip(residency(cache), layer_hits(cache))]


def layer_hits(cache) -> list[dict]:
    """Per MoE layer: hits, misses and hit rate so far, both phases and every pool (full and low-bit), from the
    cache's own counters."""
    from ..core.cache_model import PHASES

    counts = [cache.state.per_layer(ph, p) for ph in PHASES for p in cache.precisions]
    layers = range(cache.state.num_layers)
    hits = [sum(c["hits"][layer] for c in counts) for layer in layers]
    # a miss is a use of an expert that was not resident: copied in, or computed on the CPU (a fill is no use)
    misses = [sum(c["misses"][layer] + c["cpu_misses"][layer] for c in counts) for layer in layers]
    return [{"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else 0.0} for h, m in zip(hits, misses)]


def residency(cache) -> list[dict]:
    """Per MoE layer: slot count (all pools) and the resident experts with the precision of their copy (the full copy's format
    name, that layer's own: bf16, fp32, mxfp4 or fp8 as released, a GGUF's encodings, gguf-Q4_K or on a Q4_K_M
    file's layers gguf-Q4_K+Q6_K; or the low-bit copy set's name, e.g. q4g64); an expert resident in both pools
    reports the full copy."""
    from ..core.cache_model import FULL

    names = {}
    if getattr(cache.store, "lowbit", None) is not None:
        names["low"] = cache.store.lowbit.name
    out = []
    for layer in range(cache.state.num_layers):
        names[FULL] = cache.store.format_of(FULL, layer).precision_name
        slots = sum(cache.state.capacity(layer, p) for p in cache.precisions)    # every pool (lowbit-only: low-bit)
        resident = {}
        for p in reversed(cache.precisions):
            resident.update({int(e): names[p] for e in cache.resident(layer, p)})
        out.append({"slots": slots, "resident": dict(sorted(resident.items()))})
    return out
