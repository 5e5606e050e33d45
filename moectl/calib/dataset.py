"""Calibration sets: which texts the pipeline (profile, sensitivity, ...) runs the model on.

A calibration set is a small YAML file in `calibration/` (see `calibration/default.yaml`):

    source: builtin            # builtin | a local .txt/.jsonl/.json/.parquet/.csv file or directory | a save_to_disk dir
    split: validation          # split to read (builtin: train | validation; saved DatasetDict: its split names)
    text_field: text           # column holding the text (JSONL / Parquet / saved datasets)
    max_samples: 64            # at most this many texts (in file order)
    max_tokens: 512            # per-text cap, roughly: texts are cut at ~4 characters per token on a word boundary

Everything is read with `datasets` from local files only; nothing is fetched from a hub.

The built-in corpus (`source: builtin`) is `builtin_corpus.py`; the reference model's (`source: stdlib`)
`stdlib_corpus.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import MoectlError
from .builtin_corpus import builtin_corpus
from .stdlib_corpus import stdlib_corpus

_FILE_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                  ".parquet": "parquet", ".csv": "csv"}


def calibration_dirs() -> list[Path]:
    """Where calibration set names are looked up: ./calibration, then the repo's calibration/."""
    repo = Path(__file__).resolve().parents[2] / "calibration"
    here = Path.cwd() / "calibration"
    return [here] if here.resolve() == repo else [here, repo]        # in the repo root: one, named once


def find_calibration_yaml(name: str) -> Path | None:
    for d in calibration_dirs():
        for ext in (".yaml", ".yml"):
            p = d / f"{name}{ext}"
            if p.is_file():
                return p
    return None


def _cut(text: str, max_tokens: int | None) -> str:
    """Cap a text at roughly max_tokens tokens (~4 characters per token), on a word boundary."""
    if not max_tokens or len(text) <= 4 * max_tokens:
        return text
    head = text[: 4 * max_tokens]
    return head.rsplit(None, 1)[0] if " " in head or "\n" in head else head


def _load_local(path: Path, split: str | None, text_field: str) -> list[str]:
    """A local file, a directory of files, or a save_to_disk directory -> texts (via `datasets`)."""
    import datasets

    datasets.disable_progress_bars()
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            name = split or ("train" if "train" in ds else sorted(ds)[0])
            if name not in ds:
                raise MoectlError(f"{path} has splits {sorted(ds)}, not {name!r}")
            ds = ds[name]
        return _column(ds, text_field, path)

    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _FILE_BUILDERS)
        if not files:
            raise MoectlError(f"{path} holds no .txt/.jsonl/.json/.parquet/.csv files and is not a saved dataset")
    else:
        files = [path]
    kinds = {_FILE_BUILDERS.get(p.suffix.lower()) for p in files}
    if None in kinds:
        raise MoectlError(f"{path}: unsupported file type (use .txt, .jsonl, .json, .parquet or .csv)")
    if len(kinds) > 1:
        raise MoectlError(f"{path} mixes file types {sorted(kinds)}; put one kind per calibration source")
    kind = kinds.pop()
    if kind == "text":                                 # one sample per blank-line-separated paragraph block
        texts = []
        for p in files:
            texts += [t.strip() for t in re.split(r"\n\s*\n", p.read_text(encoding="utf-8")) if t.strip()]
        return texts
    try:
        ds = datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train")
    except Exception as e:
        raise MoectlError(f"could not read {path} as {kind}: {e}") from None
    return _column(ds, text_field, path)


def _column(ds, text_field: str, where: Path) -> list[str]:
    if text_field not in ds.column_names:
        raise MoectlError(f"{where} has no column {text_field!r} (columns: {ds.column_names}); set text_field")
    return [t for t in ds[text_field] if isinstance(t, str) and t.strip()]


def _by_name(path: Path) -> str:
    """For a path that is not there but names a known set (`calibration/default.yaml` run outside the repo): say
    where relative paths are read from and that the set's name finds it anywhere."""
    found = find_calibration_yaml(path.stem)
    if found is None:
        return ""
    rel = "" if path.is_absolute() else f" (relative paths are read from {Path.cwd()})"
    return f"{rel}; `--dataset {path.stem}` names the set {found} from any directory"


def load_calibration_spec(spec: str) -> dict:
    """Resolve a spec to its settings: {source, split, text_field, max_samples, max_tokens, name}."""
    import yaml

    settings = {"source": spec, "split": None, "text_field": "text", "max_samples": None, "max_tokens": None,
                "name": spec}
    path = Path(spec).expanduser()
    yaml_path = path if path.suffix in (".yaml", ".yml") else None
    if yaml_path is None and not path.exists() and spec not in ("builtin", "stdlib"):
        if "/" in spec or path.suffix:
            raise MoectlError(f"calibration source {path} does not exist{_by_name(path)}")
        yaml_path = find_calibration_yaml(spec)
        if yaml_path is None:
            raise MoectlError(
                f"calibration set {spec!r} not found: give a calibration YAML (names in "
                f"{', '.join(str(d) for d in calibration_dirs())}), a local text/JSONL/Parquet file or directory, "
                f"a saved `datasets` directory, or 'builtin'")
    if yaml_path is not None:
        if not yaml_path.is_file():
            raise MoectlError(f"calibration file {yaml_path} does not exist{_by_name(yaml_path)}")
        try:
            data = yaml.safe_load(yaml_path.read_text()) or {}
        except yaml.YAMLError as e:
            raise MoectlError(f"{yaml_path} is not valid YAML: {e}") from None
        if not isinstance(data, dict) or "source" not in data:
            raise MoectlError(f"{yaml_path} must be a mapping with a 'source' key (builtin or a local path)")
        unknown = set(data) - set(settings) - {"description"}
        if unknown:
            raise MoectlError(f"{yaml_path}: unknown keys {sorted(unknown)}")
        settings.update({k: v for k, v in data.items() if k != "description"})
        settings["name"] = yaml_path.stem
        source = str(settings["source"])
        if source not in ("builtin", "stdlib") and not Path(source).expanduser().is_absolute():
            source = str((yaml_path.parent / source).resolve())  # relative to the YAML file
        settings["source"] = source
    for key in ("max_samples", "max_tokens"):
        if settings[key] is not None and (not isinstance(settings[key], int) or settings[key] <= 0):
            raise MoectlError(f"calibration {key} must be a positive integer, got {settings[key]!r}")
    return settings


def load_calibration(spec: str, split: str | None = None, max_samples: int | None = None) -> list[str]:
    """Calibration texts for `spec`: a calibration YAML path or name ("default"), 'builtin', a local
    text/JSONL/Parquet/CSV file or directory, or a `datasets.save_to_disk` directory."""
    s = load_calibration_spec(spec)
    split = split or s["split"]
    if s["source"] == "builtin":
        texts = builtin_corpus(split or "train")
    elif s["source"] == "stdlib":                      # the reference model's corpus (calib/stdlib_corpus.py)
        texts = stdlib_corpus(split or "train")
    else:
        path = Path(s["source"]).expanduser()
        if not path.exists():
            raise MoectlError(f"calibration source {path} does not exist")
        texts = _load_local(path, split, s["text_field"])
    if not texts:
        raise MoectlError(f"calibration set {spec!r} has no texts")
    limit = max_samples or s["max_samples"]
    texts = texts[:limit] if limit else texts
    return [_cut(t, s["max_tokens"]) for t in texts]
