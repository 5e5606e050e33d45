"""A MoE layer's experts, offloaded: `OffloadedExperts` (one per layer, owning no weights) and `Runtime`, what every
layer's experts share (the cache, routing overrides, prefetch, the CPU worker, the counters).

Legend: T = tokens in this forward, K = top-k, H = hidden size, L = MoE layers.

The MoE block calls `experts(x [T,H], top_k_index [T,K], top_k_weights [T,K])` exactly as it calls the stock
`*Experts` module, so routers, shared experts, grouped routing and router biases stay the reference code. One layer:

    gate      `Runtime.gate`: forced routing (`--replay-trace`, replay.py), then adaptive top-k (policies/gating.py)
    route     `cache.route`: the cache rules' step 1 (core/cache_model.py); then `Runtime.on_route`: the engine's
              progress callback, observers (trace recorder), admission's outcomes, and in decode steps the prefetch
              policy's observe/predict -> `offer` (policies/admission.py) -> `cache.prefetch`
    plan      `cache.plan(l, e, scores)`: a resident copy's precision, else the PrecisionPolicy's FULL | LOW | SKIP
              (a skipped expert's weight dropped, the token's others renormalised to the routed sum: HOBBIT)
    place     `_place`: each miss through policies/miss.py `decide_miss` (the simulator's `_place` calls it too):
              DEVICE (resident, landed or landing) | FETCH | CPU | SKIP
    compute   the CPU's misses start on the worker thread (worker.py); meanwhile this thread runs the device's in
              the cache's order: per precision (full, then low-bit), `cache.chunks` (resident first, chunks of the
              pool's slot count), each chunk pinned and acquired (hit, or a demand copy through loader.py), computed
              landed -> in flight -> demand; then `_fill` copies a CPU miss in while the copy engine idles
    sum       in ascending expert id, as transformers' own loop does: the result does not depend on what was resident

One token with K distinct experts (decode) takes a fast path: no gather/scatter, the K outputs summed; in place
on the CPU, experts in moectl's low-bit layout wait for one fused call (`kernels.ops.experts_decode`). Several
tokens (prefill, a speculative verification pass) route once per distinct expert, each applied to its tokens (in
place, a GGUF's experts where they lie wait for one ggml graph over all tokens: `kernels.ggml.experts_routed`); a
pass runs its latest tokens' experts last (`pass_order`), a streamed prefill (`--prefill stream`) takes its misses
through two staging buffers. While `Runtime.drafting` is set (`--draft cached`, speculative.py) only experts resident
and landed run (`_resident_only`) and the cache is not touched at all.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..core.cache_model import COUNTERS, FULL, LOW
from ..formats.vnni import VnniLinear
from ..kernels import triton_lowbit
from ..kernels import ops
from ..kernels.ggml import GgmlBiasedLinear, GgmlLinear, experts_decode, experts_routed
from ..models.base import FamilyAdapter
from ..models.gpt_oss import GptOssAdapter
from ..policies.admission import PrefetchGate
from ..policies.draft_length import pass_order
from ..policies.gating import GatingPolicy, gate_rows
from ..policies.miss import decide_miss
from ..policies.placement import CPU, LayerQueue
from ..policies.precision import SKIP, rank_scores
from .recompute import recomputed


class Runtime:
    """What every layer's OffloadedExperts share. Set at load (`load.py`): the adapter (its `expert_forward`), the
    cache (`cache.py: ExpertCache`), gating, the prefetch policy with its admission gate and one copy's time, the
    placement of a miss and the CPU worker (`self.cpu`), a routing replay. Set by the engine: `on_layer`, its
    prefill progress (called with (layer, tokens) as each layer routes), and `drafting`. It knows no engine."""

    def __init__(self, adapter, gating: GatingPolicy | None = None, gate_prefill: bool = False):
        self.adapter = adapter
        self.cache = None                   # ExpertCache
        self.cpu = None                     # CpuWorker: misses computed from host RAM on its thread
        self.placement = None               # ComputePlacement: a missed expert fetched or computed on the CPU
        self.gating = gating                # adaptive top-k (None: every chosen expert runs)
        self.gate_prefill = gate_prefill    # gate every row of a multi-token forward too, not only decode's one
        self.replay = None                  # RoutingReplay: the router's choice replaced by a trace's
        self.prefetch = None                # PrefetchPolicy
        self.prefetch_gate = PrefetchGate()        # predictions -> copies: protect resident, admit missing ones
        self.copy_s = 0.0                   # one expert's copy time (the cost model's), for admission
        self.observers: list = []           # on_route(layer, idx, w, hidden); on_final_hidden(h) if they have it
        self.on_layer = None                # (layer, tokens) -> None as each layer routes: the engine's progress
        self.drafting = False               # `--draft cached` drafting: resident experts only, the cache untouched
        # counters since load
        self.expert_calls = 0               # (token, expert) FFN computations, all layers
        self.cpu_experts = 0                # experts computed on the CPU (missed, placed there)
        self.expert_stage_s = 0.0           # wall time of the layers' expert stages (both sides, overlapped)
        self.device_side_s = 0.0            # time this thread spent fetching + computing a layer's other experts
        self.cpu_side_s = 0.0               # time the worker spent computing CPU experts
        self.cpu_wait_s = 0.0               # time a layer waited for the worker after its own side was done
        self.predictor_s = 0.0              # time the prefetch policy took to observe and predict

    # --- a request, a token -------------------------------------------------------------------
    def begin_request(self) -> None:
        """Sequence-level state reset: admission's outcomes, the prefetch policy's."""
        self.prefetch_gate.reset()
        if self.prefetch is not None:
            self.prefetch.reset()

    def begin_token(self) -> None:
        """A decode step begins: the predictions made after the previous token (the aux gate: this token's first
        layer) go through admission."""
        if self.prefetch is not None:
            t0 = time.perf_counter()
            after = self.prefetch.predict_after_token()
            self.predictor_s += time.perf_counter() - t0
            self.offer(-1, after)

    def end_token(self, hidden: torch.Tensor) -> None:
        """The final norm's output [T,H]: to the observers, and in decode steps the last row to the prefetch policy."""
        for obs in self.observers:
            fn = getattr(obs, "on_final_hidden", None)
            if fn is not None:
                fn(hidden)
        if self.prefetch is not None and self.cache.state.phase == "decode":
            t0 = time.perf_counter()
            self.prefetch.end_token(hidden[-1].float().cpu().numpy())
            self.predictor_s += time.perf_counter() - t0

    # --- a layer's routing --------------------------------------------------------------------
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

    def on_route(self, layer, top_k_index, top_k_weights, hidden) -> None:
        """The layer's routing, once the cache has it: progress, observers, admission's outcomes; in decode steps
        the prefetch policy observes it and its predictions for later layers are offered."""
        if self.on_layer is not None:
            self.on_layer(layer, top_k_index.shape[0])
        for obs in self.observers:
            obs.on_route(layer, top_k_index, top_k_weights, hidden)
        if self.prefetch_gate.pending.get(layer):                             # admission's outcomes for this layer
            self.prefetch_gate.route(layer, top_k_index.reshape(-1).tolist())
        pf = self.prefetch
        if pf is not None and self.cache.state.phase == "decode":      # predict ahead in decode steps only
            t0 = time.perf_counter()
            pf.observe(layer, top_k_index[0].tolist(), top_k_weights[0].float().tolist(),
                       hidden[0].float().cpu().numpy())
            preds = pf.predict(layer)
            self.predictor_s += time.perf_counter() - t0
            self.offer(layer, preds, top_k_index[0].tolist())            # later layers of this token

    def offer(self, layer: int, preds, routed=()) -> None:
        """Predictions made after `layer` (-1: after the previous token) through the shared gate (the simulator's
        gate and rule): resident ones protected, missing ones copied when admitted; the backlog is the copy
        engine's unrun chunks, timed."""
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


class OffloadedExperts(nn.Module):
    def __init__(self, layer: int, model_layer: int, runtime: Runtime | None, apply_gate, num_experts: int):
        super().__init__()
        self.layer = layer                  # MoE layer index (0..L-1)
        self.model_layer = model_layer      # decoder layer index in the model
        self.runtime = runtime
        self.apply_gate = apply_gate        # the family's act(gate) * up (GPT-OSS: clamped SwiGLU)
        self.num_experts = num_experts
        # transformers' SiLU gating through the base adapter's FFN: what the fused decode call computes
        # (a bound method's function: a GGUF's adapter hands its family adapter's through)
        self.fusable = (_is_silu_gate(apply_gate)
                        and getattr(runtime.adapter.expert_forward, "__func__", None) is FamilyAdapter.expert_forward)
        # GPT-OSS's clamped SwiGLU (alpha, limit) through its adapter's FFN with biases: what ggml's swiglu_oai graph
        # computes (kernels/ggml.py: moe with swiglu_oai); None for other families
        self.swiglu_oai = _swiglu_oai(apply_gate, runtime.adapter)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        if rt.drafting:
            return self._resident_only(hidden_states, top_k_index, top_k_weights)
        top_k_index, top_k_weights = rt.gate(self.layer, top_k_index, top_k_weights)
        if hidden_states.shape[0] == 1 and len(set(ids := top_k_index[0].tolist())) == len(ids):
            return self._one_token(hidden_states, top_k_index, top_k_weights, ids)
        return self._tokens(hidden_states, top_k_index, top_k_weights)

    def _one_token(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   ids: list[int]) -> torch.Tensor:
        """The decode fast path: one token [1,H], K distinct experts; no gather/scatter needed."""
        rt, cache, layer = self.runtime, self.runtime.cache, self.layer
        rt.expert_calls += sum(0 <= e < self.num_experts for e in ids)
        pos = {e: j for j, e in enumerate(ids)}
        weights = top_k_weights[0].float().tolist()
        if cache.state.phase == "decode":                                       # the cache rules' step 1
            cache.route(layer, ids, weights)
        else:                                                                   # a one-token prompt
            ids = sorted(ids)
            cache.route(layer, ids, None)
        rt.on_route(layer, top_k_index, top_k_weights, hidden_states)           # observers, prefetch
        scores = rank_scores(weights)
        plan = {e: cache.plan(layer, e, [scores[pos[e]]]) for e in ids if 0 <= e < self.num_experts}
        w = top_k_weights[0]
        if SKIP in plan.values():                   # renormalise the kept weights to the routed sum
            kept = torch.tensor([plan.get(e) != SKIP for e in top_k_index[0].tolist()], device=w.device)
            w = w * (w.sum() / (w * kept).sum())
        ys: dict[int, torch.Tensor] = {}
        # In place on the CPU (weights where they lie, nothing pinned or evicted meanwhile) experts in moectl's
        # low-bit layout wait for one fused call (`kernels.ops.experts_decode`: ~15 torch operations and 4
        # kernel calls fewer an expert, the same roundings)
        fuse = self.fusable and cache.in_place and hidden_states.dtype == torch.bfloat16
        # a GGUF's experts where they lie in the mapped file: the layer's experts in one ggml graph (one wake of its
        # threadpool, x quantized once), in any dtype
        fuse_ggml = self.fusable and cache.in_place
        # GPT-OSS's GGUF experts where they lie: the layer's experts in one ggml graph with their biases
        oai_ggml = self.swiglu_oai is not None and cache.in_place
        # On a GPU, low-bit experts the Triton kernels compute (kernels/triton_lowbit.py) wait for one grouped call:
        # three launches for the layer instead of ~10 kernels and a bf16 copy per matrix
        group = self.fusable and not cache.in_place
        deferred = {}

        def one(e, expert):
            ws = getattr(expert, "weights", None)
            if fuse and ws is not None and all(isinstance(ws.get(m), VnniLinear) for m in ("gate_up", "down")):
                deferred[e] = expert
            elif group and isinstance(ws, dict) and isinstance(ws.get("gate_up"), triton_lowbit.GateUp):
                deferred[e] = expert
            elif fuse_ggml and ws is not None and all(isinstance(ws.get(m), GgmlLinear) for m in ("gate_up", "down")):
                deferred[e] = expert
            elif oai_ggml and ws is not None and isinstance(ws.get("gate_up"), GgmlBiasedLinear):
                deferred[e] = expert
            else:
                ys[e] = expert(hidden_states) * w[pos[e]]                       # [1,H]

        # admission learns how often a decode layer waits for a copy (nothing to count with it off)
        learn = cache.state.phase == "decode" and rt.prefetch_gate.admission.learns
        misses, cpu = (rt.decode_misses(layer) if learn else 0), rt.cpu_experts
        self._each_expert(plan, one)
        if learn:
            rt.prefetch_gate.layer_done(rt.decode_misses(layer) - misses, rt.cpu_experts - cpu)
        if deferred and not ys and group:
            order = sorted(deferred)
            pairs = [(deferred[e].weights["gate_up"], deferred[e].weights["down"]) for e in order]
            if triton_lowbit.groupable(pairs):
                sel = w[torch.tensor([pos[e] for e in order], device=w.device)]
                return triton_lowbit.experts_decode(hidden_states, pairs, sel).view_as(hidden_states)
        if deferred and not ys and oai_ggml:
            y = experts_routed(hidden_states, {e: ex.weights for e, ex in deferred.items()}, top_k_index, w[None],
                               self.swiglu_oai)
            if y is not None:
                return y.view_as(hidden_states)
        if deferred and not ys and (fuse or fuse_ggml):
            order, wl = sorted(deferred), w.float().tolist()
            pairs = [(deferred[e].weights["gate_up"], deferred[e].weights["down"]) for e in order]
            coefs = [wl[pos[e]] for e in order]
            if isinstance(pairs[0][0], GgmlLinear):
                return experts_decode(hidden_states, pairs, coefs).view_as(hidden_states)
            return ops.experts_decode(hidden_states, pairs, coefs).view_as(hidden_states)
        for e, expert in deferred.items():                                      # beside others: one by one
            ys[e] = expert(hidden_states) * w[pos[e]]
        out = torch.zeros_like(hidden_states)                                   # [1,H]
        for e in sorted(ys):
            out = out + ys[e].to(out.dtype)
        return out

    def _tokens(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Several tokens [T,H] (a prefill, a verification pass), or one with a repeated expert: each distinct
        expert routed once, then applied to the tokens routed to it."""
        rt, cache, layer = self.runtime, self.runtime.cache, self.layer
        if cache.state.phase == "decode":           # a verification pass: the latest tokens' experts run last
            needed = [e for e in pass_order(top_k_index.tolist()) if e < self.num_experts]   # one host sync
        else:
            needed = [e for e in top_k_index.unique().tolist() if 0 <= e < self.num_experts]
        rt.expert_calls += int((top_k_index >= 0).sum())
        cache.route(layer, needed, None)                                            # batched: once each
        rt.on_route(layer, top_k_index, top_k_weights, hidden_states)
        plan, top_k_weights = self._plan_batch(needed, top_k_index, top_k_weights)
        parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def batch(e, expert):
            tok, slot = (top_k_index == e).nonzero(as_tuple=True)                  # tokens routed to e
            keep = top_k_weights[tok, slot] != 0                                    # a token that skipped e
            tok, slot = tok[keep], slot[keep]
            parts[e] = tok, expert(hidden_states[tok]) * top_k_weights[tok, slot, None]   # [t,H]

        p = cache.pf_precision                                  # the copies streamed (low-bit at lowbit-only)
        if (cache.streaming and cache.state.phase == "prefill" and not torch.is_grad_enabled()
                and all(d == p for d in plan.values())):
            missing = [e for e in needed if not cache.contains(layer, e, p)]
            self._each_expert({e: p for e in needed if e not in missing}, batch)
            for e, w in cache.stream(layer, missing):            # DuoServe: misses through the staging buffers
                batch(e, self._expert_fn(e, w, p))
            return self._combine(hidden_states, parts)
        counts = torch.bincount(top_k_index[top_k_index >= 0].reshape(-1), minlength=self.num_experts).tolist() \
            if rt.placement is not None else None
        # In place on the CPU, a GGUF's experts where they lie in the mapped file wait for one ggml graph over all T
        # tokens (`experts_routed`: ids [T,K], weights [T,K], as llama.cpp computes a prefill) instead of two ggml
        # calls and a gather/scatter per expert; the cache's bookkeeping is `_each_expert`'s either way
        deferred = {}

        def batch_or_defer(e, expert):
            if isinstance(getattr(expert, "weights", None), dict) and isinstance(expert.weights.get("gate_up"),
                                                                               GgmlLinear):
                deferred[e] = expert
            else:
                batch(e, expert)

        fused = (self.fusable or self.swiglu_oai is not None) and cache.in_place
        self._each_expert(plan, batch_or_defer if fused else batch,
                          {e: counts[e] for e in needed} if counts else None)
        if deferred and not parts:
            y = experts_routed(hidden_states, {e: ex.weights for e, ex in deferred.items()}, top_k_index,
                               top_k_weights, self.swiglu_oai)
            if y is not None:
                return y
        for e, expert in deferred.items():                                  # not one graph: one by one
            batch(e, expert)
        return self._combine(hidden_states, parts)

    def _resident_only(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The draft's experts: each token's routed experts that are resident and landed (`resident_weights`), its
        weights [T,K] renormalised over them to the routed sum (HOBBIT's skip); a token with none gets 0 (its
        residual stream passes). Reads slots only: nothing is counted, moved or computed on the CPU."""
        ids = idx.tolist()
        held = {e: self.runtime.cache.resident_weights(self.layer, e)
                for e in {e for row in ids for e in row if 0 <= e < self.num_experts}}
        held = {e: ws for e, ws in held.items() if ws is not None}
        kept = w * torch.tensor([[e in held for e in row] for row in ids], device=w.device)   # [T,K]
        kept = kept * (w.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp_min(1e-30))
        parts = {}
        for e in sorted(held):
            tok, slot = (idx == e).nonzero(as_tuple=True)                  # tokens routed to e
            fwd = self.runtime.adapter.expert_forward(held[e], x[tok], self.apply_gate)
            parts[e] = tok, fwd * kept[tok, slot, None]
        return self._combine(x, parts)

    @staticmethod
    def _combine(hidden_states: torch.Tensor, parts: dict) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)                                       # [T,H]
        for e in sorted(parts):                                                     # ascending id: transformers' order
            tok, y = parts[e]
            out = out.index_add(0, tok, y.to(out.dtype))
        return out

    def _plan_batch(self, needed: list[int], top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The copy serving each needed expert ({e: FULL|LOW|SKIP}) and the weights [T,K] with each token's skipped
        experts zeroed and the rest renormalised to the routed sum. With only full copies: all FULL, weights as
        they are (no host sync)."""
        cache = self.runtime.cache
        if cache.precision.name == "full" and len(cache.precisions) == 1:
            return {e: cache.plan(self.layer, e, [0.0]) for e in needed}, top_k_weights
        idx = top_k_index.tolist()
        sc = [rank_scores(row) for row in top_k_weights.float().tolist()]     # per token, as the simulator scores
        w = top_k_weights
        plan, drop = {}, torch.zeros_like(w, dtype=torch.bool)
        for e in needed:
            where = [(t, k) for t, row in enumerate(idx) for k, x in enumerate(row) if x == e]
            plan[e] = cache.plan(self.layer, e, [sc[t][k] for t, k in where])
            if plan[e] == SKIP:
                for t, k in where:
                    drop[t, k] = True
        if drop.any():
            kept = top_k_weights.masked_fill(drop.to(top_k_weights.device), 0)
            top_k_weights = kept * (top_k_weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True))
        return plan, top_k_weights

    def _each_expert(self, plan: dict[int, str], compute, tokens: dict[int, int] | None = None) -> None:
        """`compute(e, expert)` for each expert the plan keeps ({e: FULL|LOW|SKIP}), `expert(x [t,H]) -> y [t,H]`
        its FFN. Misses the placement sends to the CPU (`_place`; full or low-bit, as the plan chose) run on the CPU
        worker thread from host RAM while this thread runs the rest in the cache's order: per precision (full, then
        low-bit), resident first, chunks of the pool's slot count, each chunk pinned (the chunk's accesses in the
        cache model's order), computing within a chunk what has landed, then what a prefetch is still copying, then
        what this layer's demand loads bring. Then, as the simulator does, a CPU miss may be filled into the cache
        while the copy engine idles (`_fill`). The layer ends when both sides have (`tokens`: tokens per expert, for
        the placement's cost; default 1)."""
        rt, cache, layer = self.runtime, self.runtime.cache, self.layer
        t0 = time.perf_counter()
        on_cpu = self._place(plan, tokens or {})
        side = None
        if on_cpu:
            rt.cpu_experts += len(on_cpu)
            for e, p in on_cpu:                 # misses, computed from host RAM: counted as misses (hit rate)
                cache.state.cpu_miss(layer, p)
            side = rt.cpu.start(layer, on_cpu, compute, self.apply_gate)
        cpu_ids = {e for e, _ in on_cpu}
        for p in (FULL, LOW):
            experts = [e for e, d in plan.items() if d == p and e not in cpu_ids]
            for chunk in cache.chunks(layer, experts, p) if experts else []:
                cache.pin(layer, chunk, p)
                ws = {e: cache.acquire(layer, e, p) for e in chunk}
                for e in (chunk if cache.in_place else sorted(chunk, key=lambda e: cache.landing(layer, e, p))):
                    compute(e, self._expert_fn(e, ws[e], p))
                cache.unpin(layer, chunk, p)
        if on_cpu:
            self._fill(on_cpu)
        rt.device_side_s += time.perf_counter() - t0
        if side is not None:
            busy, waited = rt.cpu.finish(side)
            rt.cpu_side_s += busy
            rt.cpu_wait_s += waited
        rt.expert_stage_s += time.perf_counter() - t0

    def _place(self, plan: dict[int, str], tokens: dict[int, int]) -> list[tuple[int, str]]:
        """The misses computed on the CPU instead of fetched: (expert, precision) for each entry of the `plan` that
        is not resident and that `decide_miss` sends there, priced at the bytes of the copy the plan chose (a low-bit
        miss reads its packed copy; `moectl-q4` is all low-bit misses). A full-precision miss needs the RAM tier (the
        disk tier keeps no host copy to compute from); low-bit copies are always in RAM. Never in place (nothing
        misses) nor under autograd (`moectl sensitivity`)."""
        rt, cache, layer = self.runtime, self.runtime.cache, self.layer
        if rt.placement is None or rt.placement.mode == "never" or cache.in_place or torch.is_grad_enabled():
            return []
        store, out, queue = cache.store, [], LayerQueue()
        for e, p in plan.items():
            held = p if p != SKIP and cache.contains(layer, e, p) else None
            where, _ = decide_miss(held, p, rt.placement, tokens.get(e, 1), store.nbytes(p) if p != SKIP else None,
                                   host_copy=p == LOW or store.buffers is not None, queue=queue)
            if where == CPU:
                out.append((e, p))
        return out

    def _fill(self, on_cpu: list[tuple[int, str]]) -> None:
        """The simulator's fill rule: a miss the CPU computed is copied into the cache in the background, only
        while the copy engine has nothing committed (a fill never delays a demand load or a prefetch; one at a
        time). Without it a cache whose misses all run on the CPU would never change after the prompt."""
        cache = self.runtime.cache
        for e, p in on_cpu:
            if cache.backlog_bytes() > 0:
                break
            if not cache.contains(self.layer, e, p):
                cache.fill(self.layer, e, p)

    def _expert_fn(self, e: int, w: dict[str, torch.Tensor], precision: str = FULL):
        if torch.is_grad_enabled():             # a backward will follow (`moectl sensitivity`)
            return recomputed(self, e, w, precision)
        fwd = lambda x: self.runtime.adapter.expert_forward(w, x, self.apply_gate)   # noqa: E731
        fwd.weights = w                                                         # for the fused decode call
        return fwd


def _swiglu_oai(apply_gate, adapter) -> tuple[float, float] | None:
    """GPT-OSS's (alpha, limit) when `apply_gate` is transformers' GptOssExperts gating and the adapter's FFN is
    GPT-OSS's (x @ gate_up + bias, the gate, @ down + bias); else None."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    owner = getattr(apply_gate, "__self__", None)
    if (getattr(apply_gate, "__func__", None) is not GptOssExperts._apply_gate
            or getattr(adapter.expert_forward, "__func__", None) is not GptOssAdapter.expert_forward):
        return None
    return float(owner.alpha), float(owner.limit)


def _is_silu_gate(apply_gate) -> bool:
    """Whether `apply_gate` is transformers' default gating (gate, up = chunk(2); act(gate) * up) with SiLU."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    owner = getattr(apply_gate, "__self__", None)
    return (getattr(apply_gate, "__func__", None) is _default_apply_gate
            and isinstance(getattr(owner, "act_fn", None), (SiLUActivation, nn.SiLU)))
