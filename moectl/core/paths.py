"""Where a command writes: checked before the work that would write there, so a read-only MOECTL_HOME or --workdir
(or --out naming a file) is one clear error at once, never a traceback after minutes of work or after old files
were deleted. And what a folder there holds (`bytes_under`: ggml's pruning, `moectl clean`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import MoectlError


def writable_dir(path, what: str) -> Path:
    """`path` as a directory this process can write to: created with its parents, then proven by creating (and
    removing) a file in it, since permission bits say nothing for root and nothing about a read-only mount or a full
    disk. Else a MoectlError naming `what` (e.g. "--out", "the workdir") and why."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise MoectlError(f"{what} {p} is a file, not a directory: name a directory (it is created if missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".moectl-write-check-"):
            pass
    except OSError as e:
        raise MoectlError(f"cannot write to {what} {p}: {e.strerror or e}" + _hint(what)) from None
    return p


def bytes_under(path: Path) -> int:
    """The bytes of the files under `path`, as `du --apparent-size` without following links: a symlink counted as
    itself (ggml's `src-p<key>/` links into the source), a file or folder that cannot be read as 0."""
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size if os.path.lexists(path) else 0
        return sum(bytes_under(p) for p in path.iterdir())
    except OSError:
        return 0


def _hint(what: str) -> str:
    if what == "the workdir":
        return " (give --workdir a writable directory, or set MOECTL_HOME to one)"
    if what == "the trace directory":
        return " (give --out or --workdir a writable directory, or set MOECTL_HOME to one)"
    return ""
