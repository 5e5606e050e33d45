"""The reference model's corpus: the Python standard library's own source and documentation, plus the built-in corpus.

Two splits, `train` and `heldout`, cached as JSONL under `$MOECTL_HOME/corpus/stdlib-v1-py3.X/` (built in seconds):
  - documentation: the built-in corpus (pydoc text, `builtin_corpus.py`) keeps its own split, so its
    `validation` documents are held out here too (the tiny model's default calibration set stays unseen);
  - source: every `.py` file of the running interpreter's standard library (no tests, no site-packages), one
    document per file (`pydoc_data/topics.py` brings the language reference's text). A file goes to `heldout`
    when the hash of its top-level module name says so (1 in 10), and nowhere at all when its module is one the
    built-in corpus documents (`BUILTIN_MODULES`): those docstrings are the built-in validation text, in another
    form, so training on them would leak the held-out split.

The held-out file interleaves documentation and source (doc, source, doc, ...) so any prefix of it (what
`moectl eval --max-tokens N` reads) scores both kinds of text.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

from ..errors import MoectlError
from .builtin_corpus import BUILTIN_MODULES, builtin_corpus, corpus_home, write_corpus

STDLIB_CORPUS_VERSION = "stdlib-v1"
HELDOUT_EVERY = 10                                   # 1 in 10 top-level modules (by name hash) is held out
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
MAX_FILE_CHARS = 400_000                             # generated tables (unicode data) are not prose or code
DOCUMENTED = {m.split(".")[0] for m in BUILTIN_MODULES}


def module_of(rel: Path) -> str:
    """'asyncio/events.py' -> 'asyncio', 'json.py' -> 'json' (the top-level module a file belongs to)."""
    return rel.parts[0].removesuffix(".py")


def source_split(module: str) -> str | None:
    """'train', 'heldout', or None (a module the built-in corpus documents: used nowhere)."""
    if module in DOCUMENTED:
        return None
    bucket = int(hashlib.sha1(module.encode()).hexdigest(), 16) % HELDOUT_EVERY
    return "heldout" if bucket == 0 else "train"


def stdlib_sources(root: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every standard-library .py file under root, sorted, tests and packages skipped."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip() and len(text) <= MAX_FILE_CHARS:
                out.append((path.relative_to(root).as_posix(), text))
    return out


def build_stdlib_corpus(out_dir: Path, root: Path | None = None, docs: dict[str, list[str]] | None = None) -> dict:
    """Write out_dir/{train,heldout}.jsonl and meta.json; `root` and `docs` default to this interpreter's stdlib
    and the built-in corpus (tests pass small ones)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if docs is None:
        docs = {"train": builtin_corpus("train"), "heldout": builtin_corpus("validation")}
    sources: dict[str, list[dict]] = {"train": [], "heldout": []}
    excluded = []
    for rel, text in stdlib_sources(root):
        split = source_split(module_of(Path(rel)))
        if split is None:
            excluded.append(rel)
        else:
            sources[split].append({"name": rel, "kind": "source", "text": text})
    splits = {}
    for split in ("train", "heldout"):
        doc_rows = [{"name": f"doc:{i}", "kind": "doc", "text": t} for i, t in enumerate(docs[split])]
        rows, src = [], sources[split]
        for i in range(max(len(doc_rows), len(src))):               # interleave: doc, source, doc, source, ...
            rows += doc_rows[i:i + 1] + src[i:i + 1]
        splits[split] = rows
    return write_corpus(out_dir, splits, {
        "version": STDLIB_CORPUS_VERSION, "python": sys.version.split()[0],
        "files": {s: len(v) for s, v in sources.items()}, "excluded_files": len(excluded),
        "docs": {s: len(d) for s, d in docs.items()},
        "chars": {s: sum(len(r["text"]) for r in rows) for s, rows in splits.items()},
    })


def stdlib_corpus_dir() -> Path:
    out_dir = corpus_home() / f"{STDLIB_CORPUS_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"
    if not (out_dir / "meta.json").exists():
        build_stdlib_corpus(out_dir)
    return out_dir


def stdlib_corpus(split: str = "train", kind: str | None = None) -> list[str]:
    """Texts of one split ('train' or 'heldout'), optionally only one kind ('doc' or 'source')."""
    if split not in ("train", "heldout"):
        raise MoectlError(f"the stdlib corpus has splits 'train' and 'heldout', not {split!r}")
    with open(stdlib_corpus_dir() / f"{split}.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["text"] for r in rows if kind is None or r["kind"] == kind]
