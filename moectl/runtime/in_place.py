"""InPlaceExperts: no GPU, experts in RAM -- the host store is the device, nothing is copied.

Legend: L = MoE layers, E = experts per layer, P = numel of one packed expert.

With `--device cpu --offload ram` (the default there) the experts are computed where they lie: each
(layer, expert) is a view of the RAM-tier buffer [E, P], made once. Every acquire is a hit, no slot
memory exists, so RSS is the checkpoint and decode runs as fast at any --cache-experts as with all
experts resident. It answers the `DeviceCache` calls the runtime makes; `--emulate-device` gives the
CPU its own slots instead (the cache logic the tests and simulator checks exercise).
"""

from __future__ import annotations

from ..policies.base import ReplacementPolicy
from ..store.expert_store import ExpertStore
from .cache import CacheStats


class InPlaceExperts:
    def __init__(self, store: ExpertStore, policy: ReplacementPolicy):
        if store.buffers is None:
            raise ValueError("in-place experts need the RAM tier")
        self.store, self.policy = store, policy
        self.slots_per_layer = [store.num_experts] * store.num_layers
        self.views = [[store.layout.views(buf[e]) for e in range(store.num_experts)] for buf in store.buffers]
        self.stats = CacheStats()
        self.clock = 0.0
        self.num_slots = self.nbytes = 0            # no slot memory: the store is what is computed on

    def resident(self, layer: int) -> list[int]:
        return list(range(self.store.num_experts))

    def contains(self, layer: int, expert: int) -> bool:
        return True

    def pin(self, layer: int, experts) -> None:
        pass

    def unpin(self, layer: int, experts) -> None:
        pass

    def acquire(self, layer: int, expert: int) -> dict:
        self.stats.hits += 1
        return self.views[layer][expert]

    def prefetch(self, layer: int, expert: int) -> bool:
        return False                                # always resident

    def layer_done(self, layer: int) -> None:
        pass

    def end_token(self) -> None:
        self.clock += 1.0
        self.policy.on_token_end(self.clock)

    def snapshot(self) -> dict:
        return self.stats.as_dict()
