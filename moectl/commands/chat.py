"""`moectl chat`: talk to a model through the offloading runtime (streamed, /reset /stats /exit)."""

from __future__ import annotations

from typing import Optional

import typer

from ._common import CacheOpts, GatingOpts, PrecisionOpts, prepare_model, print_plan_note


def chat(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name (e.g. tiny, mixtral) or checkpoint directory."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1, help="Most tokens per answer."),
    greedy: bool = typer.Option(False, "--greedy", help="Greedy decoding (default: sampling)."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0),
    seed: Optional[int] = typer.Option(0, "--seed", help="Sampling seed (turn i uses seed+i)."),
    system: Optional[str] = typer.Option(None, "--system", help="System message at the start of the conversation."),
    cache_experts: Optional[int] = CacheOpts.cache_experts(),
    budget: Optional[str] = CacheOpts.budget(),
    device: str = CacheOpts.device(),
    emulate_device: bool = CacheOpts.emulate_device(),
    offload: str = CacheOpts.offload(),
    replacement: Optional[str] = CacheOpts.replacement(),
    no_plan: bool = CacheOpts.no_plan(),
    prefetch: str = CacheOpts.prefetch(),
    admission: str = CacheOpts.admission(),
    staging_buffers: int = CacheOpts.staging_buffers(),
    predictor: Optional[str] = CacheOpts.predictor(),
    workdir: Optional[str] = CacheOpts.workdir(),
    dtype: Optional[str] = CacheOpts.dtype(),
    threads: Optional[int] = CacheOpts.threads(),
    cpu_experts: str = CacheOpts.cpu_experts(),
    prefill: str = CacheOpts.prefill(),
    gating_threshold: Optional[float] = GatingOpts.threshold(),
    gating: Optional[str] = GatingOpts.spec(),
    gate_prefill: bool = GatingOpts.prefill(),
    lowbit: Optional[str] = PrecisionOpts.lowbit(),
    precision: Optional[str] = PrecisionOpts.precision(),
    t1: float = PrecisionOpts.t1(),
    t2: float = PrecisionOpts.t2(),
    lowbit_fraction: Optional[float] = PrecisionOpts.fraction(),
):
    """Chat with a model. On a pipe: one message per input line, answers and status lines on stdout."""
    import sys

    from rich.console import Console

    from ..runtime.engine import Engine
    from ..serve.chat import ChatSession, run_chat

    console = Console()
    interactive = sys.stdin.isatty() and console.is_terminal
    prepare_model(model, workdir)
    eng = Engine.load(model, lowbit=lowbit, precision=precision, t1=t1, t2=t2,
                      lowbit_fraction=lowbit_fraction, device=device,
                      cache_experts=cache_experts, budget=budget, offload=offload,
                      threads=threads, cpu_experts=cpu_experts, prefill=prefill,
                      workdir=workdir, dtype=dtype, replacement=replacement, prefetch=prefetch, admission=admission, staging=staging_buffers, predictor=predictor,
                      emulate_device=emulate_device,
                      gating=gating or "auto", gating_threshold=gating_threshold, gate_prefill=gate_prefill,
                      plan=None if no_plan else "auto", progress=interactive)
    print_plan_note(eng)
    session = ChatSession(eng, max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature,
                          top_p=top_p, seed=seed, system=system)
    raise typer.Exit(run_chat(session, console=console, interactive=interactive))
