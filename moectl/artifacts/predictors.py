"""predictors.json (written by `moectl train-predictor`, predictors/file.py): its format and its reader, for
everything that needs what the predictors are without their weights (`--prefetch auto` in the resolver) and for the
weights' loader. No torch.

    format: moectl-predictors, format_version: 1, fingerprint (null for routing-only predictors of imported traces),
    model, num_layers, num_experts, top_k, lookahead, kinds [among mlp, aux_gate, routing], architecture {kind: ...}
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MoectlError
from .versioned import check_shape, read_descriptor, require_list

FORMAT = "moectl-predictors"
FORMAT_VERSION = 1
JSON_NAME = "predictors.json"
WEIGHTS_NAME = "predictors.safetensors"
KINDS = ("mlp", "aux_gate", "routing")
RETRAIN = "train predictors on this model's traces (`moectl train-predictor --model M`)"


def predictor_paths(path: str | Path) -> tuple[Path, Path]:
    """(predictors.json, predictors.safetensors) of a predictors directory, or of either file's path."""
    p = Path(path).expanduser()
    d = p if p.is_dir() or not p.suffix else p.parent
    return d / JSON_NAME, d / WEIGHTS_NAME


def read_predictors_meta(path: str | Path, expect_fingerprint: str | None = None,
                         expect_shape: tuple[int, int] | None = None) -> dict:
    """predictors.json of a predictors artifact (its directory, json or safetensors path), checked: format, version,
    the model's fingerprint, the shape (MoE layers, experts: routing-only predictors carry no fingerprint), known
    kinds each with its architecture, and the weights file beside it."""
    json_path, w_path = predictor_paths(path)
    if not json_path.exists():
        raise MoectlError(f"no predictors at {json_path.parent} ({JSON_NAME} missing); "
                          f"run `moectl train-predictor` first")
    meta = read_descriptor(json_path, FORMAT, what="predictors artifact", version_key="format_version",
                           max_version=FORMAT_VERSION, expect_fingerprint=expect_fingerprint)
    kinds = require_list(meta, "kinds", json_path)
    if expect_shape is not None:
        check_shape(f"predictors {json_path} ({meta.get('model')})", (meta.get("num_layers"), meta.get("num_experts")),
                    "the model", expect_shape, RETRAIN)
    arch = meta.get("architecture")
    for kind in kinds:
        if kind not in KINDS:
            raise MoectlError(f"{json_path}: unknown predictor kind {kind!r}; known: {', '.join(KINDS)}")
        if not isinstance(arch, dict) or not isinstance(arch.get(kind), dict):
            raise MoectlError(f"{json_path}: `architecture` has no {kind} entry; re-run `moectl train-predictor`")
    if not w_path.exists():
        raise MoectlError(f"{w_path} is missing (its {JSON_NAME} is there); re-run `moectl train-predictor`")
    return meta
