"""What MOECTL_HOME holds and whose it is (`moectl clean`): each entry's kind, its model's path where it records one,
its bytes, and whether it may go.

Why: a path model's workdir (`<name>/`, `<name>-<8 hex>/`, core/model_workdir.py) outlives its model: deleting or
moving a GGUF file or a checkpoint directory leaves its workdir (saved config and tokenizer, traces, copies, plans)
in MOECTL_HOME for good, and the test suite's temporary models leave dozens. The record each one keeps
(`model-source.json`) says whose it is, so those whose recorded path no longer exists can be found and removed.

Kinds, in the order they are decided (the first that fits):
- `tool`: a folder or file moectl's tools keep there (`model_workdir.TOOL_ENTRIES`: ggml's and llama.cpp's builds,
  the kernels, corpora, the machine's figures, the benches'); never removed.
- `recipe`: a recipe's workdir (`recipes/<name>.yaml` works in `<name>/`, without case); never removed, even where
  it holds a path model's old record (a model of a recipe's name used it before it took `<name>-<8 hex>/`).
- `model here`: a workdir whose recorded model path exists; never removed.
- `model gone`: a workdir whose recorded model path does not exist now: the only kind `remove_gone` removes (a model
  on a disk not mounted now counts as gone: the list says which path each one recorded).
- `no record`: any other folder (a workdir made before records were kept, an explicit `--workdir` placed here, a
  folder moectl never made); never removed.
Other files and links at the top level are not moectl's workdirs and are not listed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .model_workdir import TOOL_ENTRIES, recorded_source
from .paths import bytes_under

TOOL, RECIPE, HERE, GONE, NO_RECORD = "tool", "recipe", "model here", "model gone", "no record"


@dataclass
class HomeEntry:
    name: str
    path: Path
    kind: str                       # one of TOOL, RECIPE, HERE, GONE, NO_RECORD
    source: str | None              # the model path its record names (None: no record)
    nbytes: int

    @property
    def removable(self) -> bool:
        return self.kind == GONE

    def as_json(self) -> dict:
        return {"name": self.name, "path": str(self.path), "kind": self.kind, "source": self.source,
                "bytes": self.nbytes, "removable": self.removable}


def kind_of(entry: Path, recipes=()) -> tuple[str | None, str | None]:
    """(`entry`'s kind (module docstring), or None where it is not listed (a file or link that is no tool's); the
    model path its record names, for a workdir of a model here or gone, else None). The record is read once."""
    folded = entry.name.casefold()
    if folded in {n.casefold() for n in TOOL_ENTRIES}:
        return TOOL, None
    if entry.is_symlink() or not entry.is_dir():
        return None, None
    if folded in {n.casefold() for n in recipes}:
        return RECIPE, None
    source = recorded_source(entry)
    if source is None:
        return NO_RECORD, None
    return HERE if os.path.exists(source) else GONE, source      # as `live_source`: the recorded path still there


def home_entries(home: Path, recipes=()) -> list[HomeEntry]:
    """Every listed entry of `home` (a MOECTL_HOME), by name; `recipes`: the recipes' names. Empty where `home`
    does not exist."""
    if not home.is_dir():
        return []
    out = []
    for entry in sorted(home.iterdir(), key=lambda e: e.name):
        kind, source = kind_of(entry, recipes)
        if kind is not None:
            out.append(HomeEntry(entry.name, entry, kind, source, bytes_under(entry)))
    return out


def remove_gone(entries: list[HomeEntry], recipes=()) -> tuple[list[HomeEntry], list[HomeEntry]]:
    """Remove the `model gone` entries of `entries`, each asked again first (a model back in place, or a record
    rewritten since the list was made, keeps its workdir). Returns (removed, left): `left`, those not removed whole
    (permissions; what could go went)."""
    removed, left = [], []
    for e in entries:
        if not e.removable or kind_of(e.path, recipes)[0] != GONE:
            continue
        shutil.rmtree(e.path, ignore_errors=True)          # a link inside goes, never its target
        (left if e.path.exists() else removed).append(e)
    return removed, left
