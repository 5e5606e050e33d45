"""One resolver: what a run is, from the options a command was given, the model's sizes and its workdir.

    resolve(options, sizes, workdir, live=..., trace=...) -> Setting

fills what the options leave unset in one order, recording each value's source in `options.sources` (what
`generate --json` prints as "config"):

    explicit flag  >  plan.yaml  >  the workdir's artifacts (sensitivity.json's T_g, predictors.json's kinds)
                   >  the built-in default

then checks the precision against the low-bit copies, makes the gating policy, names the prefetcher `--prefetch
auto` stands for, and sizes the cache (`setting/pools.py`: slots per precision, staging buffers, the budget's split).
The runtime (`runtime/load.py`, so generate, chat, eval, serve and bench), `simulate` (`plan/simulation.py`),
`plan-cache` and the scoreboard (`plan/inputs.py`) call it. What differs between them is one flag, `live`:

    live    the runtime: the model computes the hidden states any prefetcher needs; low-bit copies are loaded (only
            when --lowbit names them, never a plan's unasked) and get a pool; a plan's staging buffers are part of
            its budget; built-in defaults: lru, `--prefetch auto` and the stored T_g from the CLI, admission off,
            --cpu-experts auto on a device (never on a CPU), precision hobbit with --lowbit (else full)
    replay  a trace replayed (`simulate`, plan-cache): prefetchers are the ones the trace holds the inputs of; a
            plan's low-bit copy set is priced; built-in defaults: lru, no prefetch, full precision, never, off

No torch: the simulator's and the planner's layer uses it as the runtime does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..artifacts.plan import PLAN_NAME, PLAN_POLICIES, check_plan_model, load_plan, plan_policies, plan_slots
from ..core.sizing import KV_RESERVE_TOKENS, BudgetSplit, ModelSizes
from ..errors import MoectlError
from ..policies.gating import GatingPolicy
from .options import DEFAULT, FLAG, PLAN, PREDICTORS, SENSITIVITY, RuntimeOptions
from .pools import check_lowbit_fraction, size_cache


@dataclass
class Setting:
    """What a run is, every value resolved; where each came from is `sources` (the options' own record)."""

    replacement: object             # a name or a ReplacementPolicy
    prefetch: object                # a name ("none": no prefetch), a PrefetchPolicy, or None
    precision: object               # the PrecisionPolicy (name, T1/T2)
    lowbit: str | None              # the low-bit copy set, e.g. q4g64
    lowbit_fraction: float | None   # as asked (the share in force: `sizing.lowbit_fraction_for`)
    gating: GatingPolicy | None
    cpu_experts: str
    admission: str
    draft: str | None               # speculative decoding (the runtime): cached | a draft model | None
    draft_tokens: int | None
    pools: dict[str, list[int]]     # {precision: slots per MoE layer}; in place: the full pool the memory check counts
    asked: list[int] | None         # the full-precision slots asked for, before their bytes were split over the
                                    # precisions (None: the pools came whole, a plan's or a budget's low-bit split)
    staging: int                    # buffers prefetches copy into instead of cache slots (0: into slots)
    split: BudgetSplit | None       # the budget's parts, with --budget
    plan: dict | None               # the plan applied
    sources: dict[str, str]


def note_in_place_sizes(o: RuntimeOptions) -> None:
    """In place (a CPU computing its experts from RAM) there is no cache to size: a --budget or --cache-experts given
    is said in the run's note, not silently ignored."""
    given = [f"--{n.replace('_', '-')} {getattr(o, n)}" for n in ("budget", "cache_experts")
             if o.sources.get(n) == FLAG]
    if given:
        o.plan_note = "; ".join(filter(None, [o.plan_note, (
            f"{' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect: on --device cpu with "
            "--offload ram the experts are computed in place from host RAM (no device cache to size; "
            "--emulate-device or --offload disk give the CPU one)")]))


def resolve(options: RuntimeOptions, sizes: ModelSizes, workdir=None, *, live: bool = True, trace=None,
            in_place: bool = False, expert_nbytes: float | None = None, low_nbytes: float | None = None,
            price_shape: dict | None = None, sensitivity=None, kv_tokens: int = KV_RESERVE_TOKENS,
            device_memory: tuple[int, int] | None = None) -> Setting:
    """The Setting of `options` (filled in place, sources recorded) for a model of `sizes`. `workdir`: where the
    plan, sensitivity.json and predictors.json are (None: none). `trace`: the trace a replay runs (its fingerprint,
    shape and hidden states). `in_place`: a CPU computing its experts from RAM (nothing cached, nothing prefetched).
    `expert_nbytes` / `low_nbytes`: one expert's bytes as the run holds it, full and low-bit (default: `sizes`' own,
    and the low-bit copy priced at `price_shape`, default `sizes.shape`: `sim/cost.py: expert_bytes`).
    `sensitivity`: a sensitivity.json given explicitly (`simulate --sensitivity`). `device_memory`: (free, total)
    bytes of the device a live run loads onto (`torch.cuda.mem_get_info`; None on a CPU): without --budget,
    --cache-experts or a plan, the budget is its free memory less a margin (`free_memory_budget`)."""
    o = options
    if live:
        o.check()
    L, E = sizes.num_layers, sizes.num_experts
    fingerprint = trace.fingerprint if trace is not None else sizes.fingerprint
    _apply_plan(o, workdir, fingerprint, L, E, live, trace)
    if live and device_memory is not None:
        free_memory_budget(o, *device_memory)
    if in_place and o.plan_data is not None:            # say what applies: no slots in place
        o.plan_note = (f"plan: {o.plan_data.get('_path', 'given')}: experts are computed in place on the CPU (no "
                       f"expert slots, nothing cached or copied), so its slots do not apply; its policies do "
                       f"(--emulate-device gives the CPU the plan's slots; --no-plan ignores it)")
    if live:
        if o.draft == "none":                           # --draft none: not even the plan's drafting
            o.draft = None
        o.set("draft_tokens", 4, DEFAULT)
    for name, value in _defaults(o, live).items():
        o.set(name, value, DEFAULT)
    if live and o.gating is None and o.gating_threshold is None:
        if o.workdir_defaults:
            o.set("gating", "auto", SENSITIVITY)        # sensitivity.json's T_g when there is one
        o.sources.setdefault("gating", DEFAULT)
    sens = Path(sensitivity) if sensitivity is not None else None
    gating = _gating(o, sens, workdir, fingerprint, L)
    if gating is None and o.sources.get("gating") == SENSITIVITY:
        o.sources["gating"] = DEFAULT                   # no sensitivity.json (or no T_g in it): off
    precision = _precision(o, live)
    prefetch = o.prefetch
    if prefetch == "auto":
        prefetch = None if in_place else _auto_prefetch(o.predictor or workdir, fingerprint, L, E, trace, live)
        if prefetch not in (None, "gate-reuse", "none"):
            o.sources["prefetch"] = PREDICTORS          # auto found the workdir's trained predictors
    if low_nbytes is None and o.lowbit is not None:
        from ..core.shapes import expert_bytes, parse_lowbit

        low_nbytes = expert_bytes(price_shape or sizes.shape, *parse_lowbit(o.lowbit))
    pools, asked, staging, split = size_cache(o, sizes, precision,
                                              sizes.expert_bytes() if expert_nbytes is None else expert_nbytes,
                                              low_nbytes, live=live, in_place=in_place, kv_tokens=kv_tokens)
    return Setting(o.replacement, prefetch, precision, o.lowbit, o.lowbit_fraction, gating, o.cpu_experts,
                   o.admission, o.draft, o.draft_tokens, pools, asked, staging, split, o.plan_data, o.sources)


def _defaults(o: RuntimeOptions, live: bool) -> dict:
    """The built-in default of each name left unset."""
    if not live:
        return {"replacement": "lru", "prefetch": "none", "precision": "full", "cpu_experts": "never",
                "admission": "off"}
    return {"replacement": "lru", "admission": "off",
            "cpu_experts": "auto" if o.device != "cpu" else "never",    # in place on a CPU nothing misses
            "precision": "hobbit" if o.lowbit else "full",
            "prefetch": "auto" if o.workdir_defaults else None}       # auto: predictors.json, else gate reuse


# --- the device's memory -------------------------------------------------------------------------------------------
DEVICE_MARGIN_BYTES = 2**30     # left free on the device: llama.cpp's --fit keeps 1 GiB (its default margin) ...
DEVICE_MARGIN_SHARE = 0.05      # ... here at least 5 % of the card, for the CUDA allocator's fragmentation, cuBLAS
                                # workspaces and other processes' growth, which no byte count of the model foresees


def free_memory_budget(o: RuntimeOptions, free: int, total: int) -> None:
    """A device with neither --budget, --cache-experts nor a plan's slots gets the budget of its free memory less a
    margin (`DEVICE_MARGIN_*`), so a model larger than the card is cached, not loaded whole; `budget_note` says so.
    The budget's split (`size_cache`) then checks it before anything is loaded, as it checks a --budget."""
    if o.budget is not None or o.cache_experts is not None or o.slots_per_layer is not None:
        return
    from ..core.recipes import format_bytes

    margin = max(DEVICE_MARGIN_BYTES, int(DEVICE_MARGIN_SHARE * total))
    o.budget = max(0, int(free) - margin)
    o.sources["budget"] = DEFAULT
    o.budget_note = (f"budget: {format_bytes(o.budget)} of device memory, the {format_bytes(free)} free less a "
                     f"{format_bytes(margin)} margin (--budget, --cache-experts or a plan sets another)")


# --- the plan ----------------------------------------------------------------------------------------------------
def _apply_plan(o: RuntimeOptions, workdir, fingerprint, num_layers: int, num_experts: int, live: bool,
                trace) -> None:
    """The plan to apply (`options.plan`: a path, a plan read already, or "auto": the workdir's plan.yaml; checked
    against this model or trace, `artifacts/plan.py`): its slots, its policies for every name left unset, its
    drafting, and one line saying so (`plan_note`)."""
    if o.plan is None:
        o.plan_note = "plan: none (--no-plan)"
        return
    explicit = o.plan != "auto"
    if not explicit and workdir is None:
        return
    path = (None if isinstance(o.plan, dict) else Path(o.plan).expanduser()) if explicit else Path(workdir) / PLAN_NAME
    if not explicit and not path.exists():
        return
    given = [f for f, v in (("--cache-experts", o.cache_experts), ("--budget", o.budget),
                            ("slots", o.slots_per_layer)) if v is not None]
    if given:
        if explicit:
            raise MoectlError(f"give a plan or {given[0]}, not both")
        o.plan_note = f"plan: {path} not used ({given[0]} given)"
        return
    d = load_plan(path) if path is not None else o.plan   # a plan read already
    slots = plan_slots(d, d.get("_path"))               # checked: integers, at least one per layer
    if trace is not None:
        check_plan_model(d, fingerprint, num_layers, num_experts, f"the trace ({trace.model})", trace.top_k)
    else:
        check_plan_model(d, fingerprint, num_layers, num_experts, "the model loaded")
    o.plan_data = d
    o.slots_per_layer = slots
    o.sources["slots"] = PLAN
    low_pools = any(int(s) for s in d.get("slots_low") or [])
    if live:    # its precision comes with its low-bit pools, and the copies with --lowbit: never loaded unasked
        _take_plan(o, d, ("replacement", "prefetch", "cpu_experts", "admission") + (("precision",) if low_pools
                                                                                  else ()))
        _take_plan_draft(o, d)
        if o.staging is None and (d.get("budget") or {}).get("staging") is not None:
            o.sources["staging"] = PLAN
    else:       # a replay prices the plan's copy set
        _take_plan(o, d, PLAN_POLICIES)
    pred = d.get("predicted") or {}
    ms = pred.get("ms_per_token")
    o.plan_note = (f"plan: {d.get('_path', 'given')} ({sum(d['slots'])} expert slots, {min(d['slots'])}-"
                   f"{max(d['slots'])} per layer" + (f"; predicted {ms:.3g} ms/token on {d.get('hardware')}" if ms
                                                     else "") + "; --no-plan ignores it)")


def _take_plan(o: RuntimeOptions, plan: dict, names) -> None:
    """The plan's value (`artifacts/plan.py: plan_policies`) of each name in `names` left unset, HOBBIT's T1/T2 with
    its hobbit precision, and its gating unless the command gave one."""
    pol = plan_policies(plan)
    for name in names:
        o.set(name, pol.get(name), PLAN)
    if pol.get("precision") == o.precision == "hobbit":
        for k in ("t1", "t2"):
            if k in pol and o.sources.get(k) != FLAG:
                setattr(o, k, pol[k])
                o.sources[k] = PLAN
    if pol.get("gating") and o.gating in (None, "auto") and o.gating_threshold is None:
        from ..policies.gating import SensitivityGating

        g = pol["gating"]                               # the T_g the plan was measured with, on its values
        o.gating = SensitivityGating(g["threshold"], g["values"], g["rule"], g["cost"])
        o.gating.source = plan.get("_path")
        o.sources["gating"] = PLAN


def _take_plan_draft(o: RuntimeOptions, plan: dict) -> None:
    """A plan made with `plan-cache --draft-tokens` (`plan/speculative.py`'s `draft` block) drafts as it was priced:
    `--draft cached` when it drafted with the resident experts and found some K that pays (tokens > 0; 0 means its
    replay found drafting does not pay here), and its K for a draft the command names. A draft model's path is not
    in the plan: with `source: model` only K is taken, when the command gives `--draft PATH`."""
    block = plan.get("draft") or {}
    tokens = int(block.get("tokens") or 0)
    if tokens < 1:
        return
    if block.get("source") == "cached":
        o.set("draft", "cached", PLAN)
    if o.draft not in (None, "none"):
        o.set("draft_tokens", tokens, PLAN)


# --- the artifacts ------------------------------------------------------------------------------------------------
def _gating(o: RuntimeOptions, sensitivity: Path | None, workdir, fingerprint, num_layers: int):
    """The GatingPolicy of --gating / --gating-threshold (or the plan's, or 'auto': the T_g `moectl sensitivity
    --target-ppl-delta` stored), None for off. Sensitivities from `sensitivity` (given explicitly), else the
    workdir's sensitivity.json when there is one; `threshold` (--gating-threshold T_g, 0 = off) overrides the
    stored T_g."""
    from ..artifacts.sensitivity import JSON_NAME, load_sensitivity, stored_gating
    from ..policies.gating import parse_gating

    gating, threshold = o.gating, o.gating_threshold
    if isinstance(gating, GatingPolicy):
        return gating
    if gating is None and threshold is None:
        return None
    spec = None if gating in (None, "auto") else gating
    needs = threshold is not None or gating == "auto" or (spec or "").startswith("sensitivity")
    f = sensitivity if sensitivity is not None else Path(workdir) / JSON_NAME if workdir is not None else None
    if needs and f is None and gating != "auto":
        raise MoectlError("--gating-threshold needs the traced model's sensitivities: --sensitivity "
                          "<workdir>/sensitivity.json")
    stored = None
    if needs and f is not None and (sensitivity is not None or f.exists()):
        stored = stored_gating(load_sensitivity(f, fingerprint, num_layers))      # T_g with the values it was made on
    policy = parse_gating(threshold, spec, stored.values if stored else None,
                          stored.threshold if stored and gating == "auto" else None,
                          stored.rule if stored else None, stored.cost if stored else None)
    if policy is not None and gating == "auto" and threshold is None:
        policy.source = str(f)          # on by default: the status lines say where it came from
    return policy


def _precision(o: RuntimeOptions, live: bool):
    """The PrecisionPolicy of the resolved --precision/--t1/--t2, checked against the low-bit copy set: a precision
    that loads low-bit copies needs --lowbit, and (live) a plan with low-bit pools needs its copy set named."""
    from ..policies.precision import make_precision

    check_lowbit_fraction(o.lowbit_fraction)
    prec = make_precision(o.precision, o.t1, o.t2)
    plan = o.plan_data or {}
    if live and any(int(s) for s in plan.get("slots_low") or []):
        want = plan.get("lowbit") or (plan.get("policies") or {}).get("lowbit")
        if not o.lowbit or (want and want != o.lowbit):
            raise MoectlError(f"plan {plan['_path']} serves low-bit copies ({want}): pass --lowbit {want} "
                              f"(made by `moectl quantize --bits ...`), or --no-plan")
    if prec.uses_lowbit and not o.lowbit:
        raise MoectlError(f"--precision {prec.name} loads low-bit copies: give --lowbit q<bits>g<group> (made by "
                          f"`moectl quantize`)" if live else
                          f"--precision {prec.name} needs --lowbit (the low-bit copy set, e.g. q4g64)")
    return prec


def _auto_prefetch(predictor_dir, fingerprint, num_layers: int, num_experts: int, trace, live: bool) -> str:
    """What `--prefetch auto` stands for (`auto_prefetch`) with the trained predictors in `predictor_dir`. Live, the
    model computes every hidden state; a replay has the trace's (none without a trace: nothing is replayed)."""
    from ..artifacts.predictors import JSON_NAME, read_predictors_meta

    if not live and trace is None:                      # nothing replayed (a plan from the analytic model)
        return "none"
    kinds = set()
    if predictor_dir is not None and (Path(predictor_dir) / JSON_NAME).exists():
        kinds = set(read_predictors_meta(predictor_dir, fingerprint, (num_layers, num_experts))["kinds"])
    if live:
        return auto_prefetch(kinds, True, True)
    from ..sim.simulate import hidden_lookup

    return auto_prefetch(kinds, hidden_lookup(trace) is not None, bool(trace.routers)) or "none"


def auto_prefetch(kinds: set, hidden: bool, routers: bool) -> str | None:
    """The prefetcher the inputs allow, best first: the trained aux gate + mlp, or mlp (they read hidden states),
    gate reuse (the model's routers on hidden states), a routing predictor (routing alone); None: none of them."""
    return ("aux-gate" if {"mlp", "aux_gate"} <= kinds and hidden else "mlp" if "mlp" in kinds and hidden
            else "gate-reuse" if hidden and routers else "routing" if "routing" in kinds else None)
