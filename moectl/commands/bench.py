"""`moectl bench`: the runtime on a model against its baselines (`--model`), or the runtime's overhead vs
transformers and the predictor's cost at real sizes (`--what`, without --model)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ..setting.options import RuntimeOptions
from ._common import prepare_model, runtime_options, say

# bench reads two runtime options its own way (the flags, fields and parsing are the shared ones)
BENCH_HELPS = {
    "cache_experts": "Expert slots in total for the moectl and lru rows, split evenly over MoE layers (default: half "
                     "the experts).",
    "device": "auto (CUDA when torch sees a device, else the CPU), cpu (the cached rows emulate a device: "
              "--emulate-device is implied), cuda or cuda:N.",
}


@runtime_options(helps=BENCH_HELPS)
def bench(
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Benchmark this model against the baselines (recipe name, checkpoint "
                                             "directory or .gguf file). Without it: --what overhead,predictor."),
    prompt_len: int = typer.Option(64, "--prompt-len", min=1, help="Prompt tokens (seeded random ids)."),
    gen_len: int = typer.Option(32, "--gen-len", min=2, help="Tokens generated (greedy)."),
    repeat: int = typer.Option(3, "--repeat", min=1, help="Requests per configuration (median request reported)."),
    baselines: str = typer.Option(",".join(("all-resident", "transformers", "on-demand", "lru", "moectl-plan")),
                                  "--baselines", help="Comma list of baselines to run besides moectl (--no-plan "
                                                      "drops moectl-plan)."),
    what: str = typer.Option("overhead,predictor", "--what",
                             help="Without --model: comma list of overhead (moectl vs transformers forward), predictor "
                                  "(MLP cost/layer)."),
    model_shape: str = typer.Option("mixtral", "--model-shape",
                                    help="Recipe whose shape sizes the predictor-cost run (default Mixtral-8x7B)."),
    acceptance_out: Optional[str] = typer.Option(None, "--acceptance-out",
                                                 help="With --draft: write the measured acceptance per position to "
                                                      "this JSON file (what `moectl simulate --acceptance` reads)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    opts: RuntimeOptions = None,
):
    """Measure a model's TTFT, prefill tokens/s, decode ms/token, hit rate, bytes/token, stall and predictor time
    against all-resident, transformers, on-demand and LRU baselines (and the workdir's plan), with the simulator's
    prediction; or, without --model, the runtime's overhead and the predictor's cost. The runtime options are
    generate's (one declaration); the precision, gating and cache options apply to the moectl rows."""
    from rich.console import Console

    o = opts
    if o.draft == "none":                       # bench's rows without drafting are its baseline already
        o.draft = None
    if model is not None:
        from ..benchmark.model import bench_model

        from ..store.facts import pick_device

        _check_draft(o.draft, acceptance_out)
        o.device, device_note = pick_device(o.device)
        o.check()
        prepare_model(model, o.workdir)
        say(device_note)                        # the device every row runs on
        rows = tuple(b.strip() for b in baselines.split(",") if b.strip() and not (o.plan is None and
                                                                                   b.strip() == "moectl-plan"))
        out = bench_model(model, o.workdir, o.device, o.budget, o.cache_experts, prompt_len, gen_len, o.replay_trace,
                          o.threads, o.replacement, o.prefetch or "auto", o.cpu_experts, o.dtype, rows, repeat=repeat,
                          prefill=o.prefill, progress=not as_json, admission=o.admission or "off", lowbit=o.lowbit,
                          precision=o.precision, t1=o.t1, t2=o.t2, gating=o.gating,
                          gating_threshold=o.gating_threshold, gate_prefill=o.gate_prefill,
                          runtime_kw=_moectl_row_options(o), draft=o.draft, draft_tokens=o.draft_tokens,
                          draft_rule=o.draft_rule)
        if o.draft is not None:
            _draft_acceptance(out, acceptance_out)
        if as_json:
            print(json.dumps(out))
        else:
            _model_table(Console(), out)
            for k, v in out["notes"].items():
                Console().print(f"[dim]{k}: {v}[/]", highlight=False)
            if o.draft is not None:
                d = out["runs"]["moectl+draft"]["draft"]
                acc = ", ".join(f"{p:.2f}" for p in d["acceptance"]["per_position"])
                Console().print(f"[dim]moectl+draft: --draft {d['source']} (K {d['draft_tokens']}, rule {d['rule']}): "
                                f"{d['tokens_per_pass']:.2f} tokens per pass, acceptance per position [{acc}], same "
                                f"tokens as without drafting: {d['same_tokens_as_without']}[/]", highlight=False)
        return
    _overhead_and_predictor(what, o.threads, model_shape, o.gating, o.gating_threshold, as_json, o.lowbit,
                            o.precision, o.t1, o.t2, o.gate_prefill)


def _moectl_row_options(o: RuntimeOptions) -> dict:
    """The shared runtime options bench had no flag for before, as given: passed to the moectl rows' Engine.load."""
    return {k: v for k, v in (("offload", o.offload if o.offload != "ram" else None), ("staging", o.staging),
                              ("predictor", o.predictor), ("lowbit_fraction", o.lowbit_fraction)) if v is not None}


def _check_draft(draft, acceptance_out) -> None:
    """--acceptance-out's error before anything loads (the draft options' own are `RuntimeOptions.check`'s)."""
    from ..errors import MoectlError

    if acceptance_out is not None and draft is None:
        raise MoectlError("--acceptance-out needs --draft (the acceptance is measured while drafting)")


def _draft_acceptance(out: dict, path: str | None) -> None:
    """The drafting row's acceptance on top of the report, and in `path` (`--acceptance-out`) for the simulator."""
    out["acceptance"] = out["runs"]["moectl+draft"]["draft"]["acceptance"]
    if path is not None:
        from pathlib import Path

        Path(path).expanduser().write_text(json.dumps(out["acceptance"], indent=1) + "\n")


def _model_table(console, out: dict) -> None:
    """The runs' figures, stacked into tables of the run's name and as many columns as fit the terminal."""
    from ..core.recipes import format_bytes
    from ..tables import plural, print_table

    title = (f"moectl bench {out['model']} ({out['device']}, {plural(out['threads'], 'thread')}, prompt "
             f"{out['prompt_len']}, {out['gen_len']} tokens)")
    names = ["run", "TTFT\nms", "prefill\ntok/s", "decode\nms/tok", "hit\nrate", "bytes\n/tok", "stall\nms/tok",
             "experts\nms/tok", "CPU\nexperts\nms/tok", "predictor\nms/tok", "predicted\nms/tok",
             "measured\n/predicted"]
    f = lambda v, fmt: "" if v is None else format(v, fmt)          # noqa: E731
    cells = []
    for name, r in out["runs"].items():
        p = out["predicted"].get(name, {})
        cells.append([name, f(r["ttft_ms"], ".1f"), f(r["prefill_tokens_per_s"], ".0f"),
                      f(r["decode_ms_per_token"], ".2f"), f(r.get("hit_rate"), ".1%"),
                      format_bytes(r["bytes_per_token"]) if "bytes_per_token" in r else "",
                      f(r.get("stall_ms_per_token"), ".2f"), f(r.get("expert_stage_ms_per_token"), ".2f"),
                      f(r.get("cpu_side_ms_per_token"), ".2f"), f(r.get("predictor_ms_per_token"), ".3f"),
                      f(p.get("decode_ms_per_token"), ".2f"), f(out["measured_over_predicted"].get(name), ".2f")])
    caption = ("experts: the layers' expert stages (wall: fetches, device and CPU experts overlapped); CPU experts: "
               "the worker's time on them")
    if out["all_resident_over_transformers"] is not None:
        caption += (f"\nall-resident / transformers decode time: {out['all_resident_over_transformers']:.3f} "
                    f"(goal <= {out['goal_all_resident_ratio']})")
    print_table(console, names, cells, title=title, caption=caption, left=("run",))


def _overhead_and_predictor(what, threads, model_shape, gating, gating_threshold, as_json, lowbit, precision,
                            t1, t2, gate_prefill=False) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..benchmark.overhead import predictor_cost, runtime_overhead
    from ..core.recipes import recipe_shape
    from ..errors import MoectlError

    parts = [w.strip() for w in what.split(",") if w.strip()]
    unknown = set(parts) - {"overhead", "predictor"}
    if unknown:
        raise MoectlError(f"--what: unknown part(s) {sorted(unknown)}; use overhead, predictor")
    out = {}
    if "overhead" in parts:
        out["overhead"] = runtime_overhead(threads=threads, gating=gating, gating_threshold=gating_threshold,
                                           lowbit=lowbit, precision=precision, t1=t1, t2=t2,
                                           gate_prefill=gate_prefill)
    if "predictor" in parts:
        s = recipe_shape(model_shape)
        out["predictor"] = predictor_cost(s["hidden_size"], s["num_experts"], s["top_k"], s["moe_layers"])
        out["predictor"]["model_shape"] = model_shape
    if as_json:
        print(json.dumps(out))
        return
    t = Table(title="moectl bench")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("goal", justify="right")
    if "overhead" in out:
        o = out["overhead"]
        t.add_row(f"prefill {o['prefill_tokens']} tok: moectl / transformers time", f"{o['forward_time_ratio']:.3f}",
                  "<= 1.15")
        t.add_row("decode tok/s: transformers", f"{o['decode_tok_s_transformers']:.1f}", "")
        t.add_row("decode tok/s: moectl (all experts cached)" + (f", {o['lowbit']} {o['precision']}" if o["lowbit"]
                                                                     else ""), f"{o['decode_tok_s_moectl']:.1f}", "")
    if "predictor" in out:
        p = out["predictor"]
        t.add_row(f"MLP predictor ms/layer ({model_shape}: D={p['hidden_size']}, E={p['num_experts']}), median",
                  f"{p['ms_per_layer_median']:.3f}", "<= 0.3")
        t.add_row("MLP predictor ms/layer, p90", f"{p['ms_per_layer_p90']:.3f}", "")
    Console().print(t)
