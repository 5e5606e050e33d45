"""`moectl simulate`'s one library call: traces + the options of a run -> one simulated row per configuration.

    simulate_traces(paths, options, hardware=..., cache_fraction=...) -> Simulation

The traces are concatenated, the run's setting resolved as the runtime resolves it (`setting/resolve.py`, a replay:
the plan's pools and policies, the budget's pools and staging buffers, the gating that drops experts from the trace),
the predictors loaded or trained, and each configuration replayed (`sim/simulate.py: simulate`): the one asked, or
with `compare` the policy matrix of the papers and ours (`COMPARE`), ours with the best prefetcher the inputs allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import MoectlError

COMPARE = [("lru", "none", "mixtral-offloading"), ("lfu", "none", "sequence LFU"),
           ("moe-infinity", "eam", "MoE-Infinity"), ("hobbit", "gate-reuse", "HOBBIT"), ("ours", None, "ours")]
FIELDS = ["hit_rate", "belady_hit_rate", "demand_loads_per_token", "prefetch_loads_per_token",
          "wasted_prefetch_fraction", "bytes_per_token", "stall_ms_per_token", "ms_per_token",
          "lower_bound_ms_per_token", "tokens", "prefill_misses", "full_loads_per_token", "lowbit_loads_per_token",
          "skipped_per_token", "cpu_experts_per_token", "cpu_ms_per_token", "fill_copies_per_token", "slots",
          "misses", "draft"]


@dataclass
class Simulation:
    trace: object                   # the traces as replayed (concatenated, gated)
    rows: list[dict]                # one per configuration: FIELDS + the setting replayed (+ "note")
    slots: int                      # cache slots asked for (full-precision ones before the precision split)
    cost: object                    # the CostModel
    precision: object               # the PrecisionPolicy
    draft: object = None            # the DraftSpec replayed, or None


def simulate_traces(paths: list, options, *, hardware: str = "rtx4090-pcie4", cache_fraction: float | None = None,
                    model_shape: str | None = None, bits: float | None = None, sensitivity=None,
                    train_on: list | None = None, depth: int | None = None, per_layer: int | None = None,
                    compare: bool = False, draft=None, status=None, progress=None) -> Simulation:
    """Replay the traces at `paths` with the run `options` (a RuntimeOptions: cache_experts, budget, plan, the
    policies, precision, gating, staging, predictor), or `cache_fraction` of each layer's experts. `sensitivity`: the
    traced model's sensitivity.json (for --gating-threshold); `train_on`: traces to train a routing predictor on
    (and seed EAM collections); `draft`: a DraftSpec (else the plan's). `status(text)`: says what runs before a
    predictor trains; `progress(done, total, row)`: before the first configuration (row None) and after each."""
    from ..artifacts.plan import check_plan_model, load_plan
    from ..artifacts.trace_dir import load_trace
    from ..policies import check_names
    from ..policies.gating import experts_per_token, gate_trace
    from ..setting.resolve import resolve
    from ..sim import simulate as sim

    tr = sim.concat([load_trace(p) for p in paths])
    o, plan_path = options, options.plan
    if not compare:                                     # the names the simulator takes (--compare has its own)
        check_names(o.replacement, o.prefetch, runtime=False)
    if plan_path is not None:                           # a plan of another model: said before the shape is looked up
        o.plan = load_plan(plan_path)
        check_plan_model(o.plan, tr.fingerprint, tr.num_layers, tr.num_experts, f"the trace ({tr.model})", tr.top_k)
    if sum(x is not None for x in (cache_fraction, o.cache_experts, o.plan, o.budget)) != 1:
        raise MoectlError("give exactly one of --cache-fraction, --cache-experts, --plan, --budget")
    if cache_fraction is not None:
        o.slots_per_layer = sim.capacities(tr, fraction=cache_fraction)
    shape = model_shape
    if model_shape is not None and str(model_shape).lower().endswith(".gguf"):   # read from the file's header
        from ..store.gguf.shape import gguf_shape

        shape = gguf_shape(model_shape)
    cost = sim.cost_for(tr, hardware, shape, bits)
    setting = resolve(o, _sizes(tr, cost, model_shape, o.budget is not None), live=False, trace=tr,
                      sensitivity=sensitivity, expert_nbytes=cost.expert_bytes, price_shape=cost.shape)
    preload = None
    if setting.plan is not None:
        from ..artifacts.plan import plan_preload

        preload = plan_preload(setting.plan, tr.num_layers, tr.num_experts)   # its hot set, resident from the start
        if draft is None and setting.plan.get("draft"):
            from .speculative import plan_draft_spec

            draft = plan_draft_spec(setting.plan, plan_path)   # the drafting the plan was made for
    if setting.gating is not None:
        tr = gate_trace(tr, setting.gating, o.gate_prefill)
    predictor = o.predictor
    if predictor is None and setting.plan is not None:     # the predictors the plan was measured with
        from ..artifacts.plan import plan_predictors

        predictor = plan_predictors(setting.plan)
    preds = _predictors(tr, predictor, train_on, paths, depth, setting.prefetch == "routing" or compare, status)
    configs = [(setting.replacement, setting.prefetch, f"{setting.replacement}/{setting.prefetch}")]
    if compare:
        has_hidden = sim.hidden_lookup(tr) is not None and bool(tr.routers)
        best = _best_prefetch(preds, has_hidden)
        configs = [(r, p or best, label) for r, p, label in COMPARE if p != "gate-reuse" or has_hidden]
    common = dict(train_traces=preds["train"], depth=depth, per_layer=per_layer, aux_gate=preds["aux_gate"],
                  precision=setting.precision, lowbit=setting.lowbit, lowbit_fraction=setting.lowbit_fraction,
                  cpu_experts=setting.cpu_experts, admission=setting.admission, preload=preload,
                  staging=setting.staging)
    rows = []
    if progress is not None:
        progress(0, len(configs), None)
    for i, (r, p, label) in enumerate(configs):
        pred = preds["routing"] if p == "routing" else preds["mlp"] if p in ("mlp", "aux-gate") else None
        res = sim.simulate(tr, setting.pools, r, p, cost, predictor=pred, draft=draft, **common)
        d = {k: getattr(res, k) for k in FIELDS}
        if draft is not None:                # the same setting without drafting, beside it
            base = sim.simulate(tr, setting.pools, r, p, cost, predictor=pred, belady=False, **common)
            d["draft"] |= dict(no_draft_ms_per_token=base.ms_per_token, no_draft_bytes_per_token=base.bytes_per_token,
                               speedup=base.ms_per_token / res.ms_per_token if res.ms_per_token else 1.0)
        d.update(replacement=r, prefetch=p, label=label, late_prefetches_per_token=res.late_prefetches_per_token,
                 experts_per_token=experts_per_token(tr), precision=setting.precision.name, lowbit=setting.lowbit,
                 cpu_experts=setting.cpu_experts, admission=setting.admission, staging_buffers=setting.staging)
        if res.note:
            d["note"] = res.note
        rows.append(d)
        if progress is not None:
            progress(i + 1, len(configs), d)
    slots = sum(setting.asked) if setting.asked is not None else sum(map(sum, setting.pools.values()))
    return Simulation(tr, rows, slots, cost, setting.precision, draft)


def _sizes(trace, cost, model_shape: str | None, budget: bool):
    """The sizes a budget is split with: the trace's checkpoint's when it is on disk (the runtime's own: dense bytes of
    the skeleton, KV bytes), so `--budget` buys the slots it buys in `generate`; else estimated from the shape."""
    from ..setting.model_sizes import shape_sizes

    if budget:
        from ..store.facts import model_sizes

        try:
            sizes = model_sizes(model_shape or trace.model)
        except MoectlError:
            sizes = None
        if sizes is not None and sizes.source.startswith("checkpoint") and \
                (sizes.num_layers, sizes.num_experts) == (trace.num_layers, trace.num_experts):
            return sizes
    return shape_sizes(cost.shape, trace.num_layers, trace.num_experts, trace.top_k, expert_nbytes=cost.expert_bytes)


def _predictors(trace, predictor, train_on, paths, depth, wants_routing: bool, status) -> dict:
    """{train, routing, mlp, aux_gate}: the --train-on traces (never the simulated ones), the predictors in
    `predictor` (checked against the trace), and a routing predictor trained on --train-on when one is wanted."""
    from ..artifacts.trace_dir import load_trace

    out = {"train": [], "routing": None, "mlp": None, "aux_gate": None}
    if train_on:
        simulated = {Path(p).expanduser().resolve() for p in paths}
        clash = [p for p in train_on if Path(p).expanduser().resolve() in simulated]
        if clash:
            raise MoectlError(f"--train-on {clash[0]} is also simulated: a predictor must never be trained "
                              f"on the trace it is measured on")
        out["train"] = [load_trace(p) for p in train_on]
        for t in out["train"]:
            if (t.num_layers, t.num_experts) != (trace.num_layers, trace.num_experts):
                raise MoectlError(f"--train-on trace {t.model} is not of the simulated model {trace.model}")
    if predictor is not None:
        from ..predictors.file import load_predictors

        ps = load_predictors(predictor, expect_fingerprint=trace.fingerprint)
        out.update(routing=ps.routing, mlp=ps.mlp, aux_gate=ps.aux_gate)
        r = ps.routing
        if r is not None and (r.L, r.E) != (trace.num_layers, trace.num_experts):
            raise MoectlError(f"the routing predictor in {predictor} is for {r.L} layers x {r.E} experts, the trace "
                              f"has {trace.num_layers} x {trace.num_experts}")
    if wants_routing and out["routing"] is None and out["train"]:
        from ..predictors.routing import train_routing_predictor

        if status is not None:
            status("training the routing predictor on --train-on traces")
        out["routing"], _ = train_routing_predictor(out["train"], lookahead=list(range(1, (depth or 2) + 1)))
    return out


def _best_prefetch(preds: dict, has_hidden: bool) -> str:
    """--compare's prefetcher for ours: a routing predictor given or trained for the comparison, else what `--prefetch
    auto` stands for on these inputs (`setting/resolve.py: auto_prefetch`), else EAM (MoE-Infinity's, no inputs)."""
    from ..setting.resolve import auto_prefetch

    if preds["routing"] is not None:
        return "routing"
    kinds = {k for k in ("mlp", "aux_gate") if preds[k] is not None}
    return auto_prefetch(kinds, has_hidden, has_hidden) or "eam"
