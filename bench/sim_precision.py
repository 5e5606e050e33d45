"""Issue 11 / 18 figures from the simulator: precision on a miss and CPU compute of misses, on a real trace.

On the shared Mixtral trace at a 20 GB budget on rtx4090-pcie4 (defaults), LRU replacement, no prefetch:
bytes/token and ms/token for bf16 only, HOBBIT hi/lo/skip (T1 0.6, T2 0.9, q4g64 copies, 25 % of the expert
budget low-bit), and lowbit-only at q2/q3/q4 (group 64); then the same with `--cpu-experts auto` (misses computed
on the CPU from host RAM where the cost model says it beats the copy, overlapping the device's experts).

    python bench/sim_precision.py [--trace T] [--budget 20GB] [--hardware rtx4090-pcie4] [--replacement lru]
"""

from __future__ import annotations

import argparse

from moectl.artifacts.trace_dir import load_trace
from moectl.setting.model_sizes import shape_sizes
from moectl.setting.options import RuntimeOptions
from moectl.setting.resolve import resolve
from moectl.sim import simulate as sim

CONFIGS = [("bf16 only", "full", None), ("HOBBIT hi/lo/skip q4g64", "hobbit", "q4g64"),
           ("lowbit-only q4g64", "lowbit-only", "q4g64"), ("lowbit-only q3g64", "lowbit-only", "q3g64"),
           ("lowbit-only q2g64", "lowbit-only", "q2g64")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="/work/shared/traces/mixtral-8x7b.gsm8k.jsonl")
    ap.add_argument("--budget", default="20GB")
    ap.add_argument("--hardware", default="rtx4090-pcie4")
    ap.add_argument("--replacement", default="lru")
    a = ap.parse_args()
    tr = load_trace(a.trace)
    cost = sim.cost_for(tr, a.hardware)
    sizes = shape_sizes(cost.shape, tr.num_layers, tr.num_experts, tr.top_k, expert_nbytes=cost.expert_bytes)

    def setting(precision: str, lowbit: str | None, cpu: str):     # as `simulate --budget` resolves it
        opts = RuntimeOptions(budget=a.budget, precision=precision, lowbit=lowbit, cpu_experts=cpu)
        return resolve(opts, sizes, live=False, trace=tr, expert_nbytes=cost.expert_bytes, price_shape=cost.shape)

    caps = setting("full", None, "never").pools["full"]
    print(f"{tr.model}, {tr.num_tokens} tokens, budget {a.budget} ({sum(caps)} bf16 expert slots), {a.hardware}, "
          f"{a.replacement}, no prefetch\n")
    print("| setup | cpu experts | slots | misses/tok (full / low / skip / cpu) | GB/tok copied | ms/tok | cpu ms/tok |")
    print("|---|---|---|---|---|---|---|")
    for cpu in ("never", "auto"):
        for label, prec, lowbit in CONFIGS:
            s = setting(prec, lowbit, cpu)
            r = sim.simulate(tr, s.pools, a.replacement, "none", cost, belady=False, precision=s.precision,
                             lowbit=lowbit, cpu_experts=cpu)
            slots = ", ".join(f"{p} {n}" for p, n in r.slots.items())
            print(f"| {label} | {cpu} | {slots} | {r.full_loads_per_token:.1f} / {r.lowbit_loads_per_token:.1f} / "
                  f"{r.skipped_per_token:.1f} / {r.cpu_experts_per_token:.1f} | {r.bytes_per_token / 1e9:.2f} | "
                  f"{r.ms_per_token:.1f} | {r.cpu_ms_per_token:.1f} |", flush=True)


if __name__ == "__main__":
    main()
