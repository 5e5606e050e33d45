"""One set of runtime options (RuntimeOptions, declared once for the CLI), resolved flag > plan > artifact default >
built-in default, with the sources and the lossy settings reported (issues 29 and 34)."""

from __future__ import annotations

import json
import re

import pytest

from moectl.commands._common import _runtime_option_table

RUNTIME_COMMANDS = ("generate", "chat", "eval", "serve", "bench")


def options_of(cli, command: str) -> set[str]:
    out = cli([command, "--help"], env={"COLUMNS": "300"}).output
    return set(re.findall(r"(--[a-z0-9-]+)", out))


def test_every_runtime_command_takes_the_same_runtime_options(cli):
    shared = {opt.param_decls[0] for _, _, opt in _runtime_option_table()}
    assert {"--gating-threshold", "--gating", "--gate-prefill", "--cpu-experts", "--no-plan"} <= shared
    for command in RUNTIME_COMMANDS:
        assert shared <= options_of(cli, command), (command, shared - options_of(cli, command))
    # bench's own help for the two it reads its own way; every flag bench had before still works
    out = cli(["bench", "--help"], env={"COLUMNS": "300"}).output
    assert "default: half the experts" in out and "--emulate-device is implied" in out
    assert {"--model", "--prompt-len", "--gen-len", "--repeat", "--baselines", "--what", "--model-shape",
            "--json"} <= options_of(cli, "bench")


def test_generate_json_reports_config_sources_lossy_and_no_future_warning(cli, tiny_small):
    r = cli(["generate", "--model", str(tiny_small), "--prompt", "The cache", "-n", "3",
             "--greedy", "--emulate-device", "--cache-experts", "6", "--replacement", "lfu",
             "--json"])
    assert r.exit_code == 0, r.output
    assert "FutureWarning" not in r.output and "deprecated" not in r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    c = d["config"]
    assert c["cache_experts"] == [6, "flag"] and c["replacement"] == ["lfu", "flag"]
    assert c["admission"] == ["off", "default"] and c["precision"] == ["full", "default"]
    assert c["cpu_experts"] == ["never", "default"]               # a CPU: misses fetched into the emulated slots
    assert sum(c["slots"][0]) == 6 and c["slots"][1] == "default"
    assert d["lossy"] == {"precision": "full", "lowbit": None, "gating": "off"}


def test_a_plan_in_place_on_a_cpu_says_its_slots_do_not_apply(tiny_small, tmp_path):
    from moectl.runtime.engine import Engine

    probe = Engine.load(str(tiny_small), progress=False)
    L = len(probe.moe_layer_ids)
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({"format": "moectl-plan-v1", "slots": [2] * L, "policies": {"replacement": "lfu"}}))
    eng = Engine.load(str(tiny_small), plan=str(plan), progress=False)
    assert "computed in place" in eng.plan_note and "slots do not apply" in eng.plan_note
    assert f"{2 * L} expert slots" not in eng.plan_note                   # it used to claim them
    assert eng.options.sources["replacement"] == "plan" and eng.options.replacement == "lfu"
    emulated = Engine.load(str(tiny_small), plan=str(plan), emulate_device=True, progress=False)
    assert emulated.cache.slots_per_layer == [2] * L and f"{2 * L} expert slots" in emulated.plan_note


def test_inspect_without_device_reports_the_device_this_machine_has(cli, tiny_small):
    import torch

    r = cli(["inspect", "--model", str(tiny_small), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["memory"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("command", ["generate", "eval", "chat"])
def test_a_bad_runtime_option_is_one_error_line(tiny_small, command, capsys, monkeypatch):
    from test_bad_input import assert_one_error, run_cli

    args = [command, "--model", str(tiny_small), "--admission", "maybe"] + (["--prompt", "x"] if command == "generate"
                                                                             else [])
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert_one_error(code, err, "--admission", "maybe")


def test_generate_uses_no_deprecated_transformers_api(tiny_small):
    """Issue 34: a runtime command printed transformers' FutureWarning (past_key_values). With every FutureWarning an
    error, a generate through the emulated device's cache (KV cache, prefill, decode) still succeeds."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", MOECTL_HOME=str(tiny_small.parent.parent / "home"))
    r = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-m", "moectl.cli", "generate", "--model",
                        str(tiny_small), "--prompt", "The cache", "-n", "3", "--greedy", "--emulate-device",
                        "--cache-experts", "4", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FutureWarning" not in r.stderr and len(json.loads(r.stdout)["token_ids"]) == 3


def test_bench_takes_the_shared_runtime_options(cli, tiny_small, tmp_path, monkeypatch):
    """bench --model on the shared declaration: --no-plan drops the moectl-plan row (the workdir has a plan), and
    options bench had no flag for before reach its moectl row (--staging-buffers 0 under --prefetch gate-reuse)."""
    from test_speed import bench_workdir

    wd = bench_workdir(tmp_path, monkeypatch)
    base = ["bench", "--model", str(tiny_small), "--workdir", str(wd), "--prompt-len", "4", "--gen-len", "3",
            "--repeat", "1", "--cache-experts", "8", "--baselines", "moectl-plan,lru", "--threads", "1", "--json"]
    runs = {}
    for extra in ([], ["--no-plan", "--prefetch", "gate-reuse", "--staging-buffers", "0"]):
        r = cli(base + extra)
        assert r.exit_code == 0, r.output
        runs[tuple(extra)] = json.loads(r.stdout.strip().splitlines()[-1])["runs"]
    assert set(runs[()]) == {"moectl", "moectl-plan", "lru"}
    assert set(runs[("--no-plan", "--prefetch", "gate-reuse", "--staging-buffers", "0")]) == {"moectl", "lru"}


def test_a_plan_made_for_drafting_drafts_as_it_was_priced(tiny_small, tmp_path):
    """plan-cache --draft-tokens writes a `draft` block; the runtime takes it (flag > plan > default)."""
    from moectl.runtime.engine import Engine

    probe = Engine.load(str(tiny_small), progress=False)
    L = len(probe.moe_layer_ids)

    def plan_with(draft: dict | None):
        path = tmp_path / f"plan-{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(json.dumps({"format": "moectl-plan-v1", "slots": [2] * L,
                                    **({"draft": draft} if draft is not None else {})}))
        return str(path)

    cached3 = plan_with({"tokens": 3, "source": "cached", "draft_ms": None})
    eng = Engine.load(str(tiny_small), plan=cached3, emulate_device=True, progress=False)
    o = eng.options
    assert (o.draft, o.sources["draft"], o.draft_tokens, o.sources["draft_tokens"]) == ("cached", "plan", 3, "plan")
    assert eng.speculator is not None and eng.speculator.k_max == 3
    # flags win: another K, or no drafting at all
    eng = Engine.load(str(tiny_small), plan=cached3, emulate_device=True, draft_tokens=2, progress=False)
    assert (eng.options.draft_tokens, eng.options.sources["draft_tokens"]) == (2, "flag")
    eng = Engine.load(str(tiny_small), plan=cached3, emulate_device=True, draft="none", progress=False)
    assert eng.options.draft is None and eng.speculator is None
    # a plan whose replay found drafting does not pay (tokens 0), a plan without the block: no drafting, K default
    for plan in (plan_with({"tokens": 0, "source": "cached"}), plan_with(None)):
        eng = Engine.load(str(tiny_small), plan=plan, emulate_device=True, progress=False)
        assert eng.speculator is None and eng.options.draft is None
        assert (eng.options.draft_tokens, eng.options.sources["draft_tokens"]) == (4, "default")
    # a draft model's plan gives K only, to the draft the command names
    model_plan = plan_with({"tokens": 2, "source": "model", "draft_ms": 1.0})
    eng = Engine.load(str(tiny_small), plan=model_plan, emulate_device=True, progress=False)
    assert eng.speculator is None
    eng = Engine.load(str(tiny_small), plan=model_plan, emulate_device=True, draft="cached", progress=False)
    assert (eng.speculator.k_max, eng.options.sources["draft_tokens"]) == (2, "plan")
