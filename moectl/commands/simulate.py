"""`moectl simulate`: replay routing traces through cache/prefetch policies on a modelled GPU."""

from __future__ import annotations

from pathlib import Path

import typer

from ..policies import PREFETCH_NAMES, REPLACEMENT_NAMES


def simulate(
    trace: list[Path] = typer.Option(..., "--trace", "-t", help="trace directory or moe-routing-v1 JSONL (repeatable; one model)"),
    cache_fraction: float = typer.Option(None, "--cache-fraction", help="fraction of each layer's experts cached"),
    cache_experts: int = typer.Option(None, "--cache-experts", help="expert slots in total, split evenly over layers"),
    plan: Path = typer.Option(None, "--plan", help="moectl-plan-v1 yaml (`moectl plan-cache`): its slots per precision, "
                              "its preload (the experts its trace used most, resident from the first token, as "
                              "the runtime loads them), and its policies and thresholds for every option not given here"),
    preset: str = typer.Option(None, "--preset", help="a setup people use, on this trace at --budget: mixtral-offloading, "
                               "moe-infinity, hobbit, adapmoe, llamacpp-cpu-moe, oracle, moectl (the plan: --plan, "
                               "else one made on this trace), moectl-q4 (docs/benchmarks.md: where each comes from)"),
    budget: str = typer.Option(None, "--budget", help="device memory, e.g. 20GB: the model's dense weights and a "
                               "4096-token KV reserve come off first, experts fill the rest"),
    replacement: str = typer.Option(None, "--replacement", "-r", help=f"(default lru) {', '.join(REPLACEMENT_NAMES)}. moe-infinity "
                                     "matches the request against earlier ones: on a single request without "
                                     "--train-on it is sequence LFU"),
    prefetch: str = typer.Option(None, "--prefetch", "-p", help=f"(default none) {', '.join(PREFETCH_NAMES)} (aux-gate: the aux gate "
                                  "for layer 0 + mlp)"),
    predictor: Path = typer.Option(None, "--predictor", help="predictors dir/json from `moectl train-predictor`"),
    train_on: list[Path] = typer.Option(None, "--train-on", help="train the routing predictor (and seed EAM "
                                        "collections) on these traces of the same model; never the simulated ones"),
    hardware: str = typer.Option("rtx4090-pcie4", "--hardware", help="recipes/hardware/<name>.yaml"),
    model_shape: str = typer.Option(None, "--model-shape", help="recipe whose shape: block sizes the experts, or a checkpoint directory"),
    depth: int = typer.Option(None, "--depth", min=1, help="prefetch lookahead in layers (default: 1 for gate-reuse, else 2)"),
    per_layer: int = typer.Option(None, "--per-layer", min=1, help="experts prefetched per layer (default top-k)"),
    bits: float = typer.Option(None, "--bits", help="expert precision in bits (default: the model's dtype)"),
    precision: str = typer.Option(None, "--precision", help="on a miss: full (the default: always the full copy), hobbit "
                                  "(full / low-bit / skip by the expert's rank score, --t1 --t2), lowbit-only "
                                  "(every expert from its low-bit copy)"),
    lowbit: str = typer.Option(None, "--lowbit", help="the low-bit copy set, q<bits>g<group>, e.g. q4g64 "
                               "(bytes and copy time of a low-bit expert)"),
    t1: float = typer.Option(0.6, "--t1", help="HOBBIT: a missed expert whose rank score <= T1 loads in full precision"),
    t2: float = typer.Option(0.9, "--t2", help="HOBBIT: ... <= T2 loads its low-bit copy, above T2 is skipped"),
    lowbit_fraction: float = typer.Option(None, "--lowbit-fraction", help="HOBBIT: share of the expert budget "
                                          "holding low-bit copies (default 0.25; lowbit-only uses all of it)"),
    cpu_experts: str = typer.Option(None, "--cpu-experts", help="(default never) a miss computed on the CPU from host RAM "
                                    "instead of fetched: auto (whichever the cost model says is faster), never, "
                                    "always; the CPU's experts overlap the device's within a layer"),
    admission: str = typer.Option(None, "--admission", help="(default off, or the plan's) on: issue a prefetch "
                                  "only when its expected saving (confidence x load time it hides) beats its expected "
                                  "cost (copy-engine time it takes from demand loads), capped by the time left before "
                                  "its layer"),
    staging_buffers: int = typer.Option(None, "--staging-buffers", min=0,
                                        help="(default 2 when misses are fetched, else 0; as the runtime) prefetches "
                                             "copy into this many staging buffers instead of cache slots: a wrong "
                                             "prediction evicts nothing; 0 = into slots"),
    compare: bool = typer.Option(False, "--compare", help="run the policy matrix of the papers and ours"),
    gating_threshold: float = typer.Option(None, "--gating-threshold",
                                           help="adaptive top-k on the trace's gate weights: drop a decode token's "
                                                "lower-ranked experts while (dropped weight)^2 x S_layer <= T_g "
                                                "(sensitivities from --sensitivity)"),
    gating: str = typer.Option(None, "--gating", help="score:TAU (score-only rule: drop the tail while its weight "
                                                      "sum <= TAU), sensitivity:T_G, or none"),
    gate_prefill: bool = typer.Option(False, "--gate-prefill", help="gate prefill rows too"),
    sensitivity: Path = typer.Option(None, "--sensitivity", help="sensitivity.json of the traced model "
                                                               "(for --gating-threshold)"),
    draft_tokens: str = typer.Option(None, "--draft-tokens", help="speculative decoding: replay the decode tokens in "
                                     "verification passes of K+1 tokens (the last accepted + K drafts; per layer the "
                                     "union of their experts loaded or computed once), K a number or auto (the cost "
                                     "model's rule picks 0..--draft-max, 0 = off); needs --acceptance"),
    acceptance: str = typer.Option(None, "--acceptance", help="acceptance of the drafts: a probability per position "
                                   "(e.g. 0.85), or the JSON file `bench --draft ... --acceptance-out` measured"),
    draft: str = typer.Option("cached", "--draft", help="what drafts: cached (the model itself with its resident "
                              "experts only: a decode step's compute, no loads) or model (a separate small model "
                              "costing --draft-ms per token)"),
    draft_ms: float = typer.Option(None, "--draft-ms", help="--draft model: ms per drafted token (default: a 0.5B "
                                   "dense model's weights read once per token on --hardware)"),
    draft_max: int = typer.Option(4, "--draft-max", min=0, help="--draft-tokens auto: the most drafts per pass"),
    draft_rule: str = typer.Option("cost", "--draft-rule", help="--draft-tokens auto: cost (each K replayed, the "
                                   "rule keeps the one with the most tokens per ms, 0 unless drafting pays) or online "
                                   "(the runtime's rule on the simulated pass times: explores, turns off, re-probes)"),
    draft_seed: int = typer.Option(0, "--draft-seed", help="seed of the sampled acceptance"),
    as_json: bool = typer.Option(False, "--json", help="print JSON (one object, or a list with --compare)"),
) -> None:
    """Simulate expert caching + prefetch on real routing: hit rate vs Belady, demand loads, ms/token."""
    import json

    from rich.console import Console

    from ..errors import MoectlError
    from ..plan.simulation import simulate_traces
    from ..progress import ProgressBar
    from ..setting.options import RuntimeOptions
    from ..sim.spec_passes import parse_draft

    console = Console(stderr=True)
    if preset is not None:
        from ..artifacts.trace_dir import load_trace
        from ..plan.scoreboard import simulate_preset
        from ..sim.simulate import concat

        if draft_tokens is not None:
            raise MoectlError("--preset replays a peer's setup as it runs: without --draft-tokens (give the "
                              "setup's options instead of --preset to price drafting)")
        simulate_preset(concat([load_trace(p) for p in trace]), preset, budget, hardware, model_shape, plan, as_json)
        return
    opts = RuntimeOptions(cache_experts=cache_experts, budget=budget, plan=plan, replacement=replacement,
                          prefetch=prefetch, predictor=predictor, precision=precision, lowbit=lowbit, t1=t1, t2=t2,
                          lowbit_fraction=lowbit_fraction, cpu_experts=cpu_experts, admission=admission,
                          staging=staging_buffers, gating=gating, gating_threshold=gating_threshold,
                          gate_prefill=gate_prefill)
    spec = parse_draft(draft_tokens, acceptance, draft, draft_ms, draft_max, draft_rule, draft_seed)
    shown = {}                  # what is on stderr while it runs: a status line, then the progress bar

    def status(text: str) -> None:
        shown["status"] = console.status(text)
        shown["status"].start()

    def progress(done: int, total: int, row: dict | None) -> None:
        if "status" in shown:
            shown.pop("status").stop()
        if "bar" not in shown:
            shown["bar"] = ProgressBar(console=console, transient=True).__enter__()
            shown["task"] = shown["bar"].add("simulating", total=total)
        if row is not None and "note" in row:
            console.print(f"[yellow]note[/] ({row['label']}): {row['note']}")
        shown["bar"].update(shown["task"], completed=done)
    try:
        run = simulate_traces(trace, opts, hardware=hardware, cache_fraction=cache_fraction, model_shape=model_shape,
                              bits=bits, sensitivity=sensitivity, train_on=train_on, depth=depth,
                              per_layer=per_layer, compare=compare, draft=spec, status=status, progress=progress)
    finally:
        if "status" in shown:
            shown["status"].stop()
        if "bar" in shown:
            shown["bar"].__exit__(None, None, None)
    if as_json:
        print(json.dumps(run.rows if compare else run.rows[0], indent=1))
        return
    prec = run.precision
    _table(run.rows, run.trace, run.slots, run.cost, hardware, prec.describe() if prec.uses_lowbit else "",
           run.draft.describe() if run.draft is not None else "")


def _table(results: list[dict], tr, asked: int, cost, hardware, precision: str = "", drafting: str = "") -> None:
    from rich.console import Console

    from ..core.recipes import stall_figure
    from ..tables import print_table

    out = Console()
    slots = ", ".join(f"{p} {n}" for p, n in (results[0].get("slots") or {}).items())
    title = (f"{tr.model}: {tr.num_tokens} rows, {tr.num_layers}x{tr.num_experts} top-{tr.top_k}; "
             f"{asked} slots ({asked / (tr.num_layers * tr.num_experts):.0%}); {hardware}, "
             f"expert {cost.expert_bytes / 1e6:.0f} MB" + (f"; {precision}, slots {slots}" if precision else "")
             + (f"; {drafting}" if drafting else ""))
    extra = [("full/tok", "full_loads_per_token"), ("low/tok", "lowbit_loads_per_token"),
             ("skip/tok", "skipped_per_token"), ("cpu/tok", "cpu_experts_per_token"), ("cpu ms/tok", "cpu_ms_per_token"),
             ("fill/tok", "fill_copies_per_token")]
    extra = [(c, k) for c, k in extra if any(d[k] for d in results)]
    drafts = [("k", "k"), ("tok/pass", "tokens_per_pass"), ("draft ms/tok", "draft_ms_per_token"),
              ("no-draft ms/tok", "no_draft_ms_per_token"), ("speedup", "speedup")] if results[0].get("draft") else []
    for d in results:
        if d.get("draft"):
            dr = d["draft"]
            dr["k"] = dr.get("chosen_k", max(dr["k_passes"], default=0) if dr["rule"] == "fixed" else dr["rule"])
    names = ["policy", "hit\nrate", "/\nBelady", "demand\n/tok", "prefetch\n/tok", "wasted", "MB\n/tok",
             "stall\nms/tok", "ms/tok", "bound\nms/tok"] + [c.replace(" ", "\n").replace("/", "\n/", 1) if "ms" not in c
                                                             else c.replace(" ", "\n") for c, _ in extra + drafts]
    cells = []
    for d in results:
        bel = d["belady_hit_rate"]
        cells.append([f"{d['label']} ({d['replacement']}/{d['prefetch']})" if d["label"] != f"{d['replacement']}/{d['prefetch']}"
                      else d["label"],
                      f"{d['hit_rate']:.3f}", "-" if bel is None else f"{d['hit_rate'] / max(bel, 1e-9):.3f}",
                      f"{d['demand_loads_per_token']:.2f}", f"{d['prefetch_loads_per_token']:.2f}",
                      f"{d['wasted_prefetch_fraction']:.2f}", f"{d['bytes_per_token'] / 1e6:.0f}",
                      f"{stall_figure(d['stall_ms_per_token']):.1f}", f"{d['ms_per_token']:.1f}", f"{d['lower_bound_ms_per_token']:.1f}",
                      *[f"{d[k]:.2f}" if "ms" not in c else f"{d[k]:.1f}" for c, k in extra],
                      *[_draft_cell(d["draft"], k) for _, k in drafts]])
    print_table(out, names, cells, title=title, left=("policy",), wrap=("policy",))   # stacked where too wide


def _draft_cell(draft: dict, key: str) -> str:
    v = draft[key]
    return f"{v}" if key == "k" else f"{v:.2f}x" if key == "speedup" else f"{v:.1f}" if "ms" in key else f"{v:.2f}"
