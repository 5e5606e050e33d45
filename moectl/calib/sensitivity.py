"""Per-layer Fisher sensitivity of the loss to each MoE block's output (AdapMoE §4.2), and the choice of T_g.

Legend: W = window length, D = hidden size, L = MoE layers.

S_l = (1/N) sum over scored tokens t of ||dL/dO_l[t]||^2, where L is the summed next-token cross-entropy of a
window, O_l [W,D] the output of MoE block l and N the tokens that have a next token (W-1 per window; the
last position's output reaches no loss). Weights are frozen; the gradient flows from the input embeddings.
Run through the offloading runtime, each expert is fetched again for the backward (a cache of one slot per
layer works); run on a plain transformers model it gives the same numbers (tested).

`ablation_sensitivity` measures the same thing directly: per layer, the loss of keeping only the top-1 there,
per unit of squared dropped mass. `--rule ablation` (the default) makes the gating rule use it; Fisher's S_l is
always computed and stored.

`sensitivity.json` (format `moectl-sensitivity` v1): fingerprint, model, dataset, window, windows, tokens,
moe_layer_ids, sensitivities [L] (Fisher), rule ("fisher" | "ablation"), ablation [L] and ablation_dnll [L]
(with rule ablation), and, after a search, threshold (the stored default T_g) with the search grid.
`rule_sensitivities(meta)` is what the gating uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MoectlError
from ..policies.gating import GatingPolicy


def fisher_sensitivity(model, moe_blocks: list, windows: list[list[int]], device="cpu", before_window=None,
                       after_window=None) -> dict:
    """S_l for each block of `moe_blocks` (in MoE layer order) over the windows; `before_window()` / `after_window()`
    run around each (the runtime's cache begins and ends a step there; a progress bar advances)."""
    for p in model.parameters():
        p.requires_grad_(False)
    outs: dict[int, torch.Tensor] = {}

    def keep(layer):
        def hook(_module, _args, output):
            o = output[0] if isinstance(output, tuple) else output
            if o.requires_grad:
                o.retain_grad()
                outs[layer] = o
        return hook

    handles = [blk.register_forward_hook(keep(l)) for l, blk in enumerate(moe_blocks)]
    total = torch.zeros(len(moe_blocks), dtype=torch.float64)
    scored = 0
    emb = model.get_input_embeddings()
    try:
        for ids in windows:
            x = torch.tensor([ids], device=device)                                       # [1,W]
            outs.clear()
            if before_window is not None:
                before_window()
            with torch.enable_grad():
                h = emb(x).detach().requires_grad_()                                       # [1,W,D]
                logits = model(inputs_embeds=h, use_cache=False).logits[0, :-1].float()  # [W-1,V]
                F.cross_entropy(logits, x[0, 1:], reduction="sum").backward()
            for l, o in outs.items():
                g = o.grad.reshape(-1, o.shape[-1])[:-1].double()                          # [W-1,D]
                total[l] += g.pow(2).sum().item()
            scored += len(ids) - 1
            if after_window is not None:
                after_window()
    finally:
        for hd in handles:
            hd.remove()
    if len(outs) != len(moe_blocks):
        raise MoectlError(f"only {len(outs)} of {len(moe_blocks)} MoE blocks were reached by the gradient")
    return {"sensitivities": (total / scored).tolist(), "tokens": scored}


class LayerAblation(GatingPolicy):
    """Keeps only the top-1 in MoE layer `layer` (every token), all chosen experts elsewhere."""

    name = "ablation"

    def __init__(self, layer: int):
        self.layer = layer

    def budget(self, layer: int) -> float:
        return 1.0 if layer == self.layer else -1.0


def ablation_sensitivity(eng, windows: list[list[int]], progress=None) -> dict:
    """The measured cost of dropping gate mass, per MoE layer, in the rule's own units:

        A_l = (NLL with only the top-1 kept in layer l  -  NLL) / sum over tokens of m_t^2

    m_t the normalised mass a token's tail holds in layer l. The rule `m^2 x A_l <= T_g` then spends the same
    measured loss per dropped unit everywhere. Why next to Fisher's S_l: S_l = E||dL/dO_l||^2 assumes every
    layer's dropped experts move the output by the same amount per unit of weight; on the tiny model the
    ablation costs per unit m^2 differ from S_l's ratios by up to 100x between layers (docs/benchmarks.md).
    A layer whose tail costs nothing (or helps) gets 1e-3 x the largest A_l: it drops first, not for free.
    `eng` is a loaded Engine; L + 1 teacher-forced passes over `windows`."""
    from .fidelity import gating_as, window_nll

    L = len(eng.moe_layer_ids)
    tails = TailRecorder(L)
    eng.add_observer(tails)
    try:
        with gating_as(eng, None, True):
            base = window_nll(eng, windows)["nll"]
    finally:
        eng.remove_observer(tails)
    if progress is not None:
        progress()
    cost = []
    for l in range(L):
        with gating_as(eng, LayerAblation(l), True):
            cost.append(window_nll(eng, windows)["nll"] - base)
        if progress is not None:
            progress()
    mass2 = [sum(m * m for m in ms) for ms in tails.heads]
    raw = [c / m2 if m2 > 0 else 0.0 for c, m2 in zip(cost, mass2)]
    floor = 1e-3 * max(max(raw), 0.0)
    return {"ablation": [max(a, floor) for a in raw], "ablation_dnll": cost, "tokens": sum(len(w) - 1 for w in windows)}


class TailRecorder:
    """Runtime observer: for each routed row, the normalised weight of its lowest-ranked chosen expert (the first
    one gating would drop), per layer. With S_l, these give the T_g at which each row starts to drop one."""

    def __init__(self, num_layers: int):
        self.tails: list[list[float]] = [[] for _ in range(num_layers)]
        self.heads: list[list[float]] = [[] for _ in range(num_layers)]     # mass outside the top-1

    def on_route(self, layer, top_k_index, top_k_weights, hidden) -> None:
        w = top_k_weights.detach().float()
        w = w.where(top_k_index >= 0, torch.zeros_like(w))
        total = w.sum(-1).clamp_min(1e-30)
        self.tails[layer] += (w.min(-1).values / total).tolist()
        self.heads[layer] += (1 - w.max(-1).values / total).tolist()


def threshold_grid(sensitivities: list[float], tails: list[list[float]],
                   quantiles=(0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8)) -> list[float]:
    """Candidate T_g where the fraction of rows that drop an expert passes each quantile: a row of layer l with
    lowest normalised weight w starts dropping at T_g = w^2 x S_l."""
    import numpy as np

    at = np.concatenate([np.square(np.asarray(t, np.float64)) * s for t, s in zip(tails, sensitivities) if t])
    at = at[at > 0]
    if at.size == 0:
        return []
    return sorted(set(float(v) for v in np.quantile(at, quantiles)))


def search_threshold(score, grid: list[float], target: float) -> dict:
    """The largest T_g of the grid, walking up from the smallest, whose relative perplexity delta stays within
    `target` (a T_g past the first one over it is not taken, even if noise brings it back under).
    `score(T_g)` -> eval dict (ppl_delta_rel, experts_per_token, ...)."""
    best, rows = None, []
    for t in grid:
        r = score(t)
        rows.append({"threshold": t, "ppl_delta_rel": r["ppl_delta_rel"],
                     "experts_per_token": r["experts_per_token"], "bytes_per_token": r["bytes_per_token"]})
        if r["ppl_delta_rel"] > target:
            break
        best = rows[-1]
    return {"threshold": best["threshold"] if best else None, "chosen": best, "grid": rows, "target_ppl_delta": target}
