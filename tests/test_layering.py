"""The layering of docs/architecture.md, enforced: every import of every module (top-level or inside a function,
`from . import x` resolved) is checked against the contracts below. An import moved into a function to dodge a
cycle is still that import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "moectl"

# (who, may not import): a module or package name on the left is itself and everything under it
CONTRACTS = [
    (("moectl.policies", "moectl.sim", "moectl.core.cache_model", "moectl.core.sizing", "moectl.core.copy_chunks"),
     ("torch", "moectl.runtime")),
    (("moectl.runtime",), ("moectl.calib", "moectl.plan", "moectl.commands", "moectl.cli")),
    (("moectl.serve",), ("moectl.commands", "moectl.cli")),
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved; `from X import y`
    yields X and X.y (y may be a submodule)."""
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
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
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        for who, banned in CONTRACTS:
            if not any(under(mod, w) for w in who):
                continue
            seen = set()
            for line, name in imports(path, root):
                hit = next((b for b in banned if under(name, b)), None)
                if hit is not None and line not in seen:       # one entry per import statement
                    seen.add(line)
                    bad.append(f"{path.relative_to(root.parent)}:{line}: {mod} imports {name} ({hit} is off limits)")
    return sorted(bad)


def test_import_contracts_hold():
    assert violations() == []


@pytest.mark.parametrize("who,line", [("moectl/sim/simulate.py", "    import torch\n"),
                                      ("moectl/runtime/engine.py", "    from ..plan import artifact\n"),
                                      ("moectl/serve/app.py", "    from ..commands import _common\n")])
def test_a_forbidden_import_inside_a_function_is_caught(tmp_path, who, line):
    """A copy of the package with one forbidden import added inside a function: the check names it."""
    import shutil

    copy = tmp_path / "moectl"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    f = copy / Path(who).relative_to("moectl")
    f.write_text(f.read_text() + "\n\ndef _dodge():\n" + line)
    found = violations(copy)
    assert len(found) == 1 and found[0].startswith(who), found
