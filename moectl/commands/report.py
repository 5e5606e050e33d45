"""`moectl report`: plots and a summary table of a routing trace (directory or JSONL)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def report(
    traces: Path = typer.Option(..., "--traces", "-t", help="trace directory or moe-routing-v1 JSONL file"),
    out: Path = typer.Option(None, "--out", help="directory for the PNGs [default: <trace dir>/report, "
                                                 "or ./<file stem>-report for a JSONL file]"),
    phase: str = typer.Option("all", "--phase", help="all | prefill | decode: which tokens to analyse"),
    sizes: str = typer.Option(None, "--cache-sizes", help="comma-separated pool sizes (experts per layer) "
                                                          "[default: 8 sizes from top-k to E]"),
    as_json: bool = typer.Option(False, "--json", help="print the numbers as one JSON object"),
) -> None:
    """Per-layer expert usage, reuse distances, LRU vs Belady hit rate by cache size (PNGs + table)."""
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from ..artifacts.trace_dir import load_trace
    from ..calib.report import analyze, summary_json, write_plots
    from ..core.paths import writable_dir
    from ..core.trace import PHASES
    from ..errors import MoectlError
    from ..tables import plural, print_table

    console = Console(stderr=as_json)
    if not traces.exists():
        raise MoectlError(f"--traces {traces} does not exist (a trace directory or moe-routing-v1 JSONL file)")
    if out is None:
        out = traces / "report" if traces.is_dir() else Path.cwd() / f"{traces.stem}-report"
    writable_dir(out, "--out")                               # before the work, not after it
    if traces.is_dir():                                     # hidden samples are not needed here
        from ..artifacts.trace_dir import read_trace_dir

        trace = read_trace_dir(traces, hidden=False)
    else:
        trace = load_trace(traces)
    if phase != "all":
        if phase not in PHASES:
            raise MoectlError(f"--phase must be all, prefill or decode, not {phase!r}")
        trace = trace.select(np.nonzero(trace.phase == PHASES[phase])[0])
        if trace.num_tokens == 0:
            raise MoectlError(f"{traces} has no {phase} tokens")
    try:
        size_list = [int(s) for s in sizes.split(",")] if sizes else None
    except ValueError:
        raise MoectlError(f"--cache-sizes takes comma-separated integers, not {sizes!r}") from None
    with console.status("replaying the trace through LRU and Belady..."):
        a = analyze(trace, size_list)
        files = write_plots(a, out, trace.model)
    s = summary_json(a, files)
    if as_json:
        print(json.dumps(s))
        return
    console.print(f"[bold]{trace.model}[/]: {s['tokens']} tokens ({s['prefill_tokens']} prefill, "
                  f"{s['decode_tokens']} decode), {plural(s['requests'], 'request')}, {plural(s['layers'], 'layer')} x "
                  f"{s['experts']} experts, top-{s['top_k']}")
    console.print(f"expert reuse: within a request {s['reuse_within_request']:.1%}, only across requests "
                  f"{s['reuse_across_requests']:.1%}, first use {s['cold']:.1%}")
    mid = len(a["cache_sizes"]) // 2
    c = a["cache_sizes"][mid]
    names = ["layer", "entropy\nbits", f"/ max\n{a['entropy_max_bits']:.2f}", "busiest\nexpert:\ntokens",
             "reuse\nwithin", "reuse\nacross", f"LRU\nhit@{c}", f"Belady\nhit@{c}"]
    cells = [[str(l), f"{a['entropy_bits'][l]:.2f}", f"{a['entropy_bits'][l] / a['entropy_max_bits']:.2f}",
              f"{a['top_expert_share'][l]:.2f}", f"{a['reuse_within'][l]:.1%}", f"{a['reuse_across'][l]:.1%}",
              f"{a['lru_hit_rate'][l, mid]:.3f}", f"{a['belady_hit_rate'][l, mid]:.3f}"] for l in range(a["layers"])]
    print_table(console, names, cells, title=f"per layer (hit rates at a pool of {c} experts per layer)")
    h = Table(title="hit rate vs cache size (mean over layers)")
    h.add_column("experts per layer", justify="right")
    h.add_column("LRU", justify="right")
    h.add_column("Belady/MIN", justify="right")
    h.add_column("LRU / Belady", justify="right")
    for i, size in enumerate(a["cache_sizes"]):
        lru, bel = s["lru_hit_rate"][i], s["belady_hit_rate"][i]
        h.add_row(str(size), f"{lru:.3f}", f"{bel:.3f}", f"{lru / bel:.2f}" if bel > 0 else "-")
    console.print(h)
    console.print("plots: " + ", ".join(files.values()))
