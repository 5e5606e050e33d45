"""OffloadedExperts: the stand-in for a family's `*Experts` module; it owns no weights.

Legend: T = tokens in this forward, K = top-k, H = hidden size.

The MoE block calls `experts(x [T,H], top_k_index [T,K], top_k_weights [T,K])` exactly as it
calls the stock module; we give the cache the router's choice, tell the runtime (observers,
prefetch), then compute the experts in the cache's order (resident first, chunks of the slot
count): the rule set of `moectl/cache_model.py`, which the simulator follows too.
"""

from __future__ import annotations

import torch
from torch import nn


class OffloadedExperts(nn.Module):
    def __init__(self, layer: int, model_layer: int, runtime, apply_gate, num_experts: int):
        super().__init__()
        self.layer = layer                  # MoE layer index (0..L-1)
        self.model_layer = model_layer      # decoder layer index in the model
        self.runtime = runtime
        self.apply_gate = apply_gate        # the family's act(gate) * up (GPT-OSS: clamped SwiGLU)
        self.num_experts = num_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        rt, layer = self.runtime, self.layer
        cache = rt.cache
        if hidden_states.shape[0] == 1 and len(set(ids := top_k_index[0].tolist())) == len(ids):
            # Decode fast path: one token, K distinct experts; no gather/scatter needed.
            pos = {e: j for j, e in enumerate(ids)}
            if cache.state.phase == "decode":                                       # the cache rules' step 1
                cache.route(layer, ids, top_k_weights[0].float().tolist())
            else:                                                                   # a one-token prompt
                ids = sorted(ids)
                cache.route(layer, ids, None)
            rt.on_route(layer, top_k_index, top_k_weights, hidden_states)           # observers, prefetch
            out = torch.zeros_like(hidden_states)                                   # [1,H]

            def one(e, w):
                y = rt.adapter.expert_forward(w, hidden_states, self.apply_gate)     # [1,H]
                out.add_((y * top_k_weights[0, pos[e]]).to(out.dtype))

            self._each_expert(ids, one)
            return out
        out = torch.zeros_like(hidden_states)                                       # [T,H]
        needed = [e for e in top_k_index.unique().tolist() if 0 <= e < self.num_experts]   # one host sync
        cache.route(layer, needed, None)                                            # batched: once each
        rt.on_route(layer, top_k_index, top_k_weights, hidden_states)

        def batch(e, w):
            tok, slot = (top_k_index == e).nonzero(as_tuple=True)                  # tokens routed to e
            y = rt.adapter.expert_forward(w, hidden_states[tok], self.apply_gate)  # [t,H]
            out.index_add_(0, tok, (y * top_k_weights[tok, slot, None]).to(out.dtype))

        self._each_expert(needed, batch)
        return out

    def _each_expert(self, experts: list[int], compute) -> None:
        """`compute(e, weights)` for each valid expert in the cache's order: resident ones first (on a GPU
        their compute overlaps the loads of the rest), then the missing ones, pinning at most the layer's
        slot count at once."""
        cache, layer = self.runtime.cache, self.layer
        for chunk in cache.chunks(layer, [e for e in experts if 0 <= e < self.num_experts]):
            cache.pin(layer, chunk)
            for e in chunk:
                compute(e, cache.acquire(layer, e))
            cache.unpin(layer, chunk)
