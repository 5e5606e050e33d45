"""Prefetch admission: issue a predicted copy only when it pays for itself (shared by runtime and simulator).

On a PCIe-bound setup a prefetch is not free. The copy engine runs one transfer at a time and a started one
is never interrupted, so a prefetch occupies the engine that the next demand load needs. It helps only by
the part of its copy that runs while the engine would otherwise be idle, i.e. while the device computes the
layers before its target layer (a demand load stalls compute, so the idle engine time before layer `tl` is
the compute time of the layers in between, minus the copies already queued ahead of this one).

For a candidate (confidence p, copy time c, target `layers_ahead` layers away):

    window  = layers_ahead x (attention + q x top-k expert compute)    the engine's idle time per layer:
                                                  attention always (a layer's demand loads start after its
                                                  router), its experts' compute only in layers without a demand
                                                  load (q: the running share of such layers, `layer_done`)
    hidden  = clamp(window - backlog, 0, c)       load time it hides if right; backlog = copy-engine time
                                                  committed ahead of it (in-flight copies, earlier prefetches)
    saving  = p x hidden
    cost    = (1 - p) x (c - hidden)              if wrong, the part of its copy that does not fit in idle
            + (1 - p) x victim x c                engine time delays demand loads; and it evicted a resident
                                                  expert that may be needed again (`victim`, a reuse guess)
            + p x co_chosen x c                   if right, its victim may still be another expert the same
                                                  layer is about to choose (a demand load's chunk is pinned)
    admit   <=> hidden > 0 and saving > cost + floor x c
                                                  (floor 0.1: a marginal copy changes the cache's trajectory
                                                  by +-0.1 % either way; it is not worth that noise)

`hidden > 0` is the cap on in-flight prefetches: once the copies queued for the engine fill the time left
before the target layer runs, nothing more is admitted for it. A candidate already resident costs no copy:
the driver protects it without asking.

Confidence: predictors' scores are not all probabilities (gate-reuse and EAM give a distribution over
experts, of which top-k are chosen), and a prediction of an expert that is not resident is right far less
often than the predictor's average. So `confidence(score)` is calibrated online: the driver reports, for
every prediction of a missing expert (admitted or not), whether its layer then chose it (`outcome`), and the
confidence of a score is the smoothed hit ratio of its score bucket (prior: half the score, worth 8
outcomes, so the first copies wait for evidence).

No device code: the driver supplies times from the cost model (`moectl/sim/cost.py`).
"""

from __future__ import annotations

import numpy as np

ADMISSION_MODES = ("on", "off")


class AdmitAll:
    """`--admission off`: every prediction is issued (the behaviour before admission existed)."""

    name = "off"

    def admit(self, score: float, copy_s: float, layers_ahead: int, backlog_s: float, evicts: bool = True,
              co_chosen: float = 0.0) -> bool:
        return True

    def outcome(self, score: float, chosen: bool) -> None:
        pass

    def layer_done(self, demand_loads: int) -> None:
        pass

    def describe(self) -> str:
        return "prefetch admission: off"


class PrefetchAdmission(AdmitAll):
    """The expected-saving vs expected-cost rule above. `attention_s` / `experts_s`: a decode layer's
    attention time and its top-k resident experts' compute time, from the cost model; `victim`: the chance an
    evicted resident is needed again before it would have left anyway."""

    name = "on"

    def __init__(self, attention_s: float, experts_s: float, victim: float = 1.0, buckets: int = 10,
                 prior: float = 8.0, decay: float = 0.99, fit: float = 0.0, trust: float = 0.5,
                 margin: float = 1.0, floor: float = 0.1):
        self.attention_s, self.experts_s, self.victim, self.prior = attention_s, experts_s, victim, prior
        self.n = np.zeros(buckets)                 # predictions per score bucket
        self.hit = np.zeros(buckets)               # ... whose layer then chose the expert
        self.q, self.decay = 0.5, decay            # running share of layers without a demand load
        self.fit = fit                             # share of the copy that must fit in the time left
        self.trust = trust                         # prior confidence = trust x score, until outcomes come in
        self.margin = margin                       # the saving must beat the cost this many times
        self.floor = floor                         # ... and by at least this share of the copy time

    @property
    def layer_s(self) -> float:
        return self.attention_s + self.q * self.experts_s

    def layer_done(self, demand_loads: int) -> None:
        """A decode layer ran with `demand_loads` copies it waited for."""
        self.q = self.decay * self.q + (1 - self.decay) * (demand_loads == 0)

    def _bucket(self, score: float) -> int:
        return int(min(max(score, 0.0), 1.0 - 1e-9) * len(self.n))

    def confidence(self, score: float) -> float:
        b = self._bucket(score)
        prior = min(max(score, 0.0), 1.0) * self.trust
        return float((self.hit[b] + self.prior * prior) / (self.n[b] + self.prior))

    def outcome(self, score: float, chosen: bool) -> None:
        b = self._bucket(score)
        self.n[b] += 1
        self.hit[b] += bool(chosen)

    def admit(self, score: float, copy_s: float, layers_ahead: int, backlog_s: float, evicts: bool = True,
              co_chosen: float = 0.0) -> bool:
        p = self.confidence(score)
        hidden = min(max(layers_ahead * self.layer_s - backlog_s, 0.0), copy_s)
        if hidden <= 0.0 or hidden < self.fit * copy_s:
            return False
        # a right copy evicts too: unlike a demand load (its chunk pinned) it may take the slot of an expert
        # the same layer is about to choose (`co_chosen`: that chance, from the driver)
        victim = ((1 - p) * self.victim + p * co_chosen) * copy_s if evicts else 0.0
        cost = (1 - p) * (copy_s - hidden) + victim
        return p * hidden > self.margin * cost + self.floor * copy_s

    def describe(self) -> str:
        return "prefetch admission: on (expected saving > expected copy-engine cost, capped by time left)"


def make_admission(mode: str, cost=None, top_k: int = 1, context: int = 512, **kw) -> AdmitAll:
    """The rule behind `--admission on|off`; times from `cost` (moectl/sim/cost.py)."""
    from ..errors import MoectlError

    if mode == "off":
        return AdmitAll()
    if mode == "on":
        if cost is None:
            raise MoectlError("--admission on needs a cost model (the compute time of a layer)")
        return PrefetchAdmission(cost.attention_s(1, context), top_k * cost.expert_s(1), **kw)
    raise MoectlError(f"unknown --admission {mode!r}; choose one of {', '.join(ADMISSION_MODES)}")
