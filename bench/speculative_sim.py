"""Issue 33 figures from the simulator: speculative decoding (verification passes) on the shared held-out traces.

For every held-out shared trace (Mixtral's whole file, *.code, Qwen1.5's cooking) at 25 % of the experts cached on
rtx4090-pcie4 (defaults), LRU, no prefetch: ms/token without drafting, with K = 1..4 drafts per pass, and with
`--draft-tokens auto` (DraftRule on the replays: 0 unless drafting pays), at constant acceptance 0.7 and 0.85 and at
each measured acceptance file given (`--acceptance-file`, what `bench --draft cached --acceptance-out` wrote);
with misses fetched (`--cpu-experts never`) and with `--cpu-experts auto`. Each row is one `moectl simulate
--draft-tokens auto --acceptance A` (its `draft.by_k` holds every K), so the table is reproduced by

    python bench/speculative_sim.py [--shared /work/shared/traces] [--fraction 0.25] [--hardware rtx4090-pcie4]
                                    [--draft cached|model] [--acceptance-file F ...] [--traces NAME ...] [--json out]

and one of its cells by e.g. `moectl simulate -t mixtral-8x7b.gsm8k.jsonl --cache-fraction 0.25 --draft-tokens 4
--acceptance 0.85`. Acceptance is sampled per trace row (seed 0, the same draws for every K). The union column is
the distinct experts of 4 consecutive decode tokens over 4 tokens' experts (sim/passes.py: union_ratio).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moectl.policies.draft import load_acceptance
from moectl.sim import run as sim
from moectl.sim.passes import DraftSpec, union_ratio
from moectl.trace import load_trace

HELD_OUT = ["mixtral-8x7b.gsm8k", "olmoe.code", "qwen.code", "qwen1.5-moe.cooking_1", "gptoss.code", "granite.code"]


def row(tr, caps, cost, cpu: str, acc, a) -> dict:
    spec = DraftSpec(None, acc, a.draft, a.draft_ms, k_max=4)
    r = sim.simulate(tr, caps, a.replacement, a.prefetch, cost, cpu_experts=cpu, belady=False, draft=spec)
    by_k = r.draft["by_k"]
    base = by_k[0]["ms_per_token"]
    best = min(range(1, 5), key=lambda k: by_k[k]["ms_per_token"])
    return dict(cpu_experts=cpu, acceptance=acc.source, no_draft_ms=base,
                ms={k: by_k[k]["ms_per_token"] for k in by_k}, speedup={k: base / by_k[k]["ms_per_token"] for k in by_k},
                tokens_per_pass={k: by_k[k]["tokens_per_pass"] for k in by_k},
                mb_per_token={k: by_k[k]["bytes_per_token"] / 1e6 for k in by_k},
                best_k=best, auto_k=r.draft["chosen_k"], auto_ms=r.ms_per_token, auto_speedup=base / r.ms_per_token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default="/work/shared/traces")
    ap.add_argument("--traces", nargs="*", default=HELD_OUT)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--hardware", default="rtx4090-pcie4")
    ap.add_argument("--replacement", default="lru")
    ap.add_argument("--prefetch", default="none")
    ap.add_argument("--draft", default="cached", choices=["cached", "model"])
    ap.add_argument("--draft-ms", type=float, default=None)
    ap.add_argument("--acceptance", nargs="*", default=["0.7", "0.85"])
    ap.add_argument("--acceptance-file", nargs="*", default=[])
    ap.add_argument("--cpu-experts", nargs="*", default=["never", "auto"])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    accs = [load_acceptance(x) for x in a.acceptance + a.acceptance_file]
    for f in a.acceptance_file:
        acc = load_acceptance(f)
        print(f"- measured acceptance {f}: per position {[round(p, 3) for p in acc.per_position]} over "
              f"{acc.passes} passes ({acc.source})")
    print(f"\n{a.fraction:.0%} of the experts cached, {a.hardware}, {a.replacement}/{a.prefetch}, draft {a.draft}; "
          f"ms/token (speedup over no drafting); auto = DraftRule's K\n")
    print("| trace | union of 4 | cpu experts | acceptance | no draft | K=1 | K=2 | K=3 | K=4 | best K | auto (K) | "
          "tok/pass K=4 | MB/tok no draft -> K=4 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for name in a.traces:
        tr = load_trace(Path(a.shared) / f"{name}.jsonl")
        cost = sim.cost_for(tr, a.hardware)
        caps = sim.capacities(tr, a.fraction)
        u = union_ratio(tr, 4)
        for cpu in a.cpu_experts:
            for acc in accs:
                d = row(tr, caps, cost, cpu, acc, a) | dict(trace=name, union4=u)
                out.append(d)
                cell = lambda k: f"{d['ms'][k]:.1f} ({d['speedup'][k]:.2f}x)"            # noqa: E731
                label = acc.source if acc.passes == 0 else f"measured {[round(p, 2) for p in acc.per_position]}"
                print(f"| {name} | {u:.2f} | {cpu} | {label} | {d['no_draft_ms']:.1f} | "
                      + " | ".join(cell(k) for k in range(1, 5))
                      + f" | {d['best_k']}: {d['speedup'][d['best_k']]:.2f}x | {d['auto_ms']:.1f} ({d['auto_k']}, "
                        f"{d['auto_speedup']:.2f}x) | {d['tokens_per_pass'][4]:.2f} | "
                        f"{d['mb_per_token'][0]:.0f} -> {d['mb_per_token'][4]:.0f} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
