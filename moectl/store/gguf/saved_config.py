"""A GGUF's transformers config kept in the model's workdir, for the runs that import neither torch nor transformers.

Why: `moectl generate` on a GGUF the one ggml graph serves needs a handful of the config's values (sizes, RoPE, the
routing) and the fingerprint every artifact records, which hashes transformers' `to_dict()` of the config, defaults
included. Building that config imports transformers (~1.5 s of a ~2 s load on this 2-core machine: more than
llama.cpp's whole load to first token). So the first run, which builds it (`runtime/load.py`), saves the dict here,
and later runs read it back (`runtime/graph_engine.py`). Like the saved tokenizer (`store/gguf/model.py`), it is
used only for this very file (its path, size and mtime), this transformers version (read from the package's
metadata: importing it is what this avoids) and this code that derives the config (a hash of `config.py` and
`model.py` beside this file); anything else, or a file that cannot be read, is rebuilt, never an error.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ...core.fingerprint import model_fingerprint
from .files import source_key

FILE = "gguf-config.json"
FORMAT = "moectl-gguf-config-v1"


class ConfigView:
    """The saved dict read as a config: its keys as attributes (`config.hidden_size`), `to_dict()` the dict itself
    (what the fingerprint and `core/shapes.py: shape_from_hf_config` read). Values are JSON's: tuples are lists."""

    def __init__(self, values: dict):
        self.__dict__.update(values)
        self._values = values

    def to_dict(self) -> dict:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"ConfigView({self._values.get('model_type')!r}, {len(self._values)} keys)"


def cache_key(paths: list[Path]) -> dict:
    """What the saved config is valid for: these files as they are, this transformers (`files.py: source_key`),
    this code."""
    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / n).read_bytes() for n in ("config.py", "model.py"))).hexdigest()[:16]
    return {"format": FORMAT, **source_key(paths, {"transformers": None}), "code": code}


def save_config(workdir: Path, paths: list[Path], config) -> None:
    """Keep `config.to_dict()` (JSON-safe, as the fingerprint hashes it) for later runs; a workdir that cannot be
    written is left as it is (those runs build the config again)."""
    values = json.loads(json.dumps(config.to_dict(), default=str))
    target = Path(workdir) / FILE
    try:
        want = {"key": cache_key(paths), "config": values}
        if target.exists() and json.loads(target.read_text()) == want:
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(want))
        tmp.replace(target)
    except (OSError, ValueError):
        pass


def saved_config(workdir: Path, paths: list[Path]) -> ConfigView | None:
    """The config a previous run saved for these files, or None (none yet, another file's or version's, unreadable)."""
    try:
        data = json.loads((Path(workdir) / FILE).read_text())
        if data.get("key") != cache_key(paths):
            return None
        return ConfigView(data["config"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def view_fingerprint(config: ConfigView) -> str:
    """`models.config_fingerprint` of the config this view was saved from (the same dict, the same hash): the family
    is its `model_type`, as it is for every family the torch-free engine runs (`graph_engine.py: LEAN_FAMILIES`)."""
    return model_fingerprint(config.to_dict(), config.model_type)
