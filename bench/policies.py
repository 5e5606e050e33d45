"""Cache and prefetch policies on the shared real routing traces (`../shared/traces/*.jsonl`).

Prints:
 1. each replacement policy's hit rate as a fraction of Belady's, at cache fractions 0.25 and 0.5;
 2. demand loads per token of routing-only prefetch (routing predictor trained on the OTHER file of the
    same model, never on the simulated one; for the single Mixtral file, on its other request) as a
    fraction of lru/none's, with ms/token on the model's real shape on rtx4090-pcie4;
 3. simulated Mixtral-8x7B on rtx4090-pcie4 with 50 % of experts cached: ms/token of mixtral-offloading's
    policy (lru/none), MoE-Infinity's (moe-infinity/eam), ours, and the lower bound (compute only).

Run: /tmp/venv/bin/python bench/policies.py [--quick] [--json out.json]   (a few minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.predict.routing import train_routing_predictor  # noqa: E402
from moectl.sim.run import capacities, cost_for, simulate  # noqa: E402
from moectl.trace import load_trace  # noqa: E402

REPLACEMENTS = ["lru", "lfu", "moe-infinity", "hobbit", "ours"]
FRACTIONS = [0.25, 0.5]
HW = "rtx4090-pcie4"
# simulated file -> files of the same model to train the routing predictor on
PARTNERS = {
    "olmoe.code": ["olmoe.math"], "olmoe.math": ["olmoe.code"],
    "qwen.code": ["qwen.math"], "qwen.math": ["qwen.code"],
    "gptoss.code": ["gptoss.math"], "gptoss.math": ["gptoss.code"],
    "granite.code": ["granite.math"], "granite.math": ["granite.code"],
    "qwen1.5-moe.cooking_1": ["qwen.math", "qwen.code"],
}


def traces_dir() -> Path:
    env = os.environ.get("MOECTL_SHARED")
    cands = [Path(env) / "traces"] if env else []
    cands.append(Path(__file__).resolve().parents[2] / "shared" / "traces")
    for c in cands:
        if c.is_dir():
            return c
    sys.exit(f"no shared traces found (tried {', '.join(map(str, cands))}); set MOECTL_SHARED")


def split_requests(tr):
    return [tr.select(sl) for _, sl in tr.request_slices()]


def held_out_pairs(name: str, tr, all_traces: dict) -> list[tuple[object, list]]:
    """(simulated trace, training traces) pairs that never train on the simulated tokens."""
    if name in PARTNERS:
        return [(tr, [all_traces[p] for p in PARTNERS[name] if p in all_traces])]
    reqs = split_requests(tr)                                 # one file: hold out one request at a time
    if len(reqs) < 2:
        return []
    return [(r, [o for j, o in enumerate(reqs) if j != i]) for i, r in enumerate(reqs)]


def combine(results: list) -> dict:
    """Token-weighted sum of per-part SimResults."""
    n = sum(r.tokens for r in results)
    keys = ["hit_rate", "demand_loads_per_token", "prefetch_loads_per_token", "stall_ms_per_token",
            "ms_per_token", "lower_bound_ms_per_token", "wasted_prefetch_fraction"]
    return {k: sum(getattr(r, k) * r.tokens for r in results) / max(n, 1) for k in keys} | {"tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="first 256 decode rows of each file")
    ap.add_argument("--json", type=Path, help="also write every number here")
    args = ap.parse_args()
    t_start = time.time()
    d = traces_dir()
    files = sorted(d.glob("*.jsonl"))
    traces = {f.name[: -len(".jsonl")]: load_trace(f) for f in files}
    if args.quick:
        traces = {k: t.select(slice(0, 256)) for k, t in traces.items()}
    out: dict = {"replacement": {}, "prefetch": {}, "mixtral": {}}

    print("\n1. Replacement hit rate / Belady's (no prefetch); Belady's hit rate in brackets")
    print(f"{'trace':24s} {'F':>5s} {'belady':>7s} " + " ".join(f"{r:>12s}" for r in REPLACEMENTS) + "   best")
    for name, tr in traces.items():
        cost = cost_for(tr, HW)
        for f in FRACTIONS:
            caps = capacities(tr, fraction=f)
            row, bel = {}, None
            for r in REPLACEMENTS:
                res = simulate(tr, caps, r, "none", cost, belady=bel is None)
                bel = res.belady_hit_rate if bel is None else bel
                row[r] = res.hit_rate
            frac = {r: h / bel for r, h in row.items()}
            best = max(frac, key=frac.get)
            out["replacement"][f"{name}@{f}"] = {"belady": bel, **{r: frac[r] for r in REPLACEMENTS}}
            print(f"{name:24s} {f:5.2f} {bel:7.3f} " + " ".join(f"{frac[r]:12.3f}" for r in REPLACEMENTS)
                  + f"   {best} {frac[best]:.3f}")

    print("\n2. Demand loads per token as a fraction of lru/none's (routing predictor trained on other files "
          f"of the same model); ms/token on {HW} in brackets")
    configs = [("ours", "none"), ("moe-infinity", "eam"), ("ours", "routing")]
    print(f"{'trace':24s} {'F':>5s} {'lru/none':>16s} " + " ".join(f"{r + '/' + p:>22s}" for r, p in configs))
    for name, tr in traces.items():
        pairs = held_out_pairs(name, tr, traces)
        if not pairs:
            continue
        preds = [train_routing_predictor(train, lookahead=[1, 2])[0] for _, train in pairs]
        for f in FRACTIONS:
            res = {}
            for r, p in [("lru", "none")] + configs:
                parts = []
                for (test, train), pred in zip(pairs, preds):
                    cost = cost_for(test, HW)
                    parts.append(simulate(test, capacities(test, fraction=f), r, p, cost, predictor=pred,
                                          train_traces=train, belady=False))
                res[f"{r}/{p}"] = combine(parts)
            base = res["lru/none"]["demand_loads_per_token"]
            out["prefetch"][f"{name}@{f}"] = res
            print(f"{name:24s} {f:5.2f} {base:7.2f} ({res['lru/none']['ms_per_token']:6.1f}) " + " ".join(
                f"{res[f'{r}/{p}']['demand_loads_per_token'] / max(base, 1e-9):13.3f} ({res[f'{r}/{p}']['ms_per_token']:6.1f})"
                for r, p in configs))

    print(f"\n3. Mixtral-8x7B (bf16, 352 MB experts) on {HW}, 50 % of experts cached, real GSM8K routing")
    mx = next((t for k, t in traces.items() if k.startswith("mixtral")), None)
    if mx is not None:
        pairs = held_out_pairs("mixtral", mx, traces)
        preds = [train_routing_predictor(train, lookahead=[1, 2])[0] for _, train in pairs]
        rows = [("mixtral-offloading (lru/none)", "lru", "none"), ("MoE-Infinity (moe-infinity/eam)", "moe-infinity", "eam"),
                ("ours (ours/none)", "ours", "none"), ("ours (ours/routing)", "ours", "routing"),
                ("ours (ours/routing, min_score 0.7)", "ours", "routing")]
        for label, r, p in rows:
            ms = 0.7 if "0.7" in label else None
            parts = [simulate(t, capacities(t, fraction=0.5), r, p, cost_for(t, HW), predictor=pr, train_traces=tt,
                              belady=False, min_score=ms) for (t, tt), pr in zip(pairs, preds)]
            c = combine(parts)
            out["mixtral"][label] = c
            print(f"  {label:34s} {c['ms_per_token']:7.1f} ms/token  (demand loads {c['demand_loads_per_token']:.2f}/token, "
                  f"stall {c['stall_ms_per_token']:.1f} ms)")
        print(f"  {'lower bound (compute only)':34s} {c['lower_bound_ms_per_token']:7.1f} ms/token")
    print(f"\n({time.time() - t_start:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
