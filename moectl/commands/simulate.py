"""`moectl simulate`: replay routing traces through cache/prefetch policies on a modelled GPU."""

from __future__ import annotations

from pathlib import Path

import typer

from ..policies import PREFETCH_NAMES, REPLACEMENT_NAMES

COMPARE = [("lru", "none", "mixtral-offloading"), ("lfu", "none", "sequence LFU"),
           ("moe-infinity", "eam", "MoE-Infinity"), ("hobbit", "gate-reuse", "HOBBIT"), ("ours", None, "ours")]
FIELDS = ["hit_rate", "belady_hit_rate", "demand_loads_per_token", "prefetch_loads_per_token",
          "wasted_prefetch_fraction", "bytes_per_token", "stall_ms_per_token", "ms_per_token",
          "lower_bound_ms_per_token", "tokens", "prefill_misses", "full_loads_per_token", "lowbit_loads_per_token",
          "skipped_per_token", "cpu_experts_per_token", "cpu_ms_per_token", "fill_copies_per_token", "slots",
          "misses", "draft"]


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
    from ..sim import simulate as sim
    from ..policies.gating import experts_per_token
    from ..core.trace import load_trace

    console = Console(stderr=True)
    traces = [load_trace(p) for p in trace]
    tr = sim.concat(traces)
    if preset is not None:
        from ..plan.scoreboard import simulate_preset

        if draft_tokens is not None:
            raise MoectlError("--preset replays a peer's setup as it runs: without --draft-tokens (give the "
                              "setup's options instead of --preset to price drafting)")

        simulate_preset(tr, preset, budget, hardware, model_shape, plan, as_json)
        return
    from ..setting.options import RuntimeOptions

    opts = RuntimeOptions(replacement=replacement, prefetch=prefetch, precision=precision, lowbit=lowbit, t1=t1,
                          t2=t2, cpu_experts=cpu_experts, admission=admission)
    plan_caps, plan_gating, preload = None, None, None
    if plan is not None:
        from ..plan.plan_file import apply_plan

        plan_d = sim.load_plan(plan)
        plan_caps, plan_gating = apply_plan(plan_d, tr, opts)
        preload = sim.plan_preload(plan_d, tr.num_layers, tr.num_experts)     # its hot set, resident from the start
    replacement, prefetch, precision, lowbit, t1, t2, cpu_experts = (
        opts.replacement or "lru", opts.prefetch or "none", opts.precision or "full", opts.lowbit,
        opts.t1, opts.t2, opts.cpu_experts or "never")
    admission = opts.admission or "off"
    from ..policies.admission import prefetch_staging
    from ..policies.precision import make_precision
    from ..core.recipes import parse_size

    cost = sim.cost_for(tr, hardware, model_shape, bits)
    caps = sim.capacities(tr, cache_fraction, cache_experts, plan, None if budget is None else parse_size(budget), cost,
                          facts=_checkpoint_facts(model_shape or tr.model, tr) if budget is not None else None,
                          **sim.budget_sizing(cost, prefetch, cpu_experts, staging_buffers, precision, lowbit,
                                              lowbit_fraction))      # staging and pools as the runtime takes them
    if plan_caps is not None:
        caps = plan_caps
    gated = _gated(tr, gating_threshold, gating, gate_prefill, sensitivity)
    if gated is None and plan_gating is not None and gating_threshold is None and gating is None:
        from ..policies.gating import gate_trace

        gated = gate_trace(tr, plan_gating, gate_prefill)
    if gated is not None:
        tr = gated
    prec = make_precision(precision, t1, t2)
    from ..sim.spec_passes import parse_draft

    spec = parse_draft(draft_tokens, acceptance, draft, draft_ms, draft_max, draft_rule, draft_seed)
    if spec is None and plan is not None and plan_d.get("draft"):
        from ..plan.speculative import plan_draft_spec

        spec = plan_draft_spec(plan_d, plan)         # the drafting the plan was made for
    train_traces, routing_pred, mlp_pred, aux_pred = [], None, None, None
    if train_on:
        sim_paths = {Path(p).expanduser().resolve() for p in trace}
        clash = [p for p in train_on if Path(p).expanduser().resolve() in sim_paths]
        if clash:
            raise MoectlError(f"--train-on {clash[0]} is also simulated: a predictor must never be trained "
                              f"on the trace it is measured on")
        train_traces = [load_trace(p) for p in train_on]
        for t in train_traces:
            if (t.num_layers, t.num_experts) != (tr.num_layers, tr.num_experts):
                raise MoectlError(f"--train-on trace {t.model} is not of the simulated model {tr.model}")
    if predictor is not None:
        from ..predict.predictors_file import load_predictors

        ps = load_predictors(predictor, expect_fingerprint=tr.fingerprint)
        routing_pred, mlp_pred, aux_pred = ps.routing, ps.mlp, ps.aux_gate
        if routing_pred is not None and (routing_pred.L, routing_pred.E) != (tr.num_layers, tr.num_experts):
            raise MoectlError(f"the routing predictor in {predictor} is for {routing_pred.L} layers x "
                              f"{routing_pred.E} experts, the trace has {tr.num_layers} x {tr.num_experts}")
    wants_routing = prefetch == "routing" or compare
    if wants_routing and routing_pred is None and train_traces:
        from ..predict.routing import train_routing_predictor

        with console.status("training the routing predictor on --train-on traces"):
            routing_pred, _ = train_routing_predictor(train_traces, lookahead=list(range(1, (depth or 2) + 1)))

    if compare:
        has_hidden = sim.hidden_lookup(tr) is not None and bool(tr.routers)
        best = ("routing" if routing_pred is not None
                else "aux-gate" if aux_pred is not None and mlp_pred is not None and has_hidden
                else "mlp" if mlp_pred is not None and has_hidden
                else "gate-reuse" if has_hidden else "eam")
        configs = [(r, p or best, label) for r, p, label in COMPARE if p != "gate-reuse" or has_hidden]
    else:
        configs = [(replacement, prefetch, f"{replacement}/{prefetch}")]

    results = []
    from ..progress import ProgressBar

    with ProgressBar(console=console, transient=True) as bar:
        task = bar.add("simulating", total=len(configs))
        for r, p, label in configs:
            pred = routing_pred if p == "routing" else mlp_pred if p in ("mlp", "aux-gate") else None
            res = sim.simulate(tr, caps, r, p, cost, predictor=pred, train_traces=train_traces,
                               depth=depth, per_layer=per_layer, aux_gate=aux_pred, precision=prec, lowbit=lowbit,
                               lowbit_fraction=lowbit_fraction, cpu_experts=cpu_experts, admission=admission,
                               preload=preload, staging=staging_buffers, draft=spec)
            d = {k: getattr(res, k) for k in FIELDS}
            if spec is not None:                 # the same setting without drafting, beside it
                base = sim.simulate(tr, caps, r, p, cost, predictor=pred, train_traces=train_traces, depth=depth,
                                    per_layer=per_layer, aux_gate=aux_pred, precision=prec, lowbit=lowbit,
                                    lowbit_fraction=lowbit_fraction, cpu_experts=cpu_experts, admission=admission,
                                    preload=preload, staging=staging_buffers, belady=False)
                d["draft"] |= dict(no_draft_ms_per_token=base.ms_per_token, no_draft_bytes_per_token=base.bytes_per_token,
                                   speedup=base.ms_per_token / res.ms_per_token if res.ms_per_token else 1.0)
            d.update(replacement=r, prefetch=p, label=label, late_prefetches_per_token=res.late_prefetches_per_token,
                     experts_per_token=experts_per_token(tr), precision=prec.name, lowbit=lowbit,
                     cpu_experts=cpu_experts, admission=admission,
                     staging_buffers=prefetch_staging(cpu_experts) if staging_buffers is None else staging_buffers)
            if res.note:
                d["note"] = res.note
                console.print(f"[yellow]note[/] ({label}): {res.note}")
            results.append(d)
            bar.update(task, advance=1)
    if as_json:
        print(json.dumps(results if compare else results[0], indent=1))
        return
    _table(results, tr, caps, cost, hardware, prec.describe() if prec.uses_lowbit else "",
           spec.describe() if spec is not None else "")


def _gated(tr, threshold, spec, gate_prefill, sensitivity):
    """The trace with the asked gating applied, or None when none was asked."""
    from ..calib.sensitivity import load_sensitivity, rule_sensitivities
    from ..errors import MoectlError
    from ..policies.gating import gate_trace, parse_gating

    if threshold is None and spec is None:
        return None
    sens = None
    if sensitivity is not None:
        sens = rule_sensitivities(load_sensitivity(sensitivity, tr.fingerprint, tr.num_layers))
    elif threshold is not None or (spec or "").startswith("sensitivity"):
        raise MoectlError("--gating-threshold needs the traced model's sensitivities: --sensitivity <workdir>/sensitivity.json")
    policy = parse_gating(threshold, spec, sens)
    return gate_trace(tr, policy, gate_prefill) if policy is not None else None


def _table(results: list[dict], tr, caps, cost, hardware, precision: str = "", drafting: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    from ..tables import add_fitted_columns, print_fitted

    out = Console()
    slots = ", ".join(f"{p} {n}" for p, n in (results[0].get("slots") or {}).items())
    t = Table(title=f"{tr.model}: {tr.num_tokens} rows, {tr.num_layers}x{tr.num_experts} top-{tr.top_k}; "
                    f"{sum(caps)} slots ({sum(caps) / (tr.num_layers * tr.num_experts):.0%}); {hardware}, "
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
                      f"{round(d['stall_ms_per_token'], 1) + 0.0:.1f}", f"{d['ms_per_token']:.1f}", f"{d['lower_bound_ms_per_token']:.1f}",
                      *[f"{d[k]:.2f}" if "ms" not in c else f"{d[k]:.1f}" for c, k in extra],
                      *[_draft_cell(d["draft"], k) for _, k in drafts]])
    add_fitted_columns(t, names, cells, left=("policy",), wrap=("policy",))
    for row in cells:
        t.add_row(*row)
    print_fitted(out, t)                                  # narrower would cut numbers short: the lines run longer


def _draft_cell(draft: dict, key: str) -> str:
    v = draft[key]
    return f"{v}" if key == "k" else f"{v:.2f}x" if key == "speedup" else f"{v:.1f}" if "ms" in key else f"{v:.2f}"


def _checkpoint_facts(model: str, trace):
    """The sizing facts of the trace's checkpoint when it is on disk (the runtime's own: dense bytes of the skeleton,
    KV bytes), so `--budget` buys the slots it buys in `generate`; None (estimated from the shape) otherwise."""
    from ..errors import MoectlError
    from ..store.facts import model_sizes

    try:
        facts = model_sizes(model)
    except MoectlError:
        return None
    same = (facts.num_layers, facts.num_experts) == (trace.num_layers, trace.num_experts)
    return facts if same and facts.source.startswith("checkpoint") else None
