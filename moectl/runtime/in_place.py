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

import copy

import torch

from ..core.cache_model import FULL, LOW, CacheState
from ..policies.base import ReplacementPolicy
from ..policies.precision import PrecisionPolicy
from ..store.expert_store import ExpertStore
from .cache_front import CacheFront, CacheStats


class InPlaceExperts(CacheFront):
    """`precision`: a policy that uses low-bit copies (`--precision lowbit-only`) computes every expert from its
    low-bit buffer in place; any other computes from the full copies, all resident (HOBBIT's choice only
    matters on a miss, and in place there is none)."""

    in_place = True                 # views stay valid for the whole forward (offloaded.py may defer computing them)

    def __init__(self, store: ExpertStore, policy: ReplacementPolicy, precision: PrecisionPolicy | None = None):
        # the full copies in the RAM tier, the low-bit ones, or both (lowbit-only leaves the full ones in the file)
        pools = ([FULL] if store.buffers is not None else []) + ([LOW] if store.lowbit is not None else [])
        if not pools or (precision is not None and precision.name != "lowbit-only" and FULL not in pools):
            raise ValueError("in-place experts need the RAM tier")
        self.store, self.policy, self.device = store, policy, torch.device("cpu")
        if precision is not None:
            self.precision = precision
        self.slots_per_layer = [store.num_experts] * store.num_layers
        self.state = CacheState({p: self.slots_per_layer for p in pools}, {p: copy.deepcopy(policy) for p in pools})
        self.state.policies[pools[0]] = policy
        self.views, self.formats = {}, {}
        for p in pools:
            self.state.fill(p)                      # every expert resident from the start: accesses only hit
            self.formats[p] = store.format_of(p)
            buffers = store.buffers if p == FULL else store.lowbit.buffers
            # per layer: a GGUF's experts repacked for the CPU int4 kernel differ in parts by layer (moectl/store/gguf/cpu.py)
            self.views[p] = [[store.format_of(p, layer).views(buf[e]) for e in range(store.num_experts)]
                             for layer, buf in enumerate(buffers)]
        self.stats = CacheStats(self.state, {p: store.nbytes(p) for p in dict.fromkeys([FULL] + pools)})

    def plan(self, layer: int, expert: int, scores) -> str:
        return LOW if self.precision.name == "lowbit-only" else FULL

    def acquire(self, layer: int, expert: int, precision: str = FULL) -> dict:
        self.state.access(layer, expert, precision)      # counts the hit (and ticks the policies' clock)
        return self.store.format_of(precision, layer).weights(self.views[precision][layer][expert])

    def prefetch(self, layer: int, expert: int) -> bool:
        return False                                # always resident
