"""Prefetch admission (issue 13): every prefetch kind with and without the admission rule vs no prefetch.

For every shared trace (and the tiny model's traces when given) at 25 % and 50 % of the experts cached on
rtx4090-pcie4, with the same replacement (LRU): ms/token of `--prefetch none`, and of each prefetch kind the
trace supports with `--admission off` and `--admission on`. The claim checked: with admission, no kind is
slower than no prefetch, and most are faster.

Prefetch kinds per trace: eam always; routing when a sibling trace of the same model exists to train the
predictor on (never the simulated trace; the single Mixtral file: each request, trained on the other); gate-reuse /
mlp / aux-gate when the trace has hidden states (the tiny model's profiled traces; mlp and aux-gate need
--tiny-train). `oracle` (it knows the future: simulator only) is no kind a user runs and is left out.

    python bench/admission.py [--shared /work/shared/traces] [--tiny VAL_TRACE --tiny-train TRAIN_TRACE]
                              [--fractions 0.25 0.5] [--cpu-experts never|auto] [--rows all|tune|held-out]
                              [--kinds K ...] [--traces NAME ...] [--json out.json]

Prefetches copy into the runtime's staging buffers (2 when misses are fetched, `--staging-buffers` to change): a wrong
prediction evicts nothing. The last column runs no prefetch with those buffers' bytes as 2 more cache slots (the same
device memory).

`--cpu-experts auto`: moectl's CPU-compute-of-misses mode in every run (none and each kind): a miss runs on the CPU
when the cost model says that beats fetching it, so the copy engine mostly idles and a right prefetch turns a
CPU-computed miss into a device hit.

Held out: the admission rule's parameters were compared on the `tune` traces (one of each model's pair: *.math,
Mixtral request 0; the tiny model's train trace is never simulated); the others are judged with them
(docs/benchmarks.md says which rule changes followed a held-out result).
Counts are strict: "equal" is exactly equal ms/token (--noise 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moectl.sim import simulate as sim
from moectl.policies.admission import prefetch_staging
from moectl.artifacts.trace_dir import load_trace

SIBLING = {"olmoe.math": "olmoe.code", "olmoe.code": "olmoe.math", "qwen.math": "qwen.code",
           "qwen.code": "qwen.math", "gptoss.math": "gptoss.code", "gptoss.code": "gptoss.math",
           "granite.math": "granite.code", "granite.code": "granite.math",
           "qwen1.5-moe.cooking_1": "qwen.math"}


def held_out(name: str) -> bool:
    """False for the traces the rule was tuned on (one of each model's pair)."""
    return not (name.endswith(".math") or name.endswith("request 0"))


def cases(shared: Path, tiny: Path | None, tiny_train: Path | None, tiny_model: str | None):
    """(name, trace, train trace or None, cost model) for each trace."""
    for f in sorted(shared.glob("*.jsonl")):
        tr = load_trace(f)
        sib = SIBLING.get(f.stem)
        cost = sim.cost_for(tr, "rtx4090-pcie4")
        yield f.stem, tr, load_trace(shared / f"{sib}.jsonl") if sib else None, cost
        reqs = [tr.select(sl) for _, sl in tr.request_slices()]
        if sib is None and len(reqs) >= 2:          # one file (Mixtral): each request, routing trained on the others
            for i, r in enumerate(reqs):
                yield f"{f.stem} request {i}", r, sim.concat([o for j, o in enumerate(reqs) if j != i]), cost
    if tiny is not None:
        tr = load_trace(tiny)
        yield "tiny", tr, load_trace(tiny_train) if tiny_train else None, sim.cost_for(tr, "rtx4090-pcie4", tiny_model)


def predictors(tr, train, kinds=None):
    """{kind: the keywords `sim.simulate` takes for it} the trace supports, of `kinds` (None: all); only those are
    trained."""
    def want(*names):
        return kinds is None or any(n in kinds for n in names)

    out = {"eam": {}}
    if train is not None and want("routing"):
        from moectl.predictors.routing import train_routing_predictor

        out["routing"] = dict(predictor=train_routing_predictor([train], lookahead=[1, 2])[0])
    if sim.hidden_lookup(tr) is not None and tr.routers:
        out["gate-reuse"] = {}
        if train is not None and sim.hidden_lookup(train) is not None and want("mlp", "aux-gate"):
            from moectl.predict.train import train_aux_gate, train_mlp

            out["mlp"] = dict(predictor=train_mlp([train], [1, 2], epochs=40, max_minutes=0.5)[0])
            # the aux gate: the next token's first layer from this token's final hidden state, the mlp for the rest
            if want("aux-gate"):
                out["aux-gate"] = dict(out["mlp"], aux_gate=train_aux_gate([train], epochs=40, max_minutes=0.5)[0])
    return {k: kw for k, kw in out.items() if want(k)}


def prefetches(r) -> float:
    """Prefetch copies issued per decode token (the cache state's count: the engine's copies also include fills,
    CPU-computed misses copied in while it idles)."""
    return sum(r.cache["decode"]["prefetches"]) / max(r.tokens, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", type=Path, default=Path("/work/shared/traces"))
    ap.add_argument("--tiny", type=Path, help="a profiled trace of the tiny model with hidden states")
    ap.add_argument("--tiny-train", type=Path, help="another trace of the tiny model to train predictors on")
    ap.add_argument("--tiny-model", help="the tiny model's checkpoint directory (its shape), e.g. "
                                         "~/.cache/moectl/tiny/checkpoint")
    ap.add_argument("--noise", type=float, default=0.0, help="relative differences up to this count as 'equal' "
                    "(default 0: strict)")
    ap.add_argument("--cpu-experts", default="never", choices=["never", "auto"],
                    help="never: misses fetched (the CLI default); auto: computed on the CPU when cheaper")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--replacement", default="lru")
    ap.add_argument("--rows", default="all", choices=["all", "tune", "held-out"],
                    help="which traces to run: the rule is compared on `tune` only; `held-out` judges it")
    ap.add_argument("--staging-buffers", type=int, help="prefetch staging buffers (default: the runtime's, 2 when "
                    "misses are fetched, else 0; 0 = prefetches copy into cache slots)")
    ap.add_argument("--kinds", nargs="+", help="only these prefetch kinds (default: every kind the trace supports)")
    ap.add_argument("--traces", nargs="+", help="only traces whose name starts with one of these (e.g. tiny)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows, slower = [], []
    tally = {held: [0, 0, 0] for held in (False, True)}        # held out? -> [faster, equal, slower]
    print("| trace | held out | cached | none ms/tok | prefetch | off ms/tok (pf/tok, wasted) | on ms/tok (pf/tok, wasted) "
          "| on vs none | none, staging memory as slots (on vs it) |")
    print("|---|---|---|---|---|---|---|---|---|")
    cpu = a.cpu_experts
    staging = prefetch_staging(cpu) if a.staging_buffers is None else a.staging_buffers
    print(f"prefetch staging buffers: {staging}")
    for name, tr, train, cost in cases(a.shared, a.tiny, a.tiny_train, a.tiny_model):
        if a.rows != "all" and held_out(name) != (a.rows == "held-out"):
            continue
        if a.traces and not any(name.startswith(t) for t in a.traces):
            continue
        preds = predictors(tr, train, a.kinds)
        for f in a.fractions:
            caps = sim.capacities(tr, fraction=f)
            none = sim.simulate(tr, caps, a.replacement, "none", cost, belady=False, cpu_experts=cpu)
            # the same device memory as a staged run: the staging buffers as cache slots instead (earliest layers)
            more = list(caps)
            for i in range(staging):
                more[i % len(more)] = min(more[i % len(more)] + 1, tr.num_experts)
            none_mem = sim.simulate(tr, more, a.replacement, "none", cost, belady=False,
                                    cpu_experts=cpu) if staging else none
            for kind, kw in preds.items():
                r = {adm: sim.simulate(tr, caps, a.replacement, kind, cost, belady=False, admission=adm,
                                       cpu_experts=cpu, staging=staging, **kw) for adm in ("off", "on")}
                on, off = r["on"], r["off"]
                d = on.ms_per_token / none.ms_per_token - 1
                held = held_out(name)
                tally[held][0 if d < -a.noise else 2 if d > a.noise else 1] += 1
                if d > a.noise:
                    slower.append((name, f, kind, f"{d:+.4%}"))
                row = dict(trace=name, held_out=held, fraction=f, prefetch=kind, none=none.ms_per_token,
                           off=off.ms_per_token,
                           on=on.ms_per_token, off_prefetch=prefetches(off), on_prefetch=prefetches(on),
                           off_wasted=off.wasted_prefetch_fraction, on_wasted=on.wasted_prefetch_fraction,
                           cpu_experts=cpu, staging=staging, none_same_memory=none_mem.ms_per_token)
                rows.append(row)
                print(f"| {name} | {'yes' if held else 'tune'} | {f:.0%} | {none.ms_per_token:.4g} | {kind} | "
                      f"{off.ms_per_token:.4g} "
                      f"({prefetches(off):.2f}, {off.wasted_prefetch_fraction:.0%}) | {on.ms_per_token:.4g} "
                      f"({prefetches(on):.2f}, {on.wasted_prefetch_fraction:.0%}) | "
                      f"{d:+.3%} | {none_mem.ms_per_token:.4g} ({on.ms_per_token / none_mem.ms_per_token - 1:+.3%}) |",
                      flush=True)
    for held, (fa, eq, sl) in tally.items():
        print(f"\n{'held-out' if held else 'tuning'} traces (--cpu-experts {cpu}), with admission, of {fa + eq + sl}: "
              f"{fa} faster than no prefetch, {eq} equal (+-{a.noise:.2%}), {sl} slower")
    print(f"slower: {slower}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
