"""The predictors artifact: `predictors.safetensors` (weights) + `predictors.json` (what they are).

predictors.json, format "moectl-predictors" version 1:
    format, format_version, fingerprint (model fingerprint, or null for routing-only predictors trained on
    imported traces of an unknown model), model (name), num_layers, num_experts, top_k, lookahead [d...],
    kinds [present ones among "mlp", "aux_gate", "routing"],
    architecture {kind: config dict (enough to rebuild the module)}, metrics {kind: held-out metrics},
    traces [paths trained on], created (UTC ISO time).
predictors.safetensors: tensors named "<kind>.<parameter name>" (e.g. "mlp.3.fc1.weight", "aux_gate.net.0.weight",
    "routing.<its state_dict keys>"), float32.

Saving into a directory that already holds predictors of the same model keeps the kinds not retrained
(train `--kind routing` after `--kind mlp` and both stay); predictors of another model are replaced.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..artifacts.predictors import FORMAT, FORMAT_VERSION, JSON_NAME, KINDS, predictor_paths, read_predictors_meta
from ..errors import MoectlError


@dataclass
class PredictorSet:
    mlp: object | None = None          # moectl.predictors.mlp.MLPPredictorSet
    aux_gate: object | None = None     # moectl.predictors.aux_gate.AuxGate
    routing: object | None = None      # moectl.predictors.routing.RoutingPredictor
    meta: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def fingerprint(self) -> str | None:
        return self.meta.get("fingerprint")

    @property
    def kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) is not None]


def save_predictors(out_dir: str | Path, *, fingerprint: str | None, model: str, num_layers: int,
                    num_experts: int, top_k: int, lookahead: list[int], mlp=None, aux_gate=None, routing=None,
                    metrics: dict | None = None, traces: list[str] | None = None, merge: bool = True) -> Path:
    """Write the predictors (and keep other kinds of the same model already there). Returns the json path."""
    json_path, w_path = predictor_paths(out_dir)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    new = {"mlp": mlp, "aux_gate": aux_gate, "routing": routing}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "fingerprint": fingerprint, "model": model,
            "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k,
            "lookahead": sorted(int(d) for d in lookahead), "kinds": [], "architecture": {}, "metrics": {},
            "traces": [str(t) for t in traces or []],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tensors: dict[str, torch.Tensor] = {}
    if merge and json_path.exists() and w_path.exists():
        try:
            old = json.loads(json_path.read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
        same = (old.get("format") == FORMAT and old.get("fingerprint") == fingerprint
                and (old.get("num_layers"), old.get("num_experts")) == (num_layers, num_experts))
        kept = [k for k in old.get("kinds", []) if same and new.get(k) is None]
        if kept:
            from safetensors.torch import load_file

            old_t = load_file(str(w_path))
            for k in kept:
                meta["architecture"][k] = old["architecture"][k]
                meta["metrics"][k] = old.get("metrics", {}).get(k)
                tensors.update({n: t for n, t in old_t.items() if n.startswith(k + ".")})
            meta["kept_from_previous"] = kept
    for kind, obj in new.items():
        if obj is None:
            continue
        meta["architecture"][kind] = obj.config()
        meta["metrics"][kind] = (metrics or {}).get(kind)
        for n, t in obj.state_dict().items():
            tensors[f"{kind}.{n}"] = t.detach().float().cpu().contiguous()
    meta["kinds"] = [k for k in KINDS if k in meta["architecture"]]
    if not meta["kinds"]:
        raise MoectlError("no predictor to save")
    from safetensors.torch import save_file

    tmp = w_path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "fingerprint": str(fingerprint)})
    tmp.replace(w_path)
    json_path.write_text(json.dumps(meta, indent=1) + "\n")
    return json_path


def _build(kind: str, cfg: dict):
    if kind == "mlp":
        from .mlp import MLPPredictorSet

        return MLPPredictorSet.from_config(cfg)
    if kind == "aux_gate":
        from .aux_gate import AuxGate

        return AuxGate.from_config(cfg)
    from .routing import RoutingPredictor

    return RoutingPredictor.from_config(cfg)


def load_predictors(path: str | Path, expect_fingerprint: str | None = None,
                    expect_shape: tuple[int, int] | None = None) -> PredictorSet:
    """Load a predictors artifact (its directory, json or safetensors path).

    `expect_fingerprint`: the fingerprint of the model it will run with; predictors made for another model
    are a MoectlError. Routing-only predictors of imported traces carry no fingerprint: `expect_shape` (the model's
    MoE layers, experts) catches those of another model's traces.
    """
    json_path, w_path = predictor_paths(path)
    meta = read_predictors_meta(path, expect_fingerprint, expect_shape)
    kinds, arch = meta["kinds"], meta["architecture"]
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError) as e:
        raise MoectlError(f"{w_path} is unreadable ({e}); re-run `moectl train-predictor`") from None
    out = PredictorSet(meta=meta, path=json_path)
    for kind in kinds:
        try:
            obj = _build(kind, arch[kind])
        except (KeyError, TypeError, ValueError) as e:
            raise MoectlError(f"{json_path}: the {kind} architecture is malformed ({e!r})") from None
        sd = {n[len(kind) + 1:]: t for n, t in tensors.items() if n.startswith(kind + ".")}
        try:
            obj.load_state_dict(sd)
        except (RuntimeError, KeyError) as e:
            raise MoectlError(f"{w_path}: the {kind} weights do not match {JSON_NAME} ({e})") from None
        if hasattr(obj, "eval"):
            obj.eval()
        setattr(out, kind, obj)
    return out
