"""InPlaceExperts: no GPU, experts in RAM -- the host store is the device, nothing is copied.

Legend: L = MoE layers, E = experts per layer, N = bytes of one packed expert.

With `--device cpu --offload ram` (the default there) the experts are computed where they lie: each
(layer, expert) is a view of the RAM-tier buffer uint8 [E, N], made once (a low-bit copy is dequantised from
its packed bytes where they lie, `ExpertFormat.weights`). Every acquire is a hit, no slot
memory exists, so RSS is the checkpoint and decode runs as fast at any --cache-experts as with all
experts resident. It answers the `DeviceCache` calls the runtime makes; `--emulate-device` gives the
CPU its own slots instead (the cache logic the tests and simulator checks exercise).
"""

from __future__ import annotations

import torch

from ..cache_model import FULL, LOW, CacheState
from ..policies.base import ReplacementPolicy
from ..policies.precision import PrecisionPolicy
from ..store.expert_store import ExpertStore
from .cache import CacheFront, CacheStats


class InPlaceExperts(CacheFront):
    """`precision`: a policy that uses low-bit copies (`--precision lowbit-only`) computes every expert from its
    low-bit buffer in place; any other computes from the full copies, all resident (HOBBIT's choice only
    matters on a miss, and in place there is none)."""

    def __init__(self, store: ExpertStore, policy: ReplacementPolicy, precision: PrecisionPolicy | None = None):
        if store.buffers is None:
            raise ValueError("in-place experts need the RAM tier")
        self.store, self.policy, self.device = store, policy, torch.device("cpu")
        self.serve = LOW if precision is not None and precision.name == "lowbit-only" else FULL
        if precision is not None:
            self.precision = precision
        self.slots_per_layer = [store.num_experts] * store.num_layers
        self.state = CacheState({self.serve: self.slots_per_layer}, {self.serve: policy})
        self.state.fill(self.serve)                 # every expert resident from the start: accesses only hit
        self.format = store.format_of(self.serve)
        buffers = store.buffers if self.serve == FULL else store.lowbit.buffers
        self.views = [[self.format.views(buf[e]) for e in range(store.num_experts)] for buf in buffers]
        self.stats = CacheStats(self.state, {self.serve: store.nbytes(self.serve)} | {FULL: store.expert_nbytes})

    def plan(self, layer: int, expert: int, scores) -> str:
        return self.serve

    def contains(self, layer: int, expert: int, precision: str = FULL) -> bool:
        return True

    def acquire(self, layer: int, expert: int, precision: str = FULL) -> dict:
        self.state.access(layer, expert, self.serve)     # counts the hit (and ticks the policies' clock)
        return self.format.weights(self.views[layer][expert])

    def prefetch(self, layer: int, expert: int) -> bool:
        return False                                # always resident
