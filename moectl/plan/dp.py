"""The cache-allocation dynamic program: split a byte budget over layers to minimise the summed stall.

Every layer l offers choices c = (n_hi, n_lo) (slots of full and low-bit precision) with a cost f_l(c)
(expected stall per decode token, seconds, or expected demand loads: any additive unit) and a weight w(c)
in budget units (n_hi x units per full slot + n_lo x units per low-bit slot). AdapMoE's recurrence
(seed_adapmoe.md §4.3, eq. 19), over bytes instead of slot counts:

    F[0][j] = 0                                   (j = 0..C: "at most j units")
    F[i][j] = min_c  F[i-1][j - w(c)] + f_i(c)    over c with w(c) <= j
    answer F[L][C], choices recovered by walking back from (L, C).

Ties go to the choice listed first (fewest bytes first: callers list choices that way), so the result is
deterministic. Time O(L x choices x C) as numpy vector ops over j; memory O(L x C) for the argmins.

Legend: L = layers, C = budget units, M = choices of one layer.
"""

from __future__ import annotations

import numpy as np

from ..errors import MoectlError


def allocate(costs: np.ndarray, weights: np.ndarray, budget: int) -> tuple[list[int], float]:
    """costs [L, M] (np.inf = not allowed), weights [M] integer units, budget C units ->
    (index of the chosen choice per layer, total cost)."""
    costs = np.asarray(costs, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.int64)
    L, M = costs.shape
    C = int(budget)
    F = np.zeros(C + 1)                                  # F[i-1][j]
    arg = np.zeros((L, C + 1), dtype=np.int32)
    for i in range(L):
        best = np.full(C + 1, np.inf)                    # F[i][j]
        pick = np.zeros(C + 1, dtype=np.int32)
        for m in range(M):
            w, f = int(weights[m]), costs[i, m]
            if w > C or not np.isfinite(f):
                continue
            cand = np.full(C + 1, np.inf)
            cand[w:] = F[:C + 1 - w] + f                 # F[i-1][j - w] + f_i(m)
            better = cand < best                         # strict: ties keep the earlier choice
            best[better], pick[better] = cand[better], m
        F, arg[i] = best, pick
    if not np.isfinite(F[C]):
        raise MoectlError(f"no allocation fits {C} budget units with the smallest allowed choice in every layer")
    out, j = [0] * L, C
    for i in range(L - 1, -1, -1):
        out[i] = int(arg[i, j])
        j -= int(weights[out[i]])
    return out, float(F[C])


def allocate_slots(f, num_layers: int, num_experts: int, budget: int, min_slots: int = 1) -> list[int]:
    """Slot counts per layer, one precision: f(layer, t) the cost of t slots (t = min_slots..E)."""
    ts = list(range(min_slots, num_experts + 1))
    costs = np.array([[f(l, t) for t in ts] for l in range(num_layers)])
    idx, _ = allocate(costs, np.array(ts), budget)
    return [ts[i] for i in idx]
