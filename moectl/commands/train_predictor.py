"""`moectl train-predictor`: expert predictors for prefetching, measured against gate reuse and frequency."""

from __future__ import annotations

from pathlib import Path

import typer

def register(app: typer.Typer) -> None:
    @app.command("train-predictor")
    def train_predictor(
        model: str = typer.Option(None, "--model", "-m", help="recipe name or checkpoint directory"),
        traces: list[Path] = typer.Option(None, "--traces", "-t",
                                          help="trace directory or moe-routing-v1 JSONL (repeatable) "
                                               "(default: <workdir>/traces of --model)"),
        kind: str = typer.Option("all", "--kind", "-k", help="mlp | aux-gate | routing | all"),
        lookahead: str = typer.Option("1,2,3", "--lookahead", help="layers ahead to predict, e.g. 1,2,3"),
        epochs: int = typer.Option(100, "--epochs", min=1, help="maximum epochs (early stopping ends most sooner)"),
        out: Path = typer.Option(None, "--out", "-o", help="output directory (default: the model's workdir, "
                                                              "or $MOECTL_HOME/<trace model name>)"),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda (training only; predictors run on CPU)"),
        max_minutes: float = typer.Option(10.0, "--max-minutes", help="wall-time bound for all training"),
        width: int = typer.Option(256, "--width", min=1, help="hidden width of the mlp predictors"),
        workdir: Path = typer.Option(None, "--workdir", help="artifact directory (default: $MOECTL_HOME/<model>)"),
        seed: int = typer.Option(0, "--seed"),
        as_json: bool = typer.Option(False, "--json", help="print the result as one JSON object"),
    ) -> None:
        """Train per-layer MLP predictors (ProMoE), the first-layer aux gate (AdapMoE) and the routing predictor."""
        import json

        from rich.console import Console

        from ..predict.train import run_train_predictor

        console = Console(stderr=as_json)
        result = run_train_predictor(model=model, traces=traces or [], kind=kind, lookahead=lookahead, epochs=epochs,
                                     out=out, device=device, max_minutes=max_minutes, width=width,
                                     workdir=workdir, seed=seed, console=console, progress=True)
        if as_json:
            print(json.dumps(result, indent=1))
        else:
            print_report(result, console)


def _trio(m: dict, what: str, ks: list[int]) -> str:
    return " / ".join(f"{m[f'{what}@{k}']:.2f}" if f"{what}@{k}" in m else "-" for k in ks)


def print_report(result: dict, console) -> None:
    """One rich table per lookahead (per layer, with the baselines), then aux gate and routing lines."""
    from rich.table import Table

    metrics = result["metrics"]
    mlp = metrics.get("mlp")
    if mlp:
        ks = mlp["ks"]
        kk = "/".join(f"@{k}" for k in ks)
        for d, block in mlp["lookahead"].items():
            t = Table(title=f"mlp predictor, lookahead {d}: held-out recall {kk} ({mlp['test_tokens']} test tokens)")
            t.add_column("source -> target")
            t.add_column("mlp recall")
            t.add_column(f"mlp precision@{ks[0]}")
            t.add_column(f"mlp covered@{ks[0]}")
            t.add_column("gate reuse recall")
            t.add_column(f"gate reuse covered@{ks[0]}")
            t.add_column("frequency recall")
            rows = [(f"{r['source']} -> {r['target']}", r) for r in block["per_layer"]] + [("mean", block["mean"])]
            for name, r in rows:
                g = r.get("gate_reuse")
                t.add_row(name, _trio(r["mlp"], "recall", ks), f"{r['mlp'][f'precision@{ks[0]}']:.2f}",
                          f"{r['mlp'][f'covered@{ks[0]}']:.2f}", _trio(g, "recall", ks) if g else "n/a",
                          f"{g[f'covered@{ks[0]}']:.2f}" if g else "n/a", _trio(r["frequency"], "recall", ks),
                          style="bold" if name == "mean" else None)
            console.print(t)
    aux = metrics.get("aux_gate")
    if aux:
        ks = aux["ks"]
        console.print(f"aux gate (previous token's final hidden -> layer {aux['target_layer']}), "
                      f"{aux['test_tokens']} test tokens: recall {_trio(aux['aux_gate'], 'recall', ks)} vs "
                      f"frequency {_trio(aux['frequency'], 'recall', ks)} (k = {', '.join(map(str, ks))})")
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
