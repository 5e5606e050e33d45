"""One sizing (moectl/sizing.py): the same --budget and model buy the same expert slots in the runtime, plan-cache,
simulate and inspect (issue 29: they used to disagree on the workspace and the KV reserve)."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from moectl.cli import app


def test_the_same_budget_gives_the_same_slots_everywhere(tiny_small, tmp_path):
    from moectl.plan.budget import model_facts
    from moectl.runtime.engine import Engine
    from moectl.sizing import workspace_bytes

    facts = model_facts(str(tiny_small))
    L, E, K = facts.num_layers, facts.num_experts, facts.top_k
    fixed = facts.dense_bytes + facts.kv_bytes_per_token * 4096 + workspace_bytes(facts.shape)
    budget = str(int(fixed + 5.5 * facts.expert_bytes()))          # five and a half experts beyond the fixed part
    assert L <= 5                                                   # so 5 slots hold one per layer
    trace = tmp_path / "t.jsonl"
    rows = [{"format": "moe-routing-v1", "model": str(tiny_small), "num_layers": L, "num_experts": E, "top_k": K}]
    rows += [{"request": "a", "pos": i, "phase": "decode", "experts": [[(i + l + k) % E for k in range(K)]
                                                                       for l in range(L)]} for i in range(16)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    runtime = Engine.load(str(tiny_small), budget=budget, emulate_device=True, progress=False)
    r = CliRunner().invoke(app, ["inspect", "--model", str(tiny_small), "--budget", budget, "--device", "cuda",
                                 "--json"])
    assert r.exit_code == 0, r.output
    inspect = json.loads(r.stdout)["memory"]["full_slots"]
    r = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--budget", budget, "--json"])
    assert r.exit_code == 0, r.output
    simulate = json.loads(r.stdout)["slots"]["full"]
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(app, ["plan-cache", "--model", str(tiny_small), "--budget", budget, "--traces", str(trace),
                                 "--prefetch", "none", "--cpu-experts", "never", "--out", str(out)])
    assert r.exit_code == 0, r.output
    plan = yaml.safe_load(out.read_text())
    assert sum(runtime.cache.slots_per_layer) == inspect == simulate == sum(plan["slots"]) == 5
    assert plan["budget"]["workspace"] == workspace_bytes(facts.shape)
