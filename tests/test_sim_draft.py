"""Speculative decoding in the simulator (sim/spec_passes.py, `simulate --draft-tokens`): passes, loads, the draft's cost,
the auto rule, and bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from moectl.errors import MoectlError
from moectl.policies import LRU
from moectl.policies.draft_length import Acceptance, pass_order
from moectl.sim.cost import FixedCost
from moectl.sim.spec_passes import DraftSpec, PassSimulator, accepted_drafts, run_draft, union_ratio
from moectl.sim.steps import trace_steps
from moectl.sim.simulator import Simulator
from moectl.core.trace import DECODE, Trace

from shared_data import TRACE_FILES, needs_shared

COST = FixedCost(load=1.0, attention=0.1, expert=0.0)


def make_trace(rows, E=8, K=2, requests=None):
    """rows: per decode token, per layer, the expert ids."""
    N, L = len(rows), len(rows[0])
    ex = np.full((N, L, K), -1, dtype=np.int16)
    for n, r in enumerate(rows):
        for l, ids in enumerate(r):
            ex[n, l, : len(ids)] = ids
    return Trace("hand-made", L, E, K, requests or ["r0"] * N, np.arange(N, dtype=np.int32),
                 np.full(N, DECODE, dtype=np.uint8), ex)


def random_trace(N=40, L=3, E=8, K=2, seed=0, requests=None):
    rng = np.random.default_rng(seed)
    return make_trace([[list(rng.choice(E, K, replace=False)) for _ in range(L)] for _ in range(N)], E, K, requests)


def replay(tr, k, p, cap=2, cost=COST, source="model", draft_ms=0.0, **kw):
    spec = DraftSpec(k, Acceptance.constant(p), source, draft_ms, **kw)
    return run_draft(lambda: PassSimulator([cap] * tr.num_layers, LRU(), None, cost), tr, spec)


def no_draft(tr, cap=2, cost=COST):
    return Simulator([cap] * tr.num_layers, LRU(), None, cost).run(trace_steps(tr))


# ----------------------------------------------------------------------------- passes and loads

def test_hand_computed_passes_load_each_union_once():
    # 1 layer, top-2, 2 slots, K = 2 drafts, every draft accepted: passes over rows 0-2, 3-5, 6
    tr = make_trace([[[0, 1]], [[1, 2]], [[2, 3]], [[4, 5]], [[5, 6]], [[0, 7]], [[3, 4]]])
    r = replay(tr, 2, 1.0)
    # unions {0,1,2,3} (all missing; run as 0 1 3 2: `pass_order`), {0,4,5,6,7} (2 and 3, resident after pass 1,
    # are not in it; run as 4 6 5 0 7, leaving 0 and 7), {3,4}: 4 + 5 + 2 loads, one per union member
    assert r["draft"]["passes"] == 3 and r["decode_tokens"] == 7 and r["draft"]["tokens_per_pass"] == pytest.approx(7 / 3)
    assert r["misses"] == 11 and r["accesses"] == 11
    assert r["bytes_per_token"] == pytest.approx(11 * COST.expert_bytes / 7)
    # time: per pass one layer's attention (0.1 s), the loads one after another (1 s each), no compute, no draft cost
    assert r["ms_per_token"] == pytest.approx((3 * 0.1 + 11 * 1.0) * 1e3 / 7)
    # the rows one at a time: 2 + 1 + 1 + 2 + 1 + 2 + 2 misses, 7 steps of 0.1 s
    base = no_draft(tr)
    assert base["misses"] == 11 and base["ms_per_token"] == pytest.approx((7 * 0.1 + 11) * 1e3 / 7)


def test_a_pass_shares_an_expert_between_its_tokens():
    # every row routes to 0 and 1, 1 slot: a pass of 4 rows loads each once (pass 2 finds 1 resident: 3 loads);
    # the rows one at a time load the one not resident every time (2 + 7 loads)
    tr = make_trace([[[0, 1]]] * 8)
    r, base = replay(tr, 3, 1.0, cap=1), no_draft(tr, cap=1)
    assert r["draft"]["passes"] == 2 and r["misses"] == 3 and base["misses"] == 9
    assert r["ms_per_token"] == pytest.approx((2 * 0.1 + 3) * 1e3 / 8)
    assert base["ms_per_token"] == pytest.approx((8 * 0.1 + 9) * 1e3 / 8)


def test_a_pass_runs_its_latest_tokens_experts_last_so_the_cache_keeps_them():
    assert pass_order([[2, 3], [0, 1]]) == [2, 3, 0, 1]
    assert pass_order([[5, 1], [1, 2]]) == [5, 2, 1]              # latest token's; the shared one last of those
    assert pass_order([[4, -1], [-1, 0]]) == [4, 0]
    # 2 slots, passes of 2 tokens: pass 1 leaves the second token's {0, 1}, which pass 2's first token reuses
    # (2 + 2 + 2 loads); in ascending order pass 1 would leave {2, 3} and pass 2 load all four (8)
    tr = make_trace([[[2, 3]], [[0, 1]], [[0, 1]], [[4, 5]]])
    r = replay(tr, 1, 1.0)
    assert r["draft"]["passes"] == 2 and r["misses"] == 6 and r["hit_rate"] == pytest.approx(2 / 8)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_all_accepted_takes_ceil_tokens_over_k_plus_one_passes(k):
    tr = random_trace(N=30, requests=["a"] * 13 + ["b"] * 17)
    r = replay(tr, k, 1.0)
    assert r["draft"]["passes"] == math.ceil(13 / (k + 1)) + math.ceil(17 / (k + 1))
    assert r["decode_tokens"] == 30 and r["draft"]["k_passes"].get(k, 0) == 13 // (k + 1) + 17 // (k + 1)
    # the loads are the pass unions' misses: never more than the rows one at a time would touch
    assert r["accesses"] <= sum(len(set(tr.experts[n, l])) for n in range(30) for l in range(tr.num_layers))


def test_zero_drafts_is_the_plain_replay_exactly():
    tr = random_trace()
    r, base = replay(tr, 0, 0.9), no_draft(tr)
    for key in ("ms_per_token", "misses", "bytes_per_token", "hit_rate", "stall_ms_per_token"):
        assert r[key] == base[key], key
    assert r["draft"]["passes"] == 40


def test_acceptance_is_sampled_per_position_and_reported():
    assert accepted_drafts(np.array([0.1, 0.5, 0.2]), Acceptance([0.9, 0.4])) == 1
    assert accepted_drafts(np.array([0.1, 0.3, 0.2]), Acceptance([0.9, 0.4])) == 3
    assert accepted_drafts(np.array([0.95]), Acceptance([0.9])) == 0
    tr = random_trace(N=400, L=1)
    r = replay(tr, 4, 0.7, seed=3)
    d = r["draft"]
    # sampled rates near the asked 0.7; produced = accepted + 1 per pass
    assert abs(d["sampled"][0] - 0.7) < 0.1
    assert d["tokens_per_pass"] == pytest.approx(d["accepted_per_pass"] + 1)
    assert replay(tr, 4, 0.7, seed=3)["ms_per_token"] == r["ms_per_token"]          # seeded


def test_rejected_drafts_are_extra_work():
    # nothing accepted: every pass produces 1 token but loads (and scores) its 3 rows' union
    tr = random_trace()
    r, base = replay(tr, 2, 0.0), no_draft(tr)
    assert r["draft"]["passes"] == 40 and r["draft"]["accepted_per_pass"] == 0
    assert r["bytes_per_token"] > base["bytes_per_token"] and r["ms_per_token"] > base["ms_per_token"]


def test_the_draft_costs_its_time():
    tr = random_trace()
    free, paid = replay(tr, 2, 1.0, draft_ms=0.0), replay(tr, 2, 1.0, draft_ms=50.0)
    d = paid["draft"]          # 13 passes of 2 drafts, then the request's last row alone (no room for a draft)
    assert d["passes"] == 14 and d["drafted_per_pass"] * 14 == pytest.approx(26)
    assert d["draft_ms_per_token"] == pytest.approx(50.0 * 26 / 40)
    assert paid["ms_per_token"] == pytest.approx(free["ms_per_token"] + paid["draft"]["draft_ms_per_token"])
    # cached: k forwards with no loads: L x attention (0.1 s) + the resident experts' compute (0 here) + head (0)
    cached = replay(tr, 2, 1.0, source="cached", draft_ms=None)
    assert cached["draft"]["draft_ms_per_token"] == pytest.approx(1e3 * 3 * 0.1 * 26 / 40)


def test_a_cached_draft_computes_only_the_resident_experts():
    # 1 layer, 2 slots: pass 1 loads {0, 1}; pass 2's draft forward runs row 2 ({0, 1}: both resident, 2 x 0.5 s),
    # pass 1's draft forward ran row 0 with nothing resident (0 s); attention and head cost nothing here
    tr = make_trace([[[0, 1]], [[0, 1]], [[0, 1]], [[0, 1]]])
    cost = FixedCost(load=1.0, attention=0.0, expert=0.5)
    r = replay(tr, 1, 1.0, cap=2, cost=cost, source="cached", draft_ms=None)
    assert r["draft"]["passes"] == 2 and r["draft"]["draft_ms_per_token"] == pytest.approx(1e3 * 2 * 0.5 / 4)


# ----------------------------------------------------------------------------- the auto rule

def test_auto_turns_drafting_off_when_nothing_is_accepted():
    tr = random_trace()
    r, base = replay(tr, None, 0.0), no_draft(tr)
    assert r["draft"]["chosen_k"] == 0 and r["ms_per_token"] == base["ms_per_token"]
    assert r["draft"]["by_k"][2]["ms_per_token"] > base["ms_per_token"]      # what `always` would have cost


def test_auto_drafts_when_it_pays():
    tr = make_trace([[[0, 1]]] * 8 + [[[2, 3]]] * 8)
    r = replay(tr, None, 1.0, cap=1)
    by_k = r["draft"]["by_k"]
    assert r["draft"]["chosen_k"] == min(by_k, key=lambda k: by_k[k]["ms_per_token"]) > 0
    assert r["ms_per_token"] < no_draft(tr, cap=1)["ms_per_token"] / 2
    assert set(r["draft"]["by_k"]) == {0, 1, 2, 3, 4}


def test_online_rule_explores_then_keeps_a_paying_k():
    tr = make_trace([[[0, 1]]] * 60)
    r = replay(tr, None, 1.0, cap=1, rule="online")
    used = r["draft"]["k_passes"]
    assert set(used) == {0, 1, 2, 3, 4} and max(used, key=used.get) == 4


def test_auto_on_a_prompt_alone_drafts_nothing():
    tr = random_trace(N=6)
    tr.phase[:] = 0                                                   # PREFILL: no decode row to pass over
    r = replay(tr, None, 1.0)
    assert r["draft"]["chosen_k"] == 0 and r["draft"]["passes"] == 0 and r["decode_tokens"] == 0


def test_union_ratio():
    tr = make_trace([[[0, 1]], [[1, 2]], [[0, 1]], [[0, 2]], [[5, 6]], [[5, 6]], [[5, 6]], [[5, 6]], [[7, 0]]])
    # windows rows 0-3: {0,1,2} of 8 uses; rows 4-7: {5,6} of 8; row 8 is no full window
    assert union_ratio(tr, 4) == pytest.approx(5 / 16)


# ----------------------------------------------------------------------------- the command

def error_of(args, capsys, monkeypatch) -> str:
    """`moectl ARGS` through the real entry point, which must fail with one `error:` line (exit 2): that line."""
    from test_bad_input import run_cli

    code, _, err = run_cli(args, capsys, monkeypatch)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and lines[0].startswith("error:") and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    tr = random_trace(N=24, L=32, E=8, K=2, seed=1)
    lines = [json.dumps({"format": "moe-routing-v1", "model": "mistralai/Mixtral-8x7B-Instruct-v0.1",
                         "num_layers": 32, "num_experts": 8, "top_k": 2})]
    for n in range(tr.num_tokens):
        lines.append(json.dumps({"request": "r0", "pos": n, "phase": "decode",
                                 "experts": [[int(e) for e in tr.experts[n, l]] for l in range(32)]}))
    p = tmp_path_factory.mktemp("draft") / "m.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_simulate_draft_json(cli, trace_file):
    res = cli(["simulate", "-t", str(trace_file), "--cache-fraction", "0.25", "--draft-tokens", "3",
               "--acceptance", "1.0", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    dr = d["draft"]
    assert dr["passes"] == 6 and dr["tokens_per_pass"] == 4.0 and d["tokens"] == 24
    assert dr["speedup"] == pytest.approx(dr["no_draft_ms_per_token"] / d["ms_per_token"])
    assert d["bytes_per_token"] < dr["no_draft_bytes_per_token"]
    assert dr["acceptance"]["per_position"] == [1.0]


def test_simulate_reads_an_acceptance_file(cli, trace_file, tmp_path):
    f = tmp_path / "acc.json"
    f.write_text(json.dumps(Acceptance([0.9, 0.8], passes=10, source="measured").to_json()))
    res = cli(["simulate", "-t", str(trace_file), "--cache-fraction", "0.25", "--draft-tokens", "auto",
               "--acceptance", str(f), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["draft"]
    assert d["acceptance"]["per_position"] == [0.9, 0.8] and d["rule"] == "cost" and "chosen_k" in d


@pytest.mark.parametrize("args,match", [
    (["--draft-tokens", "2"], "needs --acceptance"),
    (["--draft-tokens", "two", "--acceptance", "0.8"], "number of drafted tokens"),
    (["--acceptance", "0.8"], "give --draft-tokens"),
    (["--draft-tokens", "2", "--acceptance", "1.7"], "probability"),
    (["--draft-tokens", "2", "--acceptance", "0.8", "--draft", "eagle"], "unknown --draft"),
    (["--draft-tokens", "2", "--acceptance", "0.8", "--replacement", "belady"], "future"),
    (["--draft-tokens", "2", "--acceptance", "0.8", "--preset", "hobbit"], "--preset"),
])
def test_simulate_draft_bad_input_is_one_clear_error(trace_file, args, match, capsys, monkeypatch):
    err = error_of(["simulate", "-t", str(trace_file), "--cache-fraction", "0.25", *args], capsys, monkeypatch)
    assert match in err


@pytest.mark.parametrize("content", [{"format": "moectl-plan-v1", "slots": [2] * 32},
                                     {"format": "moectl-acceptance", "version": 9, "per_position": [0.5]}])
def test_an_acceptance_file_of_another_format_is_a_clear_error(trace_file, tmp_path, content, capsys, monkeypatch):
    f = tmp_path / "acc.json"
    f.write_text(json.dumps(content))
    err = error_of(["simulate", "-t", str(trace_file), "--cache-fraction", "0.25", "--draft-tokens", "2",
                    "--acceptance", str(f)], capsys, monkeypatch)
    assert str(f) in err and ("not an acceptance file" in err or "newer" in err)


# ----------------------------------------------------------------------------- the shared traces

@needs_shared
@pytest.mark.parametrize("cpu_experts", ["never", "auto"])
def test_auto_is_never_slower_than_no_draft_on_the_shared_traces(cpu_experts):
    from moectl.sim import simulate as sim
    from moectl.artifacts.trace_dir import load_trace

    for f in TRACE_FILES:
        tr = load_trace(f)
        first = tr.request_slices()[0][1]
        decode = np.flatnonzero(tr.phase[first] == DECODE) + first.start
        tr = tr.select(slice(first.start, decode[min(47, len(decode) - 1)] + 1))     # its prompt + 48 decode rows
        cost = sim.cost_for(tr, "rtx4090-pcie4")
        caps = sim.capacities(tr, 0.25)
        base = sim.simulate(tr, caps, "lru", "none", cost, cpu_experts=cpu_experts, belady=False)
        for p in (0.7, 0.85):
            r = sim.simulate(tr, caps, "lru", "none", cost, cpu_experts=cpu_experts, belady=False,
                             draft=DraftSpec(None, Acceptance.constant(p)))
            assert r.ms_per_token <= base.ms_per_token, (f.name, p)
            assert r.draft["chosen_k"] == 0 or r.ms_per_token < base.ms_per_token


# ----------------------------------------------------------------------------- plan-cache

def test_plan_cache_plans_for_drafting_and_simulate_replays_it(trace_file, tmp_path, capsys, monkeypatch):
    import yaml

    from test_bad_input import run_cli

    out = tmp_path / "plan.yaml"
    base = ["plan-cache", "--model", "mixtral", "--budget", "20GB", "--traces", str(trace_file), "--cpu-experts",
            "never", "--workdir", str(tmp_path), "--out", str(out)]
    code, _, err = run_cli(base + ["--draft-tokens", "3", "--acceptance", "1.0"], capsys, monkeypatch)
    assert code == 0, err
    plan = yaml.safe_load(out.read_text())
    d = plan["draft"]
    assert d["tokens"] == 3 and d["source"] == "cached" and d["chosen_by"] == "fixed"
    assert d["acceptance"]["per_position"] == [1.0] and d["acceptance"]["format"] == "moectl-acceptance"
    assert d["no_draft_ms_per_token"] > plan["predicted"]["ms_per_token"]      # all accepted: passes pay here
    # simulate --plan replays the plan's drafting: what the plan predicted, and the no-draft figure beside it
    code, stdout, err = run_cli(["simulate", "--trace", str(trace_file), "--plan", str(out), "--json"],
                                capsys, monkeypatch)
    assert code == 0, err
    sim = json.loads(stdout)
    assert sim["draft"]["passes"] == 6 and sim["ms_per_token"] == pytest.approx(plan["predicted"]["ms_per_token"])
    assert sim["draft"]["no_draft_ms_per_token"] == pytest.approx(d["no_draft_ms_per_token"])
    # auto with drafts never accepted: the rule turns drafting off, and says so in the plan
    code, _, err = run_cli(base + ["--draft-tokens", "auto", "--acceptance", "0.0"], capsys, monkeypatch)
    assert code == 0, err
    d = yaml.safe_load(out.read_text())["draft"]
    assert d["tokens"] == 0 and d["chosen_by"] == "auto" and len(d["by_k"]) == 5
    assert min(d["by_k"]) == d["by_k"][0]
