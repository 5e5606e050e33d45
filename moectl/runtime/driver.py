"""The runtime's shared state and its per-layer driver: what every OffloadedExperts module calls before its experts
run. `gate` (adaptive top-k, forced routing), `on_route` (observers, then the prefetch policy's predictions in decode
steps), `offer` (predictions through the admission gate: resident ones protected, missing ones copied). The CPU
worker (`worker.py`) is mixed in."""

from __future__ import annotations

import time

import torch

from ..core.cache_model import COUNTERS
from ..policies.admission import PrefetchGate
from ..policies.gating import GatingPolicy, gate_rows
from .worker import CpuWorker


class Runtime(CpuWorker):
    """What every OffloadedExperts module shares: the adapter, the cache, observers, prefetch, gating, where
    missed experts run (placement + the CPU worker), forced routing (replay)."""

    def __init__(self, adapter, gating: GatingPolicy | None = None, gate_prefill: bool = False):
        self.adapter = adapter
        self.cache = None                   # DeviceCache | InPlaceExperts
        self.engine = None                  # the Engine (observers, prefill progress, prefetch)
        self.gating = gating                # adaptive top-k (None: every chosen expert runs)
        self.gate_prefill = gate_prefill    # gate every row of a multi-token forward too, not only decode's one
        self.expert_calls = 0               # (token, expert) FFN computations, all layers, since load
        self.replay = None                  # RoutingReplay: the router's choice replaced by a trace's
        self.device_side_s = 0.0            # time this thread spent fetching + computing a layer's other experts
        self.expert_stage_s = 0.0           # wall time of the layers' expert stages (both sides, overlapped)
        self.predictor_s = 0.0              # time the prefetch policy took to observe and predict
        self.prefetch_gate = PrefetchGate()        # predictions -> copies: protect resident, admit missing ones
        self.copy_s = 0.0                   # one expert's copy time (the cost model's), for admission
        self.drafting = False               # `--draft cached` drafting: resident experts only, the cache untouched
        self.init_worker()

    def gate(self, layer: int, idx: torch.Tensor, w: torch.Tensor):
        """The routing `idx`, `w` [T,K] after gating: decode drops the tail (fewer columns); a gated multi-token
        forward marks dropped entries -1 with weight 0. Unchanged when nothing is dropped. With a replay, the
        trace's routing first replaces the router's."""
        if self.replay is not None:
            idx, w = self.replay.route(layer, idx, w)
        verify = self.cache.state.phase == "decode"           # a multi-token decode step: speculative verification
        if self.gating is None or (idx.shape[0] > 1 and not (self.gate_prefill or verify)):
            return idx, w
        idx_np = idx.cpu().numpy()
        e, g = gate_rows(self.gating, layer, idx_np, w.detach().float().cpu().numpy())
        if (e == idx_np).all():
            return idx, w
        if idx.shape[0] == 1:
            keep = torch.from_numpy(e[0] >= 0)
            return idx[:, keep], torch.from_numpy(g[:, keep.numpy()]).to(w.device, w.dtype)
        return torch.from_numpy(e).to(idx.device, idx.dtype), torch.from_numpy(g).to(w.device, w.dtype)

    def on_route(self, layer, top_k_index, top_k_weights, hidden):
        eng = self.engine
        eng._prefill_progress(layer, top_k_index.shape[0])
        for obs in eng.observers:
            obs.on_route(layer, top_k_index, top_k_weights, hidden)
        if self.prefetch_gate.pending.get(layer):                             # admission's outcomes for this layer
            self.prefetch_gate.route(layer, top_k_index.reshape(-1).tolist())
        pf = eng.prefetch
        if pf is not None and self.cache.state.phase == "decode":      # predict ahead in decode steps only
            t0 = time.perf_counter()
            pf.observe(layer, top_k_index[0].tolist(), top_k_weights[0].float().tolist(),
                       hidden[0].float().cpu().numpy())
            preds = pf.predict(layer)
            self.predictor_s += time.perf_counter() - t0
            self.offer(layer, preds, top_k_index[0].tolist())            # later layers of this token

    # --- prefetch admission (policies/admission.py: the simulator's gate and rule) ------------------
    def offer(self, layer: int, preds, routed=()) -> None:
        """Predictions made after `layer` (-1: after the previous token) through the shared gate: resident ones
        protected, missing ones copied when admitted; the backlog is the copy engine's unrun chunks, timed."""
        cache = self.cache

        def issue(target: int, expert: int, held: str | None) -> bool:
            if held is not None:
                cache.state.prefetch(target, expert, held)              # protect only
                return False
            return cache.prefetch(target, expert)
        p = cache.pf_precision                  # the pool prefetches copy into (low-bit at lowbit-only)
        backlog_s = self.copy_s * cache.backlog_bytes() / cache.store.nbytes(p) if self.copy_s else 0.0
        self.prefetch_gate.offer(cache.state, layer, preds, self.copy_s, backlog_s, issue, p, routed=routed)

    def decode_misses(self, layer: int) -> int:
        """Demand loads of `layer` in decode steps so far (all pools): `layer_done`'s count is the difference."""
        return sum(int(c["decode"][layer, COUNTERS.index("misses")]) for c in self.cache.state.counts.values())
