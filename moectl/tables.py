"""Tables that fit a terminal without cutting a cell short: rich shrinks columns to the terminal and ends cut
cells with "…"; here numbers never shrink, text columns wrap at words, and on a terminal narrower than that the
lines run longer instead."""

from __future__ import annotations


def add_fitted_columns(table, names: list[str], cells: list[list[str]], left=(), wrap=()) -> None:
    """Add columns `names` (a header may hold "\\n") to a rich `table` for the rows `cells`, each at least as wide as
    its widest whole cell (a `wrap` column: its widest word); `left` columns are left-justified. Then add the rows
    and show it with `print_fitted`."""
    for j, name in enumerate(names):
        words = [w for row in cells for w in (row[j].split() if name in wrap else [row[j]])] + name.split("\n")
        table.add_column(name, justify="left" if name in left else "right", no_wrap=name not in wrap,
                         min_width=max(len(w) for w in words))


def print_fitted(console, table) -> None:
    """Print `table` at the console's width, or wider where that would cut a cell short (rich's own measure of the
    table's narrowest rendering: the columns' minimum widths, padding and rules)."""
    from rich.console import Console
    from rich.measure import Measurement

    need = Measurement.get(console, console.options.update(width=10**4), table).minimum
    (console if need <= console.width else Console(width=need)).print(table)
