"""sensitivity.json (written by `moectl sensitivity`: `save_sensitivity`): its format, its writer and its reader, for
everything that applies a stored gating threshold (the runtime options, plan-cache, simulate). No torch."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class StoredGating:
    """What a sensitivity.json says the gating is: its T_g (None: no search stored one), the per-layer values that
    T_g was searched against and must be applied to (`values`, by `rule`), and what the search measured at it."""

    threshold: float | None
    values: list[float]
    rule: str                       # fisher | ablation: which of the file's per-layer values `values` are
    cost: dict | None               # {ppl_delta_rel, target_ppl_delta, experts_per_token, tokens} (None: no search)
    source: str | None = None       # the file

    def record(self) -> dict:
        """The fields a plan.yaml keeps of it (`plan/inputs.py`), so the plan gates as the search measured."""
        return {"gating": self.threshold, "sensitivities": list(self.values), "gating_rule": self.rule,
                "gating_cost": self.cost}


def stored_gating(meta: dict) -> StoredGating:
    """The one rule that picks the gating of a sensitivity.json, for everything that applies it (the runtime's
    options, plan-cache, simulate, the scoreboard): the stored T_g together with the values the search chose it
    against (`rule_sensitivities`): a T_g searched on the ablation costs applied to Fisher's S_l would gate by
    another rule than the one measured (on the tiny model: +6.7 % perplexity for a 1 % target)."""
    search = meta.get("search") or {}
    chosen = search.get("chosen")
    cost = None
    if meta.get("threshold") is not None and chosen:
        cost = {"ppl_delta_rel": float(chosen["ppl_delta_rel"]),
                "target_ppl_delta": search.get("target_ppl_delta"),
                "experts_per_token": float(chosen["experts_per_token"]),
                "tokens": int(search.get("tokens") or 0)}
    rule = "ablation" if meta.get("rule") == "ablation" and meta.get("ablation") else "fisher"
    return StoredGating(meta.get("threshold"), [float(v) for v in rule_sensitivities(meta)], rule, cost,
                        meta.get("path"))


def save_sensitivity(workdir: Path, meta: dict) -> Path:
    path = Path(workdir) / JSON_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "format_version": FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())} | meta
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path
