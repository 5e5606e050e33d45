"""`moectl clean`: what MOECTL_HOME holds, with sizes; `--remove` deletes the workdirs whose model is gone."""

from __future__ import annotations

import typer


def clean(
    remove: bool = typer.Option(False, "--remove", help="Delete the workdirs whose recorded model path no longer "
                                "exists ('model gone'); nothing else is ever deleted."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (entries, bytes, what was removed)."),
):
    """List MOECTL_HOME (~/.cache/moectl): each model's workdir with the model path it records and whether that
    still exists, the recipes' workdirs and moectl's tool folders (ggml's build, kernels, corpora), with sizes.
    Without --remove nothing is changed. --remove deletes only the 'model gone' workdirs (a deleted or moved GGUF
    file or checkpoint; a model on a disk not mounted now counts as gone: check the list first); never a recipe's
    workdir, a tool folder, a workdir without a record or one whose model exists."""
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..core.home_entries import GONE, home_entries, remove_gone
    from ..core.recipes import format_bytes, list_recipes, moectl_home
    from ..tables import plural

    home, recipes = moectl_home(), list_recipes()
    entries = home_entries(home, recipes)
    gone = [e for e in entries if e.kind == GONE]
    removed, left = remove_gone(entries, recipes) if remove else ([], [])
    if as_json:
        out = {"home": str(home), "entries": [e.as_json() for e in entries], "bytes": sum(e.nbytes for e in entries),
               "gone_bytes": sum(e.nbytes for e in gone)}
        if remove:
            out |= {"removed": [e.name for e in removed], "freed_bytes": sum(e.nbytes for e in removed),
                    "left": [e.name for e in left]}
        print(json.dumps(out))
        return
    console = Console()
    if not entries:
        console.print(f"nothing in {home}", highlight=False)
        return
    t = Table(title=f"{home}: {format_bytes(sum(e.nbytes for e in entries))}")
    t.add_column("entry", overflow="fold")
    t.add_column("size", justify="right", no_wrap=True)
    t.add_column("kind", no_wrap=True)
    t.add_column("model it records", overflow="fold")
    for e in entries:
        state = "removed" if e in removed else e.kind
        t.add_row(escape(e.name), format_bytes(e.nbytes), f"[yellow]{state}[/]" if e.kind == GONE else state,
                  escape(e.source or ""))
    console.print(t)
    if remove:
        console.print(f"removed {plural(len(removed), 'workdir')} whose model is gone: "
                      f"{format_bytes(sum(e.nbytes for e in removed))} freed"
                      + (f"; could not remove {', '.join(e.name for e in left)} (permissions?)" if left else ""),
                      highlight=False)
    elif gone:
        console.print(f"{plural(len(gone), 'workdir')} whose model is gone: {format_bytes(sum(e.nbytes for e in gone))}"
                      f" (moectl clean --remove deletes them)", highlight=False)
    else:
        console.print("no workdir whose model is gone", highlight=False)
