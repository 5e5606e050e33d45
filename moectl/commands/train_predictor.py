"""`moectl train-predictor`: expert predictors for prefetching, measured against gate reuse and frequency."""

from __future__ import annotations

from pathlib import Path

import typer


def train_predictor(
    model: str = typer.Option(None, "--model", "-m", help="recipe name, checkpoint directory or .gguf file"),
    traces: list[Path] = typer.Option(None, "--traces", "-t",
                                      help="trace directory or moe-routing-v1 JSONL (repeatable) "
                                           "(default: <workdir>/traces of --model)"),
    kind: str = typer.Option("all", "--kind", "-k", help="mlp | aux-gate | routing | all"),
    lookahead: str = typer.Option("1,2,3", "--lookahead", help="layers ahead to predict, e.g. 1,2,3"),
    epochs: int = typer.Option(None, "--epochs", min=1,
                               help="maximum epochs of every kind [default: 100 for mlp and aux gate (early stopping "
                                    "ends most sooner), 20 for routing (~150 weights per head: more passes overfit)]"),
    out: Path = typer.Option(None, "--out", "-o", help="output directory (default: the model's workdir, "
                                                          "or $MOECTL_HOME/<trace model name>)"),
    device: str = typer.Option("auto", "--device", help="where training runs: auto (CUDA when torch sees a device, "
                                                        "else the CPU), cpu, cuda or cuda:N (predictors run on the "
                                                        "CPU)"),
    max_minutes: float = typer.Option(10.0, "--max-minutes", help="wall-time bound for all training"),
    width: int = typer.Option(128, "--width", min=1,
                              help="hidden width of the mlp predictors (their CPU cost grows with it: "
                                   "128 is ~0.2 ms per layer on one core at D=4096)"),
    workdir: Path = typer.Option(None, "--workdir", help="artifact directory (default: $MOECTL_HOME/<model>)"),
    seed: int = typer.Option(0, "--seed", help="torch seed of the initial weights and the batch order: the same "
                                                "seed and traces train the same predictors"),
    as_json: bool = typer.Option(False, "--json", help="print the result as one JSON object"),
) -> None:
    """Train per-layer MLP predictors (ProMoE), the first-layer aux gate (AdapMoE) and the routing predictor."""
    import json

    from rich.console import Console

    from ..predict.pipeline import run_train_predictor
    from ..store.facts import pick_device

    console = Console(stderr=as_json)
    device, device_note = pick_device(device)      # said once the traces are checked (`run_train_predictor`)
    result = run_train_predictor(model=model, traces=traces or [], kind=kind, lookahead=lookahead, epochs=epochs,
                                 out=out, device=device, max_minutes=max_minutes, width=width,
                                 workdir=workdir, seed=seed, console=console, progress=True,
                                 device_note=device_note)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result, console)


def print_report(result: dict, console) -> None:
    """One rich table per lookahead (per layer, with the baselines), then aux gate and routing lines."""
    from rich import box
    from rich.table import Table

    metrics = result["metrics"]
    mlp = metrics.get("mlp")
    if mlp:
        ks = mlp["ks"]
        k = ks[0]
        for d, block in mlp["lookahead"].items():
            t = Table(title=f"mlp predictor, lookahead {d} ({mlp['test_tokens']} held-out tokens; R = recall, "
                            f"P = precision, cov = true set fully covered)", box=box.SIMPLE_HEAD)
            t.add_column("layer")
            for kk in ks:
                t.add_column(f"mlp\nR@{kk}", justify="right")
            t.add_column(f"mlp\nP@{k}", justify="right")
            t.add_column(f"mlp\ncov@{k}", justify="right")
            t.add_column(f"reuse\nR@{k}", justify="right")
            t.add_column(f"reuse\ncov@{k}", justify="right")
            t.add_column(f"freq\nR@{k}", justify="right")
            rows = [(f"{r['source']}->{r['target']}", r) for r in block["per_layer"]] + [("mean", block["mean"])]
            for name, r in rows:
                m, g, f = r["mlp"], r.get("gate_reuse"), r["frequency"]
                t.add_row(name, *[f"{m[f'recall@{kk}']:.2f}" for kk in ks], f"{m[f'precision@{k}']:.2f}",
                          f"{m[f'covered@{k}']:.2f}", f"{g[f'recall@{k}']:.2f}" if g else "n/a",
                          f"{g[f'covered@{k}']:.2f}" if g else "n/a", f"{f[f'recall@{k}']:.2f}",
                          style="bold" if name == "mean" else None)
            console.print(t)
    aux = metrics.get("aux_gate")
    if aux:
        ks = aux["ks"]
        trio = lambda m: " / ".join(f"{m[f'recall@{kk}']:.2f}" for kk in ks)   # noqa: E731
        console.print(f"aux gate (previous token's final hidden -> layer {aux['target_layer']}), "
                      f"{aux['test_tokens']} held-out tokens, recall@{'/'.join(map(str, ks))}: "
                      f"{trio(aux['aux_gate'])} vs frequency {trio(aux['frequency'])}")
    routing = metrics.get("routing")
    if routing:
        per_d = routing.get("lookahead", {})
        parts = [f"d={d}: recall {_num(v.get('recall'))} (previous token {_num(v.get('recall_prev_token'))}, "
                 f"popularity {_num(v.get('recall_popularity'))})" for d, v in per_d.items()]
        console.print("routing predictor, held-out recall@top-k (last 20% of the tokens): "
                      + ("; ".join(parts) if parts else "see --json"))
    for note in result.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"wrote {result['out']} (kinds: {', '.join(result['kinds'])}) in {result['seconds']:.1f} s")


def _num(v) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"
