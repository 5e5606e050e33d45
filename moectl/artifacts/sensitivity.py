"""sensitivity.json (written by `moectl sensitivity`: `save_sensitivity`): its format, its writer and its reader, for
everything that applies a stored gating threshold (the runtime options, plan-cache, simulate). No torch."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..errors import MoectlError
from .versioned import read_descriptor

FORMAT = "moectl-sensitivity"
FORMAT_VERSION = 1
JSON_NAME = "sensitivity.json"
RULES = ("fisher", "ablation")


def load_sensitivity(path: Path, expect_fingerprint: str | None = None, num_layers: int | None = None) -> dict:
    """A sensitivity.json (or its directory), checked (format, version, fingerprint through the shared artifact
    reader), with one non-negative value per MoE layer."""
    path = Path(path)
    f = path / JSON_NAME if path.is_dir() else path
    if not f.exists():
        raise MoectlError(f"no sensitivities at {f}; run `moectl sensitivity` first")
    meta = read_descriptor(f, FORMAT, what="sensitivity artifact", version_key="format_version",
                           max_version=FORMAT_VERSION, expect_fingerprint=expect_fingerprint)
    s = meta.get("sensitivities")
    if not isinstance(s, list) or not all(isinstance(v, (int, float)) and v >= 0 and math.isfinite(v) for v in s):
        raise MoectlError(f"{f}: 'sensitivities' must be a list of non-negative numbers")
    if num_layers is not None and len(s) != num_layers:
        raise MoectlError(f"{f} has {len(s)} sensitivities, the model has {num_layers} MoE layers")
    if meta.get("rule", "fisher") not in RULES:
        raise MoectlError(f"{f}: 'rule' must be one of {', '.join(RULES)}, not {meta.get('rule')!r}")
    a = meta.get("ablation")
    if meta.get("rule") == "ablation" and (not isinstance(a, list) or len(a) != len(s) or not all(
            isinstance(v, (int, float)) and v >= 0 and math.isfinite(v) for v in a)):
        raise MoectlError(f"{f}: rule 'ablation' needs 'ablation': one non-negative number per MoE layer")
    t = meta.get("threshold")
    if t is not None and (not isinstance(t, (int, float)) or t < 0):
        raise MoectlError(f"{f}: 'threshold' must be a non-negative number or null")
    return meta | {"path": str(f)}


def rule_sensitivities(meta: dict) -> list[float]:
    """The per-layer values the gating rule uses from a sensitivity.json: the ablation costs when it was made
    with `--rule ablation`, else Fisher's S_l."""
    return meta["ablation"] if meta.get("rule") == "ablation" and meta.get("ablation") else meta["sensitivities"]


def save_sensitivity(workdir: Path, meta: dict) -> Path:
    path = Path(workdir) / JSON_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "format_version": FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())} | meta
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path
