"""A layer's experts under autograd (`moectl sensitivity` takes gradients through the offloaded layers).

An expert's FFN is applied through `_ExpertRecompute`, whose backward fetches the expert again through the cache: by
the time the backward runs, its slot may hold another expert (1 slot per layer), so its weights are never saved
for it. `OffloadedExperts._expert_fn` uses it whenever grad is enabled; decoding never does.
"""

from __future__ import annotations

import torch


def recomputed(module, expert: int, w, precision: str):
    """`expert`'s FFN of the OffloadedExperts `module`, x [t,H] -> y [t,H], differentiable in x, from the weights
    `w` the cache gave (every matrix landed first)."""
    w = _all_landed(w)
    return lambda x: _ExpertRecompute.apply(x, module, expert, w, precision)


class _ExpertRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module, expert: int, w, precision: str):
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
