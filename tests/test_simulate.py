"""Simulator timing on hand-made cases, cache sizing, the cost model, and the `moectl simulate` command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from moectl.errors import MoectlError
from moectl.policies import LRU, PrefetchPolicy
from moectl.core.shapes import load_shape
from moectl.sim.cost import CostModel, FixedCost, load_hardware
from moectl.core.sizing import ModelSizes
from moectl.setting.options import RuntimeOptions
from moectl.setting.resolve import resolve
from moectl.sim.simulate import capacities
from moectl.sim.steps import trace_steps
from moectl.sim.simulator import Simulator
from moectl.core.trace import DECODE, PREFILL, Trace

COST = FixedCost(load=1.0, attention=0.1, expert=0.0)


def make_trace(rows, phases=None, E=8, K=1):
    """rows: per token, per layer, list of expert ids."""
    N, L = len(rows), len(rows[0])
    ex = np.full((N, L, K), -1, dtype=np.int16)
    for n, r in enumerate(rows):
        for l, ids in enumerate(r):
            ex[n, l, : len(ids)] = ids
    ph = np.array([PREFILL if p == "p" else DECODE for p in (phases or "d" * N)], dtype=np.uint8)
    return Trace("hand-made", L, E, K, ["r0"] * N, np.arange(N, dtype=np.int32), ph, ex)


class Fixed(PrefetchPolicy):
    """Predicts fixed (target layer, expert) lists after given layers."""

    def __init__(self, plan):
        self.plan = plan

    def predict(self, layer):
        return [(t, e, 1.0) for t, e in self.plan.get(layer, [])]


def run(tr, pf=None, cap=2):
    return Simulator([cap] * tr.num_layers, LRU(), pf, COST).run(trace_steps(tr))


def test_demand_loads_only_no_prefetch():
    r = run(make_trace([[[0], [1]]]))
    # layer 0: attention 0.1, load 1.0 -> 1.1; layer 1: attention -> 1.2, load -> 2.2
    assert r["demand"] == 2 and r["prefetch"] == 0
    assert r["ms_per_token"] == pytest.approx(2200.0)
    assert r["stall_ms_per_token"] == pytest.approx(2000.0)
    assert r["lower_bound_ms_per_token"] == pytest.approx(200.0)


def test_late_prefetch_is_stall_not_demand_load():
    tr = make_trace([[[0], [5]]])
    r = run(tr, Fixed({0: [(1, 5)]}))
    # demand 0 runs 0.1-1.1; prefetch 5 queued at 0.1 starts 1.1, lands 2.1; layer 1 needs it at 1.2
    assert r["demand"] == 1 and r["prefetch"] == 1 and r["late"] == 1 and r["hits"] == 0
    assert r["ms_per_token"] == pytest.approx(2100.0)
    assert r["stall_ms_per_token"] == pytest.approx(1000.0 + 900.0)
    assert r["wasted_prefetch_fraction"] == 0.0


def test_timely_prefetch_is_a_hit():
    tr = make_trace([[[], [], [], [], [5]]])           # 4 idle layers: 0.5 s before layer 4 needs expert 5
    cost = FixedCost(load=0.3, attention=0.1, expert=0.0)
    r = Simulator([2] * 5, LRU(), Fixed({0: [(4, 5)]}), cost).run(trace_steps(tr))
    assert r["hits"] == 1 and r["demand"] == 0 and r["stall_ms_per_token"] == pytest.approx(0.0)
    assert r["ms_per_token"] == pytest.approx(500.0)


def test_demand_loads_go_before_queued_prefetches():
    tr = make_trace([[[0], [3], [5, 6]]], K=2)
    r = run(tr, Fixed({0: [(2, 5), (2, 6)]}))
    # A copy is 2 chunks of 0.5 s (gate_up, down: `chunk_count`). 0.1: demand 0 (->1.1); prefetches 5, 6 queued.
    # 1.2: layer 1 needs 3: prefetch 5's first chunk started at 1.1 (->1.6) and is not interrupted; demand 3 goes
    # next (1.6->2.6), ahead of the rest of 5 (2.6->3.1) and of 6. (Before chunks: 5 ran whole, 3 waited to 2.1.)
    # 2.7: layer 2: 5 is late (lands 3.1); 6 has not started: promoted to a demand load (3.1->4.1).
    assert r["demand"] == 3 and r["prefetch"] == 1
    assert r["hits"] == 0 and r["late"] == 1
    assert r["stall_ms_per_layer"][1] == pytest.approx(1400.0)         # 3 waited one chunk behind 5, not all of it
    assert r["ms_per_token"] == pytest.approx(4100.0)


def test_demand_load_waits_at_most_one_chunk_and_the_overtaken_prefetch_keeps_its_progress():
    # chunks of at most 0.1 byte: a copy (1 byte, 1 s) is gate_up 7 + down 4 chunks of 1/11 s (`chunk_count`)
    tr = make_trace([[[0], [], [3], [5]]])
    r = Simulator([2] * 4, LRU(), Fixed({0: [(3, 5)]}), COST, chunk_bytes=0.1).run(trace_steps(tr))
    chunk = 1.0 / 11
    # 0.1: demand 0 (->1.1); prefetch 5 queued. Layer 1 (1.2-1.3) loads nothing: 5 runs from 1.1. 1.3: layer 2
    # needs 3: the chunk of 5 in flight ends first (5 started 1.1: chunks end at 1.1 + k/11; the one in flight at
    # 1.3 ends at 1.1 + 3/11), then demand 3 (1 s); then the rest of 5 (8 chunks) -- the 3 it ran are kept
    end3 = 1.1 + 3 * chunk + 1.0
    assert r["stall_ms_per_layer"][2] == pytest.approx(1e3 * (end3 - 1.3))
    assert end3 - 1.3 - 1.0 <= chunk                        # demand 3 waited less than one chunk
    land5 = end3 + 8 * chunk                                # not end3 + 1 s: the copy went on where it stopped
    assert r["late"] == 1 and r["demand"] == 2 and r["prefetch"] == 1
    assert r["ms_per_token"] == pytest.approx(1e3 * land5)
    # one chunk per matrix (no cap; 2 chunks of 0.5 s here): 3 waits for the chunk of 5 in flight, 1.1->1.6
    whole = Simulator([2] * 4, LRU(), Fixed({0: [(3, 5)]}), COST, chunk_bytes=float("inf")).run(trace_steps(tr))
    assert whole["stall_ms_per_layer"][2] == pytest.approx(1e3 * (1.6 + 1.0 - 1.3))


def test_queued_prefetch_promoted_to_demand_when_needed():
    tr = make_trace([[[0], [4, 7]]], K=2)
    r = run(tr, Fixed({0: [(1, 7), (1, 4)]}))
    # 7 starts at 1.1 (->2.1); 4 still queued when layer 1 runs at 1.2: promoted to a demand load (2.1->3.1)
    assert r["demand"] == 2 and r["prefetch"] == 1 and r["late"] == 1
    assert r["ms_per_token"] == pytest.approx(3100.0)


def test_wasted_prefetch_counted():
    r = run(make_trace([[[0], [1]], [[0], [1]]]), Fixed({0: [(1, 6)]}), cap=3)
    assert r["prefetch"] >= 1 and r["wasted"] == r["prefetch"]
    assert r["wasted_prefetch_fraction"] == 1.0


def test_prefill_is_one_batched_step():
    tr = make_trace([[[0], [1]], [[2], [1]], [[0], [1]]], phases="ppd")
    r = run(tr)
    # prefill loads 0, 2 (layer 0) and 1 (layer 1) once; the decode token then hits both
    assert r["decode_tokens"] == 1 and r["hit_rate"] == 1.0 and r["demand"] == 0
    assert r["prefill_ms"] == pytest.approx(0.1e3 + 2e3 + 0.1e3 + 1e3)


def test_aux_gate_prefetches_the_next_tokens_first_layer():
    from moectl.policies import AuxGatePrefetch

    class Gate:                                            # the aux gate: always says expert 5 first
        def predict_scores(self, final_hidden):
            return np.eye(8)[5]

    tr = make_trace([[[0], [1]], [[5], [1]], [[5], [1]]])
    cost = FixedCost(load=0.3, attention=0.1, expert=0.0, head=0.5)
    steps = trace_steps(tr)
    final = lambda row: np.zeros(4, dtype=np.float32)     # noqa: E731
    r = Simulator([2, 2], LRU(), AuxGatePrefetch(Gate(), per_layer=1), cost).run(steps, final_hidden_of=final)
    # token 0 loads 0 and 1; its final hidden (before the 0.5 s lm_head) prefetches 5, which lands in time
    # for token 1's layer 0. The last token's prediction has no next token in the request: not issued.
    assert r["demand"] == 2 and r["prefetch"] == 1 and r["hits"] == 4 and r["late"] == 0
    assert r["wasted"] == 0
    plain = Simulator([2, 2], LRU(), None, cost).run(steps)
    assert plain["demand"] == 3 and plain["ms_per_token"] > r["ms_per_token"]


def plan_slots(tr, plan):
    """The full-precision slots a replay of `tr` takes from `plan` (the resolver, as `simulate --plan`)."""
    sizes = ModelSizes("t", {}, tr.num_layers, tr.num_experts, tr.top_k, 0, 0)
    return resolve(RuntimeOptions(plan=plan), sizes, live=False, trace=tr, expert_nbytes=1).pools["full"]


def test_capacities():
    tr = make_trace([[[0]] * 5], E=8, K=2)
    assert capacities(tr, fraction=0.5) == [4] * 5
    assert capacities(tr, fraction=0.1) == [2] * 5              # at least top-k
    assert capacities(tr, experts=12) == [3, 3, 2, 2, 2]
    assert plan_slots(tr, {"format": "moectl-plan-v1", "slots": [1, 2, 3, 4, 5]}) == [1, 2, 3, 4, 5]
    with pytest.raises(MoectlError, match="exactly one"):
        capacities(tr, fraction=0.5, experts=10)
    with pytest.raises(MoectlError, match="layers"):
        plan_slots(tr, {"format": "moectl-plan-v1", "slots": [1, 2]})


def test_plan_file_and_fingerprint_mismatch(tmp_path):
    tr = make_trace([[[0]] * 2])
    tr.fingerprint = "mixtral:aaaaaaaaaaaa"
    p = tmp_path / "plan.yaml"
    p.write_text(yaml.safe_dump({"format": "moectl-plan-v1", "fingerprint": "mixtral:aaaaaaaaaaaa", "slots": [3, 1]}))
    assert plan_slots(tr, p) == [3, 1]
    p.write_text(yaml.safe_dump({"format": "moectl-plan-v1", "fingerprint": "mixtral:bbbbbbbbbbbb", "slots": [3, 1]}))
    with pytest.raises(MoectlError, match="made for model"):
        plan_slots(tr, p)
    p.write_text("slots: [1, 1]\n")
    with pytest.raises(MoectlError, match="moectl-plan-v1"):
        plan_slots(tr, p)


def test_mixtral_cost_model_numbers():
    cm = CostModel(load_hardware("rtx4090-pcie4"), load_shape("mixtral"))
    assert cm.expert_bytes == 3 * 4096 * 14336 * 2                    # 352 MB in bf16
    assert cm.load_s() == pytest.approx(352_321_536 / 25e9)           # ~14 ms over PCIe 4.0
    assert 0.3e-3 < cm.expert_s() < 1e-3                              # reading 352 MB at ~750 GB/s
    assert cm.load_s() > 20 * cm.expert_s()                           # why offloading is copy-bound
    for hw in ("rtx3090-pcie4", "a5000-pcie4", "h100-pcie5"):
        assert load_hardware(hw).pcie_gbps > 0
    with pytest.raises(MoectlError, match="unknown hardware"):
        load_hardware("tpu")


# ----------------------------------------------------------------------------- the command

def write_jsonl(path, tr, model="mistralai/Mixtral-8x7B-Instruct-v0.1"):
    lines = [json.dumps({"format": "moe-routing-v1", "model": model, "num_layers": tr.num_layers,
                         "num_experts": tr.num_experts, "top_k": tr.top_k})]
    for n in range(tr.num_tokens):
        lines.append(json.dumps({"request": tr.request[n], "pos": n, "phase": "decode",
                                 "experts": [[int(e) for e in tr.experts[n, l] if e >= 0] for l in range(tr.num_layers)]}))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def mixtral_like(tmp_path_factory):
    rng = np.random.default_rng(0)
    d = tmp_path_factory.mktemp("traces")
    paths = []
    for i in range(2):
        rows = [[list(rng.choice(8, 2, replace=False)) for _ in range(32)] for _ in range(24)]
        tr = make_trace(rows, E=8, K=2)
        p = d / f"m{i}.jsonl"
        write_jsonl(p, tr)
        paths.append(p)
    return paths


def test_simulate_json_fields(cli, mixtral_like):
    res = cli(["simulate", "--trace", str(mixtral_like[0]), "--cache-fraction", "0.5", "--replacement", "lru",
               "--prefetch", "none", "--hardware", "rtx4090-pcie4", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    for k in ("hit_rate", "belady_hit_rate", "demand_loads_per_token", "prefetch_loads_per_token",
              "wasted_prefetch_fraction", "bytes_per_token", "stall_ms_per_token", "ms_per_token",
              "lower_bound_ms_per_token", "tokens"):
        assert k in d
    assert d["tokens"] == 24 and d["hit_rate"] <= d["belady_hit_rate"]
    assert d["bytes_per_token"] == pytest.approx(d["demand_loads_per_token"] * 352_321_536)
    assert d["ms_per_token"] >= d["lower_bound_ms_per_token"]


def test_preload_is_the_planning_traces_hot_set_and_saves_the_first_tokens_misses(cli, mixtral_like, tmp_path):
    """A plan's preload: per layer the experts its trace used most (ties to the lower id), up to the slots; with it
    `simulate --plan` starts warm, so the first tokens miss less than the same slots started empty."""
    from moectl.core.cache_model import hot_experts
    from moectl.artifacts.trace_dir import load_trace

    ex = np.array([[[3, 1]], [[3, 5]], [[1, 3]], [[6, -1]]], dtype=np.int16)      # [N 4, L 1, K 2]
    assert hot_experts(ex, {"full": [2]}) == {"full": [[3, 1]]}       # most used first
    assert hot_experts(ex, {"full": [1], "low": [2]}) == {"full": [[3]], "low": [[1, 5]]}
    plan_tr, judged = load_trace(mixtral_like[0]), load_trace(mixtral_like[1])
    slots = [3] * 32
    hot = hot_experts(plan_tr.experts, {"full": slots})
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"format": "moectl-plan-v1", "slots": slots, "preload": hot,
                                    "policies": {"replacement": "lru", "prefetch": "none"}}))
    cold = tmp_path / "cold.yaml"
    cold.write_text(yaml.safe_dump({"format": "moectl-plan-v1", "slots": slots,
                                    "policies": {"replacement": "lru", "prefetch": "none"}}))
    first = tmp_path / "first.jsonl"                                        # the judged trace's first 4 tokens
    write_jsonl(first, judged.select(slice(0, 4)))
    warm_r, cold_r = (json.loads(cli(["simulate", "--trace", str(first), "--plan", str(p), "--json"]).stdout)
                      for p in (plan, cold))
    assert warm_r["misses"] < cold_r["misses"]
    # token 0 alone: cold misses all 64 of its experts, warm only those outside the hot set
    write_jsonl(first, judged.select(slice(0, 1)))
    token0 = [json.loads(cli(["simulate", "--trace", str(first), "--plan", str(p), "--json"]).stdout)["misses"]
              for p in (plan, cold)]
    outside = sum(int(e) not in hot["full"][l] for l in range(32) for e in judged.experts[0, l])
    assert token0 == [outside, 64] and outside < 64
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"format": "moectl-plan-v1", "slots": slots, "preload": {"full": [[9]] * 32}}))
    res = cli(["simulate", "--trace", str(first), "--plan", str(bad)])
    assert isinstance(res.exception, MoectlError) and "preload" in str(res.exception)


def test_simulate_compare_with_routing_trained_on_other_file(cli, mixtral_like):
    res = cli(["simulate", "--trace", str(mixtral_like[0]), "--train-on", str(mixtral_like[1]),
               "--cache-experts", "128", "--compare", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [(r["replacement"], r["prefetch"]) for r in rows] == [
        ("lru", "none"), ("lfu", "none"), ("moe-infinity", "eam"), ("ours", "routing")]


def test_simulate_refuses_training_on_the_simulated_trace(cli, mixtral_like):
    res = cli(["simulate", "--trace", str(mixtral_like[0]), "--train-on", str(mixtral_like[0]),
               "--cache-fraction", "0.5", "--prefetch", "routing"])
    assert isinstance(res.exception, MoectlError) and "never be trained" in str(res.exception)
    res = cli(["simulate", "--trace", str(mixtral_like[0]), "--cache-fraction", "0.5", "--prefetch", "routing"])
    assert isinstance(res.exception, MoectlError) and "--predictor" in str(res.exception)


# ----------------------------------------------------------------------------- the tiny model's own traces

def test_mlp_prefetch_on_held_out_requests_of_the_tiny_model(tiny_small, tmp_path):
    """Profile the small tiny model in-process, train the mlp predictor on some requests and simulate on the
    OTHER requests (never the training tokens): its prefetches must remove demand loads lru/none has."""
    from moectl.calib.builtin_corpus import builtin_corpus
    from moectl.calib.profile import run_profile
    from moectl.predict.train import train_mlp
    from moectl.runtime.engine import Engine
    from moectl.core.shapes import shape_from_hf_config
    from moectl.sim.cost import CostModel, load_hardware
    from moectl.sim.simulate import simulate
    from moectl.artifacts.trace_dir import load_trace

    eng = Engine.load(model=str(tiny_small), device="cpu", progress=False)
    texts = builtin_corpus("validation")[:24]
    run_profile(eng, texts, tmp_path / "t", model_name="tiny", dataset="builtin:validation", max_tokens=96,
                generate=16, hidden_samples="all")
    tr = load_trace(tmp_path / "t")
    reqs = tr.request_slices()
    assert len(reqs) == 24 and tr.num_layers == 2
    cut = reqs[11][1].stop                                     # 12 requests to train on, 12 held out
    train, test = tr.select(slice(0, cut)), tr.select(slice(cut, tr.num_tokens))
    assert not set(train.request) & set(test.request)
    pred, _ = train_mlp([train], [1], epochs=40, max_minutes=0.3)
    cost = CostModel(load_hardware("rtx4090-pcie4"), shape_from_hf_config(json.loads(
        (tiny_small / "config.json").read_text())))
    caps = capacities(test, fraction=0.25)
    res = {p: simulate(test, caps, "lru", p, cost, predictor=pred if p == "mlp" else None, belady=False)
           for p in ("none", "gate-reuse", "mlp")}
    none = res["none"].demand_loads_per_token
    assert res["mlp"].tokens >= 100 and none > 1.0            # decode tokens (generation may stop at eos)
    # 2 MoE layers: only layer 1 can be prefetched (from layer 0's hidden state), so at most about half of the
    # demand loads can go. Over thirteen small models (seeds 0-5 and 7, torch's AVX2 and scalar kernels): mlp keeps
    # 61-80 % of none's decode misses (exact counts), gate-reuse 63-81 %.
    assert res["mlp"].misses <= 0.9 * res["none"].misses, res
    # starts from gate reuse, trained to beat it: as many or more of the prefetches it asks for are used. (Per
    # prefetch that ran, both save exactly one demand load here: comparing those was a tie that rounding decided.)
    # The used shares, from exact counts, differ by the training run: mlp 0.53-0.89, gate-reuse 0.24-0.69, mlp
    # ahead by 0.06-0.52 over the same models. Each share is a fraction of ~100-250 prefetches (two standard errors
    # of the difference: 0.08-0.10), so the documented direction is asserted within that noise: an mlp predictor
    # clearly worse than gate reuse fails, a near tie does not.
    def used(r):
        return (sum(sum(c["prefetch_used"]) for c in r.cache.values()),
                sum(sum(c["prefetches"]) for c in r.cache.values()))
    (um, nm), (ug, ng) = used(res["mlp"]), used(res["gate-reuse"])
    assert nm > 0 and ng > 0 and um / nm == pytest.approx(1 - res["mlp"].wasted_prefetch_fraction)
    pm, pg = um / nm, ug / ng
    se = math.sqrt(pm * (1 - pm) / nm + pg * (1 - pg) / ng)
    assert pm >= pg - 2 * se, (pm, pg, se, res)
    assert res["mlp"].prefetch_loads_per_token > 0
