"""The one progress display of moectl: rich, on stderr (stdout stays clean for --json), or nothing.

    with ProgressBar(enabled, transient=False) as bar:
        task = bar.add("reading experts", total=N)
        bar.update(task, advance=1)                     # or completed=i, total=n, info="12 tok/s"
"""

from __future__ import annotations


class ProgressBar:
    """Tasks with a bar, done/total, an `info` text and elapsed time; every call is a no-op when disabled."""

    def __init__(self, enabled: bool = True, console=None, transient: bool = False):
        self.p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = console or Console(stderr=True)
            if transient and not console.is_terminal:   # it would leave only a blank line in a log or a pipe
                return
            self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                              console=console, transient=transient)

    def __enter__(self) -> "ProgressBar":
        if self.p:
            self.p.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self.p:
            self.p.__exit__(*exc)
        return False

    def add(self, label: str, total: int | None = None):
        return self.p.add_task(label, total=total, info="") if self.p else None

    def update(self, task, *, advance: int | None = None, completed: int | None = None, total: int | None = None,
               info: str | None = None) -> None:
        if not self.p:
            return
        kw = {k: v for k, v in (("advance", advance), ("completed", completed), ("total", total)) if v is not None}
        if info is not None:
            kw["info"] = info
        self.p.update(task, **kw)
