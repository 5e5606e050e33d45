"""`moectl build-tiny`: build and train the built-in tiny Mixtral (normally done on first use of `--model tiny`)."""

from __future__ import annotations

from typing import Optional

import typer


def print_tiny_report(report: dict, ckpt, console) -> None:
    from rich.table import Table

    name = "reference" if report["variant"].startswith("reference") else "tiny"
    console.print(f"[bold]{name}[/] ({report['variant']}) at {ckpt}: {report['params'] / 1e6:.2f} M params, "
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
    small: bool = typer.Option(False, "--small", help="The small test variant (seconds); same as --size small."),
    size: str = typer.Option("tiny", "--size",
                             help="tiny (the built-in model, ~2 min), small (tests, seconds), reference (the "
                                  "fidelity yardstick: 29 M params on the stdlib's source and docs, ~45 min, "
                                  "resumable: re-run to continue), or reference-small (its recipe scaled down)."),
    workdir: Optional[str] = typer.Option(None, "--workdir",
                                          help="Where to build (default $MOECTL_HOME/<size>, the tiny model's "
                                               "in tiny, the small one's in tiny-small)."),
    as_json: bool = typer.Option(False, "--json", help="Print tiny.json as one JSON object."),
):
    """Build the built-in tiny MoE: corpus, tokenizer, training, checkpoint, tiny.json."""
    import json
    from pathlib import Path

    from rich.console import Console

    from ..core.recipes import moectl_home
    from ..errors import MoectlError
    from ..synth import tiny

    console = Console(stderr=as_json)
    if small and size not in ("tiny", "small"):
        raise MoectlError(f"--small and --size {size} disagree; give one of them")
    size = "small" if small else size
    if size not in tiny.SIZES:
        raise MoectlError(f"--size must be one of {', '.join(tiny.SIZES)}, not {size!r}")
    wd = Path(workdir).expanduser() if workdir else moectl_home() / {"small": "tiny-small"}.get(size, size)
    existed = (wd / "tiny.json").exists() and not force
    ckpt = tiny.build_tiny(wd, steps=steps, force=force, size=size, progress=not as_json)
    report = tiny.tiny_report(wd)
    if as_json:
        print(json.dumps(report | {"checkpoint": str(ckpt), "reused": existed}))
        return
    if existed:
        console.print(f"[dim]already built in {wd} (--force rebuilds)[/]")
    print_tiny_report(report, ckpt, console)
