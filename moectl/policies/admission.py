"""Prefetch admission: issue a predicted copy only when it pays for itself (shared by runtime and simulator).

On a PCIe-bound setup a prefetch is not free. The copy engine runs one transfer at a time, in chunks of at most
`runtime/loader.py: CHUNK_BYTES` (a row range of one weight matrix); a demand load overtakes a started prefetch at
the next chunk boundary and the prefetch keeps what it copied. So a prefetch helps by the part of its copy that
runs while the engine would otherwise be idle, i.e. while the device computes the layers before its target
layer (a demand load stalls compute, so the idle engine time before layer `tl` is the compute time of the layers
in between, minus the copies already queued ahead of this one); if right, that part is saved even when the rest
is not copied yet (the rest is promoted to a demand load). If wrong, it costs the next demand load at most the
chunk in flight, and the resident expert it evicted.

For a candidate (confidence p, copy time c, chunk time k, target `layers_ahead` layers away):

    window  = layers_ahead x (attention + max(q x top-k expert compute, m x CPU expert compute))
                                                  the engine's idle time per layer: attention always (a layer's
                                                  demand loads start after its router), its experts' compute only
                                                  in layers without a demand load (q: the running share of such
                                                  layers, `layer_done`); with misses computed on the CPU, the
                                                  CPU's share of a layer (m: its running mean of CPU misses).
                                                  Less that compute share when the layer that just routed fetches
                                                  a miss (`loading`): its experts run as its copies land
    hidden  = clamp(window - backlog, 0, c)       load time it hides if right; backlog = copy-engine time
                                                  committed ahead of it (the chunk or demand loads in flight,
                                                  earlier prefetches)
    miss    = c, or the CPU compute e             what the miss it prevents costs: a copy, or where the
                                                  placement computes misses on the CPU (`--cpu-experts`), e
    saving  = p x max(miss - (c - hidden), 0)     a right copy still c - hidden from landing when its layer runs
                                                  is waited for, or its expert computed on the CPU anyway: with
                                                  misses fetched that is p x hidden (a partly copied right
                                                  prefetch saves the part it copied); with misses on the CPU a copy
                                                  saves only when it lands within e of its layer
    cost    = (1 - p) x engine                    if wrong, its copy time outside the idle window, c - hidden,
                                                  delays what would run then: with misses fetched, demand loads,
                                                  which overtake it after the chunk in flight (engine =
                                                  min(c - hidden, k)); with misses on the CPU, the fills (CPU-computed
                                                  misses copied in only while the engine has nothing committed),
                                                  which it keeps out (engine = c - hidden)
            + (1 - p) x victim x miss             and it evicted a resident expert that may be needed again
                                                  (`victim`, a reuse guess; with misses on the CPU a free slot
                                                  counts too: fills would take it). A right copy evicts the victim
                                                  its demand miss would have evicted anyway ...
            + p x co_chosen x miss                ... unless that victim is another expert the same layer is about
                                                  to choose (a demand load's chunk is pinned)
    admit   <=> hidden > 0 and saving > cost + floor x miss
                                                  (floor 0.1: a marginal copy changes the cache's trajectory
                                                  by +-0.1 % either way; it is not worth that noise)

`hidden > 0` is the cap on in-flight prefetches: once the copies queued for the engine fill the time left before
the target layer runs, nothing more is admitted for it. A candidate already resident costs no copy: the driver
protects it without asking. (With one chunk per copy, `chunk_s=None`, a wrong copy delays demand loads by all of
c - hidden: the rule for an engine that never interrupts a copy.)

Confidence: predictors' scores are not all probabilities (gate-reuse and EAM give a distribution over
experts, of which top-k are chosen), and a prediction of an expert that is not resident is right far less
often than the predictor's average. So `confidence(score)` is calibrated online: the driver reports, for
every prediction of a missing expert (admitted or not), whether its layer then chose it (`outcome`), and the
confidence of a score is the smoothed hit ratio of its score bucket (prior: half the score, worth 8
outcomes, so the first copies wait for evidence). A staged copy (misses fetched) is judged on `pessimism` (1)
posterior standard deviations below that ratio: its cost is small and sure, so the risk is the estimate of p, and a
bucket has to show that it pays before its copies are issued; a copy into a slot keeps the mean (its risk is the
cascade of what it evicts, and the bound made copies into slots slower on the tune traces: docs/benchmarks.md).

No device code: the driver supplies times from the cost model (`moectl/sim/cost.py`). `PrefetchGate` is the
driver side both drivers share (simulator and runtime make the same calls in the same order): which predictions
are only protected, which are offered to the rule, and the outcomes that calibrate it.
"""

from __future__ import annotations

import numpy as np

from ..core.cache_model import FULL
from .placement import CPU, ComputePlacement

ADMISSION_MODES = ("on", "off")


class AdmitAll:
    """`--admission off`: every prediction is issued (the behaviour before admission existed)."""

    name = "off"
    learns = False                                 # outcomes and layer times change nothing (drivers may skip them)
    cpu_expert_s = None                            # misses are fetched

    def admit(self, score: float, copy_s: float, layers_ahead: int, backlog_s: float, evicts: bool = True,
              co_chosen: float = 0.0, loading: bool = False) -> bool:
        return True

    def outcome(self, score: float, chosen: bool) -> None:
        pass

    def layer_done(self, demand_loads: int, cpu_experts: int = 0) -> None:
        pass

    def describe(self) -> str:
        return "prefetch admission: off"


class PrefetchAdmission(AdmitAll):
    """The expected-saving vs expected-cost rule above. `attention_s` / `experts_s`: a decode layer's
    attention time and its top-k resident experts' compute time, from the cost model; `victim`: the chance an
    evicted resident is needed again before it would have left anyway; `cpu_expert_s`: one missed expert's CPU
    compute when the placement computes misses on the CPU (`--cpu-experts`), None when misses are fetched;
    `chunk_s`: the copy engine's largest chunk (`make_admission`: the loader's cut of one expert)."""

    name = "on"
    learns = True

    def __init__(self, attention_s: float, experts_s: float, victim: float = 1.0, buckets: int = 10,
                 prior: float = 8.0, decay: float = 0.99, trust: float = 0.5, margin: float = 1.0, floor: float = 0.1,
                 cpu_expert_s: float | None = None, chunk_s: float | None = None, staged: bool = False,
                 pessimism: float = 1.0):
        self.attention_s, self.experts_s, self.victim, self.prior = attention_s, experts_s, victim, prior
        self.cpu_expert_s = cpu_expert_s           # a miss's cost when the CPU computes it (None: it is fetched)
        self.chunk_s = chunk_s                     # the copy engine's largest chunk (None: a copy is one chunk)
        # prefetches copy into staging buffers, so a wrong one evicts nothing and a right one evicts what its demand
        # miss would have: no victim and no change to the cache's trajectory, when misses are fetched (on the CPU a
        # right one is still installed where a fill might not have been)
        self.staged = staged and cpu_expert_s is None
        self.m = 0.0                               # running mean of CPU-computed misses per layer
        self.n = np.zeros(buckets)                 # predictions per score bucket
        self.hit = np.zeros(buckets)               # ... whose layer then chose the expert
        self.q, self.decay = 0.5, decay            # running share of layers without a demand load
        self.trust = trust                         # prior confidence = trust x score, until outcomes come in
        self.margin = margin                       # the saving must beat the cost this many times
        self.floor = floor                         # ... and by at least this share of a miss's cost
        self.pessimism = pessimism                 # a staged copy's confidence: this many posterior sd below the mean

    @property
    def compute_s(self) -> float:
        """A layer's expert time the copy engine idles through (expected)."""
        return max(self.q * self.experts_s, self.m * (self.cpu_expert_s or 0.0))

    @property
    def layer_s(self) -> float:
        return self.attention_s + self.compute_s

    def layer_done(self, demand_loads: int, cpu_experts: int = 0) -> None:
        """A decode layer ran with `demand_loads` copies it waited for and `cpu_experts` misses the CPU computed."""
        self.q = self.decay * self.q + (1 - self.decay) * (demand_loads == 0)
        self.m = self.decay * self.m + (1 - self.decay) * cpu_experts

    def _bucket(self, score: float) -> int:
        return int(min(max(score, 0.0), 1.0 - 1e-9) * len(self.n))

    def confidence(self, score: float, pessimism: float = 0.0) -> float:
        """The chance a prediction with this score is right: its bucket's smoothed hit ratio (the mean of a Beta
        posterior), less `pessimism` standard deviations of that posterior (a bucket with few outcomes is
        uncertain)."""
        b = self._bucket(score)
        prior = min(max(score, 0.0), 1.0) * self.trust
        n = self.n[b] + self.prior
        mean = (self.hit[b] + self.prior * prior) / n
        return float(max(mean - pessimism * (mean * (1 - mean) / (n + 1)) ** 0.5, 0.0))

    def outcome(self, score: float, chosen: bool) -> None:
        b = self._bucket(score)
        self.n[b] += 1
        self.hit[b] += bool(chosen)

    def admit(self, score: float, copy_s: float, layers_ahead: int, backlog_s: float, evicts: bool = True,
              co_chosen: float = 0.0, loading: bool = False) -> bool:
        p = self.confidence(score, self.pessimism if self.staged else 0.0)
        window = layers_ahead * self.layer_s - (self.compute_s if loading else 0.0)
        hidden = min(max(window - backlog_s, 0.0), copy_s)
        if hidden <= 0.0:
            return False
        miss = copy_s if self.cpu_expert_s is None else self.cpu_expert_s
        # with misses on the CPU a free slot is not free: the fills (CPU-computed misses copied in while the
        # engine idles) take it, so a copy into it displaces a recently used expert as an eviction would
        evicts = evicts or self.cpu_expert_s is not None
        # a right copy evicts the victim its demand miss would have, unless that is another expert the same layer is
        # about to choose (`co_chosen`: that chance, from the driver; a demand load's chunk is pinned)
        victim = ((1 - p) * self.victim + p * co_chosen) * miss if evicts and not self.staged else 0.0
        # a wrong copy's engine time outside the idle window before its layer: with misses fetched, a demand load
        # overtakes it after the chunk in flight; with misses on the CPU, fills wait for it: all of it is lost
        engine = copy_s - hidden
        if self.cpu_expert_s is None and self.chunk_s is not None:
            engine = min(engine, self.chunk_s)
        cost = (1 - p) * engine + victim
        saving = p * max(miss - (copy_s - hidden), 0.0)
        # the floor prices a copy's change to the cache's trajectory: a staged copy makes none
        return saving > self.margin * cost + (0.0 if self.staged else self.floor) * miss

    def describe(self) -> str:
        return "prefetch admission: on (expected saving > expected copy-engine cost, capped by time left)"


class PrefetchGate:
    """Between a prefetch policy's predictions and the copy engine, for the simulator and the runtime alike.

    `offer` takes one batch of predictions (target layer, expert, score) made after layer `layer` (-1: after the
    previous token): resident ones first (`CacheState.resident_first`); a resident one is protected with no copy; a
    missing one is remembered for calibration and copied if the admission rule admits it, each admitted copy adding
    its time to the backlog the next candidate sees. `route` reports, when a layer's router has run, whether each
    remembered prediction for it was chosen (`outcome`); `reset` forgets them at a new request."""

    def __init__(self, admission: AdmitAll | None = None, top_k: int = 1, max_per_layer: int | None = None):
        self.admission = admission if admission is not None else AdmitAll()
        self.top_k, self.max_per_layer = top_k, max_per_layer
        self.pending: dict[int, list[tuple[int, float]]] = {}      # target layer -> [(expert, score)] not resident

    def reset(self) -> None:
        self.pending.clear()

    def route(self, layer: int, chosen) -> None:
        chosen = set(chosen)
        for e, score in self.pending.pop(layer, []):
            self.admission.outcome(score, e in chosen)

    def layer_done(self, demand_loads: int, cpu_experts: int = 0) -> None:
        self.admission.layer_done(demand_loads, cpu_experts)

    def offer(self, state, layer: int, preds, copy_s: float, backlog_s: float, issue, precision: str = FULL,
              routed=()) -> int:
        """`state`: the CacheState; `copy_s`: one expert's copy time in `precision` (the pool prefetches load);
        `backlog_s`: copy-engine time committed now; `issue(tl, e, held)`: held = the precision of a resident copy
        (protect it, no copy) or None (copy it into `precision`'s pool; True when a copy was queued);
        `routed`: the experts `layer` chose. Returns the copies queued."""
        per_layer: dict[int, int] = {}
        queued = 0
        # the layer that just routed fetches a miss: its compute overlaps its own copies, not idle engine time
        loading = self.admission.cpu_expert_s is None and layer >= 0 and any(
            not any(state.contains(layer, int(e), p) for p in state.counts) for e in routed)
        for tl, e, score in state.resident_first(preds):
            tl, e = int(tl), int(e)
            if not (layer < tl < state.num_layers):
                continue
            if self.max_per_layer is not None and per_layer.get(tl, 0) >= self.max_per_layer:
                continue
            per_layer[tl] = per_layer.get(tl, 0) + 1
            held = next((p for p in state.counts if state.contains(tl, e, p)), None)
            if held is not None:
                issue(tl, e, held)                                  # protect only: no copy
                continue
            # calibrate on the candidates admission judges: a predicted expert that is not resident is right far
            # less often than one that is
            self.pending.setdefault(tl, []).append((e, float(score)))
            full = len(state.resident(tl, precision)) >= state.capacity(tl, precision)
            # the chance its victim is another expert this layer then chooses: (k - 1) of S slots, quartered as
            # replacement evicts the coldest resident and a token's other experts are mostly hot ones
            co_chosen = min(1.0, 0.25 * (self.top_k - 1) / state.capacity(tl, precision))
            if not self.admission.admit(float(score), copy_s, max(tl - max(layer, 0), 1), backlog_s, evicts=full,
                                        co_chosen=co_chosen, loading=loading):
                continue
            if issue(tl, e, None):
                backlog_s += copy_s
                queued += 1
        return queued


STAGING_BUFFERS = 2          # prefetch staging buffers per pool (the streamed prefill's two, reused in decode)


def prefetch_staging(cpu_experts: str = "never") -> int:
    """Staging buffers prefetches copy into (0: into cache slots, evicting), by where misses run. Misses fetched: a
    staged prefetch never evicts, so the cache evolves as without prefetch and a prediction costs only copy-engine
    time (`CacheState`, "staging"). Misses on the CPU (`--cpu-experts auto|always`): into slots, where a right copy
    is resident at once and the admission rule prices the fills it displaces (`bench/admission.py`: staged copies
    were slower there on the tune traces)."""
    return STAGING_BUFFERS if cpu_experts == "never" else 0


def make_admission(mode: str, cost=None, top_k: int = 1, context: int = 512, cpu_experts: str = "never",
                   staged: bool = False, **kw) -> AdmitAll:
    """The rule behind `--admission on|off`; times from `cost` (moectl/sim/cost.py); `cpu_experts` the
    placement mode (never | auto | always: what a prevented miss would have cost)."""
    from ..errors import MoectlError

    if mode == "off":
        return AdmitAll()
    if mode == "on":
        if cost is None:
            raise MoectlError("--admission on needs a cost model (the compute time of a layer)")
        from ..core.copy_chunks import chunk_count  # the copy engine's chunks (no device code)

        on_cpu = ComputePlacement(cpu_experts, cost).decide(1) == CPU          # where a decode miss runs
        return PrefetchAdmission(cost.attention_s(1, context), top_k * cost.expert_s(1),
                                 cpu_expert_s=cost.cpu_expert_s(1) if on_cpu else None,
                                 chunk_s=cost.load_s() / chunk_count(cost.expert_bytes), staged=staged, **kw)
    raise MoectlError(f"unknown --admission {mode!r}; choose one of {', '.join(ADMISSION_MODES)}")
