"""`moectl trace import|export|synthesize`: moe-routing-v1 JSONL <-> moectl trace directory, and synthetic traces
at a recipe's shape calibrated on a real one (`moectl/synth/trace.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..tables import plural


def _default_trace_dir(model_name: str) -> Path:
    """<MOECTL_HOME>/<model>/traces (never builds or resolves a checkpoint)."""
    from ..core.recipes import moectl_home

    return moectl_home() / model_name.replace("/", "--") / "traces"


def _check_recipe_shape(model_name: str, meta: dict) -> None:
    """A recipe name whose shape disagrees with the trace is a clear error (wrong --model-name)."""
    from ..core.recipes import list_recipes, load_recipe
    from ..errors import MoectlError

    if model_name not in list_recipes():
        return
    shape = load_recipe(model_name).get("shape") or {}
    want = {"num_layers": shape.get("moe_layers", shape.get("num_layers")), "num_experts": shape.get("num_experts"),
            "top_k": shape.get("top_k")}
    bad = {k: (meta[k], v) for k, v in want.items() if v is not None and int(v) != int(meta[k])}
    if bad:
        what = ", ".join(f"{k} {got} (recipe: {exp})" for k, (got, exp) in bad.items())
        raise MoectlError(f"the trace does not fit recipe {model_name!r}: {what}; pass the right --model-name")


def trace_import(
    file: Path = typer.Argument(..., help="moe-routing-v1 JSONL file"),
    model_name: str = typer.Option(..., "--model-name", help="model name recorded in meta.json (a recipe name "
                                   "puts the trace in that model's workdir when --out is not given)"),
    out: Path = typer.Option(None, "--out", help="trace directory to write [default: <workdir>/traces]"),
    as_json: bool = typer.Option(False, "--json", help="print the written meta.json summary as JSON"),
) -> None:
    """Import a moe-routing-v1 JSONL trace as a trace directory (exact: `trace export` gives the file back)."""
    from rich.console import Console

    from ..artifacts.trace_dir import import_jsonl

    def check(t) -> None:
        _check_recipe_shape(model_name, {"num_layers": t.num_layers, "num_experts": t.num_experts,
                                         "top_k": t.top_k})

    out = out or _default_trace_dir(model_name)
    meta = import_jsonl(file, out, model_name=model_name, check=check)
    summary = {"out": str(out), "model": meta["model"], "tokens": meta["num_tokens"],
               "requests": meta["num_requests"], "layers": meta["num_layers"], "experts": meta["num_experts"],
               "top_k": meta["top_k"], "shards": len(meta["shards"]), "weights": meta.get("has_weights", False)}
    if as_json:
        print(json.dumps(summary))
    else:
        Console().print(f"imported [bold]{summary['tokens']}[/] tokens, {plural(summary['requests'], 'request')} "
                        f"({plural(summary['layers'], 'layer')} x {summary['experts']} experts, top-{summary['top_k']}) "
                        f"-> {out}")

def trace_export(
    trace_dir: Path = typer.Argument(..., help="trace directory (meta.json + shards)"),
    out: Path = typer.Option(..., "--out", help="JSONL file to write"),
    as_json: bool = typer.Option(False, "--json", help="print {out, tokens, requests} as one JSON object"),
) -> None:
    """Export a trace directory as moe-routing-v1 JSONL (hidden samples and router logits are dropped)."""
    from rich.console import Console

    from ..artifacts.trace_dir import export_jsonl, read_meta

    meta = read_meta(trace_dir)
    export_jsonl(trace_dir, out)
    if as_json:
        print(json.dumps({"out": str(out), "tokens": meta["num_tokens"], "requests": meta["num_requests"]}))
    else:
        Console().print(f"exported [bold]{meta['num_tokens']}[/] tokens, {plural(meta['num_requests'], 'request')} "
                        f"-> {out}")


def trace_synthesize(
    like: Path = typer.Option(..., "--like", help="real trace (JSONL or trace directory) whose routing statistics "
                              "are fitted: popularity per layer, token-to-token and far reuse"),
    model: str = typer.Option(..., "--model", "-m", help="recipe whose shape (MoE layers x experts, top-k) the "
                              "trace gets; its trace name is the trace's model, so simulate and plan-cache price it"),
    tokens: int = typer.Option(512, "--tokens", help="decode tokens to generate"),
    requests: int = typer.Option(1, "--requests", help="requests the tokens are split into (each starts afresh)"),
    seed: int = typer.Option(0, "--seed", help="same --like, --model and seed: the same trace"),
    out: Path = typer.Option(..., "--out", help="FILE.jsonl (moe-routing-v1) or a trace directory"),
    as_json: bool = typer.Option(False, "--json", help="print the fitted and generated statistics as JSON"),
) -> None:
    """Write a synthetic routing trace at a recipe's shape with the popularity skew and reuse of a real trace of
    the same family (for models with no trace, e.g. gpt-oss-120b from gpt-oss-20b's). It is NOT a profile: its
    header says so (`source` starts with "synthetic", a `synthetic` record holds the generator's format_version,
    the seed and the trace it was fitted on). How it is fitted and how statistics carry across shapes:
    moectl/synth/trace.py; how well it reproduces the real traces: docs/benchmarks.md (issue 19)."""
    from rich.console import Console

    from ..synth.trace import fit_stats, save, synthesize_like, writable

    writable(out)
    trace, fitted, target = synthesize_like(like, model, tokens, seed, requests)
    save(trace, out)
    got = fit_stats(trace)
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    summary = {"out": str(out), "model": trace.model, "layers": L, "experts": E, "top_k": K, "tokens": tokens,
               "requests": requests, "seed": seed, "source": trace.source}
    for label, s in (("like", fitted), ("target", target), ("generated", got)):
        summary[label] = {"reuse": round(float(s.reuse.mean()), 4), "reuse_far": round(float(s.reuse_far.mean()), 4),
                          "top_quarter_share": round(float(s.shares[:, : max(1, s.num_experts // 4)].sum(1).mean()), 4)}
    if as_json:
        print(json.dumps(summary))
        return
    f = lambda d: f"reuse {d['reuse']:.3f}, far reuse {d['reuse_far']:.3f}, top 25 % share {d['top_quarter_share']:.3f}"
    c = Console()
    c.print(f"fitted on {like}: {f(summary['like'])}")
    c.print(f"target at {L} x {E}, top-{K}: {f(summary['target'])}")
    c.print(f"generated: {f(summary['generated'])}")
    c.print(f"wrote [bold]{tokens}[/] synthetic tokens of {trace.model} -> {out}")


# `moectl trace import|export|synthesize`: a command group (the CLI adds `app` as the `trace` sub-command)
app = typer.Typer(help="Convert routing traces between moe-routing-v1 JSONL and trace directories; synthesize one "
                  "at a recipe's shape from a real trace's statistics.",
                  no_args_is_help=True)
app.command("import")(trace_import)
app.command("export")(trace_export)
app.command("synthesize")(trace_synthesize)
