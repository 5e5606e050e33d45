"""One sizing (moectl/core/sizing.py): the same --budget and model buy the same expert slots in the runtime, plan-cache,
simulate and inspect (issue 29: they used to disagree on the workspace and the KV reserve)."""

from __future__ import annotations

import json

import pytest
import yaml


def _trace(tmp_path, model, L, E, K):
    """16 decode rows of round-robin routing: what simulate and plan-cache replay."""
    trace = tmp_path / "t.jsonl"
    rows = [{"format": "moe-routing-v1", "model": str(model), "num_layers": L, "num_experts": E, "top_k": K}]
    rows += [{"request": "a", "pos": i, "phase": "decode", "experts": [[(i + l + k) % E for k in range(K)]
                                                                       for l in range(L)]} for i in range(16)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return trace


def test_the_same_budget_gives_the_same_slots_everywhere(cli, tiny_small, tmp_path):
    from moectl.store.facts import model_sizes
    from moectl.runtime.engine import Engine
    from moectl.core.sizing import workspace_bytes

    facts = model_sizes(str(tiny_small))
    L, E, K = facts.num_layers, facts.num_experts, facts.top_k
    fixed = facts.dense_bytes + facts.kv_bytes_per_token * 4096 + workspace_bytes(facts.shape)
    budget = str(int(fixed + 5.5 * facts.expert_bytes()))          # five and a half experts beyond the fixed part
    assert L <= 5                                                   # so 5 slots hold one per layer
    trace = _trace(tmp_path, tiny_small, L, E, K)

    runtime = Engine.load(str(tiny_small), budget=budget, emulate_device=True, progress=False)
    r = cli(["inspect", "--model", str(tiny_small), "--budget", budget, "--device", "cuda",
             "--json"])
    assert r.exit_code == 0, r.output
    inspect = json.loads(r.stdout)["memory"]["full_slots"]
    r = cli(["simulate", "--trace", str(trace), "--budget", budget, "--json"])
    assert r.exit_code == 0, r.output
    simulate = json.loads(r.stdout)["slots"]["full"]
    out = tmp_path / "plan.yaml"
    r = cli(["plan-cache", "--model", str(tiny_small), "--budget", budget, "--traces", str(trace),
             "--prefetch", "none", "--cpu-experts", "never", "--out", str(out)])
    assert r.exit_code == 0, r.output
    plan = yaml.safe_load(out.read_text())
    assert sum(runtime.cache.slots_per_layer) == inspect == simulate == sum(plan["slots"]) == 5
    assert plan["budget"]["workspace"] == workspace_bytes(facts.shape)


@pytest.fixture(scope="module")
def q4_workdir(tiny_small, tmp_path_factory):
    from moectl.quant.quantize import quantize_model

    wd = tmp_path_factory.mktemp("sizing-q4")
    quantize_model(str(tiny_small), 4, 64, 1, workdir=str(wd), progress=False)
    return wd


@pytest.mark.parametrize("precision, experts, prefetch, want", [
    ("hobbit", 5.5, "none", {"full": 4, "low": 9}),          # 3/4 of 5.5 experts' bytes: 4 full, the rest q4
    ("lowbit-only", 1.7, "none", {"low": 10}),              # every byte q4, no full-precision slot
    ("lowbit-only", 1.7, "eam", {"low": 8}),                # two q4 staging buffers off the budget first
])
def test_the_same_budget_gives_the_same_low_bit_pools_everywhere(cli, tiny_small, q4_workdir, tmp_path, precision,
                                                                      experts, prefetch, want):
    """The low-bit pools too (issue 29): one budget, the same {precision: slots} in the runtime, `simulate`,
    `inspect` and the even split `plan-cache` measures its plan against; the low-bit copy is priced at the bytes
    the runtime's copies take (fp32 checkpoint: fp32 scales and zeros), and at lowbit-only there is no full pool."""
    from moectl.store.facts import model_sizes
    from moectl.runtime.engine import Engine
    from moectl.core.sizing import workspace_bytes

    facts = model_sizes(str(tiny_small))
    L, E, K = facts.num_layers, facts.num_experts, facts.top_k
    fixed = facts.dense_bytes + facts.kv_bytes_per_token * 4096 + workspace_bytes(facts.shape)
    budget = str(int(fixed + experts * facts.expert_bytes()))
    trace = _trace(tmp_path, tiny_small, L, E, K)
    q4 = ["--lowbit", "q4g64", "--precision", precision]
    eng = Engine.load(str(tiny_small), budget=budget, emulate_device=True, progress=False, workdir=str(q4_workdir),
                      lowbit="q4g64", precision=precision, prefetch=prefetch, cpu_experts="never", plan=None)
    runtime = {p: sum(eng.cache.state.capacity(l, p) for l in range(L)) for p in eng.cache.state.counts}
    assert eng.cache.state.staging == (2 if prefetch != "none" else 0)
    r = cli(["simulate", "--trace", str(trace), "--budget", budget, "--prefetch", prefetch,
             "--json", *q4])
    assert r.exit_code == 0, r.output
    simulate = json.loads(r.stdout)["slots"]
    out = tmp_path / "plan.yaml"
    r = cli(["plan-cache", "--model", str(tiny_small), "--budget", budget, "--traces", str(trace),
             "--prefetch", prefetch, "--cpu-experts", "never", "--out", str(out), *q4])
    assert r.exit_code == 0, r.output
    plan = yaml.safe_load(out.read_text())
    planned = {p: sum(plan[k]) for p, k in (("full", "uniform_slots"), ("low", "uniform_slots_low"))
               if sum(plan[k])}
    assert runtime == simulate == planned == want
    if prefetch == "none":                                   # inspect knows no prefetch (no staging buffers)
        r = cli(["inspect", "--model", str(tiny_small), "--budget", budget, "--device", "cuda",
                 "--json", *q4])
        assert r.exit_code == 0, r.output
        m = json.loads(r.stdout)["memory"]
        assert {p: n for p, n in (("full", m["full_slots"]), ("low", m["lowbit_slots"])) if n} == want
        assert m["bytes_per_expert_lowbit"] == eng.store.nbytes("low") == plan["expert_bytes"]["low"]
