"""OffloadedExperts: the stand-in for a family's `*Experts` module; it owns no weights.

Legend: T = tokens in this forward, K = top-k, H = hidden size.

The MoE block calls `experts(x [T,H], top_k_index [T,K], top_k_weights [T,K])` exactly as it
calls the stock module; we gate the routing (adaptive top-k, when a gating policy is set), give the cache
the router's choice, tell the runtime (observers, prefetch), then compute the experts in the cache's
order (resident first, chunks of the slot count): the rule set of `moectl/core/cache_model.py`, which the
simulator follows too.

Outputs are summed in ascending expert id, as transformers' own loop does, whatever order the cache
computed them in: the result does not depend on what was resident.

Precision (`--precision`, `policies/precision.py`): before any expert runs, the cache's `plan` says which copy
serves each routed expert -- a resident one of either precision, else the policy's full / low-bit / skip for the
expert's rank score -- and a skipped expert's weight is dropped with the token's others renormalised to the
routed sum (HOBBIT). Full-precision experts run first, then low-bit ones, each from its own slot pool.

Drafting (`--draft cached`, `runtime/draft_sources.py`): while `runtime.drafting` is set, only experts already resident and
landed on the device run (`_resident_only`); the others are skipped with the same renormalisation, and the cache is
not touched at all (no access, counter, policy update, copy, prefetch or CPU compute), so drafting loads nothing.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..core.cache_model import FULL, LOW
from ..kernels import ops
from ..models.base import FamilyAdapter
from ..policies.draft_length import pass_order
from ..policies.precision import SKIP, rank_scores
from ..formats.vnni import VnniLinear


class OffloadedExperts(nn.Module):
    def __init__(self, layer: int, model_layer: int, runtime, apply_gate, num_experts: int):
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

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        rt, layer = self.runtime, self.layer
        if rt.drafting:
            return self._resident_only(hidden_states, top_k_index, top_k_weights)
        top_k_index, top_k_weights = rt.gate(layer, top_k_index, top_k_weights)
        cache = rt.cache
        if hidden_states.shape[0] == 1 and len(set(ids := top_k_index[0].tolist())) == len(ids):
            # Decode fast path: one token, K distinct experts; no gather/scatter needed.
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
            deferred = {}

            def one(e, expert):
                ws = getattr(expert, "weights", None)
                if fuse and ws is not None and all(isinstance(ws.get(m), VnniLinear) for m in ("gate_up", "down")):
                    deferred[e] = expert
                else:
                    ys[e] = expert(hidden_states) * w[pos[e]]                       # [1,H]

            # admission learns how often a decode layer waits for a copy (nothing to count with it off)
            learn = cache.state.phase == "decode" and rt.prefetch_gate.admission.learns
            misses, cpu = (rt.decode_misses(layer) if learn else 0), rt.cpu_experts
            self._each_expert(plan, one)
            if learn:
                rt.prefetch_gate.layer_done(rt.decode_misses(layer) - misses, rt.cpu_experts - cpu)
            if deferred and not ys:
                order, wl = sorted(deferred), w.float().tolist()
                pairs = [(deferred[e].weights["gate_up"], deferred[e].weights["down"]) for e in order]
                return ops.experts_decode(hidden_states, pairs, [wl[pos[e]] for e in order]).view_as(hidden_states)
            for e, expert in deferred.items():                                      # beside others: one by one
                ys[e] = expert(hidden_states) * w[pos[e]]
            out = torch.zeros_like(hidden_states)                                   # [1,H]
            for e in sorted(ys):
                out = out + ys[e].to(out.dtype)
            return out
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
        self._each_expert(plan, batch, {e: counts[e] for e in needed} if counts else None)
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
        its FFN. Misses the placement sends to the CPU (`--cpu-experts`; full or low-bit, as the plan chose) run on
        the runtime's CPU worker thread from host RAM while this thread runs the rest in the cache's order: per
        precision (full, then low-bit), resident first, chunks of the pool's slot count, each chunk pinned (the
        chunk's accesses in the cache model's order), computing within a chunk what has landed, then what a
        prefetch is still copying, then what this layer's demand loads bring. Then, as the simulator does, a CPU
        miss may be filled into the cache while the copy engine idles. The layer ends when both sides have
        (`tokens`: tokens per expert, for the placement's cost; default 1)."""
        rt, cache, layer = self.runtime, self.runtime.cache, self.layer
        t0 = time.perf_counter()
        on_cpu = rt.cpu_side(layer, plan, tokens or {})
        side = rt.start_cpu(layer, on_cpu, compute, self.apply_gate) if on_cpu else None
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
            rt.fill(layer, on_cpu)
        rt.device_side_s += time.perf_counter() - t0
        if side is not None:
            rt.finish_cpu(side)
        rt.expert_stage_s += time.perf_counter() - t0

    def _expert_fn(self, e: int, w: dict[str, torch.Tensor], precision: str = FULL):
        if torch.is_grad_enabled():             # a backward will follow (`moectl sensitivity`)
            w = _all_landed(w)
            return lambda x: _ExpertRecompute.apply(x, self, e, w, precision)
        fwd = lambda x: self.runtime.adapter.expert_forward(w, x, self.apply_gate)   # noqa: E731
        fwd.weights = w                                                         # for the fused decode call
        return fwd


def _is_silu_gate(apply_gate) -> bool:
    """Whether `apply_gate` is transformers' default gating (gate, up = chunk(2); act(gate) * up) with SiLU."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    owner = getattr(apply_gate, "__self__", None)
    return (getattr(apply_gate, "__func__", None) is _default_apply_gate
            and isinstance(getattr(owner, "act_fn", None), (SiLUActivation, nn.SiLU)))


class _ExpertRecompute(torch.autograd.Function):
    """An expert's FFN whose backward fetches the expert again through the cache: by the time the backward
    runs, its slot may hold another expert (1 slot per layer), so its weights are never saved for it."""

    @staticmethod
    def forward(ctx, x, module: OffloadedExperts, expert: int, w, precision: str):
        ctx.module, ctx.expert, ctx.precision = module, expert, precision
        ctx.save_for_backward(x)
        return module.runtime.adapter.expert_forward(w, x, module.apply_gate)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        m, e, p = ctx.module, ctx.expert, ctx.precision
        cache = m.runtime.cache
        cache.pin(m.layer, [e], p)
        try:
            w = _all_landed(cache.acquire(m.layer, e, p))
            with torch.enable_grad():
                xr = x.detach().requires_grad_()
                (gx,) = torch.autograd.grad(m.runtime.adapter.expert_forward(w, xr, m.apply_gate), xr, grad)
        finally:
            cache.unpin(m.layer, [e], p)
        return gx, None, None, None, None


def _all_landed(w) -> dict:
    """Every matrix of a slot whose copy may be pending, landed now. Autograd needs this: the matrices are views
    of one slot and share its version counter, so a chunk landing after another matrix was saved for backward
    would look like an in-place change of the saved one."""
    return w if isinstance(w, dict) else {k: w[k] for k in w.keys()}
