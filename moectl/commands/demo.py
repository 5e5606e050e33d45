"""`moectl demo`: the whole pipeline on the built-in tiny model, one step after another.

build/train tiny (if needed) -> every pipeline command this version has (`PIPELINE`) -> one chat answer with
cache stats -> a summary table. Steps run in this process through the CLI's own command functions, so each
prints its own progress and results exactly as when typed by hand. A step whose command does not exist
yet is listed as skipped; a step that fails is listed with its error and the demo goes on.
Each later pipeline issue adds its step to `PIPELINE`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

DEMO_QUESTION = "What does bisect_left do?"


@dataclass
class Step:
    command: str                  # CLI command name
    args: list[str]               # its arguments after `--model tiny --workdir W`
    makes: list[str]              # artifacts (relative to the workdir) it should leave behind


PIPELINE = [
    Step("profile", ["--dataset", "default", "--max-samples", "24", "--max-tokens", "384", "--generate", "8",
                     "--hidden-samples", "all", "--device", "cpu"], ["traces"]),
    Step("train-predictor", ["--max-minutes", "0.5"], ["predictors.safetensors", "predictors.json"]),
    Step("sensitivity", ["--max-tokens", "4096", "--target-ppl-delta", "0.01"], ["sensitivity.json"]),
    Step("quantize", ["--bits", "4", "--group-size", "64"], ["experts-q4g64.safetensors", "experts-q4g64.json"]),
    # 40 MB of dense, KV and slots for the tiny model besides the 64 MiB every budget keeps for cuBLAS's workspaces
    # (sizing.DEVICE_LIBRARY_BYTES)
    Step("plan-cache", ["--budget", "108MB"], ["plan.yaml"]),
]


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _made(workdir: Path, names: list[str]) -> str:
    from ..core.recipes import format_bytes

    parts = [f"{n} ({format_bytes(_size(workdir / n))})" for n in names if (workdir / n).exists()]
    return ", ".join(parts) if parts else "nothing new on disk"


def run_step(group, step: Step, workdir: Path, console) -> tuple[str, str]:
    """Run one CLI command in-process -> (status, what it made or why not)."""
    import click

    from ..errors import MoectlError

    args = [step.command, "--model", "tiny", "--workdir", str(workdir), *step.args]
    console.rule(f"[bold]moectl {' '.join(args)}")
    try:
        code = group.main(args=args, prog_name="moectl", standalone_mode=False)
        if isinstance(code, int) and code:                  # typer.Exit(n) comes back as a return value
            return "[red]failed[/]", f"exit code {code}"
    except MoectlError as e:
        return "[red]failed[/]", str(e)
    except click.exceptions.Exit as e:
        if e.exit_code:
            return "[red]failed[/]", f"exit code {e.exit_code}"
    except click.ClickException as e:
        return "[red]failed[/]", e.format_message()
    except SystemExit as e:
        if e.code:
            return "[red]failed[/]", f"exit code {e.code}"
    except Exception as e:                       # the demo reports a broken step and goes on
        if hasattr(e, "format_message"):         # a usage error (typer vendors its own click classes)
            return "[red]failed[/]", e.format_message()
        return "[red]failed[/]", f"{type(e).__name__}: {e}"
    return "[green]ok[/]", _made(workdir, step.makes)


def demo(
    workdir: Optional[str] = typer.Option(None, "--workdir", help="Artifact directory (default ~/.cache/moectl/tiny)."),
    question: str = typer.Option(DEMO_QUESTION, "--question", help="What to ask the tiny model at the end."),
    cache_experts: Optional[int] = typer.Option(None, "--cache-experts", min=1,
                                                help="Expert slots for the chat step (default: half the experts)."),
):
    """Run the whole pipeline on the built-in tiny model: build, calibrate, chat, summary."""
    from rich.console import Console
    from rich.table import Table

    from ..cli import app as cli_app
    from ..core.recipes import format_bytes, resolve_model
    from .build_tiny import print_tiny_report

    console = Console()
    group = typer.main.get_command(cli_app)
    ref = resolve_model("tiny", workdir)
    wd = ref.workdir
    rows: list[tuple[str, str, str, float]] = []

    # 1. the model
    console.rule("[bold]build the tiny model")
    t0 = time.perf_counter()
    from ..synth.tiny import build_tiny, tiny_report

    existed = (wd / "tiny.json").exists()
    ckpt = build_tiny(wd)
    report = tiny_report(wd)
    print_tiny_report(report, ckpt, console)
    rows.append(("build-tiny", "[green]reused[/]" if existed else "[green]ok[/]",
                 f"checkpoint/ ({format_bytes(_size(ckpt))}), val ppl {report['val_ppl']:.1f} vs unigram "
                 f"{report['unigram_ppl']:.1f}", time.perf_counter() - t0))

    # 2. the calibration pipeline, as far as this version has it
    for step in PIPELINE:
        t0 = time.perf_counter()
        if step.command not in group.commands:
            rows.append((step.command, "[dim]skipped[/]", "not in this version of moectl", 0.0))
            continue
        status, made = run_step(group, step, wd, console)
        rows.append((step.command, status, made, time.perf_counter() - t0))

    # 3. one chat answer through the offloading runtime
    console.rule("[bold]chat")
    t0 = time.perf_counter()
    from ..runtime.engine import Engine
    from ..serve.chat import ChatSession
    from ..status import prefetch_note, print_stats_line

    lowbit = "q4g64" if (wd / "experts-q4g64.json").exists() else None     # the quantize step's copies: HOBBIT
    eng = Engine.load("tiny", workdir=str(wd), cache_experts=cache_experts or _half_the_experts(ckpt),
                      prefetch="auto", emulate_device=True, gating="auto", lowbit=lowbit,
                      progress=False)   # the cache at work, on a CPU
    console.print(f"[dim]{prefetch_note(eng)}; {eng.cache.precision.describe()}"
                  + (f" with {lowbit} copies" if lowbit else "") + "[/]")
    session = ChatSession(eng, max_new_tokens=64, temperature=0.6, top_p=0.9, seed=0)
    console.print(f"[bold green]you>[/] {question}")
    console.print("[bold blue]assistant>[/] ", end="")

    def stream(_token_id: int, piece: str) -> None:
        console.file.write(piece)
        console.file.flush()

    result = session.ask(question, on_token=stream)
    console.file.write("\n")
    print_stats_line(result.stats, console)
    s = result.stats
    per_pool: dict[str, int] = {}                  # slots per precision (lowbit-only has no full-precision pool)
    for layer in eng.cache.state.pools:
        for p, pool in layer.items():
            per_pool[p] = per_pool.get(p, 0) + pool.capacity
    slots = " + ".join(f"{n} low-bit" if p == "low" else str(n) for p, n in per_pool.items())
    rows.append(("chat", "[green]ok[/]", f"{s['tokens']} tokens at {s['tokens_per_s']:.1f} tok/s, hit rate "
                 f"{s['hit_rate']:.0%} with {slots} expert slots, {format_bytes(s['bytes_loaded'])} loaded, "
                 f"{prefetch_note(eng)}",
                 time.perf_counter() - t0))

    # 4. summary
    table = Table(title=f"moectl demo — artifacts in {wd}")
    table.add_column("step")
    table.add_column("status")
    table.add_column("what it made")
    table.add_column("time", justify="right")
    for name, status, made, seconds in rows:
        table.add_row(name, status, made, f"{seconds:.1f} s")
    console.print(table)
    failed = [name for name, status, _, _ in rows if "failed" in status]
    if failed:                                  # `make demo` must not pass over a step that failed
        console.print(f"[red]demo: {', '.join(failed)} failed (see the table)[/]")
        raise typer.Exit(1)


def _half_the_experts(ckpt: Path) -> int:
    import json

    config = json.loads((ckpt / "config.json").read_text())
    return max(1, config["num_hidden_layers"] * config["num_local_experts"] // 2)
