"""Speculative decoding's policy side: how often drafts are accepted, and how many tokens to draft next.

Legend: k = drafted tokens in one verification pass (the pass runs k+1 tokens: the last accepted one + k drafts);
p(i) = P(draft i+1 accepted | drafts 1..i accepted), i 0-based.

A verification pass with k drafts produces the accepted prefix plus one token the target model chooses itself
(the correction at the first rejection, or the bonus token after k accepted ones), so in expectation

    tokens(k) = 1 + sum_{j=1..k} prod_{i<j} p(i)

Drafting pays when tokens(k) / ms_pass(k) beats 1 / ms_pass(0) (a plain decode step): `DraftRule` is that rule,
with ms_pass from the cost model (the simulator) or from measured passes (the runtime, through `OnlineDraftRule`);
`FixedDraftRule` drafts a fixed k (both sides).
`pass_order` is the order a pass's experts run in, for the cache's sake (both sides use it).
The runtime measures acceptance with `AcceptanceCounter` and writes it as a versioned JSON file
(`Acceptance.to_json`), which `simulate --acceptance FILE` reads back (`load_acceptance`). No torch, no device code.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..artifacts.versioned import read_parsed
from ..errors import MoectlError

ACCEPTANCE_FORMAT, ACCEPTANCE_VERSION = "moectl-acceptance", 1


@dataclass
class Acceptance:
    """Per-position acceptance of drafted tokens: per_position[i] = P(draft i+1 accepted | drafts 1..i accepted)."""

    per_position: list[float]
    passes: int = 0                        # verification passes it was measured over (0: a constant / assumed)
    source: str = ""                       # "measured: <model fingerprint / run>", "constant 0.85", ...
    fingerprint: str | None = None         # the target model it was measured on, when measured

    def __post_init__(self):
        for i, v in enumerate(self.per_position):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
                raise MoectlError(f"acceptance at position {i + 1} is {v!r}: a probability in [0, 1] is expected")
        self.per_position = [float(v) for v in self.per_position]

    @classmethod
    def constant(cls, p: float) -> "Acceptance":
        """The same acceptance at every position (an assumption, not a measurement)."""
        return cls([p], passes=0, source=f"constant {p:g}")

    def p(self, i: int) -> float:
        """Acceptance at position i (0-based); beyond the list: the last value (0.0 if empty)."""
        if not self.per_position:
            return 0.0
        return self.per_position[min(i, len(self.per_position) - 1)]

    def reach(self, j: int) -> float:
        """P(drafts 1..j all accepted) = prod_{i<j} p(i)."""
        return math.prod(self.p(i) for i in range(j))

    def expected_tokens(self, k: int) -> float:
        """Tokens a pass with k drafts produces on average: 1 + sum_{j=1..k} prod_{i<j} p(i)."""
        return 1.0 + sum(self.reach(j) for j in range(1, k + 1))

    def to_json(self) -> dict:
        d = {"format": ACCEPTANCE_FORMAT, "version": ACCEPTANCE_VERSION, "per_position": list(self.per_position),
             "passes": self.passes, "source": self.source}
        if self.fingerprint is not None:
            d["fingerprint"] = self.fingerprint
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "acceptance") -> "Acceptance":
        """The inverse of `to_json`; format and version checked (a MoectlError naming `where` otherwise)."""
        if not isinstance(d, dict) or d.get("format") != ACCEPTANCE_FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise MoectlError(f"{where} is not an acceptance file: format {got!r}, expected {ACCEPTANCE_FORMAT!r} "
                              f"(written by `bench --draft ... --acceptance-out FILE`)")
        v = d.get("version")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise MoectlError(f"{where}: acceptance version {v!r} is not a positive integer")
        if v > ACCEPTANCE_VERSION:
            raise MoectlError(f"{where}: acceptance format version {v} is newer than this moectl reads "
                              f"({ACCEPTANCE_VERSION}); upgrade moectl or re-measure it")
        per = d.get("per_position")
        if not isinstance(per, list):
            raise MoectlError(f"{where}: `per_position` must be a list of probabilities, got {per!r}")
        passes = d.get("passes", 0)
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 0:
            raise MoectlError(f"{where}: `passes` must be a non-negative integer, got {passes!r}")
        try:
            return cls(per, passes=passes, source=str(d.get("source", "")), fingerprint=d.get("fingerprint"))
        except MoectlError as e:
            raise MoectlError(f"{where}: {e}") from None


def pass_order(rows: list[list[int]]) -> list[int]:
    """The distinct experts a verification pass routes at one layer (`rows`: each token's experts, in token order;
    negative ids ignored), in the order they should run: the experts of the latest tokens last, and of those the
    ones more tokens share last (then by id). A pass loads more experts than one step, and the last to run are what
    the cache keeps (LRU; and `CacheState.chunks` runs resident ones first); the next pass's tokens follow this
    pass's latest ones, whose experts they most likely reuse. Ascending ids instead left the highest ids resident:
    on Mixtral's held-out routing (25 % cached, rtx4090-pcie4, p 0.85, K = 4, 16 acceptance draws) 1.18x -> 1.21x
    over no drafting, expert bytes per token 12.3 -> 11.8 GB."""
    last: dict[int, int] = {}
    uses: dict[int, int] = {}
    for t, row in enumerate(rows):
        for e in row:
            if e >= 0:
                last[e] = t
                uses[e] = uses.get(e, 0) + 1
    return sorted(last, key=lambda e: (last[e], uses[e], e))


def _as_probability(spec) -> float | None:
    """`spec` as a float if it is one (a number or a float-like string), else None."""
    if isinstance(spec, bool):
        return None
    if isinstance(spec, (int, float)):
        return float(spec)
    try:
        return float(str(spec).strip())
    except ValueError:
        return None


def load_acceptance(spec: str | float) -> Acceptance:
    """A float-like string ("0.85") -> a constant acceptance; a path -> the JSON file it names (an acceptance file,
    or a `--json` report holding one under "acceptance"), format/version checked; MoectlError otherwise."""
    p = _as_probability(spec)
    if p is not None:
        if not 0.0 <= p <= 1.0 or math.isnan(p):
            raise MoectlError(f"acceptance {spec!r} is not a probability in [0, 1]")
        return Acceptance.constant(p)
    path = Path(str(spec))
    if not path.is_file():
        raise MoectlError(f"acceptance {spec!r} is neither a probability (e.g. 0.85) nor an existing file")
    d = read_parsed(path, "acceptance file")
    if isinstance(d, dict) and d.get("format") != ACCEPTANCE_FORMAT and isinstance(d.get("acceptance"), dict):
        d = d["acceptance"]                  # a bench/generate --json report: its "acceptance" field
    return Acceptance.from_json(d, where=str(path))


class AcceptanceCounter:
    """Online measurement (runtime; also the simulator when it samples acceptance). Position i is tried in a pass
    that drafted more than i tokens and accepted at least i (its predecessors all matched); it succeeds when the
    pass accepted more than i. Rates are smoothed towards `prior` with `prior_weight` pseudo-trials, so a position
    tried once is not judged 0 or 1."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 1.0, source: str = "measured"):
        self.prior, self.prior_weight, self.source = prior, prior_weight, source
        self.tried: list[int] = []           # per position: passes that tried it
        self.hits: list[int] = []            # per position: passes that accepted it
        self.passes = 0                      # passes with at least one draft
        self.drafted = 0
        self.accepted = 0

    def record(self, drafted: int, accepted: int) -> None:
        """One pass: drafted k tokens, the first `accepted` matched."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        if drafted == 0:
            return
        need = min(accepted + 1, drafted)
        while len(self.tried) < need:
            self.tried.append(0)
            self.hits.append(0)
        for i in range(need):
            self.tried[i] += 1
            self.hits[i] += i < accepted
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted

    def acceptance(self, fingerprint: str | None = None) -> Acceptance:
        """Per-position conditional rates so far (smoothed prior)."""
        w = self.prior_weight
        per = [(h + self.prior * w) / (t + w) for h, t in zip(self.hits, self.tried)]
        return Acceptance(per, passes=self.passes, source=self.source, fingerprint=fingerprint)

    def mean_accepted(self) -> float:
        """Accepted drafts per pass with drafts (0.0 before any)."""
        return self.accepted / self.passes if self.passes else 0.0


class DraftRule:
    """How many tokens to draft next (0 = drafting off): the cost model's rule, used by runtime and simulator alike.
    ms_pass(k): expected ms of one verification pass over k+1 tokens (k=0: a plain decode step), draft included;
    the rule picks k in 0..k_max maximising acceptance.expected_tokens(k) / ms_pass(k), and 0 unless that beats
    a plain step by `margin` (default 1.02)."""

    def __init__(self, k_max: int, margin: float = 1.02):
        if k_max < 0:
            raise MoectlError(f"--draft-tokens must be >= 0, got {k_max}")
        self.k_max, self.margin = k_max, margin

    def rates(self, acceptance: Acceptance, ms_pass: Callable[[int], float]) -> list[float]:
        """Tokens per ms for k = 0..k_max (0.0 where ms_pass is not a positive number)."""
        out = []
        for k in range(self.k_max + 1):
            ms = ms_pass(k)
            ok = isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0
            out.append(acceptance.expected_tokens(k) / ms if ok else 0.0)
        return out

    def choose(self, acceptance: Acceptance, ms_pass: Callable[[int], float]) -> int:
        return self.pick(self.rates(acceptance, ms_pass))

    def pick(self, rates: list[float]) -> int:
        """The rule on tokens per ms already known for k = 0..k_max (e.g. replays that sampled their own
        acceptance): the best k, 0 unless it beats k = 0 by the margin."""
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))      # ties: fewer drafts
        return best if best > 0 and rates[best] > self.margin * rates[0] else 0


class FixedDraftRule:
    """k drafts every pass, whatever they cost (the runtime's `--draft-rule always`, the simulator's fixed
    `--draft-tokens K` and each k of its `cost` replays; measurements). next_k() -> k; record() keeps nothing."""

    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k

    def record(self, k: int, accepted: int, ms: float) -> None:
        pass


class OnlineDraftRule:
    """The runtime's use of DraftRule with measured costs: records each pass (k, accepted, ms incl. drafting);
    ms_pass(k) is the median of the measured passes with k drafts (the last `window` of them, so it follows a
    warming cache), unknown k are explored first, in increasing order (round-robin over k = 0..limit, each tried
    `explore` times before it is judged, so no k is judged on a colder cache than the ones below it; the limit starts
    at 1 and grows while the last k beats the one below it: `_explore_limit`), and the setting not in use is probed again: k = 0
    every `reprobe` passes while drafting is on (its cost drifts too), a drafted k (1..k_max in turn) while it is off
    (so a turned-off draft can come back: fresh acceptance and pass cost), after `reprobe` passes, then twice as
    long after each probe that left it off (up to 8x: a probe of a draft that does not pay costs a whole pass).
    next_k() -> int; record(k, accepted, ms) -> None; counter: AcceptanceCounter."""

    def __init__(self, k_max: int, explore: int = 3, reprobe: int = 32, margin: float = 1.02, window: int = 16):
        self.rule = DraftRule(k_max, margin)
        self.k_max, self.explore, self.reprobe = k_max, explore, reprobe
        self.counter = AcceptanceCounter()
        self.ms: list[deque] = [deque(maxlen=window) for _ in range(k_max + 1)]
        self.seen = [0] * (k_max + 1)        # passes recorded per k (all time)
        self.passes = 0
        self._probe_k = 1                    # the next drafted k a re-probe tries while drafting is off
        self._next_probe = 0                 # pass count at which the next re-probe is due
        self._off_wait = reprobe             # passes until the next re-probe while off (doubles, up to 8 x reprobe)

    def ms_pass(self, k: int) -> float:
        """Measured ms of a pass with k drafts: the median of the last `window` (robust to the cold start's passes,
        which the first exploration round pays; nan while unmeasured)."""
        m = sorted(self.ms[k])
        return float("nan") if not m else (m[len(m) // 2] + m[(len(m) - 1) // 2]) / 2

    def _explore_limit(self) -> int:
        """The largest k worth exploring: 1, then one more while the last explored k beats the one below it. Where
        drafting does not pay, exploring k = 2..k_max too (each a costlier pass) cost a whole request's gain:
        0.80-0.93x of no drafting on the tiny model with every k explored, against about 0.98x this way."""
        limit = 1
        rates = self.rule.rates(self.counter.acceptance(), self.ms_pass)
        while (limit < self.k_max and min(self.seen[limit - 1], self.seen[limit]) >= self.explore
               and rates[limit] > rates[limit - 1]):
            limit += 1
        return limit

    def best_k(self) -> int:
        """The rule's choice on what is measured so far."""
        return self.rule.choose(self.counter.acceptance(), self.ms_pass)

    def next_k(self) -> int:
        if self.k_max == 0:
            return 0
        limit = self._explore_limit()
        least = min(range(limit + 1), key=lambda k: (self.seen[k], k))
        if self.seen[least] < self.explore:     # round-robin: each k sees the cache as warm as the others
            return least
        k = self.best_k()
        if k > 0:
            self._off_wait = self.reprobe
        if self.reprobe <= 0 or self.passes < self._next_probe:
            return k
        if self._next_probe == 0:                # just out of exploration: the first probe is one interval away
            self._next_probe = self.passes + self.reprobe
            return k
        if k > 0:
            self._next_probe = self.passes + self.reprobe
            return 0
        self._next_probe = self.passes + self._off_wait
        self._off_wait = min(2 * self._off_wait, 8 * self.reprobe)
        k, self._probe_k = self._probe_k, self._probe_k % self.k_max + 1
        return k

    def record(self, k: int, accepted: int, ms: float) -> None:
        if not 0 <= k <= self.k_max:
            raise ValueError(f"a pass with {k} drafts, the rule drafts 0..{self.k_max}")
        self.counter.record(k, accepted)
        self.ms[k].append(float(ms))
        self.seen[k] += 1
        self.passes += 1
