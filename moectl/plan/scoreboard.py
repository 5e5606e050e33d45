"""Presets: the setups people would pick instead of moectl, modelled on the same traces, budget and hardware
profile, and the scoreboard that puts them beside moectl's plan. Where each preset's parameters come from is in
docs/benchmarks.md ("Scoreboard presets").

A preset fixes slots (uniform split of the expert budget at its precision, its DP, or the plan), replacement,
prefetch, precision and gating. Prefetchers that need hidden states (gate reuse) cannot be replayed on routing-
only traces; there the preset runs without prefetch and its row says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MoectlError
from .proxy import PROXY_LABEL, setting_of

# AdapMoE's released per-layer sensitivities S_i of Mixtral-8x7B (seed_adapmoe.md §2.3) and its default T_g:
# the adapmoe preset's gating on Mixtral traces when the workdir has no sensitivity.json of its own.
SEED_MIXTRAL_SENSITIVITY = [46.69, 17.30, 13.02, 7.64, 4.17, 2.23, 1.26, 0.84, 0.68, 0.56, 0.51, 0.48, 0.45, 0.44,
                            0.38, 0.31, 0.23, 0.18, 0.14, 0.11, 0.10, 0.10, 0.09, 0.08, 0.07, 0.06, 0.05, 0.04, 0.03,
                            0.03, 0.02, 0.02]
SEED_T_G = 0.005


@dataclass
class Preset:
    name: str
    system: str
    replacement: str
    prefetch: str                      # what the system uses (replayed when the traces allow)
    slots: str = "uniform"             # uniform | adapmoe-dp | plan
    precision: str = "full"
    lowbit: str | None = None          # copy set of the low-bit precision
    gating: str | None = None          # "sensitivity" (AdapMoE)
    cpu_experts: str = "never"
    fidelity: str = "full"             # full | lower (all experts at 2 or 4 bits)


PRESETS = [
    Preset("mixtral-offloading", "Mixtral-offloading (Eliseev & Mazur)", "lru", "gate-reuse", precision="lowbit-only",
           lowbit="q2g16", fidelity="lower (2-bit experts)"),
    Preset("moe-infinity", "MoE-Infinity", "moe-infinity", "eam"),
    Preset("hobbit", "HOBBIT", "hobbit", "gate-reuse", precision="hobbit", lowbit="q4g64",
           fidelity="full (hi/lo/skip T1 0.6 T2 0.9)"),
    Preset("adapmoe", "AdapMoE", "lru", "gate-reuse", slots="adapmoe-dp", gating="sensitivity"),
    Preset("llamacpp-cpu-moe", "llama.cpp --n-cpu-moe", "-", "none", slots="layers-cpu", precision="lowbit-only",
           lowbit="q4g64", cpu_experts="always", fidelity="lower (4-bit experts)"),
    Preset("oracle", "limit: Belady + perfect prefetch", "belady", "oracle", slots="plan"),
    Preset("moectl", "moectl plan", "plan", "plan", slots="plan"),
    Preset("moectl-q4", "moectl plan, q4 + CPU", "plan", "plan", slots="plan-q4", precision="lowbit-only",
           lowbit="q4g64", cpu_experts="auto", fidelity="lower (4-bit experts)"),
]
PRESET_NAMES = [p.name for p in PRESETS]


def get_preset(name: str) -> Preset:
    for p in PRESETS:
        if p.name == name:
            return p
    raise MoectlError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")


def q4_policies(plan_pol: dict):
    from .planner import Policies

    return Policies(**(plan_pol | {"precision": "lowbit-only", "lowbit": "q4g64", "cpu_experts": "auto"}))


def run_preset(setup, preset: Preset, plan: dict | None, replay=None, q4_plan: dict | None = None) -> dict:
    """One scoreboard row: the preset simulated on `replay` (default the setup's) at the setup's budget.
    `q4_plan`: moectl's plan at q4 with CPU compute (made on the setup's traces when not given)."""
    from dataclasses import replace

    from .planner import Policies, expert_nbytes, make_plan, pools_of, summary, uniform_pools

    replay = replay or setup.replay
    row = {"preset": preset.name, "system": preset.system, "fidelity": preset.fidelity, "notes": []}
    L, E = setup.facts.num_layers, setup.facts.num_experts
    if preset.name == "moectl":
        pol = Policies(**plan["policies"])
    elif preset.name == "moectl-q4":
        if plan["policies"]["precision"] == "lowbit-only" and plan["policies"]["cpu_experts"] != "never":
            q4_plan = plan
        if q4_plan is None:
            q4_plan = make_plan(setup.facts, setup.split, setup.cost, setup.replay, q4_policies(plan["policies"]),
                                setup.hardware)
        plan, pol = q4_plan, Policies(**q4_plan["policies"])
    else:
        pol = Policies(replacement=preset.replacement, prefetch=preset.prefetch, precision=preset.precision,
                       lowbit=preset.lowbit, cpu_experts=preset.cpu_experts)
        if preset.name == "oracle":
            for k in ("precision", "lowbit", "t1", "t2", "cpu_experts"):
                setattr(pol, k, plan["policies"][k])
    src = replay.raw or replay.trace                 # the trace before gating
    trace = replay.trace                             # gated when the workdir stores a T_g (setup.py)
    if preset.gating == "sensitivity":
        trace, note = _adapmoe_gating(setup, src)
        row["notes"].append(note)
    # what the row's fidelity proxy is measured for: its precision setting, gated if its trace was
    row["proxy_setting"] = setting_of(pol.precision, pol.lowbit, pol.t1, pol.t2, trace is not src).key
    if preset.slots == "layers-cpu":
        return row | _llamacpp(setup, trace, pol)
    if pol.prefetch in ("gate-reuse", "mlp", "aux-gate") and not _has_hidden(replay):
        row["notes"].append(f"{pol.prefetch} prefetch needs hidden states the traces lack: replayed without prefetch")
        pol.prefetch = "none"
    nbytes = expert_nbytes(setup.facts, pol)
    if preset.slots.startswith("plan"):
        caps = pools_of(pol, plan["slots"], plan.get("slots_low") or [0] * L)
    elif preset.slots == "adapmoe-dp":
        caps = _adapmoe_dp(trace, int(setup.split.experts // nbytes["full"]), L, E, setup.cost.load_s(),
                           pol.prefetch != "none")
    else:
        caps = pools_of(pol, *uniform_pools(pol, L, E, setup.split.experts, nbytes))
    run = replace(replay, trace=trace)
    warm = plan.get("preload") if preset.slots.startswith("plan") else None     # the plan's hot set, loaded at start
    r = run.run(caps, pol, belady=False, preload=warm)
    if preset.name == "oracle":          # perfect prefetch can evict what a 1-2 slot layer needs: the better of the two
        plain = run.run(caps, pol, belady=False, prefetch="none", preload=warm)
        if plain.ms_per_token < r.ms_per_token:
            r, pol.prefetch = plain, "none"
            row["notes"].append("Belady alone beat Belady + perfect prefetch at these slots")
    if preset.slots.startswith("plan"):               # the plan's precision policy sets the fidelity
        row["fidelity"] = fidelity(pol)
    row.update(summary(r, setup.cost), slots=caps, replacement=pol.replacement, prefetch=pol.prefetch,
               precision=pol.precision + (f" ({pol.lowbit})" if pol.lowbit else ""),
               gating=pol.gating if preset.name.startswith("moectl") else preset.gating)
    return row


def fidelity(pol) -> str:
    if pol.precision == "full":
        return "full"
    if pol.precision == "hobbit":
        return f"full (hi/lo/skip T1 {pol.t1:g} T2 {pol.t2:g})"
    return f"lower ({pol.lowbit} experts)"


def _llamacpp(setup, trace, pol) -> dict:
    """llama.cpp's static placement, computed from the cost model: dense weights on the GPU, whole layers of q4
    experts on the GPU as far as the expert budget holds them, every other expert computed on the CPU from host
    RAM (the hardware profile's CPU rate for low-bit copies); nothing crosses PCIe per token. Layers run one after another."""
    from ..core.trace import DECODE
    from .planner import expert_nbytes

    cost, L, E = setup.cost, setup.facts.num_layers, setup.facts.num_experts
    q = expert_nbytes(setup.facts, pol)["low"]
    gpu_layers = min(L, int(setup.split.experts // (E * q)))
    dec = trace.phase == DECODE
    uses = (trace.experts[dec] >= 0).sum(-1).mean(0)                    # [L] experts per token
    context = float(trace.pos[dec].mean()) if dec.any() else 0.0
    on_gpu = [l >= L - gpu_layers for l in range(L)]                   # --n-cpu-moe N: the first N layers on the CPU
    gpu_s = sum(uses[l] * cost.expert_s(1, q) for l in range(L) if on_gpu[l])
    cpu_s = sum(uses[l] * cost.cpu_expert_s(1, q, True, engine="llamacpp") for l in range(L) if not on_gpu[l])
    base = L * cost.attention_s(1, int(context)) + cost.lm_head_s(1)
    ms = (base + gpu_s + cpu_s) * 1e3
    hit = float(sum(uses[l] for l in range(L) if on_gpu[l]) / max(uses.sum(), 1e-9))
    return {"ms_per_token": ms, "tokens_per_s": 1e3 / ms, "hit_rate": hit, "stall_ms_per_token": 0.0,
            "bytes_per_token": 0.0, "misses_per_token": 0.0, "cpu_ms_per_token": cpu_s * 1e3,
            "cpu_experts_per_token": float(sum(uses[l] for l in range(L) if not on_gpu[l])),
            "lower_bound_ms_per_token": (base + (gpu_s + sum(uses[l] * cost.expert_s(1, q) for l in range(L)
                                                              if not on_gpu[l]))) * 1e3,
            "full_loads_per_token": 0.0, "lowbit_loads_per_token": 0.0, "skipped_per_token": 0.0,
            "slots": {"low": [E if g else 0 for g in on_gpu]}, "replacement": "-", "prefetch": "none",
            "precision": f"lowbit-only ({pol.lowbit})", "gating": None,
            "notes": [f"static: {gpu_layers} of {L} layers' q4 experts on the GPU, the rest on the CPU at "
                      f"llama.cpp's measured share of {cost.hw.cpu_mem_gbps:g} GB/s host memory (cost model)"]}


def _has_hidden(replay) -> bool:
    from ..sim.simulate import hidden_lookup

    return hidden_lookup(replay.trace) is not None and bool(replay.trace.routers)


def _adapmoe_gating(setup, trace):
    """AdapMoE's sensitivity gating on the trace (`adapmoe_policy`), and the note saying which."""
    from ..policies.gating import gate_trace

    policy, note = adapmoe_policy(setup, trace)
    if policy is None:
        return trace, note
    if trace.weights is None:
        return trace, "the traces have no gate weights: gating off"
    return gate_trace(trace, policy), note


def adapmoe_policy(setup, trace):
    """The AdapMoE preset's SensitivityGating (None: no sensitivities) and where it came from: the workdir's
    sensitivity.json (its stored T_g on the values it was searched against, `stored_gating`, the rule every run
    applies; without a stored T_g, AdapMoE's T_g on Fisher's S_l, AdapMoE's own rule), or the seed's Mixtral S_i."""
    from ..artifacts.sensitivity import JSON_NAME, load_sensitivity, stored_gating
    from ..policies.gating import SensitivityGating

    f = setup.workdir / JSON_NAME if setup.workdir is not None else None
    if f is not None and f.exists():
        meta = load_sensitivity(f, setup.facts.fingerprint, setup.facts.num_layers)
        stored = stored_gating(meta)
        if stored.threshold:
            return (SensitivityGating(stored.threshold, stored.values, stored.rule, stored.cost),
                    f"sensitivity gating T_g={stored.threshold:g} ({f}, {stored.rule} values)")
        return (SensitivityGating(SEED_T_G, meta["sensitivities"], "fisher"),
                f"sensitivity gating T_g={SEED_T_G:g} ({f}, Fisher S_l, AdapMoE's T_g)")
    if trace.num_layers == len(SEED_MIXTRAL_SENSITIVITY) and trace.num_experts == 8:
        return (SensitivityGating(SEED_T_G, SEED_MIXTRAL_SENSITIVITY, "fisher"),
                f"sensitivity gating T_g={SEED_T_G:g} (AdapMoE's released Mixtral S_i)")
    return None, "no sensitivities for this model: gating off"


def _adapmoe_dp(trace, C: int, L: int, E: int, load_s: float, prefetch: bool) -> list[int]:
    """AdapMoE's DP on its analytic model, a_i (single-expert ratio) profiled on the (gated) trace."""
    from ..core.trace import DECODE
    from .curves import analytic_curves
    from .planner import dp_slots

    dec = trace.experts[trace.phase == DECODE]
    a = ((dec >= 0).sum(-1) == 1).mean(0).tolist() if len(dec) else [0.0] * L
    curves = analytic_curves(L, E, trace.top_k, load_s, single_ratio=a, prefetch=prefetch)
    return dp_slots(curves, L, E, C)


def scoreboard(setup, plan: dict, progress=None, replay=None) -> list[dict]:
    rows = []
    for p in PRESETS:
        rows.append(run_preset(setup, p, plan, replay))
        if progress is not None:
            progress()
    return rows


def add_proxy(rows: list[dict], proxy: dict) -> None:
    """Each row's `ppl_delta_proxy`: the relative ppl delta `proxy` (plan/proxy.py: proxies) holds for the row's
    precision setting, None where it was not measured."""
    for r in rows:
        got = proxy.get("settings", {}).get(r["proxy_setting"], {})
        r["ppl_delta_proxy"] = got.get("ppl_delta_rel")


def print_scoreboard(rows: list[dict], setup, title: str = "", wide: bool = False) -> None:
    """The scoreboard as a table that fits an 80-column terminal: long text wraps at words, numbers never break,
    nothing is cut short ("..."; on a narrower terminal the lines run longer). `wide` adds tok/s and "mix /tok"
    (experts per token by where they came from), one line per row. A note shared by several rows is printed once."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ..core.recipes import stall_figure
    from ..tables import add_fitted_columns, print_fitted

    out = Console()
    t = Table(title=title or f"scoreboard: {setup.facts.name}, {setup.budget} on {setup.hardware}",
              box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    proxy = "ppl_delta_proxy" in rows[0]
    cols = [("preset", lambda r: r["preset"]), ("fidelity", lambda r: r["fidelity"]),
            ("ms/tok", lambda r: f"{r['ms_per_token']:.1f}")]
    cols += [("tok/s", lambda r: f"{r['tokens_per_s']:.2f}")] if wide else []
    cols += [("hit\nrate", lambda r: f"{r['hit_rate']:.3f}"), ("MB/tok", lambda r: f"{r['bytes_per_token'] / 1e6:.0f}"),
             ("stall\nms/tok", lambda r: f"{stall_figure(r['stall_ms_per_token']):.1f}")]     # never "-0.0"
    cols += [("mix /tok", mix)] if wide else []
    delta = lambda r: "-" if r.get("ppl_delta_proxy") is None else f"{r['ppl_delta_proxy']:+.2%}"   # noqa: E731
    cols += [(PROXY_LABEL if wide else "ppl delta\n(proxy)", delta)] if proxy else []
    notes: list[str] = []
    for r in rows:
        notes += [n for n in r["notes"] if n not in notes]
    cells = [[get(r) + ("".join(f"[{notes.index(n) + 1}]" for n in r["notes"]) if name == "preset" else "")
              for name, get in cols] for r in rows]
    names = [name for name, _ in cols]
    wrap = () if wide else ("fidelity", "mix /tok")            # wrap at words; the rest never breaks or shrinks
    add_fitted_columns(t, names, cells, left=("preset", "fidelity", "mix /tok"), wrap=wrap)
    for row in cells:
        t.add_row(*row)
    print_fitted(out, t)
    for i, n in enumerate(notes):
        out.print(f"[{i + 1}] {n}", highlight=False, markup=False)
    measured = [r.get("ppl_delta_proxy") is not None for r in rows]
    if proxy and any(measured) and not all(measured):
        out.print("ppl delta \"-\": not measured for that row's precision setting (below)", highlight=False)
    if not wide:
        out.print("(--wide adds tok/s and experts per token by source: full / low-bit loads, skipped, on the CPU)",
                  highlight=False)
    ours = next((r for r in rows if r["preset"] == "moectl"), None)
    if ours is None:
        return
    for line in ratios(rows):
        out.print(line, highlight=False)
    if ours["precision"] == "full" and not ours.get("cpu_experts_per_token"):
        out.print("(moectl's row is this plan's setting: full precision, every miss copied over PCIe; the peers run "
                  "theirs, e.g. hobbit's low-bit copies. `--lowbit q4g64 --cpu-experts auto` plans moectl with "
                  "low-bit copies and misses computed on the CPU: the setting of docs/benchmarks.md's scoreboards)",
                  highlight=False)


def ratios(rows: list[dict]) -> list[str]:
    """moectl's gap to the oracle and its speed ratio to the best same-fidelity peer and to the lower-fidelity ones."""
    by = {r["preset"]: r for r in rows}
    ours = by["moectl"]
    out = []
    if "oracle" in by:
        out.append(f"moectl {ours['ms_per_token']:.1f} ms/token vs oracle {by['oracle']['ms_per_token']:.1f}: "
                   f"{ours['ms_per_token'] / by['oracle']['ms_per_token']:.2f}x the limit")
    peers = [by[n] for n in ("moe-infinity", "adapmoe", "hobbit") if n in by]
    if peers:
        best = min(peers, key=lambda r: r["ms_per_token"])
        out.append(f"best same-fidelity peer {best['preset']} {best['ms_per_token']:.1f} ms/token: moectl is "
                   f"{best['ms_per_token'] / ours['ms_per_token']:.2f}x as fast")
    for n in ("mixtral-offloading", "llamacpp-cpu-moe"):
        if n in by:
            out.append(f"{n} (lower fidelity) {by[n]['ms_per_token']:.1f} ms/token: moectl is "
                       f"{by[n]['ms_per_token'] / ours['ms_per_token']:.2f}x as fast")
    if "moectl-q4" in by and "llamacpp-cpu-moe" in by:
        q4, ll = by["moectl-q4"], by["llamacpp-cpu-moe"]
        out.append(f"same fidelity (q4): moectl-q4 {q4['ms_per_token']:.1f} ms/token = "
                   f"{q4['ms_per_token'] / ll['ms_per_token']:.2f}x llamacpp-cpu-moe's {ll['ms_per_token']:.1f}")
    return out


def mix(r: dict) -> str:
    """Experts per token by where they came from: resident hits aside, full / low-bit loads, skipped, CPU."""
    parts = [(r.get("full_loads_per_token"), "full"), (r.get("lowbit_loads_per_token"), "low"),
             (r.get("skipped_per_token"), "skip"), (r.get("cpu_experts_per_token"), "cpu")]
    text = " ".join(f"{v:.1f} {k}" for v, k in parts if v)
    return f"{r['precision']}: {text}" if text else r["precision"]


def simulate_preset(trace, name: str, budget: str | None, hardware: str, model_shape: str | None, plan_path,
                    as_json: bool) -> dict:
    """`moectl simulate --trace T --preset NAME --budget SIZE`: one scoreboard row on one trace."""
    import json

    from ..artifacts.plan import load_plan
    from .inputs import setup_from_trace

    preset = get_preset(name)
    if budget is None:
        raise MoectlError("--preset needs --budget SIZE (the device memory every preset is given)")
    setup = setup_from_trace(trace, budget, hardware, model_shape)
    plan = None
    if plan_path is not None:
        from ..artifacts.plan import check_plan_model

        plan = load_plan(plan_path)
        check_plan_model(plan, trace.fingerprint, trace.num_layers, trace.num_experts, f"the trace ({trace.model})",
                         trace.top_k)
    elif preset.slots.startswith("plan") or preset.name == "oracle":
        from .planner import make_plan

        plan = make_plan(setup.facts, setup.split, setup.cost, setup.replay, setup.policies, hardware)
    row = run_preset(setup, preset, plan)
    if as_json:
        print(json.dumps(row, indent=1, default=str))
    else:
        print_scoreboard([row], setup, title=f"{preset.name} ({preset.system}) on {trace.source or trace.model}: "
                                             f"{budget} on {hardware}")
    return row
