"""Adaptive top-k on the trained tiny model: the sensitivity rule (AdapMoE) against the score-only rule.

The rule m^2 x S_l <= T_g with two per-layer sensitivities: Fisher's S_l (AdapMoE) and the ablation cost A_l
(`moectl sensitivity --rule ablation`, the default). For a sweep of T_g: fraction of single-expert decisions,
experts computed per token and MoE layer, bytes loaded per token (half the experts cached), relative perplexity
delta and greedy agreement on held-out text (`moectl eval`'s yardstick). Next to each, the score-only rule with
its tau bisected so that it computes the same experts per token; "Δppl score" is that matched point, and
"diff ± 2se" the paired perplexity difference (rule - score, relative) with twice its standard error over
held-out windows: differences inside it are noise.

Sensitivities come from the model corpus' train split; everything measured is on its held-out text
(`bench/models.py`: tiny -> calibration/default.yaml, the built-in corpus' validation documents; reference ->
calibration/reference.yaml). `--model tiny` (default) uses the full tiny model of $MOECTL_HOME/tiny (built on
first use, ~2-3 minutes); `--model reference` the reference model (make bench-fidelity). Half the experts cached.

Run: .venv/bin/python bench/gating.py [--model tiny] [--max-tokens 4096] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.calib.dataset import load_calibration  # noqa: E402
from moectl.calib.fidelity import evaluate, gating_as, token_windows, window_nll  # noqa: E402
from moectl.calib.sensitivity import (TailRecorder, ablation_sensitivity, fisher_sensitivity,  # noqa: E402
                                     threshold_grid)
from moectl.policies.gating import ScoreGating, SensitivityGating  # noqa: E402
from moectl.runtime.engine import Engine  # noqa: E402
from bench.models import MODEL_HELP, bench_model, fit_texts, half_the_experts, held_out_dataset  # noqa: E402


def matched_tau(eng, windows, target_ept: float, iters: int = 12) -> float:
    """The score-only tau whose experts per token (on `windows`) is closest to `target_ept` (bisection: more tau,
    fewer experts)."""
    lo, hi = 0.0, 0.5
    best = (float("inf"), 0.0)
    for _ in range(iters):
        mid = (lo + hi) / 2
        with gating_as(eng, ScoreGating(mid), True):
            ept = window_nll(eng, windows)["experts_per_token"]
        best = min(best, (abs(ept - target_ept), mid))
        lo, hi = (mid, hi) if ept > target_ept else (lo, mid)
    return best[1]


def paired(eng, held, policy_a, policy_b) -> tuple[float, float]:
    """Relative perplexity difference a - b on the same windows and twice its paired standard error."""
    with gating_as(eng, policy_a, True):
        a = window_nll(eng, held)
    with gating_as(eng, policy_b, True):
        b = window_nll(eng, held)
    d = np.array(a["per_window"]) - np.array(b["per_window"])
    n = a["scored"]
    return float(d.sum() / n), float(2 * d.std(ddof=1) * np.sqrt(len(d)) / n)


def sweep(eng, held, prompts, workdir, name: str, sens: list[float], tails) -> list[dict]:
    rows = []
    for t in threshold_grid(sens, tails):
        rule = SensitivityGating(t, sens)
        eng.runtime.gating = rule
        a = evaluate(eng, held, prompts, 32, workdir)
        tau = matched_tau(eng, held, a["experts_per_token"])
        eng.runtime.gating = ScoreGating(tau)
        b = evaluate(eng, held, prompts, 32, workdir)
        diff, se2 = paired(eng, held, rule, ScoreGating(tau))
        rows.append({"rule": name, "T_g": t, "single": a["single_expert_fraction"],
                     "experts_per_token": a["experts_per_token"], "bytes_per_token": a["bytes_per_token"],
                     "ppl_delta": a["ppl_delta_rel"], "agreement": a["greedy_agreement"], "tau": tau,
                     "score_experts_per_token": b["experts_per_token"], "score_ppl_delta": b["ppl_delta_rel"],
                     "score_agreement": b["greedy_agreement"], "diff": diff, "diff_2se": se2})
        r = rows[-1]
        print(f"{name:8s} T_g {t:9.3g} single {r['single']:.3f} experts/tok {r['experts_per_token']:.3f} "
              f"Δppl {r['ppl_delta']:+.4f} agree {r['agreement']:.3f} | score tau {tau:.3f} experts/tok "
              f"{r['score_experts_per_token']:.3f} Δppl {r['score_ppl_delta']:+.4f} agree {r['score_agreement']:.3f}"
              f" | diff {diff:+.4f} ± {se2:.4f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help=MODEL_HELP)
    ap.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens scored")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    ref = bench_model(args.model)
    workdir = ref.workdir
    eng = Engine.load(args.model, workdir=str(workdir), cache_experts=half_the_experts(ref), prefetch="none",
                      emulate_device=True, progress=False)
    fit = token_windows(eng.tokenizer, fit_texts(ref), args.window, 4096)
    tails = TailRecorder(len(eng.moe_layer_ids))
    eng.add_observer(tails)
    fisher = fisher_sensitivity(eng.model, [b for _, b in eng.adapter.moe_blocks(eng.model)], fit,
                                before_window=lambda: eng.cache.begin_step("prefill"),
                                after_window=eng.cache.end_token)["sensitivities"]
    eng.remove_observer(tails)
    abl = ablation_sensitivity(eng, fit)
    held = token_windows(eng.tokenizer, load_calibration(held_out_dataset(ref)), args.window, args.max_tokens)
    prompts = [w[:32] for w in held[:8]]
    print(f"{args.model}: {len(eng.moe_layer_ids)} MoE layers, top-{eng.adapter.top_k}; {sum(len(w) - 1 for w in held)} "
          f"held-out tokens\n  Fisher S_l   = " + ", ".join(f"{s:.3g}" for s in fisher)
          + "\n  ablation A_l = " + ", ".join(f"{s:.3g}" for s in abl["ablation"])
          + "\n  ablation dNLL/token = " + ", ".join(f"{c / abl['tokens']:.4f}" for c in abl["ablation_dnll"]),
          flush=True)

    rows = sweep(eng, held, prompts, workdir, "ablation", abl["ablation"], tails.tails)
    rows += sweep(eng, held, prompts, workdir, "fisher", fisher, tails.tails)

    print()
    print("| rule | T_g | single-expert | experts/token | KB/token | Δppl rule | agreement | tau (score) "
          "| experts/token (score) | Δppl score | agreement score | diff ± 2se |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rule']} | {r['T_g']:.3g} | {r['single']:.3f} | {r['experts_per_token']:.3f} "
              f"| {r['bytes_per_token'] / 1e3:.1f} | {r['ppl_delta']:+.2%} | {r['agreement']:.3f} | {r['tau']:.3f} "
              f"| {r['score_experts_per_token']:.3f} | {r['score_ppl_delta']:+.2%} | {r['score_agreement']:.3f} "
              f"| {r['diff']:+.2%} ± {r['diff_2se']:.2%} |")
    print()
    for name in ("ablation", "fisher"):
        rs = [r for r in rows if r["rule"] == name]
        no_worse = sum(r["ppl_delta"] <= r["score_ppl_delta"] + 1e-9 for r in rs)
        within = sum(r["diff"] <= r["diff_2se"] for r in rs)
        better = sum(r["diff"] < -r["diff_2se"] for r in rs)
        print(f"{name} rule vs score-only at {len(rs)} matched points: no worse {no_worse}, no worse beyond noise "
              f"(diff <= 2se) {within}, better beyond noise {better}")
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"fisher": fisher, "ablation": abl, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
