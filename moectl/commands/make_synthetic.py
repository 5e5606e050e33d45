"""`moectl make-synthetic`: a random-weight checkpoint with a recipe's real tensor shapes."""

from __future__ import annotations

import json
from typing import Optional

import typer


def make_synthetic(
    shape: str = typer.Option(..., "--shape", help="Recipe with a shape: block (e.g. mixtral), or a yaml file with one."),
    out: str = typer.Option(..., "--out", help="New (or empty) directory for the checkpoint."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Keep the first N decoder layers (default: all)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16, float16 or float32 (default: the recipe's)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (path, layers, bytes, shards)."),
):
    """Write a random-weight checkpoint with the shapes of a real model, shard by shard (one tensor in RAM at a
    time): real-size experts for `moectl bench` / `generate` without downloading the model; route it with
    --replay-trace."""
    from pathlib import Path

    import yaml

    from ..core.recipes import format_bytes, load_recipe
    from ..core.shapes import load_shape
    from ..store.facts import parse_dtype as _dtype
    from ..synth.checkpoint import write_synthetic
    from ..tables import plural

    s = load_shape(shape)
    p = Path(shape).expanduser()
    recipe = (yaml.safe_load(p.read_text()) or {}) if p.is_file() else load_recipe(shape)
    family = recipe.get("family", "mixtral")
    info = write_synthetic(s, out, layers, family=family, dtype=_dtype(dtype, None) if dtype else None, seed=seed,
                           progress=not as_json)
    if as_json:
        print(json.dumps({k: info[k] for k in ("path", "layers", "bytes", "shards")}))
    else:
        print(f"wrote {info['path']}: {plural(info['layers'], 'layer')}, {plural(info['shards'], 'shard')}, {format_bytes(info['bytes'])}")
