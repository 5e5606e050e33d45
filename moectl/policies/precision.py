"""Precision on a miss: full copy, low-bit copy, or skip (HOBBIT), shared by the runtime and the simulator.

Legend: K = experts a token chose in one layer.

A token's chosen experts are ranked by gate weight; weights are normalised over the K chosen ones. Expert i's
score s_i is the sum of the normalised weights ranked above it (the top-1 scores 0): the more of the token's
mass is already covered, the less a miss of i matters. On a miss (no copy of either precision resident):

    s_i <= T1        -> "full"  (load the full-precision copy)
    T1 < s_i <= T2   -> "low"   (load the low-bit copy)
    s_i > T2         -> "skip"  (drop it; the driver renormalises the rest)

A resident copy of either precision is always used (that is the cache's rule, not this class's). The top-1 is
never skipped. `T1 = 1` never goes low and never skips: output is the lossless one.

No device code: the runtime asks `decide` per missed expert, the simulator per trace row, and both count the
same way.
"""

from __future__ import annotations

from ..core.cache_model import FULL, LOW  # the copies (pool names) a decision picks
from ..errors import MoectlError

SKIP = "skip"


def rank_scores(weights: list[float]) -> list[float]:
    """s_i for each entry of `weights` (one token's chosen experts, any order): the normalised weight of the
    experts ranked above it. Ties keep the given order."""
    total = sum(weights)
    norm = [w / total if total > 0 else 0.0 for w in weights]
    order = sorted(range(len(weights)), key=lambda i: -norm[i])
    s, above = [0.0] * len(weights), 0.0
    for i in order:
        s[i] = above
        above += norm[i]
    return s


class PrecisionPolicy:
    """Always the full-precision copy (no low-bit copies, no skipping)."""

    name = "full"
    uses_lowbit = False

    def decide(self, score: float) -> str:
        """FULL, LOW or SKIP for a missed expert whose rank score is `score`."""
        return FULL

    def decide_token(self, weights: list[float]) -> list[str]:
        """The decision for each of one token's chosen experts (as if each missed)."""
        return [self.decide(s) for s in rank_scores(weights)]

    def describe(self) -> str:
        return "precision: full"


class HobbitPrecision(PrecisionPolicy):
    """HOBBIT's hi/lo/skip thresholds (the seed's Mixtral values are T1 0.6, T2 0.9)."""

    name = "hobbit"
    uses_lowbit = True

    def __init__(self, t1: float = 0.6, t2: float = 0.9):
        if not (0.0 <= t1 <= t2):
            raise MoectlError(f"precision thresholds need 0 <= T1 <= T2, got T1={t1:g} T2={t2:g}")
        self.t1, self.t2 = t1, t2
        self.uses_lowbit = t1 < 1.0

    def decide(self, score: float) -> str:
        if score <= self.t1 + 1e-12:
            return FULL
        if score <= self.t2 + 1e-12:
            return LOW
        return SKIP

    def describe(self) -> str:
        return f"precision: hobbit T1={self.t1:g} T2={self.t2:g}"


class LowbitOnly(PrecisionPolicy):
    """Every expert from its low-bit copy (mixtral-offloading's setup, llama.cpp at q4)."""

    name = "lowbit-only"
    uses_lowbit = True

    def decide(self, score: float) -> str:
        return LOW

    def describe(self) -> str:
        return "precision: low-bit only"


PRECISION_NAMES = ["full", "hobbit", "lowbit-only"]


def make_precision(name: str, t1: float = 0.6, t2: float = 0.9) -> PrecisionPolicy:
    """The policy behind `--precision NAME [--t1 --t2]`."""
    if name == "full":
        return PrecisionPolicy()
    if name == "hobbit":
        return HobbitPrecision(t1, t2)
    if name == "lowbit-only":
        return LowbitOnly()
    raise MoectlError(f"unknown --precision {name!r}; choose one of {', '.join(PRECISION_NAMES)}")
