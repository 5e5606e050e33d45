"""Cache planning figures: plan-cache time at real model shapes, the plan against the even split of the same bytes
on every shared trace (and a profiled tiny trace), and the scoreboards of issues 12 and 18.

  1. time: curves (simulator runs) + DP, at Mixtral-8x7B (the shared trace) and Qwen3-30B-A3B (48 x 128 top-8; no
     shared trace of it, so a synthetic one with OLMoE's (top-8) popularity and reuse, moectl/synth/trace.py) shapes.
  2. plan vs uniform: full-precision plans (replacement ours, no prefetch: the shared traces have no hidden
     states) at a budget holding ~25 % of the bf16 experts (Mixtral: 20 GB), stall ms/token of both, the margin.
  3. scoreboards on rtx4090-pcie4: Mixtral-8x7B at 20 GB (one trace: plan and judgement on it); Qwen1.5-MoE and
     OLMoE at 25 % of their bf16 experts, the plan made on the .math trace and judged on the .code one (and
     MoE-Infinity's request collection seeded with the .math trace). moectl = a plan at moectl's default precision
     policy (HOBBIT's T1 0.6 / T2 0.9 with q4g64 copies) with misses computed on the CPU where the cost model says
     it beats a copy. Mixtral gets AdapMoE's released sensitivities (T_g 0.005) in its workdir, so moectl's plan and
     the adapmoe preset gate alike.
  4. issue 18: moectl-q4 (lowbit-only q4g64, CPU compute auto) against llamacpp-cpu-moe: Mixtral at 16/20/24 GB
     (held out: plan on one request of the shared file, judged on the other, both ways round), Qwen1.5-MoE and
     OLMoE at 25 % (plan on .math, judged on .code). moectl-q4 starts with the plan's preload resident, as
     llama.cpp's static placement is from token 0.

  5. issue 19: gpt-oss-120b at 20 GB, every preset: no trace of it exists, so the plan is made on a synthetic trace
     at its shape with gptoss.math's routing statistics and judged on one with gptoss.code's (`trace synthesize`).

Run: [MOECTL_SHARED=../shared] .venv/bin/python bench/plan.py [--only time,uniform,scoreboard,q4,gptoss120b]
     [--tiny WORKDIR] [--keep-traces DIR] [--json out.json]
(--tiny: a workdir whose traces/ came from `moectl profile --model tiny ... --hidden-samples all`.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.core.sizing import split_budget  # noqa: E402
from moectl.policies.gating import SensitivityGating, gate_trace  # noqa: E402
from moectl.plan.planner import Policies, Replay, make_plan  # noqa: E402
from moectl.plan.scoreboard import (PRESETS, SEED_MIXTRAL_SENSITIVITY, SEED_T_G, print_scoreboard,  # noqa: E402
                                    ratios, run_preset)
from moectl.plan.inputs import plan_setup  # noqa: E402
from moectl.store.facts import model_sizes  # noqa: E402
from moectl.synth.trace import save, synthesize_like  # noqa: E402
from moectl.artifacts.trace_dir import load_trace
from moectl.artifacts.routing_jsonl import write_jsonl
from moectl.core.trace import Trace  # noqa: E402

SHARED = Path(os.environ.get("MOECTL_SHARED") or Path(__file__).resolve().parents[2] / "shared") / "traces"
HW = "rtx4090-pcie4"
TRACES = {   # recipe -> shared trace files
    "mixtral": ["mixtral-8x7b.gsm8k"],
    "olmoe": ["olmoe.math", "olmoe.code"],
    "qwen1.5-moe": ["qwen.math", "qwen.code", "qwen1.5-moe.cooking_1"],
    "gpt-oss-20b": ["gptoss.math", "gptoss.code"],
    "granite-moe": ["granite.math", "granite.code"],
}


def quarter_budget(model: str, fraction: float = 0.25) -> int:
    """Bytes that hold dense + KV (4096 tokens) + workspace + `fraction` of the bf16 experts."""
    f = model_sizes(model)
    s = split_budget(10**15, f)
    return int(s.dense + s.kv + s.workspace + fraction * f.num_layers * f.num_experts * f.expert_bytes())


def synthetic_trace(like: str, recipe: str, tokens: int, seed: int) -> Trace:
    """A synthetic trace at `recipe`'s shape with the routing statistics of shared trace `like`
    (the same as `moectl trace synthesize --like SHARED/like.jsonl --model recipe --tokens N --seed S`)."""
    return synthesize_like(SHARED / f"{like}.jsonl", recipe, tokens, seed)[0]


def timing() -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as wd:
        s = plan_setup("mixtral", "20GB", HW, 4096, [SHARED / "mixtral-8x7b.gsm8k.jsonl"], "ours", "auto", None, wd)
        for pol in (s.policies, replace(s.policies, precision="hobbit", lowbit="q4g64")):
            t = time.perf_counter()
            p = make_plan(s.facts, s.split, s.cost, s.replay, pol, HW)
            out.append({"shape": "Mixtral-8x7B (shared trace, 244 decode rows)", "precision": pol.precision,
                        "seconds": time.perf_counter() - t} | p["timing_s"])
        s = plan_setup("qwen3-moe", "20GB", HW, 4096, None, "ours", "auto", None, wd)
        tr = synthetic_trace("olmoe.math", "qwen3-moe", 128, seed=0)
        replay = Replay(tr, s.cost)
        replay.raw = tr
        for pol in (replace(s.policies, prefetch="none"),):
            t = time.perf_counter()
            p = make_plan(s.facts, s.split, s.cost, replay, pol, HW)
            out.append({"shape": "Qwen3-30B-A3B (synthetic trace from olmoe.math, 128 decode rows)", "precision": pol.precision,
                        "seconds": time.perf_counter() - t} | p["timing_s"])
    for r in out:
        print(f"plan-cache {r['shape']}, {r['precision']}: {r['seconds']:.1f} s (curves {r['curves']:.1f} s, DP "
              f"{r['dp']:.3f} s, replay {r.get('replay', 0):.1f} s)", flush=True)
    return out


def plan_vs_uniform(tiny: str | None) -> list[dict]:
    rows = []
    jobs = [(m, f, 20_000_000_000 if m == "mixtral" else quarter_budget(m)) for m, fs in TRACES.items() for f in fs]
    if tiny:
        jobs.append((str(Path(tiny) / "checkpoint"), None, None))
    for model, name, budget in jobs:
        with tempfile.TemporaryDirectory() as wd:
            traces = [SHARED / f"{name}.jsonl"] if name else None
            if name is None:
                wd = tiny
                budget = quarter_budget(model)
            s = plan_setup(model, str(budget), HW, 4096, traces, "ours", "auto", None, wd)
            p = make_plan(s.facts, s.split, s.cost, s.replay, s.policies, HW)
        pr, un = p["predicted"], p["uniform"]
        rows.append({"trace": name or "tiny (profiled)", "model": p["model"], "budget_bytes": int(budget),
                     "slots": sum(p["slots"]), "of_experts": sum(p["slots"]) / (p["num_layers"] * p["num_experts"]),
                     "prefetch": p["policies"]["prefetch"], "stall_plan": pr["stall_ms_per_token"],
                     "stall_uniform": un["stall_ms_per_token"], "ms_plan": pr["ms_per_token"],
                     "ms_uniform": un["ms_per_token"], "margin": 1 - pr["stall_ms_per_token"] / un["stall_ms_per_token"],
                     "refined_moves": p.get("refined_moves", 0), "kept": p.get("kept"),
                     "dp_margin": p.get("dp", {}).get("margin"), "seconds": sum(p["timing_s"].values())})
        r = rows[-1]
        print(f"{r['trace']:24s} {r['budget_bytes'] / 1e9:6.2f} GB {r['slots']:4d} slots ({r['of_experts']:.0%}) "
              f"stall plan {r['stall_plan']:8.4g} uniform {r['stall_uniform']:8.4g} ms/tok: {r['margin']:+.1%} "
              f"(kept {r['kept']}, the DP's own {r['dp_margin']:+.1%}; {r['seconds']:.0f} s)", flush=True)
    return rows


def _mixtral_workdir(wd: str) -> None:
    """AdapMoE's released Mixtral sensitivities and T_g as the workdir's sensitivity.json (fingerprint unknown)."""
    Path(wd, "sensitivity.json").write_text(json.dumps({
        "format": "moectl-sensitivity", "format_version": 1, "fingerprint": None,
        "sensitivities": SEED_MIXTRAL_SENSITIVITY, "threshold": SEED_T_G,
        "source": "AdapMoE released weight list (seed_adapmoe.md 2.3)"}))


def _shared(name: str, wd: str) -> Path:
    """A shared trace file, or with `#i` one request of it (the single Mixtral file has 2: plan on one, judge on
    the other), written into `wd`; a path to a .jsonl file as it is."""
    if Path(name).suffix == ".jsonl":
        return Path(name)
    name, _, req = name.partition("#")
    path = SHARED / f"{name}.jsonl"
    if not req:
        return path
    tr = load_trace(path)
    return write_jsonl(tr.select(tr.request_slices()[int(req)][1]), Path(wd) / f"{name}.request{req}.jsonl")


def board(model: str, budget, plan_trace: str, judge_trace: str | None, precision: dict, names=None) -> dict:
    """Every preset at `budget`: plan on `plan_trace`, judge on `judge_trace` (shared trace names, or paths)."""
    with tempfile.TemporaryDirectory() as wd:
        if model == "mixtral":
            _mixtral_workdir(wd)
        s = plan_setup(model, str(budget), HW, 4096, [_shared(plan_trace, wd)], "ours", "auto", None, wd)
        for k, v in precision.items():
            setattr(s.policies, k, v)
        plan = make_plan(s.facts, s.split, s.cost, s.replay, s.policies, HW)
        replay = s.replay
        if judge_trace:
            tr = load_trace(_shared(judge_trace, wd))
            replay = Replay(tr, s.cost, train_traces=[s.replay.raw])
            replay.raw = tr
            if s.policies.gating is not None and tr.weights is not None:     # the workdir's T_g, as the planning
                gating = SensitivityGating(s.policies.gating, s.policies.sensitivities)    # trace got it
                replay.trace = gate_trace(tr, gating)
        rows = [run_preset(s, p, plan, replay) for p in PRESETS if names is None or p.name in names]
    title = (f"{model} {budget if isinstance(budget, str) else f'{budget / 1e9:.2f}GB'} on {HW}: plan on "
             f"{Path(plan_trace).name}" + (f", judged on {Path(judge_trace).name}" if judge_trace else ""))
    print_scoreboard(rows, s, title=title)
    return {"title": title, "rows": rows, "ratios": ratios(rows) if any(r["preset"] == "moectl" for r in rows) else [],
            "plan_slots": plan["slots"], "plan_slots_low": plan.get("slots_low")}


def scoreboards() -> list[dict]:
    moectl = {"precision": "hobbit", "lowbit": "q4g64", "cpu_experts": "auto"}
    return [board("mixtral", "20GB", "mixtral-8x7b.gsm8k", None, moectl),
            board("qwen1.5-moe", quarter_budget("qwen1.5-moe"), "qwen.math", "qwen.code", moectl),
            board("olmoe", quarter_budget("olmoe"), "olmoe.math", "olmoe.code", moectl)]


def q4() -> list[dict]:
    q = {"precision": "lowbit-only", "lowbit": "q4g64", "cpu_experts": "auto"}
    out = []
    for gb in ("16GB", "20GB", "24GB"):          # held out: plan on one request of the Mixtral file, judge on the other
        for plan_req, judge_req in ((0, 1), (1, 0)):
            out.append(board("mixtral", gb, f"mixtral-8x7b.gsm8k#{plan_req}", f"mixtral-8x7b.gsm8k#{judge_req}", q,
                             names={"llamacpp-cpu-moe", "moectl-q4"}))
    out.append(board("qwen1.5-moe", quarter_budget("qwen1.5-moe"), "qwen.math", "qwen.code", q,
                     names={"llamacpp-cpu-moe", "moectl-q4"}))
    out.append(board("olmoe", quarter_budget("olmoe"), "olmoe.math", "olmoe.code", q,
                     names={"llamacpp-cpu-moe", "moectl-q4"}))
    for b in out:
        by = {r["preset"]: r for r in b["rows"]}
        print(f"{b['title']}: moectl-q4 / llamacpp-cpu-moe = {by['moectl-q4']['ms_per_token']:.1f} / "
              f"{by['llamacpp-cpu-moe']['ms_per_token']:.1f} ms/token = "
              f"{by['moectl-q4']['ms_per_token'] / by['llamacpp-cpu-moe']['ms_per_token']:.2f}x", flush=True)
    return out


def gptoss_120b(out_dir: str | None) -> dict:
    """Issue 19: gpt-oss-120b (36 x 128, top-4) at 20 GB, every preset at the CLI's defaults (full precision:
    the synthetic traces have no gate weights). No trace of it exists: the plan is made on a synthetic trace with
    gptoss.math's statistics (seed 1) and judged on one with gptoss.code's (seed 2), 512 decode tokens each,
    written to `out_dir` (kept) or a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(out_dir or tmp)
        paths = []
        for like, seed in (("gptoss.math", 1), ("gptoss.code", 2)):
            paths.append(save(synthetic_trace(like, "gpt-oss-120b", 512, seed),
                                     d / f"gpt-oss-120b.synthetic-{like.split('.')[1]}.s{seed}.jsonl"))
        return board("gpt-oss-120b", "20GB", str(paths[0]), str(paths[1]), {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="time,uniform,scoreboard,q4,gptoss120b")
    ap.add_argument("--keep-traces", default=None, help="folder to keep the synthetic gpt-oss-120b traces in")
    ap.add_argument("--tiny", default=None, help="tiny workdir with profiled traces/")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    parts = a.only.split(",")
    res = {}
    if "time" in parts:
        res["time"] = timing()
    if "uniform" in parts:
        res["uniform"] = plan_vs_uniform(a.tiny)
    if "scoreboard" in parts:
        res["scoreboard"] = scoreboards()
    if "q4" in parts:
        res["q4"] = q4()
    if "gptoss120b" in parts:
        res["gptoss120b"] = gptoss_120b(a.keep_traces)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
