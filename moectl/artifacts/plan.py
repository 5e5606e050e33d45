"""plan.yaml (`moectl-plan-v1`): its writer (`moectl plan-cache`) and its reader, for everything that applies a plan
(the runtime options, `simulate --plan`). No torch.

    format: moectl-plan-v1        version: 1            fingerprint: <model fp, or null for a recipe shape>
    model, num_layers, num_experts, top_k
    slots: [full-precision slots per MoE layer]
    slots_low: [low-bit slots per layer]          (only when the plan serves low-bit copies)
    preload: {full: [[experts] per layer], low: ...}   (the experts the planning trace used most, up to each
                                                  pool's slots: loaded at start-up, `CacheState.preload`)
    expert_bytes: {full: B, low: b}, lowbit: q4g64
    budget: {total, dense, kv, kv_tokens, workspace, experts, experts_used}
    predictors: the directory of the predictors.json its prefetcher was measured with (when it used one)
    policies: {replacement, prefetch, depth, per_layer, gating (T_g), sensitivities (the values T_g applies to),
               gating_rule (which values: fisher | ablation), gating_cost (what sensitivity measured at T_g),
               precision, t1, t2, lowbit, cpu_experts, admission}
    hardware, curves (measured/analytic and on what), traces
    predicted / uniform: {hit_rate, ms_per_token, tokens_per_s, stall_ms_per_token, bytes_per_token,
                          misses_per_token, ...}  (the plan and the even split of the same bytes, simulated)
"""

from __future__ import annotations

from pathlib import Path

from .. import __version__
from ..core.cache_model import FULL, LOW
from ..errors import MoectlError
from .versioned import check_shape, is_int, read_descriptor, require_list, where, write_descriptor

PLAN_FORMAT, PLAN_VERSION = "moectl-plan-v1", 1
PLAN_NAME = "plan.yaml"


def check_plan_model(plan: dict, fingerprint: str | None, num_layers: int, num_experts: int, what: str,
                     top_k: int | None = None) -> None:
    """A plan made for another model is a clear error: its fingerprint (when both are known), else its shape
    (MoE layers, experts, and top-k when the caller gives one)."""
    src = plan.get("_path", "plan")
    fp = plan.get("fingerprint")
    if fp and fingerprint and fp != fingerprint:
        raise MoectlError(f"plan {src} was made for model {fp} ({plan.get('model')}), but {what} is {fingerprint}; "
                          f"re-run `moectl plan-cache` for this model")
    if plan.get("num_layers") is not None:
        have = (plan.get("num_layers"), plan.get("num_experts")) + ((plan["top_k"],) if plan.get("top_k") else ())
        check_shape(f"plan {src} ({plan.get('model')})", have, what, (num_layers, num_experts) +
                    (() if top_k is None or not plan.get("top_k") else (top_k,)),
                    "re-run `moectl plan-cache` for this model")


def load_plan(path: str | Path) -> dict:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "plan.yaml"
    if not p.is_file():
        raise MoectlError(f"plan {p} does not exist")
    d = read_descriptor(p, PLAN_FORMAT, what=f"{PLAN_FORMAT} plan (format: {PLAN_FORMAT}, slots: [per layer])")
    d["_path"] = str(p)
    return d


def plan_slots(d: dict, path) -> list[int]:
    """The plan's per-layer slot counts, each an integer >= 1; errors name the file and the entry's line."""
    path = d.get("_path", path)
    slots = require_list(d, "slots", path or "plan")
    low = require_list(d, "slots_low", path or "plan") if "slots_low" in d else None
    if low is not None and len(low) != len(slots):
        raise MoectlError(f"{path or 'plan'}: slots_low has {len(low)} layers, slots {len(slots)}")
    for key, values in (("slots", slots), ("slots_low", low or [])):
        lines = _yaml_item_lines(path, key)
        for i, s in enumerate(values):
            line = lines[i] if i < len(lines) else None
            if not is_int(s):
                raise MoectlError(f"{where(path or 'plan', line)}: {key}[{i}] must be an integer, not {s!r}")
            if s < 0 or (s < 1 and not (low and low[i] >= 1)):
                raise MoectlError(f"{where(path or 'plan', line)}: {key}[{i}] is {s}; every MoE layer needs at least "
                                  f"one slot")
    return list(slots)


def plan_preload(d: dict, num_layers: int, num_experts: int) -> dict:
    """The plan's preload {precision: [[experts] per layer]} ({} when it has none), checked against the model."""
    sets = d.get("preload") or {}
    src = d.get("_path", "plan")
    if not isinstance(sets, dict):
        raise MoectlError(f"{src}: preload must map a precision (full, low) to per-layer expert lists")
    for p, per_layer in sets.items():
        if p not in (FULL, LOW) or not isinstance(per_layer, list) or len(per_layer) != num_layers or not all(
                isinstance(x, list) and all(is_int(e) and 0 <= e < num_experts for e in x) for x in per_layer):
            raise MoectlError(f"{src}: preload[{p!r}] must hold {num_layers} lists of expert ids in [0, {num_experts})")
    return sets


def _yaml_item_lines(path, key: str) -> list[int]:
    """1-based line of each item of the top-level list `key` of a YAML file ([] if unknown)."""
    if path is None:
        return []
    import yaml                                     # here: only a plan's error message needs it

    try:
        node = yaml.compose(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return []
    for k, v in node.value if isinstance(node, yaml.MappingNode) else []:
        if k.value == key and isinstance(v, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in v.value]
    return []


PLAN_POLICIES = ("replacement", "prefetch", "precision", "lowbit", "cpu_experts", "admission")


def plan_policies(plan: dict) -> dict:
    """The options a plan sets, for everything that applies one (the resolver, `setting/resolve.py`): its
    policies, HOBBIT's T1/T2 with its hobbit precision, and its gating when it was measured gated: {threshold,
    values, rule, cost}, as `artifacts/sensitivity.py: stored_gating` gave them to plan-cache. A plan that gated
    without recording its rule (plan-cache before the rule was recorded, when it could pair the stored T_g with
    Fisher's S_l) brings no gating: the run takes sensitivity.json's, by the same rule."""
    pol = plan.get("policies") or {}
    out = {k: pol[k] for k in PLAN_POLICIES if pol.get(k) is not None}
    if pol.get("precision") == "hobbit":
        out |= {k: float(pol[k]) for k in ("t1", "t2") if pol.get(k) is not None}
    if pol.get("gating") and pol.get("sensitivities") and pol.get("gating_rule"):
        out["gating"] = {"threshold": float(pol["gating"]), "values": [float(x) for x in pol["sensitivities"]],
                         "rule": str(pol["gating_rule"]), "cost": pol.get("gating_cost")}
    return out


def plan_predictors(plan: dict) -> Path | None:
    """Where the predictors a plan was measured with are (`predictors`: the directory of their predictors.json,
    recorded by plan-cache), else the plan's own directory (its workdir) when it holds a predictors.json; None when
    neither does (a plan that prefetches with them then needs --predictor)."""
    from .predictors import JSON_NAME

    here = Path(plan["_path"]).parent if plan.get("_path") else None
    for d in (plan.get("predictors"), here):
        if d and (Path(d) / JSON_NAME).exists():
            return Path(d)
    return None


def write_plan(path, plan: dict, fingerprint: str | None) -> Path:
    head = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "fingerprint": fingerprint,
            "created_by": f"moectl {__version__}"}
    return write_descriptor(path, head | plan)
