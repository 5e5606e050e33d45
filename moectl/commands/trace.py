"""`moectl trace import|export`: moe-routing-v1 JSONL <-> moectl trace directory."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def _default_trace_dir(model_name: str) -> Path:
    """<MOECTL_HOME>/<model>/traces (never builds or resolves a checkpoint)."""
    from ..recipes import moectl_home

    return moectl_home() / model_name.replace("/", "--") / "traces"


def _check_recipe_shape(model_name: str, meta: dict) -> None:
    """A recipe name whose shape disagrees with the trace is a clear error (wrong --model-name)."""
    from ..errors import MoectlError
    from ..recipes import list_recipes, load_recipe

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

    from ..calib.trace_io import import_jsonl

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
        Console().print(f"imported [bold]{summary['tokens']}[/] tokens, {summary['requests']} requests "
                        f"({summary['layers']} layers x {summary['experts']} experts, top-{summary['top_k']}) "
                        f"-> {out}")

def trace_export(
    trace_dir: Path = typer.Argument(..., help="trace directory (meta.json + shards)"),
    out: Path = typer.Option(..., "--out", help="JSONL file to write"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Export a trace directory as moe-routing-v1 JSONL (hidden samples and router logits are dropped)."""
    from rich.console import Console

    from ..calib.trace_io import export_jsonl, read_meta

    meta = read_meta(trace_dir)
    export_jsonl(trace_dir, out)
    if as_json:
        print(json.dumps({"out": str(out), "tokens": meta["num_tokens"], "requests": meta["num_requests"]}))
    else:
        Console().print(f"exported [bold]{meta['num_tokens']}[/] tokens, {meta['num_requests']} requests -> {out}")


# `moectl trace import|export`: a command group (the CLI adds `app` as the `trace` sub-command)
app = typer.Typer(help="Convert routing traces between moe-routing-v1 JSONL and trace directories.",
                  no_args_is_help=True)
app.command("import")(trace_import)
app.command("export")(trace_export)
