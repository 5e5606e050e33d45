"""Set metrics for expert predictors, and the baselines every predictor is measured against.

Legend: N = tokens, E = experts, K = the model's top-k (true experts per token, -1 = padding).

A predictor outputs a score per expert; a prefetcher takes the k best. For k in (K, K+1, K+2):
- recall@k    = |top-k(scores) & true| / |true|    (share of the needed experts that were fetched early)
- precision@k = |top-k(scores) & true| / k         (share of the fetched experts that were needed)
- covered@k   = share of tokens whose whole true set is inside top-k (no demand load at all for that layer)
Tokens with an empty true set (all -1) are left out.

Baselines, scored on the very same held-out tokens:
- gate reuse: the target layer's router applied to the source layer's MoE input (`router[t] @ h[l]`), the
  free predictor of mixtral-offloading / AdapMoE / HOBBIT;
- frequency: the experts of the target layer that were most popular on the training split.
"""

from __future__ import annotations

import numpy as np


def multi_hot(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, K] expert ids (-1 = none) -> [N, E] bool."""
    n = experts.shape[0]
    out = np.zeros((n, num_experts + 1), dtype=bool)            # column E swallows the -1 padding
    ids = np.where(experts >= 0, experts, num_experts).astype(np.int64)
    out[np.arange(n)[:, None], ids] = True
    return out[:, :num_experts]


def ks_for(top_k: int, num_experts: int) -> list[int]:
    """The k values we report: the model's top-k, +1, +2 (never more than E)."""
    return sorted({min(k, num_experts) for k in (top_k, top_k + 1, top_k + 2)})


def set_metrics(scores: np.ndarray, true_experts: np.ndarray, ks: list[int]) -> dict:
    """recall@k, precision@k, covered@k of `scores` [N, E] against `true_experts` [N, K]."""
    scores = np.asarray(scores, dtype=np.float32)
    N, E = scores.shape
    truth = multi_hot(true_experts, E)                          # [N, E]
    n_true = truth.sum(1)
    keep = n_true > 0
    truth, n_true, scores = truth[keep], n_true[keep], scores[keep]
    out: dict = {"tokens": int(keep.sum())}
    if not keep.any():
        return out
    order = np.argsort(-scores, axis=1, kind="stable")          # [N, E] best first; ties -> lower expert id
    hit_sorted = np.take_along_axis(truth, order, axis=1)       # [N, E] was the r-th best a true expert?
    hits_at = np.cumsum(hit_sorted, axis=1)                     # [N, E] hits within the first r+1
    for k in ks:
        hits = hits_at[:, k - 1]
        out[f"recall@{k}"] = float((hits / n_true).mean())
        out[f"precision@{k}"] = float((hits / k).mean())
        out[f"covered@{k}"] = float((hits == n_true).mean())
    return out


def gate_reuse_scores(hidden: np.ndarray, router: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """[N, D] MoE inputs of the source layer @ [E, D] router of the target layer -> [N, E] logits."""
    logits = hidden.astype(np.float32) @ router.astype(np.float32).T
    if bias is not None:
        logits = logits + bias.astype(np.float32)
    return logits


def frequency_scores(train_experts: np.ndarray, num_experts: int, n: int) -> np.ndarray:
    """The training split's expert popularity at one layer ([M, K] ids), repeated for n tokens -> [n, E]."""
    counts = multi_hot(train_experts, num_experts).sum(0).astype(np.float32)
    return np.broadcast_to(counts, (n, num_experts))


def mean_metrics(rows: list[dict]) -> dict:
    """Token-weighted mean of several set_metrics dicts (e.g. over layers)."""
    rows = [r for r in rows if r.get("tokens", 0) > 0]
    if not rows:
        return {"tokens": 0}
    total = sum(r["tokens"] for r in rows)
    keys = [k for k in rows[0] if k != "tokens"]
    out = {k: float(sum(r[k] * r["tokens"] for r in rows) / total) for k in keys}
    out["tokens"] = int(total)
    return out
