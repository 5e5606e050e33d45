"""Speculative decoding, simulated (issue 33): a trace replayed in verification passes.

Legend: k = drafted tokens per pass, L = MoE layers, K = top-k, N = trace rows.

A pass covers the next k+1 decode rows of a request (the last accepted token + k drafts). The trace's rows are the
target model's own tokens, so an accepted draft routes as its row did; a rejected draft's row stands in for the wrong
token it was (its experts are loaded all the same: it was in the pass). Per layer the union of the rows' experts
goes through the decode path once (`Simulator._layer`: the miss rule of policies/miss.py decides hits, fetches, CPU
compute, low-bit, skip), each expert computed for the tokens routed to it (`steps.tokens_of`: the cost model's
multi-token prices, per token on the CPU's side, per expert on the copy's). The pass produces its accepted drafts + 1
tokens (the correction, or the bonus token); the request advances by that many rows, and the rejected rows leave the
context (their KV is rolled back). With k = 0 a pass is exactly the one-token decode step, so no drafting replays as
`simulate` always has.

Acceptance is sampled, not taken in expectation: row r of the trace draws u[r] ~ U(0, 1) once (seeded), and a draft
at position i of its pass that covers row r is accepted when u[r] < p(i) and every earlier draft was. The same draws
serve every k (common random numbers), so runs at different k differ by k, not by luck. What was sampled is
counted (`AcceptanceCounter`) and reported beside the asked acceptance.

The draft's own time comes before its pass, on the compute timeline (the copy engine keeps running): `cached` (the
target drafting itself with its resident experts only, HOBBIT's skip for the rest) costs per drafted token a decode
step's compute with no loads: per layer attention and those of its row's experts resident at the time (the draft
forward of position j runs the pass's row j, and routes as it: an approximation for a draft that goes wrong);
a separate draft model costs `draft_ms` per drafted token (default: a SMALL_DRAFT_PARAMS dense model, its weights read
once per token at the device's memory bandwidth, plus per-layer overhead for SMALL_DRAFT_LAYERS layers).

`auto` (DraftRule, policies/draft_length.py): `cost` replays every k in 0..k_max, takes ms_pass(k) = the mean simulated pass
(draft included) and the tokens its passes produced, and keeps the replay at the k the rule picks (0 unless it beats
a plain step by the margin: so never slower than no drafting on the replayed trace); `online` drives OnlineDraftRule with the simulated pass times, as the runtime drives it
with measured ones (exploration and re-probes included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import MoectlError
from ..policies.draft_length import Acceptance, AcceptanceCounter, DraftRule, FixedDraftRule, OnlineDraftRule
from .simulator import Simulator
from .steps import multi_token_step, trace_steps

DRAFT_SOURCES = ("cached", "model")
DRAFT_RULES = ("cost", "online")
SMALL_DRAFT_PARAMS, SMALL_DRAFT_LAYERS = 0.5e9, 24     # a 0.5B dense draft (Qwen2.5-0.5B-sized)


@dataclass
class DraftSpec:
    """How a replay drafts: `tokens` k per pass (None: auto, the rule picks 0..k_max), the acceptance per position,
    the draft's source (cached | model) and its cost, the auto rule, the RNG seed."""

    tokens: int | None
    acceptance: Acceptance
    source: str = "cached"
    draft_ms: float | None = None         # model: ms per drafted token (None: small_draft_ms)
    k_max: int = 4
    rule: str = "cost"
    seed: int = 0
    margin: float = 1.02

    def __post_init__(self):
        if self.source not in DRAFT_SOURCES:
            raise MoectlError(f"unknown --draft {self.source!r}; the simulator prices {', '.join(DRAFT_SOURCES)} "
                              f"(a separate draft model: `model`, with --draft-ms)")
        if self.rule not in DRAFT_RULES:
            raise MoectlError(f"unknown --draft-rule {self.rule!r}; choose one of {', '.join(DRAFT_RULES)}")
        if self.tokens is not None and self.tokens < 0 or self.k_max < 0:
            raise MoectlError("--draft-tokens must be >= 0 (or auto)")
        if self.draft_ms is not None and self.draft_ms < 0:
            raise MoectlError(f"--draft-ms must be >= 0, got {self.draft_ms:g}")

    def describe(self) -> str:
        k = "auto" if self.tokens is None else str(self.tokens)
        return f"draft {self.source}, k {k}, acceptance {self.acceptance.source or self.acceptance.per_position}"


def parse_draft(tokens: str | None, acceptance: str | None, source: str = "cached", draft_ms: float | None = None,
                k_max: int = 4, rule: str = "cost", seed: int = 0) -> DraftSpec | None:
    """The DraftSpec of the --draft-tokens / --acceptance / --draft / --draft-ms / --draft-max / --draft-rule options
    (simulate, plan-cache); None without --draft-tokens."""
    from ..policies.draft_length import load_acceptance

    if tokens is None:
        if acceptance is not None or draft_ms is not None:
            raise MoectlError("--acceptance / --draft-ms price drafting: give --draft-tokens K (or auto) too")
        return None
    if acceptance is None:
        raise MoectlError("--draft-tokens needs --acceptance P (e.g. 0.85) or the acceptance file the runtime "
                          "measured (`moectl bench --draft ... --acceptance-out FILE`)")
    if str(tokens).strip().lower() == "auto":
        k = None
    elif str(tokens).strip().isdigit():
        k = int(tokens)
    else:
        raise MoectlError(f"--draft-tokens {tokens!r}: give a number of drafted tokens (0, 1, 2, ...) or auto")
    if draft_ms is not None and source == "cached":
        source = "model"                     # a draft time per token is a separate model's
    return DraftSpec(k, load_acceptance(acceptance), source, draft_ms, k_max, rule, seed)


def check_draftable(replacement: str, prefetch: str) -> None:
    """Policies that read the trace's future token by token cannot follow a replay in passes."""
    if replacement == "belady" or prefetch == "oracle":
        raise MoectlError(f"--replacement {replacement} / --prefetch {prefetch} read the future token by token: "
                          f"not with --draft-tokens (the passes regroup the tokens)")


def small_draft_ms(cost) -> float:
    """ms per token of a separate SMALL_DRAFT_PARAMS dense draft model on the cost model's device."""
    return 1e3 * (SMALL_DRAFT_PARAMS * cost.dtype_bytes / cost.mem_bps
                  + SMALL_DRAFT_LAYERS * cost.hw.layer_overhead_ms * 1e-3)


def draft_model_s(cost, spec: DraftSpec) -> float:
    """Seconds a separate draft model takes per drafted token."""
    return (small_draft_ms(cost) if spec.draft_ms is None else spec.draft_ms) / 1e3


def accepted_drafts(u: np.ndarray, acceptance: Acceptance) -> int:
    """Drafts a pass accepts: `u` the draws of its k draft rows; draft i is accepted while u[i] < p(i)."""
    a = 0
    while a < len(u) and u[a] < acceptance.p(a):
        a += 1
    return a


class PassSimulator(Simulator):
    """The Simulator, driven in verification passes (`run_passes`)."""

    def run_passes(self, trace, spec: DraftSpec, chooser, hidden_of=None, final_hidden_of=None) -> dict:
        """Replay `trace` in passes whose k `chooser` gives (next_k / record(k, accepted, ms)); the Simulator's
        results plus the draft's."""
        steps = trace_steps(trace)
        self._start(steps)
        u = np.random.default_rng(spec.seed).random(trace.num_tokens)        # [N] one draw per row, every k
        self.counter = AcceptanceCounter(prior_weight=0.0, source="sampled in the replay")
        self.draft_time, self.n_passes, self.k_used = 0.0, 0, {}
        i = 0
        while i < len(steps):
            step = steps[i]
            if step.prefill:
                self._step(step, hidden_of, final_hidden_of)
                i += 1
                continue
            left = 0                                  # decode rows of this request from here on
            while i + left < len(steps) and not steps[i + left].prefill and steps[i + left].request == step.request:
                left += 1
            k = min(chooser.next_k(), left - 1)
            rows = np.array([s.rows[0] for s in steps[i:i + k + 1]])
            a = accepted_drafts(u[rows[1:]], spec.acceptance)
            t0 = self.clock
            self._draft(spec, trace, rows[:k])
            self._step(step if k == 0 else multi_token_step(trace, rows, step.request, step.first_of_request,
                                                            False, a + 1), hidden_of, final_hidden_of)
            chooser.record(k, a, (self.clock - t0) * 1e3)
            self.counter.record(k, a)
            self.n_passes += 1
            self.k_used[k] = self.k_used.get(k, 0) + 1
            i += a + 1
        return self._results() | self._draft_results(spec)

    def _draft(self, spec: DraftSpec, trace, rows: np.ndarray) -> None:
        """The draft's k tokens, before the pass: forwards of `rows` (the last accepted token, then the drafts but the
        last). `cached`: per layer attention and the row's experts resident now (the others skipped), and the head."""
        if spec.source == "model":
            d = len(rows) * draft_model_s(self.cost, spec)
        else:
            d = 0.0
            for j, row in enumerate(rows):
                for l in range(trace.num_layers):
                    d += self.cost.attention_s(1, self.context + j)
                    for e in trace.experts[row, l]:
                        held = next((p for p in self.pools if e >= 0 and self.state.contains(l, int(e), p)), None)
                        d += self.cost.expert_s(1, self.nbytes[held]) if held else 0.0
                d += self.cost.lm_head_s(1)
        self.clock += d
        self.draft_time += d
        self.compute_only += d

    def _draft_results(self, spec: DraftSpec) -> dict:
        n, p = max(self.decode_tokens, 1), max(self.n_passes, 1)
        return dict(draft=dict(
            source=spec.source, rule="fixed" if spec.tokens is not None else spec.rule, k_max=spec.k_max,
            passes=self.n_passes, tokens_per_pass=self.decode_tokens / p,
            accepted_per_pass=self.counter.accepted / p, drafted_per_pass=self.counter.drafted / p,
            draft_ms_per_token=self.draft_time * 1e3 / n,
            k_passes={int(k): c for k, c in sorted(self.k_used.items())},
            acceptance=spec.acceptance.to_json(), sampled=self.counter.acceptance().per_position))


def run_draft(make_sim, trace, spec: DraftSpec, hidden_of=None, final_hidden_of=None) -> dict:
    """Replay `trace` with drafting `spec` on fresh simulators from `make_sim()` (a PassSimulator per run). A fixed k:
    one replay. auto/online: one replay with OnlineDraftRule. auto/cost: a replay per k in 0..k_max and DraftRule's
    pick kept: tokens per ms of k = the tokens its passes produced (its own sampled acceptance: per pass, the sampled
    rates' expected_tokens exactly) over their simulated time; `draft.by_k` gives every k's figures."""
    def replay(chooser) -> dict:
        return make_sim().run_passes(trace, spec, chooser, hidden_of, final_hidden_of)

    if spec.tokens is not None:
        return replay(FixedDraftRule(spec.tokens))
    if spec.rule == "online":
        return replay(OnlineDraftRule(spec.k_max, margin=spec.margin))
    runs = {k: replay(FixedDraftRule(k)) for k in range(spec.k_max + 1)}

    def ms_pass(k: int) -> float:
        return runs[k]["decode_s"] * 1e3 / max(runs[k]["draft"]["passes"], 1)
    rates = [runs[k]["draft"]["tokens_per_pass"] / ms_pass(k) if ms_pass(k) > 0 else 0.0    # no decode rows: 0
             for k in range(spec.k_max + 1)]
    k = DraftRule(spec.k_max, spec.margin).pick(rates)
    out = runs[k]
    out["draft"]["chosen_k"] = k
    out["draft"]["by_k"] = {j: dict(ms_per_token=r["ms_per_token"], bytes_per_token=r["bytes_per_token"],
                                    ms_per_pass=ms_pass(j), tokens_per_pass=r["draft"]["tokens_per_pass"],
                                    expected_tokens_per_pass=spec.acceptance.expected_tokens(j))
                            for j, r in runs.items()}
    return out


def union_ratio(trace, n: int = 4) -> float:
    """Distinct experts of n consecutive decode tokens over n tokens' experts (per layer, summed over the trace's
    non-overlapping windows of n decode rows of one request): 1.0 = no two tokens share an expert."""
    from ..core.trace import PREFILL

    distinct = total = 0
    for _, sl in trace.request_slices():
        rows = np.arange(sl.start, sl.stop)
        rows = rows[trace.phase[rows] != PREFILL]
        for w in range(0, len(rows) - n + 1, n):
            ex = trace.experts[rows[w:w + n]]                                   # [n, L, K]
            for l in range(trace.num_layers):
                ids = ex[:, l][ex[:, l] >= 0]
                distinct += len(np.unique(ids))
                total += len(ids)
    return distinct / max(total, 1)
