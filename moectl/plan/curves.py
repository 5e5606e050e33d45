"""Per-layer cost curves f_l(n_hi, n_lo): expected critical-path stall (seconds) per decode token of layer l
with n_hi full-precision and n_lo low-bit slots.

Measured (the default when there are traces): the simulator (`moectl/sim/`) replays the model's traces with
the configured replacement, prefetch, gating and precision policies once per grid point, every layer given
the same slots; the stall the simulator measured at each layer (its wait for demand loads and late prefetches,
`stall_ms_per_layer`; with CPU compute of misses, each miss times the cheaper of CPU and copy: planner.py
layer_runner) is that layer's point of the curve, so at an even split the curves sum to the replay's stall.
Pools are per layer and policies keep per-layer state, so a layer's misses depend on its own slots: one uniform
run measures every layer at once. The copy engine is shared, so the plan is replayed whole afterwards
(`predicted` in plan.yaml).
Large E is measured on a grid (every count when E <= 16, else ~12 points spaced geometrically) and linearly
interpolated in between.

Analytic (no traces): AdapMoE's model (seed_adapmoe.md §4.2), experts uniform and independent:
demand loads = a_l x [one expert, (1 - t/E)(1 - beta_l)] + (1 - a_l) x [k experts: expected misses
k (1 - t/E) minus beta_l x P(at least one miss), one correctly prefetched expert per layer];
for k = 2 this is exactly eqs. 11-15. a_l = single-expert ratio (0 without gating), beta_l = prefetch
accuracy (DEFAULT_BETA after layer 0 when prefetching, the seed's "about 90 % for most layers"; 0 without).

Legend: L = layers, H = grid points of n_hi, W = grid points of n_lo, M = choices of one layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

DEFAULT_BETA = 0.9
MAX_EXACT = 16              # every slot count measured up to here, a grid beyond


def slot_grid(num_experts: int, points: int = 12, start: int = 1) -> list[int]:
    """Slot counts to measure: all of start..E when E <= MAX_EXACT, else ~`points` spread geometrically."""
    if num_experts <= MAX_EXACT:
        return list(range(start, num_experts + 1))
    g = np.unique(np.round(np.geomspace(max(start, 1), num_experts, points)).astype(int))
    return sorted({start, *g.tolist(), num_experts})


def coarse_grid(num_experts: int, points: int = 5) -> list[int]:
    """Fewer points for the two-precision grid (its runs multiply): 1..E-1 spaced geometrically."""
    top = max(num_experts - 1, 1)
    return sorted({int(x) for x in np.unique(np.round(np.geomspace(1, top, points)))})


@dataclass
class Curves:
    hi: list[int]                  # grid of n_hi
    lo: list[int]                  # grid of n_lo ([0]: no low-bit pool)
    stall: np.ndarray              # [L, H, W] seconds per decode token
    source: str                    # "measured (...)" or "analytic (...)"
    misses: np.ndarray | None = None    # [L, H, W] demand loads per token, measured

    def at(self, layer: int, n_hi: float, n_lo: float = 0) -> float:
        """Bilinear interpolation on the grid (clamped at its ends)."""
        f = self.stall[layer]
        i, wi = _bracket(self.hi, n_hi)
        j, wj = _bracket(self.lo, n_lo)
        i2, j2 = min(i + 1, len(self.hi) - 1), min(j + 1, len(self.lo) - 1)
        top = f[i, j] * (1 - wj) + f[i, j2] * wj
        bot = f[i2, j] * (1 - wj) + f[i2, j2] * wj
        return float(top * (1 - wi) + bot * wi)

    def table(self, choices: list[tuple[int, int]]) -> np.ndarray:
        """[L, M] cost of each (n_hi, n_lo) choice in every layer."""
        return np.array([[self.at(l, h, w) for h, w in choices] for l in range(self.stall.shape[0])])


def _bracket(grid: list[int], x: float) -> tuple[int, float]:
    if len(grid) == 1 or x <= grid[0]:
        return 0, 0.0
    if x >= grid[-1]:
        return len(grid) - 1, 0.0
    i = int(np.searchsorted(grid, x, side="right")) - 1
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


# --------------------------------------------------------------------------- analytic (the seed's model)

def seed_demand_loads(E: int, k: int, t: int, a: float, beta: float) -> float:
    """Expected demand loads of one layer with t slots, experts uniform and independent (AdapMoE eqs. 10-15,
    generalised from top-2 to top-k)."""
    t = min(t, E)
    one = (1 - t / E) * (1 - beta)
    p_all_hit = comb(t, k) / comb(E, k) if t >= k else 0.0
    many = k * (1 - t / E) - beta * (1 - p_all_hit)
    return a * one + (1 - a) * many


def analytic_curves(num_layers: int, num_experts: int, top_k: int, load_s: float,
                    single_ratio: list[float] | None = None, beta: list[float] | None = None,
                    prefetch: bool = True) -> Curves:
    a = single_ratio or [0.0] * num_layers
    b = beta or [0.0 if (l == 0 or not prefetch) else DEFAULT_BETA for l in range(num_layers)]
    hi = list(range(0, num_experts + 1))
    loads = np.array([[[seed_demand_loads(num_experts, top_k, t, a[l], b[l])] for t in hi] for l in range(num_layers)])
    return Curves(hi, [0], loads * load_s, f"analytic (seed AdapMoE model, beta {'profiled' if beta else 'default'})",
                  loads)


# --------------------------------------------------------------------------- measured (the simulator)

def measure_curves(run_uniform, num_layers: int, hi_grid: list[int], lo_grid: list[int] | None = None,
                   progress=None, label: str = "simulator") -> Curves:
    """`run_uniform(n_hi, n_lo)` -> (stall [L] seconds per token, demand loads [L] per token) with every
    layer given n_hi full and n_lo low-bit slots. Grid points whose pools hold nothing are not run."""
    lo_grid = lo_grid or [0]
    stall = np.full((num_layers, len(hi_grid), len(lo_grid)), np.nan)
    loads = np.full_like(stall, np.nan)
    for i, h in enumerate(hi_grid):
        for j, w in enumerate(lo_grid):
            if h + w == 0:
                continue
            s, m = run_uniform(h, w)
            stall[:, i, j], loads[:, i, j] = s, m
            if progress is not None:
                progress()
    _fill_empty(stall), _fill_empty(loads)
    return Curves(list(hi_grid), list(lo_grid), stall, f"measured ({label})", loads)


def _fill_empty(a: np.ndarray) -> None:
    """The (0, 0) point (no slot at all) is not allowed in a plan; give it the next point's value so that
    interpolation near it stays finite."""
    if np.isnan(a[:, 0, 0]).all():
        a[:, 0, 0] = a[:, min(1, a.shape[1] - 1), 0] if a.shape[1] > 1 else a[:, 0, min(1, a.shape[2] - 1)]


def extend_curves(curves: Curves, run_uniform, counts, low: bool = False) -> Curves:
    """The curves with every slot count in `counts` measured (one run each) on the one-precision axis (`low`: the
    low-bit one), so the DP's chosen points are measured, not interpolated."""
    grid = curves.lo if low else curves.hi
    new = sorted(set(int(c) for c in counts) - set(grid))
    if not new:
        return curves
    merged = sorted(set(grid) | set(new))
    shape = list(curves.stall.shape)
    shape[2 if low else 1] = len(merged)
    stall, loads = np.zeros(shape), np.zeros(shape)
    for i, c in enumerate(merged):
        if c in grid:
            k = grid.index(c)
            src = (slice(None), slice(None), k) if low else (slice(None), k, slice(None))
            dst = (slice(None), slice(None), i) if low else (slice(None), i, slice(None))
            stall[dst], loads[dst] = curves.stall[src], curves.misses[src]
        else:
            s, m = run_uniform(0, c) if low else run_uniform(c, 0)
            dst = (slice(None), slice(None), i) if low else (slice(None), i, slice(None))
            stall[dst], loads[dst] = s[:, None], m[:, None]
    return Curves(merged if not low else curves.hi, curves.lo if not low else merged, stall,
                  curves.source + f" + {len(new)} more measured", loads)
