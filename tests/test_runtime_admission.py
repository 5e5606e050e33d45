"""Prefetch admission in the runtime (issue 13): the runtime drives the simulator's gate and rule
(`policies/admission.py`), on the CPU with its own slots (`--emulate-device`).

Costs are fixed (`FixedCost`): a layer's compute (1 s) dwarfs a copy (1 ms), so every copy would fit in the time
left and admission decides by calibrated confidence and the eviction terms alone, which the shared cache model
makes identical in the runtime and the simulator.

Legend: L = MoE layers, E = experts, K = top-k.
"""

from __future__ import annotations

import json

import pytest
import torch

from moectl.errors import MoectlError
from moectl.policies.base import PrefetchPolicy
from moectl.sim.cost import FixedCost

PROMPT = "The cache keeps recently used experts close to the compute."
# The decode tests need a run whose routing changes from token to token, so that right predictions find their experts
# missing; how much the routing of one prompt changes is a property of the training run (one model routes PROMPT's
# decode to the same two experts of layer 1 throughout), so `reference` takes the prompt of these that misses most.
PROMPTS = (PROMPT, "def bisect_left(a, x, lo=0, hi=None):", "class Counter(dict):",
           "Return a new sorted list from the items in iterable.", "The os.path module")


class Routing:
    """Observer: the decode routing of one run, [(layer, experts)] in the order the layers ran."""

    def __init__(self):
        self.rows = []

    def on_route(self, layer, top_k_index, top_k_weights, hidden):
        if top_k_index.shape[0] == 1:
            self.rows.append((layer, sorted(top_k_index[0].tolist())))


class Scripted(PrefetchPolicy):
    """After layer l of decode step i: the experts layer l+1 will choose (known from a recorded run) at score
    `right`, and one it will not choose at score `wrong`. Given the cache's `state` (`_run` sets it), the wrong one
    is never resident when predicted: a resident prediction is only protected, never copied, and the protection keeps
    it resident, so a wrong prediction that names a resident expert once names it for the whole run and is never
    offered to admission (seed 0 kept an expert layer 1 never chooses in decode resident from the prefill on). Of
    the experts left, the one layer l+1 chooses least often in the recorded run (then the lowest index). Without a
    state (the simulator's copy) only that order decides."""

    name = "scripted"

    def __init__(self, future: list[tuple[int, list[int]]], num_layers: int, num_experts: int,
                 right: float = 0.95, wrong: float = 0.05):
        self.future, self.L, self.E, self.right, self.wrong = future, num_layers, num_experts, right, wrong
        self.i = 0
        self.state = None                                       # the CacheState, to predict a missing wrong expert
        self.made: list[tuple[int, int, int, float]] = []       # (call, target, expert, score) handed over
        self.uses = [[0] * num_experts for _ in range(num_layers)]
        for layer, experts in future:
            for e in experts:
                self.uses[layer][e] += 1

    def predict(self, layer):
        row = self.i
        self.i += 1
        if layer + 1 >= self.L or row + 1 >= len(self.future):
            return []
        nxt = self.future[row + 1][1]
        out = [(layer + 1, e, self.right) for e in nxt]
        st = self.state
        out.append((layer + 1, min((e for e in range(self.E) if e not in nxt and not (
                                        st is not None and any(st.contains(layer + 1, e, p) for p in st.counts))),
                                   key=lambda e: (self.uses[layer + 1][e], e)), self.wrong))
        self.made += [(row, *p) for p in out]
        return out


def _load(ckpt, **kw):
    from moectl.runtime.engine import Engine

    return Engine.load(str(ckpt), emulate_device=True, progress=False, threads=1, **kw)


@pytest.fixture(scope="module")
def reference(tiny_small):
    """Tokens and decode routing with no prefetch, the model's size, the fixed costs (a copy of one expert 1 ms, a
    layer's attention 1 s) and the prompt: of `PROMPTS`, the one with the most decode misses in layers 1.. (the
    ones a prediction targets), so that whatever model training made, predictions have missing experts to copy."""
    runs = []
    for prompt in PROMPTS:
        eng = _load(tiny_small, cache_experts=8, prefetch="none")
        obs = Routing()
        eng.add_observer(obs)
        res = eng.generate(prompt, max_new_tokens=24, stop_at_eos=False)
        runs.append((sum(eng.cache.state.per_layer("decode")["misses"][1:]), -len(runs), prompt, res, obs, eng))
    misses, _, prompt, res, obs, eng = max(runs, key=lambda r: r[:2])
    assert misses >= 4, f"no prompt's decode misses in layers 1..: {[(r[2], r[0]) for r in runs]}"
    cost = FixedCost(load=0.001, attention=1.0, expert=0.03, expert_bytes=eng.store.expert_nbytes)
    return res.token_ids, obs.rows, len(eng.cache.slots_per_layer), eng.adapter.num_experts, cost, prompt


def _run(ckpt, reference, admission, staging=None, **kw):
    ids, rows, L, E, cost, prompt = reference
    pf = Scripted(rows, L, E, **kw)
    eng = _load(ckpt, cache_experts=8, prefetch=pf, admission=admission, cost=cost, staging=staging)
    pf.state = eng.cache.state
    issued = []                                     # (call, target, expert) of every copy the cache queued
    real = eng.cache.prefetch

    def spy(layer, expert):
        ok = real(layer, expert)
        if ok:
            issued.append((pf.i - 1, layer, expert))
        return ok
    eng.cache.prefetch = spy
    res = eng.generate(prompt, max_new_tokens=24, stop_at_eos=False)
    return res, pf, issued, eng


def test_admission_copies_confident_predictions_and_not_unlikely_ones(tiny_small, reference):
    """Prefetches into slots (`staging=0`), where a wrong copy evicts a resident expert."""
    ids = reference[0]
    off, pf_off, issued_off, _ = _run(tiny_small, reference, "off", staging=0)
    on, pf_on, issued_on, eng = _run(tiny_small, reference, "on", staging=0)
    # the wrong expert predicted depends on what is resident, so each run's own predictions
    wrong_off = {(i, t, e) for i, t, e, s in pf_off.made if s < 0.5}
    wrong = {(i, t, e) for i, t, e, s in pf_on.made if s < 0.5}
    right = {(i, t, e) for i, t, e, s in pf_on.made if s > 0.5}
    # off: every missing prediction is copied, unlikely ones included
    assert any(x in wrong_off for x in issued_off)
    # on: no unlikely (score 0.05, always wrong) prediction is ever copied; confident, always-right ones are
    # (once a few outcomes have calibrated their score bucket), and make decode hits
    assert issued_on and not any(x in wrong for x in issued_on)
    # ... because admission judged and refused every one, not because none reached it: each named a missing expert,
    # so each went to the rule and its outcome (wrong) to its score bucket
    rule = eng.runtime.prefetch_gate.admission
    b = rule._bucket(0.05)
    assert wrong and rule.n[b] == len(wrong) and rule.hit[b] == 0
    assert all(x in right for x in issued_on)
    assert eng.cache.stats.as_dict()["prefetch_used"] == len(issued_on)
    # lossless: the same tokens as without prefetch, either way
    assert on.token_ids == off.token_ids == ids


def test_bytes_loaded_counts_only_copies_that_ran(tiny_small, reference):
    """CPU: a prefetch runs when its expert is used; a wrong one whose slot is reused first never runs, and is
    not counted in bytes_loaded."""
    res, pf, issued, eng = _run(tiny_small, reference, "off", right=0.95, wrong=0.05)
    cache = eng.cache
    cache.loader.drain()
    s = cache.stats.as_dict()
    per_copy = cache.store.expert_nbytes
    issued_bytes = (s["misses"] + s["prefetches"]) * per_copy
    assert s["bytes_loaded"] < issued_bytes                        # some prefetch was cancelled before it ran
    assert s["bytes_loaded"] == s["misses"] * per_copy + s["prefetch_bytes"]
    assert s["prefetch_bytes"] >= s["prefetch_used"] * per_copy    # every used prefetch ran


@pytest.mark.parametrize("staging", [0, 2])
def test_runtime_and_simulator_admit_the_same_predictions(tiny_small, reference, tmp_path, staging):
    """The same scripted predictions (right ones at 0.95, a wrong one at 0.05) through the runtime and through the
    simulator on the trace the runtime recorded, same fixed costs, prefetches into slots or into two staging buffers:
    per layer, the same prefetches, hits, misses and evictions with admission off and on. Admission skipped some
    and admitted some both ways (staged, a copy hides under the 1 s layers whole and a wrong one evicts nothing, but
    a staged copy also waits for its score bucket's evidence: the 0.05 ones, right almost never, are not copied)."""
    from moectl.calib.builtin_corpus import builtin_corpus
    from moectl.calib.profile import run_profile
    from moectl.policies import LRU
    from moectl.policies.admission import make_admission
    from moectl.sim.steps import trace_steps
    from moectl.sim.simulator import Simulator
    from moectl.artifacts.trace_dir import load_trace
    from moectl.core.trace import PREFILL

    texts = builtin_corpus("validation")[:3]
    _, _, L, E, cost, _ = reference
    n = L * E // 2                                                   # half the experts

    def profile(prefetch, out, admission="off"):
        eng = _load(tiny_small, cache_experts=n, prefetch=prefetch, admission=admission, cost=cost, staging=staging)
        run_profile(eng, texts, out, model_name="tiny", dataset="builtin:validation", max_tokens=40, generate=12)
        return eng, load_trace(out)

    _, tr0 = profile("none", tmp_path / "none")
    decode = [r for r in range(len(tr0.phase)) if tr0.phase[r] != PREFILL]
    future = [(l, sorted(int(e) for e in tr0.experts[r, l] if e >= 0)) for r in decode for l in range(L)]
    counts = {}
    for adm in ("off", "on"):
        eng, tr = profile(Scripted(future, L, E), tmp_path / adm, adm)
        assert (tr.experts == tr0.experts).all()                    # prefetch never changes the routing
        runtime = eng.cache.state.per_layer("decode")
        assert eng.cache.state.staging == staging
        sim = Simulator([n // L] * L, LRU(), Scripted(future, L, E), cost, staging=staging,
                        admission=make_admission(adm, cost, tr.top_k, staged=staging > 0)).run(trace_steps(tr))
        for k in ("prefetches", "hits", "misses", "evictions"):
            assert sim["cache"]["decode"][k] == runtime[k], (adm, k)
        counts[adm] = sum(runtime["prefetches"])
    assert 0 < counts["on"] < counts["off"]


def test_admission_flag_on_generate(cli, tiny_small, tmp_path, monkeypatch):
    monkeypatch.setenv("MOECTL_HOME", str(tmp_path / "home"))
    base = ["generate", "--model", str(tiny_small), "--prompt", PROMPT, "--max-new-tokens", "8", "--emulate-device",
            "--cache-experts", "8", "--prefetch", "gate-reuse", "--threads", "1", "--json"]
    r = cli(base + ["--admission", "maybe"])       # the console script prints it as error:
    assert isinstance(r.exception, MoectlError) and "--admission" in str(r.exception)
    outs = {}
    for adm in ("off", "on"):
        r = cli(base + ["--admission", adm])
        assert r.exit_code == 0, r.output
        outs[adm] = json.loads(r.stdout.strip().splitlines()[-1])
    assert outs["on"]["text"] == outs["off"]["text"]


def test_runtime_admission_knows_where_its_misses_run(tiny_small, reference):
    """`--cpu-experts` reaches the rule: with misses computed on the CPU a prevented miss is worth its CPU compute
    (the cost model's), with misses fetched it is worth a copy."""
    cost = reference[4]
    slow_copy = FixedCost(load=1.0, attention=1.0, expert=0.03, cpu_expert=0.3, expert_bytes=cost.expert_bytes)
    for mode, want in (("never", None), ("auto", 0.3), ("always", 0.3)):
        eng = _load(tiny_small, cache_experts=8, prefetch="gate-reuse", admission="on", cost=slow_copy,
                    cpu_experts=mode)
        got = eng.runtime.prefetch_gate.admission.cpu_expert_s
        assert got == (None if want is None else pytest.approx(want)), mode
    fast_copy = FixedCost(load=0.001, attention=1.0, expert=0.03, cpu_expert=0.3, expert_bytes=cost.expert_bytes)
    eng = _load(tiny_small, cache_experts=8, prefetch="gate-reuse", admission="on", cost=fast_copy, cpu_experts="auto")
    assert eng.runtime.prefetch_gate.admission.cpu_expert_s is None        # auto fetches: a copy is cheaper


def test_staged_prefetches_leave_the_cache_as_it_is_without_prefetch(tiny_small, reference):
    """Misses fetched (`--cpu-experts never`): a prediction copies into one of two staging buffers, never a slot, and
    one its layer uses is installed as that layer's miss would have been. So with right and wrong predictions alike
    the cache evicts what the run without prefetch evicted and ends with the same residents; a right prediction
    is a hit where that run missed; every slot holds its expert's bytes; the tokens are the same."""
    ids = reference[0]
    base = _load(tiny_small, cache_experts=8, prefetch="none")
    base.generate(reference[5], max_new_tokens=24, stop_at_eos=False)
    res, pf, issued, eng = _run(tiny_small, reference, "off", right=0.95, wrong=0.05)
    cache, c0 = eng.cache, base.cache
    assert cache.state.staging == 2 and c0.state.staging == 0
    assert cache.device_nbytes() == c0.device_nbytes() + 2 * cache.store.expert_nbytes      # the two buffers
    s, s0 = cache.state.per_layer("decode"), c0.state.per_layer("decode")
    assert sum(s["prefetch_used"]) > 0 and sum(s["prefetch_wasted"]) > 0
    assert s["evictions"] == s0["evictions"]
    assert [m + u for m, u in zip(s["misses"], s["prefetch_used"])] == s0["misses"]
    assert cache.state.per_layer("prefill") == c0.state.per_layer("prefill")
    cache.loader.drain()
    for layer in range(len(cache.slots_per_layer)):
        assert sorted(cache.resident(layer)) == sorted(c0.resident(layer))
        for e in cache.resident(layer):
            assert torch.equal(cache.slot_bytes(layer, e), cache.store.host(layer, e))
    assert not cache.state.staged and not cache.stage_jobs                   # nothing left staged after a step
    assert res.token_ids == ids
