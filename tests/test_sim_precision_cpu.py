"""Simulator: per-precision pools (HOBBIT hi/lo/skip, lowbit-only), CPU compute of misses overlapping the
device, and prefetch admission, on hand-made traces with fixed costs; `moectl simulate`'s flags for them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moectl.core.cache_model import FULL
from moectl.errors import MoectlError
from moectl.policies import LRU, PrefetchPolicy
from moectl.policies.admission import AdmitAll, PrefetchAdmission, make_admission
from moectl.policies.placement import ComputePlacement
from moectl.policies.precision import LOW, HobbitPrecision, LowbitOnly
from moectl.core.shapes import expert_bytes, load_shape, parse_lowbit
from moectl.sim.cost import CostModel, FixedCost, load_hardware
from moectl.setting.pools import precision_pools
from moectl.sim.steps import trace_steps
from moectl.sim.simulator import Simulator
from moectl.core.trace import DECODE, Trace

NBYTES = {FULL: 1.0, LOW: 0.25}            # a low-bit copy is a quarter of the full one


def make_trace(rows, weights=None, E=8, K=2):
    """rows: per token, per layer, expert ids (top-k order); weights alike (gate weights)."""
    N, L = len(rows), len(rows[0])
    ex = np.full((N, L, K), -1, dtype=np.int16)
    w = np.zeros((N, L, K), dtype=np.float32)
    for n, r in enumerate(rows):
        for l, ids in enumerate(r):
            ex[n, l, : len(ids)] = ids
            if weights is not None:
                w[n, l, : len(ids)] = weights[n][l]
    return Trace("hand-made", L, E, K, ["r0"] * N, np.arange(N, dtype=np.int32),
                 np.full(N, DECODE, dtype=np.uint8), ex, w if weights is not None else None)


def sim(caps, precision=None, placement=None, cost=None, prefetch=None, admission=None):
    pools = caps if isinstance(caps, dict) else {FULL: caps}
    return Simulator(pools, {p: LRU() for p in pools}, prefetch, cost or FixedCost(load=1.0, attention=0.1, expert=0.0),
                     precision=precision, nbytes=NBYTES, placement=placement, admission=admission)


# ----------------------------------------------------------------------------- precision

def test_hobbit_loads_full_low_or_skips_by_rank_score():
    # one layer, three tokens; scores of the 2nd expert = top-1's normalised weight
    tr = make_trace([[[0, 1]], [[2, 3]], [[4, 5]]], [[[0.5, 0.5]], [[0.7, 0.3]], [[0.95, 0.05]]])
    r = sim({FULL: [2], LOW: [2]}, HobbitPrecision(0.6, 0.9)).run(trace_steps(tr))
    # token 0: both full (s = 0, 0.5); token 1: 2 full, 3 low (s = 0.7); token 2: 4 full, 5 skipped (s = 0.95)
    assert r["full_loads_per_token"] == pytest.approx(4 / 3)
    assert r["lowbit_loads_per_token"] == pytest.approx(1 / 3)
    assert r["skipped_per_token"] == pytest.approx(1 / 3)
    assert r["bytes_per_token"] == pytest.approx((4 * 1.0 + 0.25) / 3)
    # per token: attention 0.1, then the loads back to back on one copy engine
    assert r["ms_per_token"] == pytest.approx(1e3 * (0.1 * 3 + 2.0 + 1.25 + 1.0) / 3)


def test_a_resident_copy_of_either_precision_is_used():
    # token 0 loads expert 1 low (s = 0.8); token 1 has expert 1 as its top-1 (would load full): the low copy
    # is resident, so it is a hit, no copy
    tr = make_trace([[[0, 1]], [[1, 0]]], [[[0.8, 0.2]], [[0.8, 0.2]]])
    r = sim({FULL: [2], LOW: [2]}, HobbitPrecision(0.6, 0.9)).run(trace_steps(tr))
    assert r["full_loads_per_token"] == pytest.approx(0.5) and r["lowbit_loads_per_token"] == pytest.approx(0.5)
    assert r["hits"] == 2 and r["demand"] == 2


def test_hobbit_with_t1_one_is_full_precision_only():
    tr = make_trace([[[0, 1]], [[2, 3]]], [[[0.9, 0.1]], [[0.99, 0.01]]])
    full = sim({FULL: [2]}).run(trace_steps(tr))
    hobbit = sim({FULL: [2], LOW: [2]}, HobbitPrecision(1.0, 1.0)).run(trace_steps(tr))
    for k in ("ms_per_token", "bytes_per_token", "full_loads_per_token"):
        assert hobbit[k] == pytest.approx(full[k])
    assert hobbit["lowbit_loads_per_token"] == 0 and hobbit["skipped_per_token"] == 0


def test_lowbit_only_loads_every_miss_low():
    tr = make_trace([[[0, 1], [2, 3]]], [[[0.5, 0.5], [0.9, 0.1]]])
    r = sim({LOW: [2, 2]}, LowbitOnly()).run(trace_steps(tr))
    assert r["lowbit_loads_per_token"] == 4 and r["full_loads_per_token"] == 0
    assert r["bytes_per_token"] == pytest.approx(1.0)
    assert r["ms_per_token"] == pytest.approx(1e3 * (0.1 + 0.5 + 0.1 + 0.5))


def test_precision_pools_split_the_bytes():
    # 4 layers x 4 full slots of 1 byte = 16 bytes; 25 % of it holds 0.25-byte copies
    pools = precision_pools([4] * 4, HobbitPrecision(), 1.0, 0.25, num_experts=8, lowbit_fraction=0.25)
    assert pools == {FULL: [3] * 4, LOW: [4] * 4}          # 12 bytes of full slots; 4 bytes of 0.25-byte slots
    assert precision_pools([4] * 4, LowbitOnly(), 1.0, 0.5, 8) == {LOW: [8] * 4}
    assert precision_pools([4] * 4, HobbitPrecision(), 1.0, 0.25, 8, 0.5)[FULL] == [2] * 4
    assert precision_pools([4] * 4, HobbitPrecision(1.0, 1.0), 1.0, 0.25, 8, 0.5) == {FULL: [4] * 4}   # never low
    with pytest.raises(MoectlError, match="--lowbit"):
        precision_pools([4] * 4, LowbitOnly(), 1.0, None, 8)
    with pytest.raises(MoectlError, match="below one per"):
        precision_pools([1] * 4, HobbitPrecision(), 1.0, 0.25, 8, 0.01)


def test_lowbit_spec_and_bytes():
    assert parse_lowbit("q4g64") == (4, 64) and parse_lowbit("Q2G16") == (2, 16) and parse_lowbit("q3") == (3, 64)
    for bad in ("q5g64", "int4", "q4g0", "4"):
        with pytest.raises(MoectlError, match="q<bits>g<group size>"):
            parse_lowbit(bad)
    shape = load_shape("mixtral")
    n = 3 * 4096 * 14336
    assert expert_bytes(shape, 4, 64) == pytest.approx(n * 0.5 + n / 64 * 4)      # ~99 MB vs 352 MB bf16


def test_budget_keeps_dense_weights_and_kv_reserve():
    from moectl.core.shapes import dense_bytes, kv_reserve_bytes
    from moectl.core.sizing import workspace_bytes
    from moectl.setting.model_sizes import shape_sizes
    from moectl.setting.options import RuntimeOptions
    from moectl.setting.resolve import resolve

    shape = load_shape("mixtral")
    cm = CostModel(load_hardware("rtx4090-pcie4"), shape)
    assert 2.5e9 < dense_bytes(shape) < 3.5e9                # attention + embeddings + head of Mixtral-8x7B
    assert kv_reserve_bytes(shape) == 2 * 32 * 8 * 128 * 4096 * 2
    tr = make_trace([[[0, 1]] * 32])
    def capacities(tr, budget, cost):           # what `simulate --budget` sizes, from the trace's shape
        sizes = shape_sizes(cost.shape, tr.num_layers, tr.num_experts, tr.top_k, expert_nbytes=cost.expert_bytes)
        return resolve(RuntimeOptions(budget=int(budget)), sizes, live=False, trace=tr,
                       expert_nbytes=cost.expert_bytes).pools["full"]

    caps = capacities(tr, budget=20e9, cost=cm)
    left = 20e9 - dense_bytes(shape) - kv_reserve_bytes(shape) - workspace_bytes(shape)     # the runtime's sizing
    assert sum(caps) == int(left // cm.expert_bytes)
    with pytest.raises(MoectlError, match="below the minimum"):
        capacities(tr, budget=4e9, cost=cm)


# ----------------------------------------------------------------------------- CPU compute of misses

def test_cpu_experts_overlap_the_device_within_a_layer():
    # layer 0: expert 0 resident after token 0; token 1 needs 0 (device, 0.03) and 1, 2 (misses on the CPU,
    # 0.3 each, serial): the layer takes attention + max(0.03, 0.6)
    cost = FixedCost(load=1.0, attention=0.1, expert=0.03, cpu_expert=0.3)
    tr = make_trace([[[0]], [[0, 1, 2]]], K=3)
    steps = trace_steps(tr)
    r = Simulator({FULL: [4]}, {FULL: LRU()}, None, cost, nbytes=NBYTES,
                  placement=ComputePlacement("always", cost)).run(steps[:1])
    assert r["cpu_experts_per_token"] == 1 and r["ms_per_token"] == pytest.approx(1e3 * (0.1 + 0.3))
    # the CPU computed expert 0 and, the copy engine being idle, a background copy puts it in the cache; bytes count
    # as chunks run: its first of 2 chunks ran in this one-step run, the second would start after it ends
    assert r["fill_copies_per_token"] == 1 and r["bytes_per_token"] == pytest.approx(0.5)
    # the copy lands 1 s later: the next token (after it landed) finds it resident
    tr2 = make_trace([[[0]], [[]], [[]], [[]], [[]], [[]], [[]], [[]], [[]], [[0, 1, 2]]], K=3)
    r = Simulator({FULL: [4]}, {FULL: LRU()}, None, cost, nbytes=NBYTES,
                  placement=ComputePlacement("always", cost)).run(trace_steps(tr2))
    last = 1e3 * (0.1 + max(0.03, 0.3 + 0.3))
    first = 1e3 * 0.4
    assert r["ms_per_token"] == pytest.approx((first + 8 * 100 + last) / 10)
    assert r["cpu_ms_per_token"] == pytest.approx(1e3 * 0.9 / 10)


def test_a_miss_computed_on_the_cpu_is_a_miss_in_the_hit_rate_and_no_stall_prints_negative():
    """Every miss on the CPU (`always`): the hit rate counts them as misses (it was 1.0: only the device side's
    accesses were counted), the cache's counters say so, a fill is no use; a stall that rounding left at -1e-14 s
    prints as 0, never negative, in simulate's and plan-cache's figures."""
    from moectl.core.cache_model import hit_rate
    from moectl.core.recipes import stall_figure

    cost = FixedCost(load=1.0, attention=0.1, expert=0.03, cpu_expert=0.3)
    # one layer, uses 0 1 | 0 | - | 0: token 0's two misses run on the CPU (0.6 s), and expert 0 is filled in the
    # background (1 s); token 1 finds it resident but landing (a cache hit, late: it waits), token 3 on time
    tr = make_trace([[[0, 1]], [[0]], [[]], [[0]]])
    r = Simulator({FULL: [4]}, {FULL: LRU()}, None, cost, nbytes=NBYTES,
                  placement=ComputePlacement("always", cost)).run(trace_steps(tr))
    dec = {k: sum(v) for k, v in r["cache"]["decode"].items()}
    assert dec["cpu_misses"] == r["cpu_misses"] == 2 and r["cpu_experts_per_token"] * r["decode_tokens"] == 2
    assert (dec["fills"], dec["misses"], dec["hits"]) == (1, 0, 2)      # a fill is a copy, not a use
    assert r["accesses"] == 4 and (r["hits"], r["late"]) == (1, 1)      # four uses; one hit on time, one late
    assert r["hit_rate"] == 1 / 4                                        # on time over uses (was 1 / 2: CPU uncounted)
    assert hit_rate(dec) == 2 / 4                                        # the cache's: a landing copy is resident
    assert r["stall_ms_per_token"] > 0.0
    for residue in (-1.28e-11, -0.0, 0.0, 1.41e-12):        # rounding's, in ms: none is a stall
        assert f"{stall_figure(residue):.3g}" == "0" and f"{stall_figure(residue):.1f}" == "0.0"
    assert stall_figure(2.5) == 2.5 and stall_figure(3e-6) == 3e-6


def test_a_demand_load_overtakes_a_fill_after_one_chunk():
    class FirstOnCpu:                                      # the first miss runs on the CPU, later ones are fetched
        mode = "auto"

        def __init__(self):
            self.n = 0

        def decide(self, *args):
            self.n += 1
            return "cpu" if self.n == 1 else "fetch"
    cost = FixedCost(load=1.0, attention=0.1, expert=0.03, cpu_expert=0.3)
    tr = make_trace([[[0], [1]]], K=1)
    r = Simulator({FULL: [4, 4]}, {FULL: LRU()}, None, cost, nbytes=NBYTES, placement=FirstOnCpu()).run(
        trace_steps(tr))
    # layer 0: expert 0 on the CPU (0.1-0.4), its fill starts at 0.1 (2 chunks of 0.5 s); layer 1 at 0.5 needs
    # expert 1: its demand load waits for the fill's chunk in flight (-> 0.6), not the whole fill (-> 1.1)
    assert r["fill_copies_per_token"] == 1 and r["demand"] == 1
    assert r["ms_per_token"] == pytest.approx(1e3 * (0.6 + 1.0 + 0.03))


def test_cpu_placement_auto_follows_the_cost_model():
    tr = make_trace([[[0, 1]], [[2, 3]]])
    slow_cpu = FixedCost(load=1.0, attention=0.1, expert=0.0, cpu_expert=2.0)
    fast_cpu = FixedCost(load=1.0, attention=0.1, expert=0.0, cpu_expert=0.2)
    fetch = Simulator({FULL: [2]}, {FULL: LRU()}, None, slow_cpu, placement=ComputePlacement("auto", slow_cpu)).run(
        trace_steps(tr))
    cpu = Simulator({FULL: [2]}, {FULL: LRU()}, None, fast_cpu, placement=ComputePlacement("auto", fast_cpu)).run(
        trace_steps(tr))
    assert fetch["cpu_experts_per_token"] == 0 and fetch["ms_per_token"] == pytest.approx(1e3 * 2.1)
    # on the CPU: 2 x 0.2 serial, overlapped with nothing on the device
    assert cpu["cpu_experts_per_token"] == 2 and cpu["ms_per_token"] == pytest.approx(1e3 * 0.5)


def test_cpu_reads_a_lowbit_copy_faster():
    tr = make_trace([[[0, 1]]], [[[0.5, 0.5]]])
    cost = FixedCost(load=1.0, attention=0.1, expert=0.0, cpu_expert=0.4)
    r = Simulator({LOW: [2]}, {LOW: LRU()}, None, cost, precision=LowbitOnly(), nbytes=NBYTES,
                  placement=ComputePlacement("always", cost)).run(trace_steps(tr))
    assert r["cpu_ms_per_token"] == pytest.approx(1e3 * 2 * 0.1)            # 0.4 x 0.25 bytes each


# ----------------------------------------------------------------------------- prefetch admission

class Fixed(PrefetchPolicy):
    def __init__(self, plan, score=1.0):
        self.plan, self.score = plan, score

    def predict(self, layer):
        return [(t, e, self.score) for t, e in self.plan.get(layer, [])]


def test_admission_rule():
    a = PrefetchAdmission(attention_s=0.1, experts_s=0.0, chunk_s=0.05)   # 0.1 s of idle copy engine per layer
    assert a.confidence(1.0) == pytest.approx(0.5)                 # before any outcome: half the score
    for _ in range(100):
        a.outcome(0.95, True)
        a.outcome(0.35, False)
    assert a.confidence(0.95) == pytest.approx((100 + 8 * 0.475) / 108)
    assert a.confidence(0.35) < 0.02
    assert a.admit(0.95, copy_s=0.3, layers_ahead=4, backlog_s=0.0, evicts=False)   # lands in time, sure
    assert not a.admit(0.95, copy_s=0.3, layers_ahead=1, backlog_s=0.1)            # no time left before it
    # 0.1 s hidden of a 0.3 s copy: worth it when right 96 % of the time and the victim is cold
    # (0.096 saved vs 0.014 cost + the floor of 10 % of the copy)...
    assert a.admit(0.95, copy_s=0.3, layers_ahead=2, backlog_s=0.1)
    assert not a.admit(0.95, copy_s=0.3, layers_ahead=2, backlog_s=0.17)           # 0.03 s: below the floor
    # ... not when the slot it takes may hold an expert its layer is about to choose
    assert not a.admit(0.95, copy_s=0.3, layers_ahead=2, backlog_s=0.1, co_chosen=0.5)
    assert not a.admit(0.35, copy_s=0.3, layers_ahead=4, backlog_s=0.0)             # mostly wrong: evicts
    assert isinstance(make_admission("off"), AdmitAll) and AdmitAll().admit(0.0, 9, 1, 9)
    # make_admission: the chunk of the loader's cut of one expert (FixedCost: 1 byte, gate_up and down: 2 chunks)
    assert make_admission("on", FixedCost(load=0.3), 1).chunk_s == pytest.approx(0.15)
    with pytest.raises(MoectlError, match="--admission"):
        make_admission("maybe")


def confident(a, score=0.95, n=100):
    """`a` after `n` predictions at `score`, all right: confidence (n + 8 x score/2) / (n + 8)."""
    for _ in range(n):
        a.outcome(score, True)
    return a


def calibrated(admissions, score, tenths_right, n=100):
    """Each of `admissions` after `n` predictions at `score`, `tenths_right` of every ten right."""
    for a in admissions:
        for i in range(n):
            a.outcome(score, i % 10 < tenths_right)
    return admissions


def test_a_wrong_copy_delays_a_demand_load_by_one_chunk_at_most():
    # right 70 % of the time, 0.1 s hidden of a 0.3 s copy into a free slot: if wrong, the 0.2 s not hidden delays
    # the next demand load -- all of it when a copy is one uninterruptible chunk, one 0.05 s chunk when the engine
    # is chunked (0.068 saved vs 0.065 + the floor, or 0.016 + the floor)
    whole, chunked = calibrated((PrefetchAdmission(0.1, 0.0), PrefetchAdmission(0.1, 0.0, chunk_s=0.05)), 0.75, 7)
    assert chunked.admit(0.75, copy_s=0.3, layers_ahead=1, backlog_s=0.0, evicts=False)
    assert not whole.admit(0.75, copy_s=0.3, layers_ahead=1, backlog_s=0.0, evicts=False)
    # a copy that fits the idle window delays nothing either way
    assert whole.admit(0.75, copy_s=0.3, layers_ahead=3, backlog_s=0.0, evicts=False)


def test_admission_values_a_prevented_cpu_miss_at_its_cpu_compute():
    # 0.1 s of idle engine per layer; a 0.3 s copy two layers ahead hides 0.2 s and lands 0.1 s late
    fetched = confident(PrefetchAdmission(attention_s=0.1, experts_s=0.0))
    assert fetched.admit(0.95, copy_s=0.3, layers_ahead=2, backlog_s=0.0)         # saves 0.2 s of a demand load
    # misses computed on the CPU in 0.05 s: the late copy would be waited for longer than the CPU takes, so
    # the miss is computed on the CPU anyway: it saves nothing (the copy's 0.2 s hidden is not a saving)
    cheap = confident(PrefetchAdmission(attention_s=0.1, experts_s=0.0, cpu_expert_s=0.05))
    assert not cheap.admit(0.95, copy_s=0.3, layers_ahead=2, backlog_s=0.0)
    # a 0.15 s CPU miss: 0.1 s late still beats the CPU by 0.05 s (p x 0.05 > costs + 10 % of 0.15)
    slow = confident(PrefetchAdmission(attention_s=0.1, experts_s=0.0, cpu_expert_s=0.15))
    assert slow.admit(0.95, copy_s=0.3, layers_ahead=2, backlog_s=0.0)
    # landing in time, a right copy saves the whole CPU compute and a wrong one's victim is re-missed on the CPU:
    # both sides scale with the miss, so a copy that fits is judged alike in both placements (confidence ~0.5
    # here: worth it against a cold victim, reuse 0.2, not against a hot one)
    for victim, want in ((0.2, True), (1.0, False)):
        for cpu in (None, 0.05):
            a = PrefetchAdmission(attention_s=0.1, experts_s=0.0, victim=victim, cpu_expert_s=cpu)
            for i in range(90):
                a.outcome(0.65, i % 2 == 0)                       # right half the time
            assert a.admit(0.65, copy_s=0.3, layers_ahead=4, backlog_s=0.0) == want


def test_admission_with_cpu_misses_treats_a_free_slot_as_taken_by_a_fill():
    # right 30 % of the time, a copy that fits into a free slot: free when misses are fetched (nothing evicted,
    # no engine time lost) ...
    fetched, cpu = calibrated((PrefetchAdmission(0.1, 0.0), PrefetchAdmission(0.1, 0.0, cpu_expert_s=0.05)), 0.35, 3)
    assert fetched.admit(0.35, copy_s=0.3, layers_ahead=4, backlog_s=0.0, evicts=False)
    # ... but with misses computed on the CPU the fills would take that slot (the expert just computed): the
    # copy displaces it, and at 30 % that costs more than it saves
    assert not cpu.admit(0.35, copy_s=0.3, layers_ahead=4, backlog_s=0.0, evicts=False)


def test_admission_window_counts_the_cpu_share_of_a_layer():
    a = PrefetchAdmission(attention_s=0.1, experts_s=0.02, decay=0.5, cpu_expert_s=0.2)
    assert a.layer_s == pytest.approx(0.1 + 0.5 * 0.02)                 # q starts at 0.5, no CPU misses yet
    a.layer_done(0, cpu_experts=2)                                       # a layer with 2 misses on the CPU
    assert a.m == pytest.approx(1.0) and a.q == pytest.approx(0.75)
    assert a.layer_s == pytest.approx(0.1 + 1.0 * 0.2)                   # the engine idles while the CPU computes
    assert PrefetchAdmission(0.1, 0.02, decay=0.5).layer_s == pytest.approx(0.11)   # misses fetched: no CPU share


def test_a_layer_fetching_a_miss_leaves_no_idle_compute():
    from moectl.core.cache_model import CacheState
    from moectl.policies.admission import PrefetchGate

    # 0.1 s attention, 0.2 s of expert compute in a layer without demand loads (q = 0.5 at the start)
    a = confident(PrefetchAdmission(attention_s=0.1, experts_s=0.4))
    assert a.layer_s == pytest.approx(0.3)
    assert a.admit(0.95, copy_s=0.6, layers_ahead=2, backlog_s=0.0)                  # hides 0.6 of 0.6
    # the layer that just routed fetches a miss: its experts run as its copies land, so its compute is no idle
    # engine time: 0.1 s hidden of 0.6 one layer ahead, not 0.3 s (one chunk per copy here: a wrong copy's 0.5 s
    # not hidden delays the next layer's loads)
    assert a.admit(0.95, copy_s=0.6, layers_ahead=1, backlog_s=0.0)                  # 0.3 s: saves 0.29
    assert not a.admit(0.95, copy_s=0.6, layers_ahead=1, backlog_s=0.0, loading=True)   # 0.1 s: 0.096 < 0.10
    assert a.admit(0.95, copy_s=0.6, layers_ahead=2, backlog_s=0.0, loading=True)       # 0.4 s

    class Seen(AdmitAll):
        def __init__(self, cpu_expert_s=None):
            self.cpu_expert_s, self.loading = cpu_expert_s, []

        def admit(self, score, copy_s, layers_ahead, backlog_s, evicts=True, co_chosen=0.0, loading=False):
            self.loading.append(loading)
            return False

    st = CacheState([2, 2, 2], LRU())
    st.begin_request("r")
    st.begin_step("decode")
    st.access(0, 1)                                                     # expert 1 of layer 0 resident
    for adm, layer, routed, want in ((Seen(), 0, [1, 5], True), (Seen(), 0, [1], False),
                                     (Seen(cpu_expert_s=0.05), 0, [1, 5], False), (Seen(), -1, [5], False)):
        PrefetchGate(adm, 2).offer(st, layer, [(2, 3, 0.9)], copy_s=0.3, backlog_s=0.0, issue=None, routed=routed)
        assert adm.loading == [want], (layer, routed, adm.cpu_expert_s)


def test_make_admission_knows_where_a_miss_runs():
    cpu_cheaper = FixedCost(load=1.0, attention=0.1, expert=0.03, cpu_expert=0.3)
    copy_cheaper = FixedCost(load=0.1, attention=0.1, expert=0.03, cpu_expert=0.3)
    assert make_admission("on", cpu_cheaper, 1).cpu_expert_s is None                       # --cpu-experts never
    assert make_admission("on", cpu_cheaper, 1, cpu_experts="auto").cpu_expert_s == pytest.approx(0.3)
    assert make_admission("on", copy_cheaper, 1, cpu_experts="auto").cpu_expert_s is None  # auto fetches
    assert make_admission("on", copy_cheaper, 1, cpu_experts="always").cpu_expert_s == pytest.approx(0.3)


def test_admission_drops_a_late_prefetch_and_keeps_a_timely_one():
    cost = FixedCost(load=1.0, attention=0.1, expert=0.0)
    tr = make_trace([[[0], [5]]], K=1)
    off, on = (Simulator([2, 2], LRU(), Fixed({0: [(1, 5)]}), cost, admission=adm).run(trace_steps(tr))
               for adm in (AdmitAll(), make_admission("on", cost, 1)))
    none = Simulator([2, 2], LRU(), None, cost).run(trace_steps(tr))
    # the prefetch of 5 queues behind demand 0 and cannot land before layer 1 runs (0.1 s of compute for a
    # 1 s copy): admission does not issue it
    assert off["prefetch"] == 1 and off["late"] == 1
    assert on["prefetch"] == 0 and on["ms_per_token"] == pytest.approx(none["ms_per_token"])
    timely = make_trace([[[], [], [], [], [5]]], K=1)
    c2 = FixedCost(load=0.3, attention=0.1, expert=0.0)
    r = Simulator([2] * 5, LRU(), Fixed({0: [(4, 5)]}), c2, admission=make_admission("on", c2, 1)).run(
        trace_steps(timely))
    assert r["prefetch"] == 1 and r["hits"] == 1 and r["ms_per_token"] == pytest.approx(500.0)


# ----------------------------------------------------------------------------- the command

def write_jsonl(path, rows, weights):
    lines = [json.dumps({"format": "moe-routing-v1", "model": "mistralai/Mixtral-8x7B-Instruct-v0.1",
                         "num_layers": 32, "num_experts": 8, "top_k": 2})]
    for n, (r, w) in enumerate(zip(rows, weights)):
        lines.append(json.dumps({"request": "r0", "pos": n, "phase": "decode", "experts": r, "weights": w}))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def mixtral_weighted(tmp_path_factory):
    rng = np.random.default_rng(1)
    rows = [[[int(x) for x in rng.choice(8, 2, replace=False)] for _ in range(32)] for _ in range(16)]
    weights = []
    for _ in rows:
        w = rng.uniform(0.5, 1.0, 32)
        weights.append([[float(a), float(1 - a)] for a in w])
    p = tmp_path_factory.mktemp("wtrace") / "m.jsonl"
    write_jsonl(p, rows, weights)
    return p


def test_simulate_precision_cpu_and_admission_flags(cli, mixtral_weighted, tmp_path):
    import yaml

    from moectl.sim.cost import HARDWARE_DIR

    # a CPU that computes q4 experts at its whole DDR bandwidth (the profiles' default share is the one measured
    # beside llama.cpp, sim/cost.py: CPU_Q4_SHARE, at which computing misses on the CPU no longer pays here)
    fast = yaml.safe_load((HARDWARE_DIR / "rtx4090-pcie4.yaml").read_text())
    (tmp_path / "fast-cpu.yaml").write_text(yaml.safe_dump(fast | {"cpu_lowbit_gbps": fast["cpu_mem_gbps"]}))
    base = ["simulate", "-t", str(mixtral_weighted), "--budget", "20GB", "--json"]
    out = {}
    for name, extra in {"full": [], "hobbit": ["--precision", "hobbit", "--lowbit", "q4g64"],
                        "q4": ["--precision", "lowbit-only", "--lowbit", "q4g64"],
                        "q4cpu": ["--precision", "lowbit-only", "--lowbit", "q4g64", "--cpu-experts", "auto",
                                  "--hardware", str(tmp_path / "fast-cpu.yaml")],
                        "eam": ["--prefetch", "eam", "--admission", "on"],
                        "eam-slots": ["--prefetch", "eam", "--admission", "on", "--staging-buffers", "0"]}.items():
        res = cli(base + extra)
        assert res.exit_code == 0, res.output
        out[name] = json.loads(res.stdout)
    full, hobbit, q4, q4cpu = out["full"], out["hobbit"], out["q4"], out["q4cpu"]
    assert full["bytes_per_token"] == pytest.approx(full["demand_loads_per_token"] * 352_321_536)
    assert hobbit["lowbit_loads_per_token"] > 0 and hobbit["bytes_per_token"] < full["bytes_per_token"]
    assert set(hobbit["slots"]) == {"full", "low"} and set(q4["slots"]) == {"low"}
    assert q4["slots"]["low"] > 3 * full["slots"]["full"]                     # ~3.5x as many q4 experts fit
    assert q4["ms_per_token"] < hobbit["ms_per_token"] < full["ms_per_token"]
    assert q4cpu["cpu_experts_per_token"] > 0 and q4cpu["ms_per_token"] < q4["ms_per_token"]
    # admission never makes prefetch slower than none on the same slots. Staged (the default with misses fetched) the
    # two staging buffers come off the budget as the runtime takes them (issue 29: one sizing), two full slots here:
    # compared with no prefetch at the slots left; into slots (no buffers) at the same budget
    eam = out["eam"]
    assert eam["slots"]["full"] == full["slots"]["full"] - 2 and eam["staging_buffers"] == 2
    res = cli(["simulate", "-t", str(mixtral_weighted), "--cache-experts", str(eam["slots"]["full"]), "--json"])
    assert res.exit_code == 0, res.output
    assert eam["ms_per_token"] <= json.loads(res.stdout)["ms_per_token"] + 1e-9
    assert out["eam-slots"]["slots"] == full["slots"]
    assert out["eam-slots"]["ms_per_token"] <= full["ms_per_token"] + 1e-9
    for bad, msg in ((["--lowbit", "q5"], "q<bits>g<group size>"), (["--precision", "hobbit"], "--lowbit"),
                     (["--cpu-experts", "sometimes"], "--cpu-experts"), (["--admission", "yes"], "--admission"),
                     (["--precision", "int4"], "--precision")):
        res = cli(base + bad)
        assert isinstance(res.exception, MoectlError) and msg in str(res.exception), (bad, res.output)


def test_a_prediction_batch_never_evicts_its_own_resident_experts():
    from moectl.core.cache_model import CacheState

    st = CacheState([2], LRU())
    st.access(0, 0)                     # expert 0 least recently used, then 2
    st.access(0, 2)
    batch = [(0, 5, 0.9), (0, 0, 0.8)]  # 5 is missing, 0 resident: 0 is protected before 5 takes a slot
    assert st.resident_first(batch) == [(0, 0, 0.8), (0, 5, 0.9)]
    for tl, e, _ in st.resident_first(batch):
        st.prefetch(tl, e)
    assert sorted(st.resident(0)) == [0, 5]          # 2 went, not the predicted 0
    # the simulator issues in that order: an oracle prefetch then saves the load it predicts
    tr = make_trace([[[0], [1, 2]], [[0], [1, 3]]])
    steps = trace_steps(tr)

    class Oracle(PrefetchPolicy):
        def __init__(self):
            self.i = -1

        def observe(self, layer, chosen, weights=None, hidden=None):
            self.i += layer == 0

        def predict(self, layer):
            return [(1, e, 1.0) for e in steps[self.i].chosen[1]] if layer == 0 else []

    cost = FixedCost(load=1.0, attention=0.1, expert=0.01)
    none = Simulator([2, 2], LRU(), None, cost).run(steps)
    oracle = Simulator([2, 2], LRU(), Oracle(), cost).run(steps)
    assert oracle["demand"] + oracle["prefetch"] == none["demand"] == 4      # right predictions add no copy
    assert oracle["ms_per_token"] < none["ms_per_token"]


def test_a_staged_copy_waits_for_evidence_that_it_pays():
    # staged (misses fetched, a wrong copy evicts nothing): 0.1 s hidden of a 0.3 s copy one layer ahead; if wrong,
    # one 0.05 s chunk delays a demand load. It pays when right more than 1/3 of the time (p x 0.1 > (1 - p) x 0.05)
    def after(n, right, score=0.75, **kw):
        """An admission rule after `n` predictions at `score`, the first `right` of them right."""
        a = PrefetchAdmission(0.1, 0.0, chunk_s=0.05, staged=True, **kw)
        for i in range(n):
            a.outcome(score, i < right)
        return a

    def staged(n, right, pessimism=1.0):
        return after(n, right, pessimism=pessimism).admit(0.75, copy_s=0.3, layers_ahead=1, backlog_s=0.0)

    # 5 right of 12 (+ the prior, 3 of 8): 0.40 on average, but one posterior standard deviation (0.11) below it
    # is 0.29: not enough evidence yet; the mean alone would admit it
    a = after(12, 5)
    assert a.confidence(0.75) == pytest.approx(0.4)
    assert a.confidence(0.75, 1.0) == pytest.approx(0.4 - (0.4 * 0.6 / 21) ** 0.5)
    assert not staged(12, 5) and staged(12, 5, pessimism=0.0)
    # 160 right of 400: the same 0.40, now sure to within 0.024: admitted
    assert staged(400, 160)
    # into cache slots (misses on the CPU) the mean decides: 2 right of 12 at score 0.15 is 0.13 on average, 0.06
    # one deviation below; a copy that fits pays above 0.1 (p x 0.05 > the floor, 10 % of the 0.05 s CPU miss)
    slots = after(12, 2, score=0.15, victim=0.0, cpu_expert_s=0.05)
    assert not slots.staged
    assert slots.confidence(0.15) == pytest.approx(0.13)
    assert slots.admit(0.15, copy_s=0.3, layers_ahead=4, backlog_s=0.0)
