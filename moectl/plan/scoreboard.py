"""Presets: the setups people would pick instead of moectl, modelled on the same traces, budget and hardware
profile, and the scoreboard that puts them beside moectl's plan. Where each preset's parameters come from is in
docs/benchmarks.md ("Scoreboard presets").

A preset fixes slots (uniform split of the expert budget at its precision, its DP, or the plan), replacement,
prefetch, precision and gating. Prefetchers that need hidden states (gate reuse) cannot be replayed on routing-
only traces; there the preset runs without prefetch and its row says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cache_model import split_slots
from ..errors import MoectlError

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
    needs: list = field(default_factory=list)    # simulator features it needs beyond this build


PRESETS = [
    Preset("mixtral-offloading", "Mixtral-offloading (Eliseev & Mazur)", "lru", "gate-reuse", precision="lowbit-only",
           lowbit="q2g16", fidelity="lower (2-bit experts)", needs=["precision"]),
    Preset("moe-infinity", "MoE-Infinity", "moe-infinity", "eam"),
    Preset("hobbit", "HOBBIT", "hobbit", "gate-reuse", precision="hobbit", lowbit="q4g64", needs=["precision"]),
    Preset("adapmoe", "AdapMoE", "lru", "gate-reuse", slots="adapmoe-dp", gating="sensitivity"),
    Preset("llamacpp-cpu-moe", "llama.cpp --n-cpu-moe", "lru", "none", slots="layers-cpu", precision="lowbit-only",
           lowbit="q4g64", cpu_experts="always", fidelity="lower (4-bit experts)", needs=["precision", "cpu"]),
    Preset("oracle", "limit: Belady + perfect prefetch", "belady", "oracle", slots="plan"),
    Preset("moectl", "moectl plan", "plan", "plan", slots="plan"),
]
PRESET_NAMES = [p.name for p in PRESETS]


def get_preset(name: str) -> Preset:
    for p in PRESETS:
        if p.name == name:
            return p
    raise MoectlError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")


def simulator_features() -> set[str]:
    """What the simulator in this build can replay: low-bit pools ('precision'), CPU compute ('cpu')."""
    import inspect

    from ..sim.run import simulate

    params = inspect.signature(simulate).parameters
    return {f for f, p in (("precision", "precision"), ("cpu", "cpu_experts")) if p in params}


def run_preset(setup, preset: Preset, plan: dict | None, replay=None) -> dict:
    """One scoreboard row: the preset simulated on `replay` (default the setup's) at the setup's budget."""
    from .planner import Policies, summary

    replay = replay or setup.replay
    missing = [n for n in preset.needs if n not in simulator_features()]
    row = {"preset": preset.name, "system": preset.system, "fidelity": preset.fidelity, "notes": []}
    if missing:
        return row | {"skipped": f"needs simulator features not in this build: {', '.join(missing)}"}
    L, E = setup.facts.num_layers, setup.facts.num_experts
    if preset.name == "moectl":
        pol = Policies(**plan["policies"])
    else:
        pol = Policies(replacement=preset.replacement, prefetch=preset.prefetch, precision=preset.precision,
                       lowbit=preset.lowbit, cpu_experts=preset.cpu_experts)
        if preset.name == "oracle":
            pol.precision, pol.lowbit = plan["policies"]["precision"], plan["policies"]["lowbit"]
    if pol.prefetch in ("gate-reuse", "mlp", "aux-gate") and not _has_hidden(replay):
        row["notes"].append(f"{pol.prefetch} prefetch needs hidden states the traces lack: replayed without prefetch")
        pol.prefetch = "none"
    trace = replay.trace
    if preset.gating == "sensitivity":
        trace, note = _adapmoe_gating(setup, replay.raw or trace)
        row["notes"].append(note)
    B = setup.facts.expert_bytes()
    C = int(setup.split.experts // B)
    if preset.slots == "plan":
        caps = list(plan["slots"])
    elif preset.slots == "adapmoe-dp":
        caps = _adapmoe_dp(trace, C, L, E, setup.cost.load_s(), pol.prefetch != "none")
    else:
        caps = split_slots(max(C, L), L, E, "--budget")
    from dataclasses import replace

    run = replace(replay, trace=trace)
    r = run.run(caps, pol, belady=False)
    if preset.name == "oracle":          # perfect prefetch can evict what a 1-2 slot layer needs: the better of the two
        plain = run.run(caps, pol, belady=False, prefetch="none")
        if plain.ms_per_token < r.ms_per_token:
            r, pol.prefetch = plain, "none"
            row["notes"].append("Belady alone beat Belady + perfect prefetch at these slots")
    row.update(summary(r, setup.cost), slots=caps, replacement=pol.replacement, prefetch=pol.prefetch,
               precision=pol.precision + (f" ({pol.lowbit})" if pol.lowbit else ""),
               gating=pol.gating if preset.name == "moectl" else preset.gating)
    return row


def _has_hidden(replay) -> bool:
    from ..sim.run import hidden_lookup

    return hidden_lookup(replay.trace) is not None and bool(replay.trace.routers)


def _adapmoe_gating(setup, trace):
    """AdapMoE's sensitivity gating on the trace: the workdir's sensitivity.json, or the seed's Mixtral S_i."""
    from ..calib.sensitivity import JSON_NAME, load_sensitivity
    from ..policies.gating import SensitivityGating, gate_trace

    f = setup.workdir / JSON_NAME
    if f.exists():
        meta = load_sensitivity(f, setup.facts.fingerprint, setup.facts.num_layers)
        sens, tg, src = meta["sensitivities"], meta.get("threshold") or SEED_T_G, str(f)
    elif trace.num_layers == len(SEED_MIXTRAL_SENSITIVITY) and trace.num_experts == 8:
        sens, tg, src = SEED_MIXTRAL_SENSITIVITY, SEED_T_G, "AdapMoE's released Mixtral S_i"
    else:
        return trace, "no sensitivities for this model: gating off"
    if trace.weights is None:
        return trace, "the traces have no gate weights: gating off"
    return gate_trace(trace, SensitivityGating(tg, sens)), f"sensitivity gating T_g={tg:g} ({src})"


def _adapmoe_dp(trace, C: int, L: int, E: int, load_s: float, prefetch: bool) -> list[int]:
    """AdapMoE's DP on its analytic model, a_i (single-expert ratio) profiled on the (gated) trace."""
    from ..trace import DECODE
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


def print_scoreboard(rows: list[dict], setup, title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    t = Table(title=title or f"scoreboard: {setup.facts.name}, {setup.budget} on {setup.hardware}")
    for col in ("preset", "fidelity", "ms/tok", "tok/s", "hit rate", "MB/tok", "stall ms/tok", "precision", "notes"):
        t.add_column(col, justify="left" if col in ("preset", "fidelity", "precision", "notes") else "right")
    for r in rows:
        if "skipped" in r:
            t.add_row(r["preset"], r["fidelity"], "-", "-", "-", "-", "-", "-", r["skipped"])
            continue
        t.add_row(r["preset"], r["fidelity"], f"{r['ms_per_token']:.1f}", f"{r['tokens_per_s']:.2f}",
                  f"{r['hit_rate']:.3f}", f"{r['bytes_per_token'] / 1e6:.0f}", f"{r['stall_ms_per_token']:.1f}",
                  r["precision"], "; ".join(r["notes"]))
    out.print(t)
    ours = next((r for r in rows if r["preset"] == "moectl" and "skipped" not in r), None)
    if ours is None:
        return
    for line in ratios(rows):
        out.print(line)


def ratios(rows: list[dict]) -> list[str]:
    """moectl's gap to the oracle and its speed ratio to the best same-fidelity peer and to the lower-fidelity ones."""
    by = {r["preset"]: r for r in rows if "skipped" not in r}
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
    return out
