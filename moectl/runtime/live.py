"""What the expert cache is doing right now, for live views (`moectl serve`'s cache page and /metrics).

Legend: L = MoE layers, E = experts, K = top-k.

`LayerHits` is an Engine observer that counts, per MoE layer, routed experts that were resident (hits) or
not (misses) when the layer's router ran. `OffloadedExperts` computes the resident experts first, so nothing
resident at routing time is evicted before it is used: the per-layer counts add up to `DeviceCache.stats`.
`residency` lists which experts each layer holds on the device and at what precision.
"""

from __future__ import annotations


class LayerHits:
    def __init__(self, cache):
        self.cache = cache
        L = len(cache.slots_per_layer)
        self.hits, self.misses = [0] * L, [0] * L

    def on_route(self, layer, top_k_index, top_k_weights, hidden):
        E = self.cache.store.num_experts
        routed = top_k_index[0].tolist() if top_k_index.shape[0] == 1 else top_k_index.unique().tolist()   # [K]
        resident = self.cache.slot_of[layer]
        for e in set(routed):
            if 0 <= e < E:
                if e in resident:
                    self.hits[layer] += 1
                else:
                    self.misses[layer] += 1

    def as_list(self) -> list[dict]:
        return [{"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else 0.0}
                for h, m in zip(self.hits, self.misses)]


def precision_name(dtype) -> str:
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype), str(dtype))


def residency(cache) -> list[dict]:
    """Per MoE layer: slot count and the resident experts with their precision (all experts share the
    store's dtype today; a mixed-precision cache reports each slot's own)."""
    precision = precision_name(cache.store.dtype)
    return [{"slots": slots, "resident": {int(e): precision for e in sorted(cache.slot_of[layer])}}
            for layer, slots in enumerate(cache.slots_per_layer)]
