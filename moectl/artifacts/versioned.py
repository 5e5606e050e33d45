"""Reading moectl's versioned artifacts: one place for parsing, format/version and fingerprint checks,
and errors that name the file and line.

Every artifact's descriptor is a JSON or YAML mapping with a format name, a format version and the model
fingerprint it was made for (trace `meta.json`, `predictors.json`, `plan.yaml`, and the coming
`sensitivity.json` and quantized-copy manifests). A reader calls

    meta = read_descriptor(path, FORMAT, version_key="version", max_version=1, what="trace",
                           expect_fingerprint=fp)
    L = require_int(meta, "num_layers", path, minimum=1)

and gets a dict, or a `MoectlError` that says which file (and line, where the parser knows it) is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.fingerprint import check_fingerprint, shape_text
from ..errors import MoectlError


def where(path, line: int | None = None) -> str:
    """`file:line` (or `file`) for error messages."""
    return f"{path}:{line}" if line else f"{path}"


def parse_text(text: str, path) -> object:
    """JSON (.json, .jsonl lines) or YAML (.yaml / .yml) text -> Python object; syntax errors name the line."""
    if Path(path).suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            raise MoectlError(f"{where(path, mark.line + 1 if mark else None)}: not valid YAML "
                              f"({getattr(e, 'problem', None) or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MoectlError(f"{where(path, e.lineno)}: not valid JSON ({e.msg}): truncated or corrupt") from None


def read_parsed(p: Path, what: str):
    """The file `p` parsed (`parse_text`): one MoectlError naming `what` when it is missing, unreadable or corrupt."""
    if not p.is_file():
        raise MoectlError(f"{what} {p} does not exist")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise MoectlError(f"{p}: cannot read the {what} ({e})") from None
    return parse_text(text, p)


def read_descriptor(path, fmt: str | tuple[str, ...], *, what: str, version_key: str | None = None,
                    max_version: int = 1, expect_fingerprint: str | None = None) -> dict:
    """Parse an artifact's descriptor and check its format, version and (optionally) fingerprint."""
    p = Path(path)
    d = read_parsed(p, what)
    if not isinstance(d, dict):
        raise MoectlError(f"{where(p, 1)}: a {what} is a mapping with a `format` key, this holds a "
                          f"{type(d).__name__}")
    formats = (fmt,) if isinstance(fmt, str) else fmt
    if d.get("format") not in formats:
        raise MoectlError(f"{p} is not a {what}: format {d.get('format')!r}, expected {formats[0]!r}")
    if version_key is not None:
        v = d.get(version_key, 0)
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise MoectlError(f"{p}: {version_key} {v!r} is not an integer")
        if v > max_version:
            raise MoectlError(f"{p}: {what} format version {v} is newer than this moectl reads ({max_version}); "
                              f"upgrade moectl or re-create the {what}")
    if expect_fingerprint is not None:
        check_fingerprint(d.get("fingerprint"), expect_fingerprint, what, p)
    return d


def check_shape(what: str, have: tuple, model: str, want: tuple, fix: str) -> None:
    """An artifact made for a model of another routing shape is one clear error (imported traces and routing-only
    predictors carry no fingerprint, so their shape is what tells). `have`, `want`: (MoE layers, experts[, top-k]);
    a top-k either side leaves out is not compared."""
    n = min(len(have), len(want))
    if tuple(have[:n]) != tuple(want[:n]):
        raise MoectlError(f"{what} is for {shape_text(*have)}, {model} has {shape_text(*want)}: {fix}")


def is_int(x) -> bool:
    """A JSON/YAML integer (bools are not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def require_int(d: dict, key: str, path, *, minimum: int | None = None, line: int | None = None) -> int:
    """`d[key]` as an int >= `minimum`, or a MoectlError naming the file (and line)."""
    if key not in d:
        raise MoectlError(f"{where(path, line)}: `{key}` is missing")
    v = d[key]
    if not is_int(v):
        raise MoectlError(f"{where(path, line)}: `{key}` must be an integer, not {v!r}")
    if minimum is not None and v < minimum:
        raise MoectlError(f"{where(path, line)}: `{key}` must be >= {minimum}, not {v}")
    return v


def require_list(d: dict, key: str, path, *, line: int | None = None) -> list:
    if key not in d:
        raise MoectlError(f"{where(path, line)}: `{key}` is missing")
    if not isinstance(d[key], list):
        raise MoectlError(f"{where(path, line)}: `{key}` must be a list, not {type(d[key]).__name__}")
    return d[key]


def write_descriptor(path, d: dict) -> Path:
    """Write an artifact's descriptor atomically (a temp file renamed into place): YAML for .yaml/.yml, else
    JSON. Numpy scalars become plain numbers."""
    import os

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    clean = json.loads(json.dumps(d, default=_plain))
    if p.suffix in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(clean, sort_keys=False, default_flow_style=None, width=120)
    else:
        text = json.dumps(clean, indent=1)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, p)
    return p


def _plain(x):
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"cannot write {type(x).__name__} into an artifact")
