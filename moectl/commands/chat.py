"""`moectl chat`: talk to a model through the offloading runtime (streamed, /reset /stats /exit)."""

from __future__ import annotations

from typing import Optional

import typer

from ..setting.options import RuntimeOptions
from ._common import SamplingOpts, load_engine, runtime_options


@runtime_options
def chat(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name (e.g. tiny, mixtral), checkpoint directory or .gguf file."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1, help="Most tokens per answer."),
    greedy: bool = SamplingOpts.greedy(),
    temperature: float = SamplingOpts.temperature(),
    top_p: float = SamplingOpts.top_p(),
    seed: Optional[int] = SamplingOpts.seed("Sampling seed (turn i uses seed+i)."),
    system: Optional[str] = typer.Option(None, "--system", help="System message at the start of the conversation."),
    opts: RuntimeOptions = None,
):
    """Chat with a model. On a pipe: one message per input line, answers and status lines on stdout."""
    import sys

    from rich.console import Console

    from ..serve.chat import ChatSession, run_chat

    console = Console()
    interactive = sys.stdin.isatty() and console.is_terminal
    eng, _ = load_engine(model, opts, progress=interactive, torch_free=True)
    session = ChatSession(eng, max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature,
                          top_p=top_p, seed=seed, system=system)
    raise typer.Exit(run_chat(session, console=console, interactive=interactive))
