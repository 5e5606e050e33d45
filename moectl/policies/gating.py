"""Adaptive top-k gating: drop the low-weight tail of a token's chosen experts (AdapMoE, generalised to top-k).

Legend: N = rows (tokens), K = top-k.

Rows are one token's chosen experts and their gate weights. Weights are normalised over the K chosen ones
(w / sum w) before the rule, so models that renormalise top-k and models that do not are judged alike.
The top-1 is always kept. What is kept is rescaled to the chosen experts' original weight sum, i.e. for
models whose top-k weights sum to 1 (Mixtral, OLMoE, ...) the kept ones sum to 1 again (the seed's eq. 4).

- `SensitivityGating(threshold=T_g, sensitivities=S)`: drop the tail while
  (sum of the dropped normalised weights)^2 x S_l <= T_g. For top-2 this is the seed's rule
  (drop the 2nd iff w2^2 x S_l <= T_g).
- `ScoreGating(tau)`: the score-only baseline, drop the tail while the dropped weight sum <= tau, the same
  tau for every layer.

No device code: the runtime gates a layer's routing tensors with `gate_rows`, the simulator and `eval`
gate a trace's arrays with the same call.
"""

from __future__ import annotations

import numpy as np

from ..errors import MoectlError


class GatingPolicy:
    """Keeps every chosen expert (no gating)."""

    name = "none"
    source: str | None = None           # the artifact a default policy came from (sensitivity.json), for status lines

    def budget(self, layer: int) -> float:
        """Largest dropped weight mass (normalised) this layer tolerates; < 0 keeps everything."""
        return -1.0

    def keep_counts(self, layer: int, weights: np.ndarray) -> np.ndarray:
        """Experts kept per row [N] (>= 1) for `weights` [N,K] sorted best first (unused slots 0)."""
        w = np.asarray(weights, np.float64)
        total = w.sum(-1, keepdims=True)
        norm = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
        tail = np.cumsum(norm[:, ::-1], -1)[:, ::-1]             # tail[:, j] = dropped mass if we keep j experts
        droppable = (tail <= self.budget(layer) + 1e-12) & (w > 0)
        droppable[:, 0] = False                                  # the top-1 is always kept
        valid = (w > 0).sum(-1)
        # keep = first j whose tail may be dropped (tails shrink as j grows, so droppable is monotone in j)
        first = np.where(droppable.any(-1), droppable.argmax(-1), valid)
        return np.maximum(np.minimum(first, valid), 1)

    def describe(self) -> str:
        return "gating: off"


class SensitivityGating(GatingPolicy):
    name = "sensitivity"

    def __init__(self, threshold: float, sensitivities: list[float], rule: str | None = None,
                 cost: dict | None = None):
        """`rule`: which per-layer values `sensitivities` are (fisher | ablation; None: given as they are);
        `cost`: what `moectl sensitivity --target-ppl-delta` measured at this T_g on these values (None: not
        measured, e.g. a --gating-threshold of the user's)."""
        if threshold < 0:
            raise MoectlError(f"--gating-threshold must be >= 0, not {threshold}")
        if any(s < 0 for s in sensitivities):
            raise MoectlError("sensitivities must be >= 0")
        self.threshold, self.sensitivities = float(threshold), [float(s) for s in sensitivities]
        self.rule, self.cost = rule, cost

    def budget(self, layer):
        s = self.sensitivities[layer]
        # (dropped)^2 x S_l <= T_g  <=>  dropped <= sqrt(T_g / S_l); a layer with S_l = 0 tolerates any drop
        return float("inf") if s == 0 else (self.threshold / s) ** 0.5 if self.threshold > 0 else -1.0

    def describe(self):
        return f"gating: sensitivity T_g={self.threshold:g}" + (f" on {self.rule} values" if self.rule else "") + (
            f" ({measured_cost(self.cost)})" if self.cost else "")


class ScoreGating(GatingPolicy):
    name = "score"

    def __init__(self, tau: float):
        if not 0 <= tau < 1:
            raise MoectlError(f"the score-only gating threshold must be in [0, 1), not {tau}")
        self.tau = float(tau)

    def budget(self, layer):
        return self.tau if self.tau > 0 else -1.0

    def describe(self):
        return f"gating: score-only tau={self.tau:g}"


def gate_rows(policy: GatingPolicy, layer: int, experts: np.ndarray, weights: np.ndarray):
    """(experts, weights) [N,K] with each row's dropped tail set to -1 / 0 and the kept weights rescaled to the
    row's original sum. Rows may come in any order of weight; -1 entries are 'no expert'."""
    experts, weights = np.asarray(experts), np.asarray(weights, np.float64)
    w = np.where(experts >= 0, weights, 0.0)
    order = np.argsort(-w, -1, kind="stable")                   # best first
    ws = np.take_along_axis(w, order, -1)
    keep = policy.keep_counts(layer, ws)
    kept_sorted = np.arange(w.shape[1])[None, :] < keep[:, None]
    kept = np.zeros_like(kept_sorted)
    np.put_along_axis(kept, order, kept_sorted, -1)
    kept &= experts >= 0
    total, kept_sum = w.sum(-1, keepdims=True), np.where(kept, w, 0).sum(-1, keepdims=True)
    scale = np.divide(total, kept_sum, out=np.ones_like(total), where=kept_sum > 0)
    return np.where(kept, experts, -1), np.where(kept, w * scale, 0.0)


def measured_cost(cost: dict) -> str:
    """What `moectl sensitivity`'s T_g search measured at a stored T_g, for the lossy line: e.g. "measured by
    sensitivity: perplexity +0.74% (target 1.00%) at 1.22 experts/token"."""
    target = cost.get("target_ppl_delta")
    return (f"measured by sensitivity: perplexity {cost['ppl_delta_rel']:+.2%}"
            + (f" (target {target:.2%})" if target is not None else "")
            + f" at {cost['experts_per_token']:.2f} experts/token")


def parse_gating(threshold: float | None, spec: str | None, sensitivities: list[float] | None,
                 default_threshold: float | None = None, rule: str | None = None,
                 default_cost: dict | None = None) -> GatingPolicy | None:
    """The gating policy a command asked for: `--gating score:TAU`, `--gating-threshold T_g` (needs
    sensitivities), else the stored default T_g (from sensitivity.json) when there is one. 0 turns it off.
    `rule`: which values `sensitivities` are; `default_cost`: what was measured at the default T_g (kept only
    when that T_g is the one in force)."""
    if spec is not None and threshold is not None:
        raise MoectlError("give --gating-threshold or --gating, not both")
    if spec is not None:
        kind, _, value = spec.partition(":")
        if kind == "none" and not value:
            return None
        if kind == "sensitivity" and value:
            threshold = _number(value, "--gating sensitivity:T_G")
        elif kind == "score" and value:
            tau = _number(value, "--gating score:TAU")
            return ScoreGating(tau) if tau > 0 else None
        else:
            raise MoectlError(f"--gating takes score:TAU, sensitivity:T_G or none, not {spec!r}")
    cost = None
    if threshold is None:
        threshold, cost = default_threshold, default_cost
    if threshold is None:
        return None
    if threshold < 0:
        raise MoectlError(f"--gating-threshold must be >= 0, not {threshold}")
    if threshold == 0:
        return None
    if sensitivities is None:
        raise MoectlError("--gating-threshold needs the model's sensitivities: run `moectl sensitivity` first "
                          "(or use the score-only rule, --gating score:TAU)")
    return SensitivityGating(threshold, sensitivities, rule, cost)


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise MoectlError(f"{what}: {text!r} is not a number") from None


def gate_trace(trace, policy: GatingPolicy, gate_prefill: bool = False):
    """A copy of `trace` whose decode rows (and prefill rows with `gate_prefill`) are gated: the dropped experts
    become -1 (no expert), so every replay of it (simulator, report) loads and computes only what is kept."""
    import dataclasses

    if trace.weights is None:
        raise MoectlError(f"trace {trace.source or trace.model} has no gate weights: gating needs them")
    from ..core.trace import DECODE

    experts, weights = trace.experts.copy(), trace.weights.copy()
    rows = np.ones(trace.num_tokens, bool) if gate_prefill else trace.phase == DECODE
    for layer in range(trace.num_layers):
        e, w = gate_rows(policy, layer, experts[rows, layer], weights[rows, layer].astype(np.float64))
        experts[rows, layer], weights[rows, layer] = e, w
    return dataclasses.replace(trace, experts=experts, weights=weights.astype(trace.weights.dtype))


def experts_per_token(trace, decode_only: bool = True) -> float:
    """Mean experts computed per token and MoE layer (decode rows by default)."""
    from ..core.trace import DECODE

    ex = trace.experts[trace.phase == DECODE] if decode_only else trace.experts
    return float((ex >= 0).sum() / max(ex.shape[0] * trace.num_layers, 1))
