"""`moectl report`: what a routing trace says about caching, as numbers and PNG plots.

Legend: N = tokens, L = MoE layers, K = top-k, E = experts, C = cache sizes (experts per layer).

- usage: [L, E] share of each layer's routing that went to each expert (heatmap), and its entropy;
- reuse: for every (token, layer, expert) access, was that expert used before by the same request
  (within-request reuse, with its distance in tokens), only by an earlier request (across), or never (cold);
- hit rate vs cache size: a per-layer pool of C experts, the trace replayed through the simulator (the
  runtime's cache rules, `moectl/core/cache_model.py`) with the replacement policy objects the runtime uses
  (`LRU`, and `Belady`/MIN, which knows the future: the upper bound); C >= K.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.trace import Trace, expert_activation_matrix
from ..errors import MoectlError

# --- statistics -----------------------------------------------------------------------------------

def usage_entropy(eam: np.ndarray) -> np.ndarray:
    """[L] entropy in bits of each layer's expert-usage distribution (log2 E = uniform)."""
    p = eam / np.maximum(eam.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log2(p), 0.0).sum(1)
    return h


def reuse_stats(trace: Trace) -> dict:
    """Per layer: counts of within-request / across-request / cold accesses, and within-request
    reuse distances in tokens (all layers pooled)."""
    L, E = trace.num_layers, trace.num_experts
    last_tok = np.full((L, E), -1, dtype=np.int64)          # row of the last use
    last_req = np.full((L, E), -1, dtype=np.int64)          # request ordinal of the last use
    within = np.zeros(L, dtype=np.int64)
    across = np.zeros(L, dtype=np.int64)
    cold = np.zeros(L, dtype=np.int64)
    dists: list[np.ndarray] = []
    layer_ix = np.arange(L)[:, None]
    for r, (_, rows) in enumerate(trace.request_slices()):
        for t in range(rows.start, rows.stop):
            ex = trace.experts[t].astype(np.int64)                          # [L, K]
            ok = ex >= 0
            lt = np.where(ok, last_tok[layer_ix, np.maximum(ex, 0)], -1)
            lr = np.where(ok, last_req[layer_ix, np.maximum(ex, 0)], -1)
            w = ok & (lr == r)
            a = ok & (lr >= 0) & (lr != r)
            within += w.sum(1)
            across += a.sum(1)
            cold += (ok & (lr < 0)).sum(1)
            dists.append(t - lt[w])
            li, ki = np.nonzero(ok)
            last_tok[li, ex[li, ki]] = t
            last_req[li, ex[li, ki]] = r
    d = np.concatenate(dists) if dists else np.zeros(0, dtype=np.int64)
    return {"within": within, "across": across, "cold": cold, "distances": d}


def cache_sizes(trace: Trace, n: int = 8) -> list[int]:
    """About n pool sizes from K (the smallest pool that holds one token's experts) to E."""
    K, E = trace.top_k, trace.num_experts
    return sorted({int(round(x)) for x in np.linspace(K, E, n)})


def hit_rates(trace: Trace, policy_factory, sizes: list[int]) -> np.ndarray:
    """[L, C] hit rate (prefill and decode accesses) of a per-layer pool of each size: `trace` replayed
    through the simulator (the runtime's cache rules) with a fresh policy from `policy_factory()`."""
    from ..sim.simulator import Simulator
    from ..sim.steps import trace_steps

    steps = trace_steps(trace)
    out = np.zeros((trace.num_layers, len(sizes)))
    for c_i, cap in enumerate(sizes):
        c = Simulator([cap] * trace.num_layers, policy_factory()).run(steps)["cache"]
        hits = np.add(c["prefill"]["hits"], c["decode"]["hits"])
        misses = np.add(c["prefill"]["misses"], c["decode"]["misses"])
        out[:, c_i] = hits / np.maximum(hits + misses, 1)
    return out


def analyze(trace: Trace, sizes: list[int] | None = None) -> dict:
    """Everything the report shows, as plain numbers."""
    from ..policies import LRU, Belady

    if trace.num_tokens == 0:
        raise MoectlError("the trace has no tokens")
    sizes = sizes or cache_sizes(trace)
    if min(sizes) < trace.top_k or max(sizes) > trace.num_experts:
        raise MoectlError(f"cache sizes must be between top-k ({trace.top_k}) and the expert count "
                          f"({trace.num_experts}) per layer, got {sizes}")
    eam = expert_activation_matrix(trace)                                   # [L, E]
    ent = usage_entropy(eam)
    reuse = reuse_stats(trace)
    lru = hit_rates(trace, LRU, sizes)                                      # [L, C]
    bel = hit_rates(trace, Belady, sizes)
    acc = reuse["within"] + reuse["across"] + reuse["cold"]
    share = eam / np.maximum(eam.sum(1, keepdims=True), 1)
    return {
        "model": trace.model, "tokens": trace.num_tokens, "requests": len({r for r, _ in trace.request_slices()}),
        "prefill_tokens": int((trace.phase == 0).sum()), "decode_tokens": int((trace.phase == 1).sum()),
        "layers": trace.num_layers, "experts": trace.num_experts, "top_k": trace.top_k,
        "usage": share, "entropy_bits": ent, "entropy_max_bits": float(np.log2(trace.num_experts)),
        "top_expert_share": eam.max(1) / trace.num_tokens,          # share of tokens routed to the busiest expert
        "reuse_within": reuse["within"] / np.maximum(acc, 1), "reuse_across": reuse["across"] / np.maximum(acc, 1),
        "cold": reuse["cold"] / np.maximum(acc, 1), "reuse_distances": reuse["distances"],
        "cache_sizes": sizes, "lru_hit_rate": lru, "belady_hit_rate": bel,
    }


# --- plots ----------------------------------------------------------------------------------------

def write_plots(a: dict, out: Path, title: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    files = {}

    fig, ax = plt.subplots(figsize=(max(6, a["experts"] * 0.12 + 2), max(3, a["layers"] * 0.22 + 1.5)))
    im = ax.imshow(a["usage"], aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"{title}: expert usage share per layer")
    fig.colorbar(im, ax=ax, label="share of the layer's routing")
    files["usage_heatmap"] = _save(fig, out / "usage_heatmap.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    d = a["reuse_distances"]
    if len(d):
        bins = np.unique(np.round(np.logspace(0, np.log10(max(d.max(), 2)) + 1e-9, 40)).astype(int))
        ax.hist(d, bins=bins, color="tab:blue")
        ax.set_xscale("log")
    ax.set_xlabel("reuse distance (tokens since the same layer last used the expert, same request)")
    ax.set_ylabel("accesses")
    w, c = float(np.mean(a["reuse_within"])), float(np.mean(a["reuse_across"]))
    ax.set_title(f"{title}: reuse distance\n(reused within the request {w:.0%}, only across requests {c:.0%})")
    files["reuse_distance"] = _save(fig, out / "reuse_distance.png")

    L = a["layers"]
    cols = min(L, 8)
    rows = (L + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 1.9 * rows + 0.6), sharex=True, sharey=True,
                             squeeze=False)
    for l in range(rows * cols):
        ax = axes[l // cols][l % cols]
        if l >= L:
            ax.axis("off")
            continue
        ax.plot(a["cache_sizes"], a["lru_hit_rate"][l], "o-", ms=2, label="LRU")
        ax.plot(a["cache_sizes"], a["belady_hit_rate"][l], "s-", ms=2, label="Belady/MIN")
        ax.set_title(f"layer {l}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_ylim(0, 1)
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("cache size (experts per layer)")
    fig.supylabel("hit rate")
    fig.suptitle(f"{title}: hit rate vs cache size")
    files["hit_rate"] = _save(fig, out / "hit_rate.png")
    return files


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def summary_json(a: dict, files: dict) -> dict:
    """The JSON `moectl report --json` prints (arrays as lists)."""
    lru, bel = a["lru_hit_rate"], a["belady_hit_rate"]
    return {
        "model": a["model"], "tokens": a["tokens"], "requests": a["requests"],
        "prefill_tokens": a["prefill_tokens"], "decode_tokens": a["decode_tokens"],
        "layers": a["layers"], "experts": a["experts"], "top_k": a["top_k"],
        "entropy_bits": np.round(a["entropy_bits"], 4).tolist(), "entropy_max_bits": a["entropy_max_bits"],
        "reuse_within_request": round(float(np.mean(a["reuse_within"])), 4),
        "reuse_across_requests": round(float(np.mean(a["reuse_across"])), 4),
        "cold": round(float(np.mean(a["cold"])), 4),
        "cache_sizes": a["cache_sizes"],
        "lru_hit_rate": np.round(lru.mean(0), 4).tolist(), "belady_hit_rate": np.round(bel.mean(0), 4).tolist(),
        "lru_hit_rate_per_layer": np.round(lru, 4).tolist(), "belady_hit_rate_per_layer": np.round(bel, 4).tolist(),
        "plots": files,
    }
