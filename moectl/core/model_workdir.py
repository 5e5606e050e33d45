"""A path model's artifact workdir: `$MOECTL_HOME/<name>/`, claimed by the file or directory it was made for.

Why: a path model's name is its GGUF's stem or its checkpoint directory's name (`recipes.py: model_name`), and two
models can share it (`a/model-Q4_K_M.gguf` and `b/model-Q4_K_M.gguf`, two directories named `checkpoint`). Sharing
one workdir, each run would replace the other's saved config and tokenizer (`store/gguf/saved_config.py`) and take the
slow load every time. So the workdir records its source, the resolved path (a symlink and its target are one source),
in `model-source.json`; a model that finds `<name>/` recording another source takes `<name>-<8 hex>/`, the hex a
sha256 of its resolved path's string (stable across runs; never of the file's bytes: the torch-free run reads no more
than a header). A `<name>/` without the record (made by a moectl that kept none), or recording a path that no longer
exists (a deleted or moved model; the test suite's temporary files), is adopted by the first model that uses it, so
`-<8 hex>` workdirs do not pile up (`moectl clean`, core/home_entries.py, lists those of models gone and removes
them). The record is written when the workdir is resolved, so every command on a file lands in the same workdir
whichever of them ran first; a MOECTL_HOME that cannot be written is left as it is (the command that writes there
says so, `core/paths.py: writable_dir`). An explicit `--workdir` is never renamed or recorded.

A name is claimed by others' besides a recorded path: a recipe's (`recipes/<name>.yaml` works in `<name>/`, and keeps
no record) and the folders moectl's tools keep beside the models (`TOOL_ENTRIES`). A path model of such a name
(`tiny.gguf`, `llamacpp.gguf`) always takes `<name>-<8 hex>/`, compared without case (a case-insensitive file system
makes `Tiny/` and `tiny/` one). A `<name>/` that such a model used before this rule (its record is in the recipe's
workdir) is left as it is: nothing is moved or deleted, since the recipe's own artifacts may lie beside the path
model's and no file says which is whose; the path model starts afresh in its `-<8 hex>/` (its first run remakes the
saved config and tokenizer), and an artifact of it left in `<name>/` is refused by the recipe's commands as another
model's (each artifact records its model's fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

FILE = "model-source.json"
FORMAT = "moectl-model-source-v1"
# what moectl's tools keep in MOECTL_HOME beside the models' workdirs: ggml's and llama.cpp's builds
# (kernels/ggml.py, bench/llamacpp.py), moectl's CPU kernels (kernels/__init__.py), the built-in corpora
# (calib/builtin_corpus.py), the machine's measured figures (runtime/machine.py), `build-tiny --size`'s workdirs that
# are no recipe's, and the benches' work folders; tests/test_model_workdir.py finds every such name in the sources
TOOL_ENTRIES = ("llamacpp", "kernels", "corpus", "machine.json", "tiny-small", "reference-small",
                "gguf_vs_llamacpp", "vs_llamacpp", "bench-gpt-oss")


def recorded_source(workdir: Path) -> str | None:
    """The resolved path `workdir` records as its model's, or None: no record (none yet, made before records were
    kept) or one that cannot be read (adopted, as none)."""
    try:
        data = json.loads((workdir / FILE).read_text())
        return data["source"] if data.get("format") == FORMAT and isinstance(data.get("source"), str) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def live_source(workdir: Path) -> str | None:
    """`recorded_source`, or None where the recorded path is gone: a workdir whose model was deleted or moved is
    free to adopt."""
    source = recorded_source(workdir)
    return source if source is not None and os.path.exists(source) else None


def record_source(workdir: Path, source: str) -> None:
    """Write `workdir`'s record (creating the directory), atomically; a place that cannot be written is left as is."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        tmp = workdir / f".{FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"format": FORMAT, "source": source}) + "\n")
        tmp.replace(workdir / FILE)
    except OSError:
        pass


def source_suffix(source: str) -> str:
    """8 hex of the resolved path's string: the workdir name's suffix when its plain name is another model's."""
    return hashlib.sha256(source.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def reserved(name: str, recipes=()) -> bool:
    """Whether `name` is a recipe's (of `recipes`) or a tool's folder in MOECTL_HOME, without case."""
    return name.casefold() in {n.casefold() for n in (*recipes, *TOOL_ENTRIES)}


def path_workdir(home: Path, name: str, path: Path, recipes=()) -> Path:
    """The workdir of the model at `path` named `name`: `home/name`, unless that records another source, is not a
    directory, or is `reserved` (a recipe of `recipes`, a tool's folder), then `home/name-<suffix>`. Claims the one
    it returns (writes its record when it has none)."""
    source = str(Path(path).resolve())
    wd = home / name
    recorded = live_source(wd)
    if reserved(name, recipes) or (wd.exists() and not wd.is_dir()) or recorded not in (None, source):
        wd = home / f"{name}-{source_suffix(source)}"
        recorded = live_source(wd)
    if recorded != source:
        record_source(wd, source)
    return wd
