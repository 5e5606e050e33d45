"""Tables that fit a terminal without cutting a cell short: rich shrinks columns to the terminal and ends cut
cells with "…"; here numbers never shrink, text columns wrap at words, and on a terminal narrower than that the
lines run longer instead."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """"1 layer", "2 layers" (`many`: an irregular plural)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


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


def print_table(console, names: list[str], cells: list[list[str]], *, title: str = "", caption: str | None = None,
                left=(), wrap=(), keys: int = 1, width: int | None = None) -> int:
    """Print rows `cells` under `names` within `width` columns (default: the console's) without cutting a cell:
    as one table where it fits, else stacked -- the columns split, in order, into tables one below the other, each
    repeating the first `keys` columns (a row's name) -- so a wide table reads on an 80-column terminal too
    (`--json` has every figure on one record). The title heads the first table, the caption ends the last.
    Returns the number of tables printed."""
    from rich.measure import Measurement
    from rich.table import Table

    width = width or console.width

    def build(cols: list[int], first: bool, last: bool):
        t = Table(title=title if first else None, caption=caption if last else None)
        add_fitted_columns(t, [names[j] for j in cols], [[row[j] for j in cols] for row in cells],
                           left=left, wrap=wrap)
        for row in cells:
            t.add_row(*[row[j] for j in cols])
        return t

    def need(cols: list[int]) -> int:
        return Measurement.get(console, console.options.update(width=10**4), build(cols, False, False)).minimum

    head = list(range(min(keys, len(names))))
    groups, group = [], list(head)
    for j in range(len(head), len(names)):
        if len(group) > len(head) and need(group + [j]) > width:
            groups.append(group)
            group = head + [j]
        else:
            group.append(j)
    groups.append(group)
    if len(groups) > 1:                 # as many tables, the columns shared evenly where that fits too
        rest = list(range(len(head), len(names)))
        n = len(groups)
        even = [head + rest[i * len(rest) // n:(i + 1) * len(rest) // n] for i in range(n)]
        if all(need(g) <= width for g in even):
            groups = even
    for i, cols in enumerate(groups):
        print_fitted(console, build(cols, i == 0, i == len(groups) - 1))
    return len(groups)
