"""plan-cache for speculative decoding (issue 33): the plan's candidates priced in verification passes, and the
drafting it was made for recorded in plan.yaml.

    draft:                       (plan.yaml; absent when the plan was made without drafting)
      tokens: K                  drafts per pass the plan was priced with (0: the rule found drafting does not pay)
      source: cached | model     what drafts (model: a separate draft model at draft_ms per token)
      draft_ms: null | X
      acceptance: {...}          policies/draft_length.py Acceptance.to_json(): the per-position acceptance it assumed
      chosen_by: fixed | auto    auto: DraftRule on the even split's replays at K = 0..k_max (`by_k`: their ms/token,
                                 a list indexed by K)
      no_draft_ms_per_token      the plan's slots replayed without drafting (what drafting gains)

`--draft-tokens auto` picks K once, on the even split of the budget (each K replayed, sim/spec_passes.py run_draft's
cost rule), then plans at that K: the curves and every replay of the planner are passes at that K.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import MoectlError
from ..policies.draft_length import Acceptance
from ..sim.spec_passes import DraftSpec


def choose_tokens(replay, pol, facts, split, spec: DraftSpec) -> tuple[DraftSpec, list | None]:
    """`spec` with K fixed: as given, or (auto) DraftRule's pick on the even split's replays; and auto's by_k."""
    if spec.tokens is not None:
        return spec, None
    from .planner import expert_nbytes, pools_of, reserve_staging, uniform_pools

    nbytes = expert_nbytes(facts, pol)
    split = reserve_staging(split, pol, nbytes, facts.num_layers)
    u_hi, u_lo = uniform_pools(pol, facts.num_layers, facts.num_experts, split.experts, nbytes)
    r = replace(replay, draft=spec).run_warm(pools_of(pol, u_hi, u_lo), pol)
    by_k = [round(r.draft["by_k"][k]["ms_per_token"], 3) for k in range(spec.k_max + 1)]
    return replace(spec, tokens=r.draft["chosen_k"]), by_k


def draft_record(spec: DraftSpec, by_k: list | None, no_draft_ms: float | None) -> dict:
    """plan.yaml's `draft` block."""
    return {"tokens": spec.tokens, "source": spec.source, "draft_ms": spec.draft_ms,
            "acceptance": spec.acceptance.to_json(), "chosen_by": "fixed" if by_k is None else "auto",
            **({"by_k": by_k} if by_k is not None else {}), "no_draft_ms_per_token": no_draft_ms}


def plan_draft_spec(plan: dict, path) -> DraftSpec:
    """The DraftSpec a plan's `draft` block records (`simulate --plan` replays with it)."""
    d = plan.get("draft")
    if not isinstance(d, dict) or not isinstance(d.get("tokens"), int) or d["tokens"] < 0:
        raise MoectlError(f"{path}: `draft.tokens` must be a number of drafted tokens (re-run plan-cache)")
    acc = Acceptance.from_json(d.get("acceptance"), where=f"{path}: draft.acceptance")
    return DraftSpec(d["tokens"], acc, d.get("source", "cached"), d.get("draft_ms"))
