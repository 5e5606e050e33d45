"""`moectl build-tiny`: build and train the built-in tiny Mixtral (normally done on first use of `--model tiny`)."""

from __future__ import annotations

from typing import Optional

import typer


def print_tiny_report(report: dict, ckpt, console) -> None:
    from rich.table import Table

    console.print(f"[bold]tiny[/] ({report['variant']}) at {ckpt}: {report['params'] / 1e6:.2f} M params, "
                  f"{report['steps']} steps ({report['train_tokens']:,} tokens) in {report['train_seconds']:.0f} s"
                  + (" [yellow](stopped by the time cap)[/]" if report.get("stopped_by_time_cap") else ""),
                  highlight=False)
    ratio = report["val_ppl"] / report["unigram_ppl"]
    console.print(f"validation perplexity [bold]{report['val_ppl']:.1f}[/] vs unigram baseline "
                  f"{report['unigram_ppl']:.1f} ({ratio:.2f}x) on {report['val_tokens']:,} held-out tokens",
                  highlight=False)
    table = Table(title=f"routing entropy, bits (uniform = log2 E = {report['uniform_entropy_bits']:.2f})")
    table.add_column("MoE layer", justify="right")
    table.add_column("expert usage", justify="right")
    table.add_column("per-token router", justify="right")
    for i, (u, r) in enumerate(zip(report["usage_entropy_bits"], report["router_entropy_bits"])):
        table.add_row(str(i), f"{u:.3f}", f"{r:.3f}")
    console.print(table)


def build_tiny(
    steps: Optional[int] = typer.Option(None, "--steps", min=1,
                                        help="Training steps (default: 600, or fewer if 120 s of training run out; "
                                             "an explicit --steps has no time cap)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if the workdir has a build."),
    small: bool = typer.Option(False, "--small", help="The small test variant (seconds)."),
    workdir: Optional[str] = typer.Option(None, "--workdir",
                                          help="Where to build (default ~/.cache/moectl/tiny, or tiny-small)."),
    as_json: bool = typer.Option(False, "--json", help="Print tiny.json as one JSON object."),
):
    """Build the built-in tiny MoE: corpus, tokenizer, training, checkpoint, tiny.json."""
    import json
    from pathlib import Path

    from rich.console import Console

    from ..recipes import moectl_home
    from .. import tiny

    console = Console(stderr=as_json)
    wd = Path(workdir).expanduser() if workdir else moectl_home() / ("tiny-small" if small else "tiny")
    existed = (wd / "tiny.json").exists() and not force
    ckpt = tiny.build_tiny(wd, steps=steps, force=force, small=small, progress=not as_json)
    report = tiny.tiny_report(wd)
    if as_json:
        print(json.dumps(report | {"checkpoint": str(ckpt), "reused": existed}))
        return
    if existed:
        console.print(f"[dim]already built in {wd} (--force rebuilds)[/]")
    print_tiny_report(report, ckpt, console)
