"""The built-in corpus (`source: builtin` of a calibration set, `dataset.py`): English technical prose that any
CPython 3.10+ can build offline and deterministically: the pydoc text (`pydoc.render_doc(module, renderer=pydoc.plaintext)`,
rendered in a fresh interpreter: `render_pydoc`) of a fixed, sorted list of
standard-library modules (`BUILTIN_MODULES`), cleaned (pydoc boilerplate, file paths, docs URLs, memory addresses,
`DATA`/`FILE`/`VERSION` sections and class-box rules removed), cut into documents of about 2,000 characters at
paragraph boundaries, exact duplicates dropped (inherited members repeat verbatim), and split by the hash of
each document's name (`module:index`): 1 in 10 goes to `validation`.
It is cached as JSONL under `$MOECTL_HOME/corpus/builtin-v3-py3.X/` (built in ~5 s). On CPython 3.11 it is
70 modules, 957 documents, 1.62 M characters: 857 documents / 1.45 M characters train, 100 / 0.17 M validation
(~420 k / ~50 k tokens with the tiny model's 2048-token BPE). Other Python versions document slightly different
text, so the cache directory is keyed by the Python minor version.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import textwrap
from pathlib import Path

from ..errors import MoectlError

CORPUS_VERSION = "builtin-v3"        # v3: rendered in a fresh interpreter (v2's text varied with the builder's
                                     # process: pytest's logging handlers, a cached __slotnames__, ...)
VALIDATION_EVERY = 10              # 1 in 10 documents (by name hash) is held out
DOC_CHARS = 2000                   # target document size

# Stable, side-effect-free modules present in every CPython >= 3.10 (none removed through 3.13).
BUILTIN_MODULES = tuple(sorted([
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmath", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fractions", "functools", "getopt", "gettext", "glob", "hashlib", "heapq",
    "hmac", "html", "http.client", "inspect", "io", "ipaddress", "itertools", "json", "logging", "math",
    "mimetypes", "numbers", "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "sched", "secrets", "shlex", "shutil", "socket", "statistics", "string", "struct", "subprocess",
    "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile",
]))

_DROP_SECTIONS = {"MODULE REFERENCE", "FILE", "VERSION", "DATA", "AUTHOR", "CREDITS", "PACKAGE CONTENTS",
                  "SUBMODULES", "DATE"}
_SECTION = re.compile(r"^[A-Z][A-Z ]+$")


# ---------------------------------------------------------------------------------------------- builtin corpus

def clean_pydoc(text: str) -> str:
    """pydoc plaintext -> prose: no boilerplate, paths, URLs, addresses or version-specific sections."""
    out, dropping = [], False
    for line in text.splitlines():
        if line.startswith("Python Library Documentation:") or line.startswith("Help on "):
            continue
        if _SECTION.match(line):                       # a top-level section heading
            dropping = line.strip() in _DROP_SECTIONS
            if not dropping:
                out.append(line.strip().capitalize())
            continue
        if dropping:
            continue
        line = re.sub(r"^(\s*)\|  ?", r"\1", line)      # class bodies are drawn inside "|  " boxes
        line = re.sub(r"^(\s*)\|  ?", r"\1", line)      # (nested classes: twice)
        if re.fullmatch(r"\s*[-|]{3,}\s*|\s*\|\s*", line):
            continue                                   # box rules
        if re.search(r"(/[\w.+-]+){2,}\.(py|so)\b|site-packages|lib/python3", line):
            continue                                   # file paths differ per machine
        line = re.sub(r"https?://\S+", "", line)        # docs URLs carry the Python version
        line = re.sub(r"\s+at 0x[0-9a-fA-F]+", "", line)
        line = re.sub(r"0x[0-9a-fA-F]{6,}", "0x...", line)
        out.append(line.rstrip())
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def _documents(module: str, text: str) -> list[dict]:
    """Cut one module's text into ~DOC_CHARS documents at paragraph boundaries."""
    docs, current = [], ""
    for para in re.split(r"\n\s*\n", text):
        if current and len(current) + len(para) > DOC_CHARS:
            docs.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current.strip():
        docs.append(current)
    return [{"name": f"{module}:{i:03d}", "text": textwrap.dedent(d).strip() + "\n"} for i, d in enumerate(docs)]


def _split_of(name: str) -> str:
    bucket = int(hashlib.sha1(name.encode()).hexdigest(), 16) % VALIDATION_EVERY
    return "validation" if bucket == 0 else "train"


def corpus_home() -> Path:
    return Path(os.environ.get("MOECTL_HOME", Path.home() / ".cache" / "moectl")).expanduser() / "corpus"


# pydoc's text of each module, rendered in a fresh interpreter (see `render_pydoc`); a module this build lacks: null
_RENDER = r"""
import importlib, json, pydoc, sys, warnings
warnings.simplefilter("ignore")
out = {}
for name in json.loads(sys.argv[1]):
    try:
        out[name] = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
    except Exception:
        out[name] = None
sys.stdout.write(json.dumps(out))
"""


def render_pydoc(modules: tuple[str, ...]) -> dict[str, str | None]:
    """{module: pydoc plaintext, None where this Python lacks it}, rendered in a fresh interpreter: pydoc renders
    live objects, so a process's own state shows in the text (pytest's logging handlers in `logging.shutdown`'s
    default, a `__slotnames__` that copying an argparse object caches, a threading hook replaced), and the same
    corpus must come out of any process. `-S` keeps site-packages' start-up hooks out too; the environment is fixed
    (hash seed, UTF-8) and the working directory is the temp dir, so no local file shadows a module."""
    import subprocess
    import tempfile

    env = {"PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8", "PATH": os.environ.get("PATH", "")}
    r = subprocess.run([sys.executable, "-S", "-c", _RENDER, json.dumps(list(modules))], capture_output=True,
                       env=env, cwd=tempfile.gettempdir(), timeout=600, check=False)
    if r.returncode != 0:
        last = (r.stderr.decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1]
        raise MoectlError(f"rendering the built-in corpus's pydoc text failed ({sys.executable}): {last}")
    return json.loads(r.stdout.decode("utf-8"))


def build_builtin_corpus(out_dir: Path, modules: tuple[str, ...] = BUILTIN_MODULES) -> dict:
    """Render (`render_pydoc`), clean, cut and split the stdlib docs into out_dir/{train,validation}.jsonl
    (+ meta.json)."""
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    used, missing, seen = [], [], set()
    for name, raw in render_pydoc(modules).items():
        if raw is None:                                # a module missing from this build (e.g. no _socket)
            missing.append(name)
            continue
        used.append(name)
        for doc in _documents(name, clean_pydoc(raw)):
            if doc["text"] in seen:                    # pydoc repeats inherited members verbatim: keep one copy,
                continue                               # so no validation document is also a training document
            seen.add(doc["text"])
            splits[_split_of(doc["name"])].append(doc)
    return write_corpus(out_dir, splits, {
        "version": CORPUS_VERSION, "python": sys.version.split()[0], "modules": used, "missing_modules": missing,
        "docs": {s: len(d) for s, d in splits.items()},
        "chars": {s: sum(len(x["text"]) for x in d) for s, d in splits.items()},
    })


def write_corpus(out_dir: Path, splits: dict[str, list[dict]], meta: dict) -> dict:
    """out_dir/<split>.jsonl (one JSON row per document), then meta.json, written last: its presence means the
    corpus is complete. Each file goes through a temp name, so concurrent builders (same bytes) never tear one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, docs in splits.items():
        tmp = out_dir / f"{split}.jsonl.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        tmp.replace(out_dir / f"{split}.jsonl")
    tmp = out_dir / f"meta.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(out_dir / "meta.json")
    return meta


def builtin_corpus_dir() -> Path:
    """The cached corpus directory, built on first use (about 5 s). Where $MOECTL_HOME cannot be written (a read-only
    cache) it is built for this process only, in a temporary directory removed at exit."""
    out_dir = corpus_home() / f"{CORPUS_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"
    if (out_dir / "meta.json").exists():
        return out_dir
    try:
        build_builtin_corpus(out_dir)
        return out_dir
    except OSError:
        return _process_corpus_dir()


_PROCESS_DIR: list[Path] = []          # the corpus built for this process (`builtin_corpus_dir`), once


def _process_corpus_dir() -> Path:
    if not _PROCESS_DIR:
        import atexit
        import shutil
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="moectl-corpus-"))
        atexit.register(shutil.rmtree, tmp, True)
        build_builtin_corpus(tmp)
        _PROCESS_DIR.append(tmp)
    return _PROCESS_DIR[0]


def builtin_corpus(split: str = "train") -> list[str]:
    """Texts of the built-in corpus for one split ("train" or "validation")."""
    if split not in ("train", "validation"):
        raise MoectlError(f"the builtin corpus has splits 'train' and 'validation', not {split!r}")
    path = builtin_corpus_dir() / f"{split}.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------- loading specs
