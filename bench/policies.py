"""Cache and prefetch policies on the shared real routing traces (`../shared/traces/*.jsonl`).

Prints:
 1. each replacement policy's hit rate as a fraction of Belady's, at cache fractions 0.25 and 0.5;
 2. demand loads per token of routing-only prefetch (routing predictor trained on the OTHER file of the
    same model, never on the simulated one; for the single Mixtral file, on its other request) as a
    fraction of lru/none's, with ms/token on the model's real shape on rtx4090-pcie4; routing+cal picks the
    prefetch threshold / per-layer count (or no prefetch) per cache size on the training traces only;
 3. simulated Mixtral-8x7B on rtx4090-pcie4 with 50 % of experts cached: ms/token of mixtral-offloading's
    policy (lru/none), MoE-Infinity's (moe-infinity/eam), ours, and the lower bound (compute only);
 4. the built-in tiny model's own profiled traces (hidden states of every token): gate-reuse and the mlp
    predictor (ProMoE) at lookahead depths 1-3 (and with AdapMoE's aux gate for layer 0), demand loads per
    token as a fraction of lru/none's. The predictors are trained on the first validation documents and
    simulated on OTHER documents. Uses the full tiny model of $MOECTL_HOME/tiny when it is built, else
    builds the small variant in a temp dir.

Run: /tmp/venv/bin/python bench/policies.py [--quick] [--tiny-only | --no-tiny] [--json out.json]
(a few minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.predictors.routing import train_routing_predictor  # noqa: E402
from moectl.sim.simulate import capacities, cost_for, simulate  # noqa: E402
from moectl.artifacts.trace_dir import load_trace  # noqa: E402

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


# (min_score, per_layer) candidates for routing prefetch; None = the policy's default (0.5, top-k); 1.01 = off
CAL_GRID = [(None, None), (0.7, None), (0.85, None), (0.95, None), (None, 1), (0.7, 1), (1.01, None)]


def calibrate_routing(train: list, f: float, replacement: str = "ours") -> tuple:
    """Pick routing prefetch's (min_score, per_layer) for cache fraction f on the TRAINING traces only: a
    predictor trained on half of them (alternate requests, or the first half of each when requests are few)
    is simulated on the other half. Small caches favour fewer, surer prefetches (each one evicts something)."""
    reqs = [r for t in train for r in split_requests(t)]
    if len(reqs) >= 4:
        a, b = reqs[0::2], reqs[1::2]
    else:
        a = [r.select(slice(0, r.num_tokens // 2)) for r in reqs]
        b = [r.select(slice(r.num_tokens // 2, r.num_tokens)) for r in reqs]
    pred = train_routing_predictor(a, lookahead=[1, 2])[0]
    best, best_v = (None, None), float("inf")
    for ms, pl in CAL_GRID:
        v = combine([simulate(t, capacities(t, fraction=f), replacement, "routing", cost_for(t, HW), predictor=pred,
                              train_traces=a, belady=False, min_score=ms, per_layer=pl) for t in b])
        if v["demand_loads_per_token"] < best_v:
            best, best_v = (ms, pl), v["demand_loads_per_token"]
    return best


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
    ap.add_argument("--tiny-only", action="store_true", help="only section 4 (the tiny model's own traces)")
    ap.add_argument("--no-tiny", action="store_true", help="skip section 4")
    args = ap.parse_args()
    t_start = time.time()
    if args.tiny_only:
        out = {"tiny": tiny_section(args.quick)}
        print(f"\n({time.time() - t_start:.0f} s)")
        if args.json:
            args.json.write_text(json.dumps(out, indent=1, default=float))
        return
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
    configs = [("ours", "none"), ("moe-infinity", "eam"), ("ours", "routing"), ("ours", "routing+cal")]
    print("   (routing+cal: min_score / per_layer picked per cache size on the training traces, see calibrate_routing)")
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
                    ms, pl = calibrate_routing(train, f, r) if p == "routing+cal" else (None, None)
                    parts.append(simulate(test, capacities(test, fraction=f), r, p.split("+")[0], cost,
                                          predictor=pred, train_traces=train, belady=False, min_score=ms,
                                          per_layer=pl))
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
    if not args.no_tiny:
        out["tiny"] = tiny_section(args.quick)
    print(f"\n({time.time() - t_start:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=float))


def tiny_checkpoint(tmp: Path) -> Path:
    """The full tiny model when `moectl build-tiny` made it, else the small variant built into `tmp`."""
    from moectl.core.recipes import resolve_model
    from moectl.synth.tiny import _built, build_tiny

    wd = resolve_model("tiny", None).workdir
    if _built(wd):
        return wd / "checkpoint"
    print(f"  (no full tiny model in {wd}: building the small variant; `moectl build-tiny` for the full one)")
    return build_tiny(tmp / "tiny", small=True, progress=False)


def tiny_section(quick: bool = False) -> dict:
    """Profile the tiny model on held-out text, train the mlp predictor on some documents and simulate the
    others: demand loads per token of gate-reuse / mlp (lookahead 1..3) / aux-gate (AdapMoE's first-layer gate
    + mlp) as a fraction of lru/none's."""
    import tempfile

    import torch

    from moectl.calib.builtin_corpus import builtin_corpus
    from moectl.calib.profile import run_profile
    from moectl.predict.train import train_aux_gate, train_mlp
    from moectl.runtime.engine import Engine
    from moectl.core.shapes import shape_from_hf_config
    from moectl.sim.cost import CostModel, load_hardware

    torch.set_num_threads(1)
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="moectl-bench-tiny-") as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        ckpt = tiny_checkpoint(tmp)
        docs = builtin_corpus("validation")
        n_train = 16 if quick else 48                 # documents to train on; the rest (up to 48) are simulated
        n_test = 12 if quick else 48
        eng = Engine.load(model=str(ckpt), device="cpu", progress=False)
        for name, texts in (("train", docs[:n_train]), ("test", docs[n_train: n_train + n_test])):
            run_profile(eng, texts, tmp / name, model_name="tiny", dataset=f"builtin:validation:{name}",
                        max_tokens=256, generate=32, hidden_samples="all")
        del eng
        train, test = load_trace(tmp / "train"), load_trace(tmp / "test")
        # (request ids restart at each profile; the documents are disjoint)
        depths = [d for d in (1, 2, 3) if d < test.num_layers]
        t1 = time.time()
        pred, _ = train_mlp([train], depths, epochs=100, max_minutes=0.5 if quick else 2.0)
        gate, _ = train_aux_gate([train], epochs=100, max_minutes=0.2 if quick else 0.5)
        t2 = time.time()
        cost = CostModel(load_hardware(HW), shape_from_hf_config(json.loads((ckpt / "config.json").read_text())))
        print(f"\n4. Tiny model ({ckpt.parent.name}: {test.num_layers} MoE layers x {test.num_experts} experts, "
              f"top-{test.top_k}), own traces: mlp trained on {n_train} documents ({train.num_tokens} tokens), "
              f"simulated on {len(test.request_slices())} others ({int((test.phase != 0).sum())} decode tokens); "
              f"profile {t1 - t0:.0f} s, train {t2 - t1:.0f} s")
        print("   demand loads per token as a fraction of lru/none's (prefetch loads per token in brackets)")
        configs = [("lru", "none", None)] + [("lru", "gate-reuse", d) for d in depths] + \
                  [("lru", "mlp", d) for d in depths] + [("ours", "mlp", max(depths[:2]))] + \
                  [("lru", "aux-gate", max(depths[:2]))]
        print(f"   {'F':>5s} {'lru/none':>9s} " + " ".join(f"{f'{r}/{p}@{d}':>18s}" for r, p, d in configs[1:]))
        for f in FRACTIONS:
            caps = capacities(test, fraction=f)
            row = {}
            for r, p, d in configs:
                x = simulate(test, caps, r, p, cost, predictor=pred if p in ("mlp", "aux-gate") else None,
                             depth=d, belady=False, aux_gate=gate)
                row[f"{r}/{p}@{d}"] = {"demand_loads_per_token": x.demand_loads_per_token,
                                       "prefetch_loads_per_token": x.prefetch_loads_per_token,
                                       "ms_per_token": x.ms_per_token}
            base = row["lru/none@None"]["demand_loads_per_token"]
            res[str(f)] = row
            print(f"   {f:5.2f} {base:9.2f} " + " ".join(
                f"{row[f'{r}/{p}@{d}']['demand_loads_per_token'] / max(base, 1e-9):11.3f} "
                f"({row[f'{r}/{p}@{d}']['prefetch_loads_per_token']:4.2f})" for r, p, d in configs[1:]))
    return res


if __name__ == "__main__":
    main()
