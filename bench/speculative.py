"""Speculative decoding on the tiny model (issue 33): acceptance per position and ms/token with `--draft cached` and
with a smaller tiny draft (the tiny model cut to its first layers, sharing its tokenizer), at K = 1..4
(`--draft-rule always`) and `auto` (K <= 4), against no draft, in two settings:

  emulated   --emulate-device, a small cache (25 % of the experts), no prefetch, misses fetched, every copy paced to
             "PCIe speed per byte" relative to compute: the emulated link moves bytes pcie_gbps / (gpu_mem_gbps x
             mem_efficiency) as fast as this CPU computes an expert for one token (rtx4090-pcie4: 25 / 756), the ratio
             a real GPU has (a Mixtral expert copies in ~14 ms and computes in ~0.5 ms). The rate is measured here.
  in-place   the CPU computing every expert in place from RAM: nothing misses, nothing is copied.

One process, 1 thread; per setting one engine per draft source, every configuration (no draft included) run on the
same prompt in turn before the next prompt (so load drifts hit all alike; a source's speed-up is against the no-draft
runs on its own engine); sampling at temperature 0.8, top-p 0.95, seeded (the tiny model's greedy output
repeats itself, which flatters any draft), `--greedy` to see that. ms/token = decode time after the first token
over the tokens produced (drafting included); expert bytes/token = bytes copied in decode over those tokens.

    python bench/speculative.py [--tokens 48] [--prompts 6] [--draft-layers 1] [--cache-experts 12] [--greedy]
                                [--settings emulated in-place] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = ["def read(path):\n    with open(path) as f:", "The os module provides a portable way of using",
           "Return the number of items in a container.", "class Thread:\n    def __init__(self, group=None,",
           "import sys\nimport json\n\ndef main():", "Raise a ValueError if the value is negative.",
           "Parse the command line arguments and", "    for key, value in sorted(items):\n"]
SETTINGS = {"emulated": dict(emulate_device=True, cache_experts=12, prefetch="none", cpu_experts="never"),
            "in-place": dict()}


def expert_compute_gbps() -> float:
    """Bytes per second at which this CPU computes one tiny expert for one token (1 thread)."""
    from moectl.runtime.engine import Engine

    eng = Engine.load("tiny", progress=False, threads=1)
    w = eng.cache.acquire(0, 0)
    x = torch.randn(1, eng.config.hidden_size)
    f = eng.model.model.layers[0].mlp.experts
    for _ in range(20):
        eng.runtime.adapter.expert_forward(w, x, f.apply_gate)
    t0, n = time.perf_counter(), 300
    for _ in range(n):
        eng.runtime.adapter.expert_forward(w, x, f.apply_gate)
    return eng.store.expert_nbytes * n / (time.perf_counter() - t0) / 1e9


def configs(k_max: int) -> list[tuple[str, int, str]]:
    """(name, K, rule): no draft, K = 1..k_max always, auto."""
    return [("none", 0, "")] + [(f"K={k}", k, "always") for k in range(1, k_max + 1)] + [("auto", k_max, "auto")]


def run_setting(setting: str, sources: dict, args, copy_gbps: float | None) -> list[dict]:
    from moectl.policies.draft_length import AcceptanceCounter
    from moectl.runtime.engine import Engine
    from moectl.policies.draft_length import FixedDraftRule
    from moectl.policies.draft_length import OnlineDraftRule

    rows = []
    for src_name, src in sources.items():
        eng = Engine.load("tiny", progress=False, threads=1, draft=src, draft_tokens=args.k_max, **SETTINGS[setting])
        if copy_gbps:
            eng.cache.emulated_gbps = copy_gbps
        spec = eng.speculator
        todo = configs(args.k_max)              # "none" on every engine: each source's speed-up is paired
        acc = {name: {"counter": AcceptanceCounter(source=f"measured: tiny, --draft {src_name}, {setting}, {name}"),
                      "ms": [], "bytes": 0, "tokens": 0, "passes": 0, "rule": OnlineDraftRule(k)
                      if rule == "auto" else FixedDraftRule(k)} for name, k, rule in todo}
        for i, prompt in enumerate(PROMPTS[:args.prompts]):
            for name, k, rule in todo:
                a = acc[name]
                spec.enabled = k > 0
                spec.counter, spec.rule = a["counter"], a["rule"]
                r = eng.generate(prompt, max_new_tokens=args.tokens, greedy=args.greedy, temperature=0.8, top_p=0.95,
                                 seed=i, stop_at_eos=False)
                n = len(r.token_ids) - 1
                a["ms"].append(r.stats["decode_ms_per_token"])
                a["tokens"] += n
                a["bytes"] += sum(t["bytes_loaded"] for t in r.per_token[1:])
                a["passes"] += r.stats["draft"]["passes"] if "draft" in r.stats else n
        for name, k, rule in todo:
            a = acc[name]
            rows.append({"setting": setting, "draft": src_name, "config": name,
                         "acceptance": a["counter"].acceptance().per_position if k else [],
                         "tokens_per_pass": a["tokens"] / max(a["passes"], 1),
                         "ms_per_token": statistics.median(a["ms"]),
                         "expert_bytes_per_token": a["bytes"] / max(a["tokens"], 1)})
        del eng
        base = next(r["ms_per_token"] for r in rows if r["config"] == "none" and r["draft"] == src_name)
        for r in rows[-len(todo):]:
            r["speedup"] = base / r["ms_per_token"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=1, help="layers of the smaller tiny draft (of 6)")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--cache-experts", type=int, default=12, help="emulated setting: expert slots (of 48)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    SETTINGS["emulated"]["cache_experts"] = args.cache_experts
    from moectl.commands._common import prepare_model
    from moectl.core.recipes import resolve_model
    from moectl.synth.truncate import truncate_checkpoint

    prepare_model("tiny")
    small = Path(tempfile.mkdtemp(prefix="moectl-draft-")) / f"tiny-{args.draft_layers}layer"
    truncate_checkpoint(resolve_model("tiny").path, small, args.draft_layers)
    sources = {"cached": "cached", f"tiny-{args.draft_layers}layer": str(small)}
    ratio = 25.0 / (1008.0 * 0.75)                                  # rtx4090-pcie4: pcie / (gpu_mem x efficiency)
    compute = expert_compute_gbps()
    copy_gbps = compute * ratio
    load = os.getloadavg()
    rows = []
    for s in args.settings:
        rows += run_setting(s, sources, args, copy_gbps if s == "emulated" else None)
    print(f"tiny model, {args.prompts} prompts x {args.tokens} tokens, "
          f"{'greedy' if args.greedy else 'sampling T 0.8 top-p 0.95'}, 1 thread, load average {load[0]:.1f} "
          f"(start) / {os.getloadavg()[0]:.1f} (end); emulated copy {copy_gbps * 1000:.0f} MB/s "
          f"(expert compute {compute:.1f} GB/s x {ratio:.4f}), emulated cache {args.cache_experts} of 48 experts")
    print(f"{'setting':9} {'draft':13} {'config':6} {'acceptance per position':28} {'tok/pass':>8} "
          f"{'ms/token':>9} {'KB/token':>9} {'speed-up':>8}")
    for r in rows:
        acc = " ".join(f"{p:.2f}" for p in r["acceptance"])
        print(f"{r['setting']:9} {r['draft']:13} {r['config']:6} {acc:28} {r['tokens_per_pass']:8.2f} "
              f"{r['ms_per_token']:9.2f} {r['expert_bytes_per_token'] / 1e3:9.0f} {r['speedup']:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "copy_gbps": copy_gbps, "load": load}, indent=1))


if __name__ == "__main__":
    main()
