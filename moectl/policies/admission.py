"""Prefetch admission: issue a predicted copy only when it pays for itself (shared by runtime and simulator).

On a PCIe-bound setup a prefetch is not free. The copy engine runs one transfer at a time and a started one
is never interrupted, so a prefetch occupies the engine that the next demand load needs. It helps only by
the part of its copy that runs while the engine would otherwise be idle, i.e. while the device computes the
layers before its target layer (a demand load stalls compute, so the idle engine time before layer `tl` is
the compute time of the layers in between, minus the copies already queued ahead of this one).

For a candidate (confidence p, copy time c, target `layers_ahead` layers away):

    window  = layers_ahead x (compute time of one layer whose experts are resident)
    hidden  = clamp(window - backlog, 0, c)       load time it hides if right; backlog = copy-engine time
                                                  committed ahead of it (in-flight copies, earlier prefetches)
    saving  = p x hidden
    cost    = (1 - p) x (c - hidden)              if wrong, the part of its copy that does not fit in idle
            + (1 - p) x victim x c                engine time delays demand loads; and it evicted a resident
                                                  expert that may be needed again (`victim`, a reuse guess)
    admit   <=> hidden > 0 and saving > cost

`hidden > 0` is the cap on in-flight prefetches: once the copies queued for the engine fill the time left
before the target layer runs, nothing more is admitted for it. A candidate already resident costs no copy:
the driver protects it without asking.

Confidence: predictors' scores are not all probabilities (gate-reuse and EAM give a distribution over
experts, of which top-k are chosen). So `confidence(score)` is calibrated online: the driver reports, for
every prediction (admitted or not), whether its layer then chose it (`outcome`), and the confidence of a
score is the smoothed hit ratio of its score bucket (prior: the score itself).

No device code: the driver supplies times from the cost model (`moectl/sim/cost.py`).
"""

from __future__ import annotations

import numpy as np

ADMISSION_MODES = ("on", "off")


class AdmitAll:
    """`--admission off`: every prediction is issued (the behaviour before admission existed)."""

    name = "off"

    def admit(self, score: float, copy_s: float, layers_ahead: int, backlog_s: float, evicts: bool = True) -> bool:
        return True

    def outcome(self, score: float, chosen: bool) -> None:
        pass

    def describe(self) -> str:
        return "prefetch admission: off"


class PrefetchAdmission(AdmitAll):
    """The expected-saving vs expected-cost rule above. `layer_s`: compute time of one decode layer whose
    experts are resident (attention + top-k experts), from the cost model; `victim`: the chance an evicted
    resident is needed again before it would have left anyway."""

    name = "on"

    def __init__(self, layer_s: float, victim: float = 0.5, buckets: int = 10, prior: float = 4.0):
        self.layer_s, self.victim, self.prior = layer_s, victim, prior
        self.n = np.zeros(buckets)                 # predictions per score bucket
        self.hit = np.zeros(buckets)               # ... whose layer then chose the expert

    def _bucket(self, score: float) -> int:
        return int(min(max(score, 0.0), 1.0 - 1e-9) * len(self.n))

    def confidence(self, score: float) -> float:
        b = self._bucket(score)
        prior = min(max(score, 0.0), 1.0)
        return float((self.hit[b] + self.prior * prior) / (self.n[b] + self.prior))

    def outcome(self, score: float, chosen: bool) -> None:
        b = self._bucket(score)
        self.n[b] += 1
        self.hit[b] += bool(chosen)

    def admit(self, score: float, copy_s: float, layers_ahead: int, backlog_s: float, evicts: bool = True) -> bool:
        p = self.confidence(score)
        hidden = min(max(layers_ahead * self.layer_s - backlog_s, 0.0), copy_s)
        if hidden <= 0.0:
            return False
        cost = (1 - p) * ((copy_s - hidden) + (self.victim * copy_s if evicts else 0.0))
        return p * hidden > cost

    def describe(self) -> str:
        return "prefetch admission: on (expected saving > expected copy-engine cost, capped by time left)"


def make_admission(mode: str, layer_s: float | None = None, **kw) -> AdmitAll:
    from ..errors import MoectlError

    if mode == "off":
        return AdmitAll()
    if mode == "on":
        if layer_s is None:
            raise MoectlError("--admission on needs a cost model (the compute time of a layer)")
        return PrefetchAdmission(layer_s, **kw)
    raise MoectlError(f"unknown --admission {mode!r}; choose one of {', '.join(ADMISSION_MODES)}")
