"""Model recipes (`recipes/<name>.yaml`) and the per-model artifact workdir.

`--model` takes a recipe name (`mixtral`, `olmoe`, `tiny`, ...) or a checkpoint directory. A recipe
names the family, where the checkpoint lives (`path`, overridden by the `path_env` variable), a
`shape:` block the simulator uses when no checkpoint is present, and defaults. Artifacts of a model
live in `$MOECTL_HOME/<name>/` (MOECTL_HOME defaults to ~/.cache/moectl) unless `--workdir` says; a path model's
is `<name>-<8 hex>/` where `<name>/` is another model's of the same name, a recipe's or a tool's folder
(`model_workdir.py`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import MoectlError
from .model_workdir import path_workdir

REPO_ROOT = Path(__file__).resolve().parents[2]


def recipes_dir() -> Path:
    return Path(os.environ.get("MOECTL_RECIPES", REPO_ROOT / "recipes"))


def moectl_home() -> Path:
    return Path(os.environ.get("MOECTL_HOME", "~/.cache/moectl")).expanduser()


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def load_recipe(name: str) -> dict:
    f = recipes_dir() / f"{name}.yaml"
    if not f.exists():
        raise MoectlError(f"no recipe {name!r}; recipes: {', '.join(list_recipes())}")
    import yaml                                     # here: a GGUF's or a checkpoint's run reads no recipe

    try:
        recipe = yaml.safe_load(f.read_text()) or {}
    except yaml.YAMLError as e:
        raise MoectlError(f"recipe {f} is not valid YAML: {e}") from None
    recipe.setdefault("name", name)
    return recipe


def recipe_shape(name: str) -> dict:
    shape = load_recipe(name).get("shape")
    if not shape:
        raise MoectlError(f"recipe {name!r} has no shape: block")
    return dict(shape)


@dataclass
class ModelRef:
    name: str
    path: Path               # checkpoint directory, or a GGUF file (part 1 of a split one)
    family: str | None
    workdir: Path
    recipe: dict | None

    @property
    def gguf(self) -> bool:
        """A llama.cpp GGUF file (moectl/store/gguf/), not a safetensors directory."""
        return is_gguf_path(self.path)


SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}$")       # llama.cpp's split files: name-00001-of-00003.gguf


def is_gguf_path(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and not Path(path).is_dir()


def model_name(path: Path) -> str:
    """The artifact workdir's name of a checkpoint path: its directory name, or a GGUF's stem without the split
    part's `-0000k-of-0000N`."""
    name = SPLIT_PART.sub("", path.resolve().stem) if is_gguf_path(path) else path.resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name) or "model"


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or spec.startswith((".", "~")) or os.sep in spec


def resolve_model(spec: str, workdir: str | Path | None = None) -> ModelRef:
    """A recipe name, checkpoint directory or GGUF file -> where the checkpoint and the artifacts are. Builds nothing:
    the built-in tiny model's checkpoint is `<workdir>/checkpoint`, made by the commands that need it
    (`moectl/commands/_common.py: prepare_model`) or `moectl build-tiny`. What it writes: a path model's default
    workdir's record of its source (`model_workdir.py`: the claim that keeps two models of one name apart), here so
    that every command on a file, whichever runs first, lands in the same workdir."""
    if not spec:
        raise MoectlError("--model is required (a recipe name, a checkpoint directory or a .gguf file)")
    p = Path(spec).expanduser()
    if p.is_dir() or _looks_like_path(spec) or is_gguf_path(p):
        if not p.exists():
            raise MoectlError(f"model path {p} does not exist")
        name = model_name(p)
        wd = Path(workdir).expanduser() if workdir else path_workdir(moectl_home(), name, p, list_recipes())
        return ModelRef(name, p, None, wd, None)
    if not (recipes_dir() / f"{spec}.yaml").exists():
        raise MoectlError(f"--model {spec!r} is neither a checkpoint directory nor a recipe name (nor a .gguf file); "
                          f"recipes: {', '.join(list_recipes())}")
    recipe = load_recipe(spec)
    wd = Path(workdir).expanduser() if workdir else moectl_home() / recipe["name"]
    if recipe.get("builtin") in ("tiny", "reference"):      # built by `moectl build-tiny [--size reference]`
        return ModelRef(recipe["name"], wd / "checkpoint", recipe.get("family"), wd, recipe)
    env = recipe.get("path_env")
    raw = os.environ.get(env) if env and os.environ.get(env) else recipe.get("path")
    if not raw:
        raise MoectlError(f"recipe {spec!r} has no path; set {env or 'path:'} to the checkpoint directory")
    path = Path(raw).expanduser()
    if not path.exists():
        hint = f"set {env}=/path/to/checkpoint" if env else f"edit {recipes_dir() / (spec + '.yaml')}"
        raise MoectlError(f"recipe {spec!r} ({recipe.get('description', spec)}) points at {path}, which does not "
                          f"exist: download {recipe.get('hf_id', 'the checkpoint')} there, or {hint}")
    return ModelRef(recipe["name"], path, recipe.get("family"), wd, recipe)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'20GB' -> 20e9 bytes, '512MiB' -> 512*2**20. Clear error otherwise."""
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise MoectlError(f"cannot read size {text!r}; write e.g. 20GB, 512MB or 1.5GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def stall_figure(ms: float) -> float:
    """A stall in ms as printed: it cannot be negative, and below 1e-9 ms (a picosecond) it is float rounding's
    residue of a replay whose waits all cancel (Mixtral at 20 GB with its misses on the CPU: -1.28e-11 ms/token),
    so 0.0: never "-0", "-1.28e-11" or "1.41e-12"."""
    return ms if ms > 1e-9 else 0.0


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
