"""One progress bar for long work (rich), shown on stderr so --json output stays clean."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def progress_bar(label: str, total: int, enabled: bool = True):
    """Yields `advance()`; a no-op when not enabled."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n=1: bar.advance(task, n)
