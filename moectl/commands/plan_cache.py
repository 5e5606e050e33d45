"""`moectl plan-cache`: split a device-memory budget into per-layer expert slots by DP on measured curves."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import MoectlError
from ..policies import REPLACEMENT_NAMES
from ..policies.admission import ADMISSION_MODES


def plan_cache(
    model: str = typer.Option(..., "--model", "-m", help="Checkpoint directory, .gguf file, recipe name, or tiny. A recipe whose "
                              "checkpoint is absent plans from its shape: block and --traces."),
    budget: str = typer.Option(..., "--budget", help="Device memory: 20GB, 20GiB, 20000MB or bytes. Dense weights, the "
                               "KV cache for --kv-tokens and a workspace come off first; the rest holds experts."),
    hardware: str = typer.Option("rtx4090-pcie4", "--hardware", help="recipes/hardware/<name>.yaml (or a yaml path)"),
    kv_tokens: int = typer.Option(4096, "--kv-tokens", min=0, help="tokens of KV cache the budget keeps room for"),
    traces: list[Path] = typer.Option(None, "--traces", help="trace directories or moe-routing-v1 JSONL files of the "
                                      "model (default: the workdir's profiled traces/). Without any, the seed's "
                                      "analytic model (AdapMoE §4.4) gives the curves."),
    replacement: str = typer.Option("ours", "--replacement", help=f"replacement policy measured: "
                                    f"{', '.join(n for n in REPLACEMENT_NAMES if n != 'belady')}"),
    prefetch: str = typer.Option("auto", "--prefetch", help="auto (the workdir's predictors, else gate reuse when the "
                                 "traces have hidden states, else none), or a prefetch policy name"),
    depth: int = typer.Option(None, "--depth", min=1, help="prefetch lookahead in layers"),
    lowbit: str = typer.Option(None, "--lowbit", help="low-bit copies, e.g. q4g64 (HQQ 4-bit, group 64)"),
    precision: str = typer.Option(None, "--precision", help="full (default), hobbit (hi/lo/skip by rank score, "
                                  "--t1/--t2; the default with --lowbit) or lowbit-only (every expert low-bit)"),
    t1: float = typer.Option(0.6, "--t1", help="hobbit: a missed expert with rank score <= T1 loads in full precision"),
    t2: float = typer.Option(0.9, "--t2", help="hobbit: <= T2 loads its low-bit copy, above is skipped"),
    cpu_experts: str = typer.Option("auto", "--cpu-experts", help="misses computed on the CPU from host RAM: auto "
                                    "(when the cost model says it beats a copy; the default: the fastest lossless "
                                    "setting, outputs unchanged), never, always"),
    admission: str = typer.Option("off", "--admission", help="on: the plan's prefetches pass the admission rule "
                                  "(a copy only when its expected saving beats its copy-engine cost), measured so and "
                                  "recorded for `simulate --plan`"),
    draft_tokens: str = typer.Option(None, "--draft-tokens", help="plan for speculative decoding: every candidate "
                                     "replayed in verification passes of K drafts (or auto: DraftRule picks K on the "
                                     "even split, 0 = off); recorded in plan.yaml's draft block; needs --acceptance"),
    acceptance: str = typer.Option(None, "--acceptance", help="acceptance of the drafts: a probability per position "
                                   "(e.g. 0.85), or the JSON file `bench --draft ... --acceptance-out` measured"),
    draft: str = typer.Option("cached", "--draft", help="cached (the model drafts with its resident experts) or model "
                              "(a separate draft model at --draft-ms per token)"),
    draft_ms: float = typer.Option(None, "--draft-ms", help="--draft model: ms per drafted token"),
    draft_max: int = typer.Option(4, "--draft-max", min=0, help="--draft-tokens auto: the most drafts per pass"),
    out: Path = typer.Option(None, "--out", help="where to write the plan (default <workdir>/plan.yaml)"),
    png: Path = typer.Option(None, "--png", help="slots-per-layer figure (default beside the plan)"),
    compare: bool = typer.Option(False, "--compare", help="also print the scoreboard: every preset on the same "
                                 "traces, budget and hardware"),
    workdir: Path = typer.Option(None, "--workdir", help="artifact directory (default ~/.cache/moectl/<model>)"),
    wide: bool = typer.Option(False, "--wide", help="the scoreboard with every column (experts per token by source); "
                              "the default fits 80 columns"),
    as_json: bool = typer.Option(False, "--json", help="print the plan (and scoreboard) as JSON"),
) -> None:
    """Plan the device expert cache: per-layer slots by dynamic programming on per-layer cost curves
    measured by the simulator on the model's traces; writes plan.yaml (read by simulate --plan, generate,
    chat, bench, serve) and a PNG of slots per layer."""
    import json

    from rich.console import Console

    from ..artifacts.plan import PLAN_NAME, write_plan
    from ..plan import scoreboard as sb
    from ..plan.inputs import plan_setup
    from ..plan.planner import make_plan
    from ..plan.proxy import Setting, proxies
    from ..plan.speculative import choose_tokens, draft_record
    from ..progress import ProgressBar
    from ..sim.spec_passes import check_draftable, parse_draft
    from ..synth.tiny import tiny_report
    from ._common import prepare_model

    console = Console(stderr=True)
    if model == "tiny":
        prepare_model(model, workdir)
    if admission not in ADMISSION_MODES:
        raise MoectlError(f"--admission must be {' or '.join(ADMISSION_MODES)}, not {admission!r}")
    setup = plan_setup(model, budget, hardware, kv_tokens, traces, replacement, prefetch, depth, workdir,
                       precision or ("hobbit" if lowbit else "full"), lowbit, t1, t2, cpu_experts, admission)
    spec = parse_draft(draft_tokens, acceptance, draft, draft_ms, draft_max)
    by_k = None
    if spec is not None:
        if setup.replay is None:
            raise MoectlError("--draft-tokens prices verification passes on traces: give --traces (or profile first)")
        check_draftable(setup.policies.replacement, setup.policies.prefetch)
        with console.status("choosing the drafted tokens per pass (each K on the even split)"):
            spec, by_k = choose_tokens(setup.replay, setup.policies, setup.facts, setup.split, spec)
        setup.replay.draft = spec
    with ProgressBar(console=console, transient=True) as bar:
        task = bar.add("measuring per-layer curves", total=None)
        plan = make_plan(setup.facts, setup.split, setup.cost, setup.replay, setup.policies, hardware,
                         progress=lambda: bar.update(task, advance=1))
    if spec is not None:
        plan["draft"] = draft_record(spec, by_k, _no_draft_ms(setup, plan))
    if setup.replay is not None and (setup.replay.predictor is not None or setup.replay.aux_gate is not None):
        plan["predictors"] = str(setup.workdir.resolve())      # so `simulate --plan` replays with them too
    path = write_plan(out or setup.workdir / PLAN_NAME, plan, setup.facts.fingerprint)
    figure = draw_slots(plan, png or path.with_suffix(".png"))
    board = None
    if compare:
        if setup.replay is None:
            raise MoectlError("--compare replays traces: give --traces (or profile the model first)")
        with ProgressBar(console=console, transient=True) as bar:
            task = bar.add("scoreboard", total=len(sb.PRESETS))
            board = sb.scoreboard(setup, plan, progress=lambda: bar.update(task, advance=1))
        with ProgressBar(console=console, transient=True) as bar:      # measured once, then read from its cache
            task = bar.add("ppl delta proxies (moectl eval on the tiny model)", total=None)
            need = [Setting()] + [Setting.parse(k) for k in dict.fromkeys(r["proxy_setting"] for r in board)]
            proxy = proxies(setup.workdir if tiny_report(setup.workdir) else None, settings=list(dict.fromkeys(need)),
                            progress=lambda: bar.update(task, advance=1))
        sb.add_proxy(board, proxy)
    if as_json:
        print(json.dumps({"plan": plan, "path": str(path), "png": str(figure)}
                         | ({"scoreboard": board, "ppl_delta_proxy": proxy} if board is not None else {}),
                         indent=1, default=str))
        return
    print_plan(plan, path, figure)
    if board is not None:
        sb.print_scoreboard(board, setup, wide=wide)
        print_proxy(proxy)


def _no_draft_ms(setup, plan: dict) -> float | None:
    """The plan's slots (and preload) replayed without drafting: ms/token."""
    from dataclasses import replace

    from ..plan.planner import pools_of

    if setup.replay is None or plan.get("predicted", {}).get("ms_per_token") is None:
        return None
    pools = pools_of(setup.policies, plan["slots"], plan.get("slots_low") or [0] * len(plan["slots"]))
    return replace(setup.replay, draft=None).run(pools, setup.policies, preload=plan.get("preload")).ms_per_token


KEPT = {"dp": "the DP's slots", "dp+refine": "the DP's slots, refined by replay",
        "uniform+refine": "the even split, refined by replay (the DP's slots replayed no better than it)",
        "uniform": "the even split (neither the DP's slots nor a replayed slot move beat it)"}


def print_plan(plan: dict, path, figure) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..core.recipes import format_bytes, stall_figure

    out = Console()
    b, pred, uni = plan["budget"], plan["predicted"], plan.get("uniform")
    held = b.get("experts_used", b["experts"])          # the bytes of the slots placed, not the bytes left for them
    t = Table(title=f"{plan['model']}: {format_bytes(b['total'])} on {plan['hardware']}: dense "
                    f"{format_bytes(b['dense'])} + KV {format_bytes(b['kv'])} ({b['kv_tokens']} tokens) + workspace "
                    f"{format_bytes(b['workspace'])} + experts {format_bytes(held)}"
                    + (f" + prefetch staging {format_bytes(b['staging'])}" if b.get("staging") else ""))
    for col in ("layer", "slots", "uniform", "of experts"):
        t.add_column(col, justify="right")
    E = plan["num_experts"]
    for l, (s, u) in enumerate(zip(plan["slots"], plan["uniform_slots"])):
        t.add_row(str(l), str(s), str(u), f"{s / E:.0%}")
    t.add_row("total", str(sum(plan["slots"])), str(sum(plan["uniform_slots"])),
              f"{sum(plan['slots']) / (E * len(plan['slots'])):.0%}")
    out.print(t)
    if b.get("all_experts") is not None and b["experts"] >= b["all_experts"]:
        out.print(f"the budget exceeds the whole model: every expert has a slot ({format_bytes(b['all_experts'])}), "
                  f"{format_bytes(b['experts'] - held)} of the budget is left unused", highlight=False)
    pol = plan["policies"]
    out.print(f"policies: {pol['replacement']} / prefetch {pol['prefetch']}"
              + (" (admission on)" if pol.get("admission") == "on" else "") + f" / precision {pol['precision']}"
              + (f" / gating T_g={pol['gating']:g}" if pol.get("gating") else "") + f"; curves: {plan['curves']}")
    if uni is not None:
        stall, uni_stall = stall_figure(pred["stall_ms_per_token"]), stall_figure(uni["stall_ms_per_token"])
        # compared by what the plan minimises: the stall, or with misses on the CPU the whole ms/token
        key = plan.get("objective", "stall_ms_per_token")
        mine, even = (stall, uni_stall) if key == "stall_ms_per_token" else (pred[key], uni[key])
        gain = 1 - mine / even if even else 0.0
        out.print(f"predicted: {pred['ms_per_token']:.3g} ms/token ({pred['tokens_per_s']:.1f} tok/s), hit rate "
                  f"{pred['hit_rate']:.1%}, stall {stall:.3g} ms/token; uniform split of the same "
                  f"bytes: {uni['ms_per_token']:.3g} ms/token, stall {uni_stall:.3g} "
                  f"(the plan's {'stall' if key == 'stall_ms_per_token' else 'ms/token'} is {abs(gain):.1%} "
                  + ("lower)" if gain >= 0 else "higher)"))
        dp = plan["dp"]
        out.print(f"kept: {KEPT[plan['kept']]}" + (f" ({plan['refined_moves']} replayed slot moves)"
                                                  if plan["refined_moves"] else "")
                  + f"; the DP's own slots replay {abs(dp['margin']):.1%} "
                  + ("below" if dp["margin"] >= 0 else "above") + " the even split")
    else:
        out.print(f"predicted (analytic): stall {stall_figure(pred['stall_ms_per_token']):.1f} ms/token, "
                  f"uniform {plan['curve_ms_per_token']['uniform']:.1f}")
    if plan.get("draft"):
        d = plan["draft"]
        out.print(f"drafting: {d['tokens']} {d['source']} drafts per pass ({d['chosen_by']}"
                  + (f", ms/token by K {d['by_k']}" if d.get("by_k") else "") + f"), acceptance "
                  f"{d['acceptance']['source'] or d['acceptance']['per_position']}; without drafting the plan's slots "
                  f"replay {d['no_draft_ms_per_token']:.3g} ms/token")
    out.print(f"wrote {path} and {figure} (curves {plan['timing_s']['curves']:.2f} s, DP {plan['timing_s']['dp']:.3f} s)")


def print_proxy(proxy: dict) -> None:
    """Where the scoreboard's ppl column comes from, or why it is empty."""
    from rich.console import Console

    out = Console()
    if proxy["status"].startswith("not measured"):
        out.print(f"{proxy['label']}: {proxy['status']}", highlight=False)
        return
    ev = proxy["eval"]
    out.print(f"{proxy['label']}: moectl eval --decode-steps on the tiny model ({ev['max_tokens']} tokens of "
              f"{ev['dataset']}, windows of {ev['window']}, device slots for {ev['cache_fraction']:.0%} of the "
              f"experts), per precision setting; {proxy['status']} in {proxy['path']}", highlight=False)
    for key, r in proxy["settings"].items():
        if "not_measured" in r:
            out.print(f"  {key}: not measured ({r['not_measured']})", highlight=False)


def draw_slots(plan: dict, path: Path) -> Path:
    """Bar chart of slots per layer, the plan beside the even split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    L = len(plan["slots"])
    x = np.arange(L)
    fig, ax = plt.subplots(figsize=(max(6, L * 0.25), 3.2))
    ax.bar(x - 0.2, plan["slots"], 0.4, label="plan (full precision)")
    if plan.get("slots_low"):
        ax.bar(x - 0.2, plan["slots_low"], 0.4, bottom=plan["slots"], label="plan (low-bit)")
    ax.bar(x + 0.2, plan["uniform_slots"], 0.4, label="uniform", alpha=0.6)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("expert slots")
    ax.set_title(f"{plan['model']}: {plan['budget']['total'] / 1e9:.1f} GB on {plan['hardware']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
