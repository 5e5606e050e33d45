"""The layering of docs/architecture.md, enforced: every import of every module (top-level or inside a function,
`from . import x` resolved) is checked against the table below. An import moved into a function to dodge a cycle
is still that import.

The rule is one line: a module imports modules of its own layer or of lower ones. Besides it, the torch-free layers
import neither torch nor transformers, and no two files import each other, directly or around a loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "moectl"

# Bottom to top. A name is a module or a package (itself and everything under it); the root package's own
# `__init__` sits at the bottom.
LAYERS = [
    ("base", ("moectl", "moectl.errors", "moectl.progress", "moectl.tables")),
    ("core", ("moectl.core",)),
    ("artifacts", ("moectl.artifacts",)),
    ("decisions", ("moectl.policies", "moectl.setting", "moectl.sim")),
    ("kernels", ("moectl.kernels", "moectl.formats")),
    ("models", ("moectl.models", "moectl.predictors")),
    ("store", ("moectl.store",)),
    ("runtime", ("moectl.runtime",)),
    ("uses", ("moectl.calib", "moectl.predict", "moectl.plan", "moectl.quant", "moectl.synth",
              "moectl.benchmark")),
    ("serve", ("moectl.serve", "moectl.status")),
    ("front", ("moectl.commands", "moectl.cli", "moectl.__main__")),
]
TORCH_FREE = ("base", "core", "artifacts", "decisions")
TORCH = ("torch", "transformers", "accelerate")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(mod: str) -> int | None:
    """Index in LAYERS of the most specific entry naming `mod` (the root `moectl` names only its `__init__`)."""
    best, best_len = None, -1
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (mod == n if n == "moectl" else under(mod, n)) and len(n) > best_len:
                best, best_len = i, len(n)
    return best


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved; `from X import y`
    yields X.y where that is a module of the package, else X."""
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    modules = _modules(root)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            for a in node.names:
                out.append((node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base))
    return out


def _modules(root: Path) -> set[str]:
    return {module_name(p, root) for p in root.rglob("*.py")}


def _graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (a package import counts as its `__init__`)."""
    modules = _modules(root)
    graph = {}
    for path in root.rglob("*.py"):
        mod = module_name(path, root)
        graph[mod] = {name for _, name in imports(path, root) if name in modules and name != mod}
    return graph


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        where = f"{path.relative_to(root.parent)}"
        mine = layer_of(mod)
        if mine is None:
            bad.append(f"{where}: {mod} is in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        seen = set()
        for line, name in imports(path, root):
            if line in seen:
                continue
            if under(name, "moectl"):
                theirs = layer_of(name)
                if theirs is not None and theirs > mine:
                    seen.add(line)
                    bad.append(f"{where}:{line}: {mod} ({LAYERS[mine][0]}) imports {name} ({LAYERS[theirs][0]})")
            elif LAYERS[mine][0] in TORCH_FREE and any(under(name, t) for t in TORCH):
                seen.add(line)
                bad.append(f"{where}:{line}: {mod} ({LAYERS[mine][0]}, torch-free) imports {name}")
    return bad


def cycles(root: Path = ROOT) -> list[list[str]]:
    """Every set of files that import each other around a loop (strongly connected components of size > 1)."""
    graph = _graph(root)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_every_import_goes_down_or_sideways():
    assert violations() == []


def test_no_two_files_import_each_other():
    assert cycles() == []


def _planted(tmp_path, who: str, line: str) -> Path:
    """A copy of the package with `line` added inside a new function of `who`."""
    import shutil

    copy = tmp_path / "moectl"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    f = copy / Path(who).relative_to("moectl")
    f.write_text(f.read_text() + "\n\ndef _dodge():\n" + line)
    return copy


@pytest.mark.parametrize("who,line", [("moectl/sim/simulator.py", "    import torch\n"),
                                      ("moectl/core/sizing.py", "    from ..store import memory\n"),
                                      ("moectl/runtime/engine.py", "    from ..plan import planner\n"),
                                      ("moectl/serve/app.py", "    from ..commands import _common\n")])
def test_a_forbidden_import_inside_a_function_is_caught(tmp_path, who, line):
    """A copy of the package with one forbidden import added inside a function: the check names it."""
    found = violations(_planted(tmp_path, who, line))
    assert len(found) == 1 and found[0].startswith(who), found


def test_a_planted_cycle_is_caught(tmp_path):
    """core/sizing.py imports core/cache_model.py; planting the way back makes one cycle of exactly those two."""
    copy = _planted(tmp_path, "moectl/core/cache_model.py", "    from . import sizing\n")
    assert cycles(copy) == [["moectl.core.cache_model", "moectl.core.sizing"]]


def test_python_dash_m_moectl_is_the_cli():
    """`python -m moectl` runs the same command line as the installed script (no `No module named moectl.__main__`)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moectl", "--help"], capture_output=True, text=True,
                       cwd=ROOT.parent, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Usage: python -m moectl" in r.stdout and "plan-cache" in r.stdout
