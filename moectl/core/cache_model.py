"""The expert cache's bookkeeping, shared by the runtime and the simulator (numpy/stdlib only).

`runtime/cache.py: DeviceCache` = this state + tensor copies; `sim/simulator.py: Simulator` = this
state + a cost-model clock and one copy engine. Both drive it with the same calls in the same order,
so a simulated trace gives the hits, misses and evictions the runtime had (tests/test_cache_model.py).

Legend: L = MoE layers, E = experts, S = slots of one pool.

Pools. Every MoE layer has one slot pool per precision (`FULL`, and `LOW` when low-bit copies are served:
`--lowbit`, `--lowbit-fraction` of the budget). A pool holds at most its capacity of experts; each precision has its own replacement
policy object (policy state is keyed by (layer, expert)).

The rules, in the order a driver applies them:
  requests  `begin_request(name)` -> policy.on_request_start (sequence statistics reset).
  steps     a forward is a step: a request's first forward (its prompt, all tokens at once, or any
            forward of more than one token) is `prefill`, every later one-token forward `decode`;
            `begin_step(phase)` ... `end_step()`. `end_step` calls policy.on_token_end(clock).
  per layer, in this order:
    1. `route(l, chosen, weights)`: the router's choice (prefill: the step's distinct experts, ascending,
       no weights; decode: top-k order with gate weights). policy.on_route. The predictions for layer l
       are spent now and no longer protected: an expert a prefetch loaded counts `prefetch_used` if
       chosen, `prefetch_wasted` if not.
    2. decode steps only: the prefetch policy observes the layer and its predictions for later layers
       go to `prefetch(target, e)`, resident ones first (`resident_first`: a copy for one prediction must
       not evict another of the same batch).
    3. the layer's experts run in `chunks(l, experts)`: resident ones first (stable order), then the
       missing ones, in chunks of at most the pool's slot count; a chunk is pinned while it runs
       (`pin` / `unpin`) and each expert is one `access(l, e)`.
  after-token predictions (the aux gate: the next token's first layer, from this token's final hidden
  state) are issued when the next decode step of the same request begins, before its layer 0.
  preload   before the first request a plan's hot set (`hot_experts`: per layer, the experts its planning
            trace used most) is put into free slots by `preload`: no miss, no eviction, no counter; one
            policy insert each (least used first, so recency ranks them by use). The runtime copies them at
            load time; the simulator starts with them landed.
  clock     ticks once per access (hit or miss), once per prefetch that inserts and once per preloaded
            expert; it is the `now` every policy event carries.
  counting  every access counts in its step's phase (prefill and decode alike): a hit if the expert is
            resident (a prefetched expert whose copy is still in flight is a hit; the simulator
            reports the wait as stall), else a miss (one demand load). A miss the placement computes on
            the CPU from host RAM is a miss too (`cpu_miss`: `cpu_misses`, nothing copied, no slot, no
            clock tick); the background copy that may follow it (`access(..., fill=True)`) is a fill, not a
            use: `fills`. So a layer's uses are hits + misses + cpu_misses (`hit_rate`). Evictions count
            in the phase and layer of the pool they happen in.
  eviction  the victim is the policy's choice among residents that are neither pinned (the running
            chunk) nor protected (predicted for a layer whose router has not run yet, whether the
            prediction loaded it or found it resident). A miss always
            finds one (a chunk is at most the slot count, so at most S - 1 others are pinned, and a
            layer's own predictions are spent before it runs). A prefetch that finds none is dropped:
            predictions never evict each other.
  staging   with `staging` = n > 0 a prefetch of a missing expert evicts nothing: its copy goes to one of n
            staging buffers per pool (`staged`), outside the slots. When its layer routes, a wrong one is dropped
            (`prefetch_wasted`, the buffer is free again); a right one is installed by its `access`, exactly as a
            demand miss would be (the same victim, the same clock tick and policy insert; the driver swaps the
            buffer with the victim's slot, no copy), but counts as a hit. So the pools evolve as in a run without
            prefetch, whatever the predictions: a prediction costs copy-engine time, never a resident expert.
            No buffer free: the prefetch is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FULL, LOW = "full", "low"                 # the precisions a pool can hold (policies/precision.py decides which)
PHASES = ("prefill", "decode")
# misses: demand loads (a use copied in); cpu_misses: uses computed on the CPU instead; fills: background copies of
# CPU-computed misses (not uses)
COUNTERS = ("hits", "misses", "evictions", "prefetches", "prefetch_used", "prefetch_wasted", "cpu_misses", "fills")


def hit_rate(counts: dict) -> float:
    """Hits over uses, from counters summed any way (`totals`, `per_layer` entries): a miss computed on the CPU is a
    miss, a fill is no use (0.0 without uses)."""
    uses = counts["hits"] + counts["misses"] + counts.get("cpu_misses", 0)
    return counts["hits"] / uses if uses else 0.0


@dataclass
class Access:
    slot: int                             # the pool slot holding the expert now
    hit: bool
    victim: int | None = None             # expert evicted to make room, if any
    staged: int | None = None             # the staging buffer the expert came from (a staged prefetch), if any


class Pool:
    """One layer's slots of one precision: expert -> slot, and the free slots."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slot_of: dict[int, int] = {}
        self.free = list(range(capacity))[::-1]


class CacheState:
    """Per-layer slot pools with pinning, protection of predicted experts and per-phase counters.

    `slots`: per layer slot counts of the full-precision pools, or {precision: per layer counts}.
    `policy`: the replacement policy, or {precision: policy}; `staging`: staging buffers per pool that prefetches
    copy into (0: they copy into cache slots, evicting)."""

    def __init__(self, slots, policy, staging: int = 0):
        slots = slots if isinstance(slots, dict) else {FULL: list(slots)}
        self.policies = policy if isinstance(policy, dict) else {FULL: policy}
        self.num_layers = len(next(iter(slots.values())))
        self.pools = [{p: Pool(int(s[l])) for p, s in slots.items()} for l in range(self.num_layers)]
        self.pinned: set[tuple[int, str, int]] = set()          # (layer, precision, expert) in the running chunk
        # predicted for a layer that has not routed yet -> True if the prediction loaded it (a prefetch)
        self.predicted: dict[tuple[int, str, int], bool] = {}
        self.clock = 0
        self.phase = "decode"
        self.counts = {p: {ph: np.zeros((self.num_layers, len(COUNTERS)), dtype=np.int64) for ph in PHASES}
                       for p in slots}
        self.staging = int(staging)
        self.staged: dict[tuple[int, str, int], int] = {}          # (layer, precision, expert) -> staging buffer
        self.stage_free = {p: list(range(self.staging))[::-1] for p in slots}

    # --- queries ------------------------------------------------------------------------
    def capacity(self, layer: int, precision: str = FULL) -> int:
        return self.pools[layer][precision].capacity

    def contains(self, layer: int, expert: int, precision: str = FULL) -> bool:
        return expert in self.pools[layer][precision].slot_of

    def resident(self, layer: int, precision: str = FULL) -> list[int]:
        return list(self.pools[layer][precision].slot_of)

    def slot(self, layer: int, expert: int, precision: str = FULL) -> int | None:
        return self.pools[layer][precision].slot_of.get(expert)

    def staged_in(self, layer: int, expert: int) -> str | None:
        """The precision of a staging buffer holding (or receiving) the expert's copy, if any."""
        return next((p for p in self.counts if (layer, p, expert) in self.staged), None)

    def chunks(self, layer: int, experts: list[int], precision: str = FULL) -> list[list[int]]:
        """The order the layer's experts run in: resident first (stable), chunks of the slot count."""
        order = sorted(experts, key=lambda e: not self.contains(layer, e, precision))
        width = self.capacity(layer, precision)
        return [order[i:i + width] for i in range(0, len(order), width)]

    def totals(self, phase: str | None = None, precision: str = FULL) -> dict[str, int]:
        """Counters summed over layers (and phases when `phase` is None)."""
        c = self.counts[precision]
        arr = sum(c[ph] for ph in PHASES) if phase is None else c[phase]
        return {k: int(v) for k, v in zip(COUNTERS, arr.sum(0))}

    def per_layer(self, phase: str, precision: str = FULL) -> dict[str, list[int]]:
        arr = self.counts[precision][phase]
        return {k: arr[:, i].tolist() for i, k in enumerate(COUNTERS)}

    def fill(self, precision: str = FULL) -> None:
        """Every expert resident in the slot of its own id, for good (a store computed in place: pools as big
        as the layer, so no access ever misses or evicts)."""
        for pools in self.pools:
            pool = pools[precision]
            pool.slot_of, pool.free = {e: e for e in range(pool.capacity)}, []

    def preload(self, sets: dict) -> list[tuple[int, str, int, int]]:
        """Fill free slots with {precision: [[experts, most used first] per layer]} (a plan's `preload`) before
        the first request; an expert already resident in a pool of its layer, a precision this cache has no
        pool of, or one beyond the free slots is left out. Returns the (layer, precision, expert, slot) filled."""
        out = []
        for p, per_layer in sets.items():
            if p not in self.policies:
                continue
            for l, experts in enumerate(per_layer[: self.num_layers]):
                pool = self.pools[l][p]
                fit = [int(e) for e in experts if not any(int(e) in q.slot_of for q in self.pools[l].values())]
                for e in reversed(fit[: len(pool.free)]):
                    self.clock += 1
                    pool.slot_of[e] = pool.free.pop()
                    self.policies[p].on_insert(l, e, self.clock)
                    out.append((l, p, e, pool.slot_of[e]))
        return out

    # --- events -------------------------------------------------------------------------
    def _count(self, layer: int, precision: str, name: str) -> None:
        self.counts[precision][self.phase][layer, COUNTERS.index(name)] += 1

    def count_hits(self, per_layer, precision: str = FULL) -> None:
        """Hits counted in bulk, per_layer[l] of them in layer l, in this step's phase: accesses of experts that
        are all resident and stay so (in place, one ggml graph a forward: no policy to tick, nothing to evict)."""
        self.counts[precision][self.phase][:, COUNTERS.index("hits")] += np.asarray(per_layer, dtype=np.int64)

    def begin_request(self, name: str) -> None:
        for pol in self.policies.values():
            pol.on_request_start(name)

    def begin_step(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
        self.phase = phase

    def end_step(self) -> list[tuple[int, str, int, int]]:
        """The step is over; staged copies no access took are dropped (returned as by `route`; counted when their
        layer routed: a chosen expert the driver ran elsewhere, e.g. skipped, took no slot)."""
        for pol in self.policies.values():
            pol.on_token_end(self.clock)
        return self._unstage(list(self.staged), (), count=False)

    def _unstage(self, keys, chosen, count: bool = True) -> list[tuple[int, str, int, int]]:
        """Drop the staged `keys` not in `chosen` (wasted): their buffers are free again."""
        out = []
        for key in keys:
            if key[2] in chosen:
                continue
            buf = self.staged.pop(key)
            self.stage_free[key[1]].append(buf)
            if count:
                self._count(key[0], key[1], "prefetch_wasted")
            out.append((*key, buf))
        return out

    def route(self, layer: int, chosen: list[int], weights: list[float] | None = None,
              precision: str = FULL) -> list[tuple[int, str, int, int]]:
        """Returns the staged prefetches this routing wasted, (layer, precision, expert, buffer): the driver drops
        their copies."""
        self.policies[precision].on_route(layer, chosen, weights)
        chosen_set = set(chosen)
        for key in [k for k in self.predicted if k[0] == layer and k[1] == precision]:
            if self.predicted.pop(key):
                self._count(layer, precision, "prefetch_used" if key[2] in chosen_set else "prefetch_wasted")
        staged = [k for k in self.staged if k[0] == layer and k[1] == precision]
        for key in staged:
            if key[2] in chosen_set:
                self._count(layer, precision, "prefetch_used")
        return self._unstage(staged, chosen_set)

    def pin(self, layer: int, experts, precision: str = FULL) -> None:
        self.pinned.update((layer, precision, int(e)) for e in experts)

    def unpin(self, layer: int, experts, precision: str = FULL) -> None:
        self.pinned.difference_update((layer, precision, int(e)) for e in experts)

    def _take_slot(self, layer: int, precision: str) -> tuple[int, int | None] | None:
        """(free slot, evicted expert or None), or None when every resident is pinned or protected."""
        pool = self.pools[layer][precision]
        if pool.free:
            return pool.free.pop(), None
        cands = [e for e in pool.slot_of
                 if (layer, precision, e) not in self.pinned and (layer, precision, e) not in self.predicted]
        if not cands:
            return None
        victim = self.policies[precision].victim(layer, cands, self.clock)
        slot = pool.slot_of.pop(victim)
        self.policies[precision].on_evict(layer, victim, self.clock)
        self._count(layer, precision, "evictions")
        return slot, victim

    def access(self, layer: int, expert: int, precision: str = FULL, fill: bool = False) -> Access:
        """The running layer needs (layer, expert): a hit, or a miss that takes a slot (evicting). `fill`: no use
        but the background copy of a miss the CPU computed (`cpu_miss` counted the use): it takes its slot as a
        miss would and counts as a fill."""
        self.clock += 1
        pool, pol = self.pools[layer][precision], self.policies[precision]
        slot = pool.slot_of.get(expert)
        if slot is not None:
            self._count(layer, precision, "hits")
            pol.on_hit(layer, expert, self.clock)
            return Access(slot, True)
        taken = self._take_slot(layer, precision)
        if taken is None:
            raise RuntimeError(f"layer {layer}: every slot is pinned; a chunk is at most the slot count")
        slot, victim = taken
        pool.slot_of[expert] = slot
        pol.on_insert(layer, expert, self.clock)
        buf = self.staged.pop((layer, precision, expert), None)
        if buf is not None:                     # a staged prefetch: installed as this miss, its copy already made
            self.stage_free[precision].append(buf)
            if not fill:                        # (installed after the CPU computed it: no use, no copy)
                self._count(layer, precision, "hits")
            return Access(slot, True, victim, buf)
        self._count(layer, precision, "fills" if fill else "misses")
        return Access(slot, False, victim)

    def cpu_miss(self, layer: int, precision: str = FULL) -> None:
        """A use of a non-resident expert that the placement computed on the CPU from host RAM: a miss with no copy,
        no slot and no policy event (the cache evolves as before; only the count says it missed)."""
        self._count(layer, precision if precision in self.counts else next(iter(self.counts)), "cpu_misses")

    def stream(self, layer: int, expert: int, precision: str = FULL) -> None:
        """A prefill miss streamed through a staging buffer (DuoServe) instead of the cache: one demand load,
        counted as a miss, nothing inserted or evicted (the decode cache is left as it was)."""
        self.clock += 1
        self._count(layer, precision, "misses")

    def resident_first(self, predictions) -> list:
        """One batch of predictions (target layer, expert, score), the ones resident (in any pool) first,
        stable: a driver issues them in this order, so every resident prediction is protected before a missing
        one takes a slot, and a copy never evicts an expert predicted in the same batch."""
        def resident(p):
            return 0 <= p[0] < self.num_layers and any(int(p[1]) in pool.slot_of for pool in self.pools[p[0]].values())
        return sorted(predictions, key=lambda p: not resident(p))

    def prefetch(self, layer: int, expert: int, precision: str = FULL) -> Access | None:
        """A predicted expert of a later layer: protected until that layer routes, inserted if missing.
        None when it is already resident (then only protected) or no slot can be freed without evicting
        a pinned or another predicted expert."""
        pool, key = self.pools[layer][precision], (layer, precision, expert)
        if expert in pool.slot_of:
            self.predicted.setdefault(key, False)
            return None
        if self.staging:                        # into a staging buffer: no slot taken, nothing evicted
            if key in self.staged or not self.stage_free[precision]:
                return None
            buf = self.staged[key] = self.stage_free[precision].pop()
            self._count(layer, precision, "prefetches")
            return Access(-1, False, None, buf)
        taken = self._take_slot(layer, precision)
        if taken is None:
            return None
        self.clock += 1
        slot, victim = taken
        pool.slot_of[expert] = slot
        self.predicted[key] = True
        self._count(layer, precision, "prefetches")
        self.policies[precision].on_insert(layer, expert, self.clock)
        return Access(slot, False, victim)


def split_slots(total: int, num_layers: int, num_experts: int, flag: str = "--cache-experts") -> list[int]:
    """`total` slots split evenly over the layers (earlier layers get the remainder), each capped at E."""
    from ..errors import MoectlError

    if total < num_layers:
        raise MoectlError(f"{flag} {total} is below the minimum of one slot per MoE layer ({num_layers})")
    base, extra = divmod(min(total, num_layers * num_experts), num_layers)
    return [min(num_experts, base + (1 if i < extra else 0)) for i in range(num_layers)]


def hot_experts(experts: np.ndarray, pools: dict) -> dict[str, list[list[int]]]:
    """What a plan preloads: per layer, the experts used most in `experts` [N, L, K] (routing rows, -1 = none;
    ties to the lower id), the most used filling the full-precision pool, the next ones the low-bit pool, each
    up to its slots (`pools`: {precision: per-layer slots})."""
    N, L, K = experts.shape
    out = {p: [] for p in pools}
    for l in range(L):
        ids = experts[:, l].reshape(-1)
        counts = np.bincount(ids[ids >= 0].astype(np.int64), minlength=1)
        order = [int(e) for e in np.argsort(-counts, kind="stable") if counts[e] > 0]
        for p in sorted(pools, key=lambda p: p != FULL):
            n = int(pools[p][l])
            out[p].append(order[:n])
            order = order[n:]
    return out
