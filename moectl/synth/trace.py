"""Synthetic routing traces at any model shape, calibrated on a real trace of the same family.

Legend: N = tokens, L = MoE layers, E = experts, K = top-k, R = sorted rank (0 = the layer's most used expert).

There is no routing trace of every model moectl plans for (gpt-oss-120b: 36 x 128, top-4; the shared traces
hold gpt-oss-20b's 24 x 32). `fit_stats(trace)` measures what the simulator's cache hit rates depend on, per
layer, on a real trace's decode rows:

  shares [L, R]   expert popularity: the layer's usage shares sorted high to low (sum 1)
  reuse  [L]      token-to-token reuse: the share of a token's K experts the next token of the request picks again
  reuse_far [L]   the same at distance FAR_LAGS (8..32 tokens): the working set a request keeps

`stats.scaled(L, E, K)` carries them to another shape:
  - depth: target layer l sits at relative depth l / (L - 1) and takes the source layers around it, linearly
    interpolated (the sorted shares, in log space, and the reuse figures);
  - experts: the sorted shares are a density over the rank fraction x = (R + 0.5) / E; it is interpolated
    (log-linearly) at the new E's rank fractions and renormalised, so "the top 25 % of experts take y % of the
    routing" stays true. Each expert's inclusion probability is then K * share (at most 1);
  - reuse: the source's reuse above chance is kept, not the raw share. With independent tokens a layer would
    reuse r0 = sum(p_i^2) / K of its experts by chance (p_i = inclusion probability), far more at 32 experts
    than at 128; stickiness q = (reuse - r0) / (1 - r0), the chance that a choice is a repeat beyond chance, is
    what transfers: the target's reuse is r0' + q * (1 - r0'). At the source's own shape that is the source's.
Cross-layer correlation (which experts of layer l go with which of layer l+1) is not modelled: the generated
layers are independent given their own history (the shared traces carry no hidden states, so the simulator's
prefetchers that use it -- gate reuse, MLP -- do not run on them anyway).

`synthesize(stats, tokens, seed)` draws routing with those statistics: per token and layer, the K experts with the
largest score log(w_i) + b1 [i ran at the previous token] + drift * z_i + Gumbel noise (Plackett-Luce sampling
without replacement), z_i a slow random walk of each expert's popularity within the request (AR(1), correlation
time DRIFT_TOKENS, fresh at each request): b1 gives the lag-1 reuse, the drift the working set seen at 8..32
tokens (real traces drop from lag 1 to lag 2 and then stay above chance for ~64 tokens; the drift reproduces
that shape). w, b1 and drift are found by moment matching: generate CALIB_TOKENS tokens, compare popularity, reuse and far
reuse with the targets, correct, CALIB_ROUNDS times (`calibrate`). Each layer's ranks map to expert
ids by a seeded permutation (a different hot set in every layer, as in real models). Same stats + same seed ->
same trace. `synthesize_like(file, recipe, ...)` does all of it for `moectl trace synthesize`; `save` writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.trace import DECODE, MAX_EXPERTS, Trace
from ..errors import MoectlError

FAR_LAGS = (8, 16, 24, 32)       # "far" reuse: mean over these distances (tokens)
DRIFT_TOKENS = 64                # correlation time of the popularity drift (tokens)
CALIB_TOKENS = 2048              # tokens generated per calibration round (4 requests)
CALIB_ROUNDS = 40
SYNTHETIC_FORMAT_VERSION = 2    # the generator's: same version + stats + seed -> same trace (2: sorted-share calibration)
MIN_SHARE = 1e-4                 # an expert never seen keeps a small share (log space stays finite)


@dataclass
class RoutingStats:
    num_layers: int              # L
    num_experts: int             # E
    top_k: int                   # K
    shares: np.ndarray           # [L, E] float64, sorted usage shares, each row sums to 1
    reuse: np.ndarray            # [L] float64, lag-1 reuse (share of K)
    reuse_far: np.ndarray        # [L] float64, mean reuse over FAR_LAGS
    source: str = ""             # what the statistics were fitted on
    request_tokens: int = 512    # decode tokens per request of the source (its sample size: see calibrate)
    requests: int = 1            # requests the source's shares were pooled over

    def inclusion(self) -> np.ndarray:
        """[L, E] probability that a token's top-K holds the rank-R expert."""
        return np.minimum(self.shares * self.top_k, 1.0)

    def chance_reuse(self) -> np.ndarray:
        """[L] reuse of independent tokens with this popularity: sum(p^2) / K."""
        return (self.inclusion() ** 2).sum(1) / self.top_k

    def scaled(self, num_layers: int, num_experts: int, top_k: int) -> "RoutingStats":
        """The statistics carried to another shape (module docstring: depth, experts, reuse above chance)."""
        check_shape(num_layers, num_experts, top_k)
        L0, E0 = self.num_layers, self.num_experts
        depth = np.linspace(0, L0 - 1, num_layers) if num_layers > 1 else np.zeros(1)     # [L] source layer
        lo = np.floor(depth).astype(int)
        hi = np.minimum(lo + 1, L0 - 1)
        f = depth - lo

        def mix(a: np.ndarray) -> np.ndarray:            # [L0, ...] -> [L, ...], linear in depth
            w = f.reshape(-1, *([1] * (a.ndim - 1)))
            return a[lo] * (1 - w) + a[hi] * w

        x0 = (np.arange(E0) + 0.5) / E0
        x1 = (np.arange(num_experts) + 0.5) / num_experts
        log_density = np.log(np.maximum(self.shares, MIN_SHARE / E0) * E0)          # [L0, E0]
        dens = np.exp(np.stack([np.interp(x1, x0, row) for row in mix(log_density)]))   # [L, E]
        shares = _cap(dens / dens.sum(1, keepdims=True), top_k)

        r0 = self.chance_reuse()
        stick = (self.reuse - r0) / (1 - r0)
        stick_far = (self.reuse_far - r0) / (1 - r0)
        out = RoutingStats(num_layers, num_experts, top_k, shares, np.zeros(num_layers), np.zeros(num_layers),
                           self.source, self.request_tokens, self.requests)
        r1 = out.chance_reuse()
        out.reuse = np.clip(r1 + mix(stick) * (1 - r1), 0, 1)
        out.reuse_far = np.clip(r1 + mix(stick_far) * (1 - r1), 0, 1)
        return out


def check_shape(num_layers: int, num_experts: int, top_k: int) -> None:
    if min(num_layers, num_experts, top_k) < 1:
        raise MoectlError(f"a routing shape needs layers, experts and top-k >= 1, got {num_layers} x {num_experts}, "
                          f"top-{top_k}")
    if top_k >= num_experts:
        raise MoectlError(f"top-k {top_k} must be below the number of experts {num_experts} (a layer that runs "
                          f"every expert has nothing to cache)")
    if num_experts > MAX_EXPERTS:
        raise MoectlError(f"{num_experts} experts is above the {MAX_EXPERTS} moectl supports")


def _cap(shares: np.ndarray, K: int) -> np.ndarray:
    """Shares with no expert above 1/K (an expert runs at most once per token), the excess spread over the rest."""
    s = shares.copy()
    for _ in range(K):
        over = s > 1.0 / K
        if not over.any():
            break
        excess = (s - 1.0 / K).clip(min=0).sum(1, keepdims=True)
        s = np.where(over, 1.0 / K, s)
        free = np.where(over, 0.0, s)
        s = s + free / np.maximum(free.sum(1, keepdims=True), 1e-12) * excess
    return s


def _onehot(experts: np.ndarray, E: int) -> np.ndarray:
    """[N, L, K] ids (-1 = none) -> [N, L, E] bool."""
    N, L, K = experts.shape
    oh = np.zeros((N, L, E + 1), dtype=bool)
    np.put_along_axis(oh, np.where(experts < 0, E, experts).astype(np.int64), True, axis=2)
    return oh[:, :, :E]


def _reuse(chunks: list[np.ndarray], lags, K: int) -> np.ndarray:
    """[L] mean share of K picked again `lag` tokens later, over the lags and the requests (`chunks`: [n, L, E])."""
    hits, pairs = 0.0, 0
    for oh in chunks:
        for lag in lags:
            if len(oh) > lag:
                hits = hits + (oh[lag:] & oh[:-lag]).sum((0, 2))
                pairs += len(oh) - lag
    if not pairs:
        raise MoectlError(f"the trace's requests are too short to measure reuse over {max(lags)} tokens")
    return hits / (pairs * K)


def fit_stats(trace: Trace) -> RoutingStats:
    """Popularity and reuse of `trace`'s decode rows (module docstring)."""
    check_shape(trace.num_layers, trace.num_experts, trace.top_k)
    chunks = []
    for _, rows in trace.request_slices():
        dec = trace.phase[rows] == DECODE
        if dec.sum() > 1:
            chunks.append(_onehot(trace.experts[rows][dec], trace.num_experts))
    if not chunks:
        raise MoectlError(f"trace {trace.model} has no request with 2 or more decode tokens to fit routing on")
    counts = sum(c.sum(0) for c in chunks).astype(np.float64)                       # [L, E]
    shares = np.sort(counts, axis=1)[:, ::-1] / counts.sum(1, keepdims=True)
    far = [lag for lag in FAR_LAGS if any(len(c) > lag for c in chunks)] or [max(len(c) for c in chunks) - 1]
    return RoutingStats(trace.num_layers, trace.num_experts, trace.top_k, np.ascontiguousarray(shares),
                        _reuse(chunks, [1], trace.top_k), _reuse(chunks, far, trace.top_k),
                        f"{trace.model}: {trace.source}" if trace.source else trace.model,
                        round(sum(map(len, chunks)) / len(chunks)), len(chunks))


def _generate(logw: np.ndarray, b1: np.ndarray, drift: np.ndarray, K: int, lengths: list[int],
              rng: np.random.Generator) -> np.ndarray:
    """[N, L, K] rank ids: per layer the top-K of log w + b1 * prev + drift * z + Gumbel (Plackett-Luce)."""
    L, E = logw.shape
    a = 1 - 1 / DRIFT_TOKENS
    out = np.zeros((sum(lengths), L, K), dtype=np.int64)
    n = 0
    for length in lengths:
        prev = np.zeros((L, E))
        z = rng.standard_normal((L, E))                                                  # a request's own mix
        for _ in range(length):
            score = logw + b1[:, None] * prev + drift[:, None] * z + rng.gumbel(size=(L, E))
            top = np.argpartition(-score, K - 1, axis=1)[:, :K]                         # [L, K]
            out[n] = top
            prev = np.zeros((L, E))
            np.put_along_axis(prev, top, 1.0, axis=1)
            z = a * z + np.sqrt(1 - a * a) * rng.standard_normal((L, E))
            n += 1
    return out


def _measured(ranks: np.ndarray, lengths: list[int], per_sample: int, E: int,
              K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted inclusion [L, E], reuse [L], far reuse [L]) of generated requests of `lengths` tokens, the
    inclusion measured as fit_stats measures a trace: counts pooled over `per_sample` requests, sorted high to low
    (averaged over the samples)."""
    oh = _onehot(ranks, E)
    chunks = np.split(oh, np.cumsum(lengths)[:-1])
    samples = [sum(c.sum(0) for c in chunks[i:i + per_sample]) for i in range(0, len(chunks), per_sample)]
    inc = np.mean([np.sort(c, axis=1)[:, ::-1] / sum(lengths[:per_sample]) for c in samples], axis=0)
    return inc, _reuse(chunks, [1], K), _reuse(chunks, FAR_LAGS, K)


def calibrate(stats: RoutingStats, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(log w [L, E], b1 [L], drift [L]) whose generated routing, measured like the source (samples of its
    requests x request_tokens), has `stats`' popularity and reuse in expectation. A finite sample's sorted shares
    are more skewed than the probabilities behind them (noise and drift pick the top ranks), so the popularity is
    matched sorted to sorted: the correction for the j-th largest measured share goes to the rank id with the j-th
    largest weight. Stochastic approximation with fresh noise every round (a fixed noise would fit its own draw of
    the drift), steps shrinking over the second half, parameters averaged over it (Polyak)."""
    L, E, K = stats.num_layers, stats.num_experts, stats.top_k
    target = np.maximum(stats.inclusion(), MIN_SHARE / E)
    logw = np.log(target)
    b1, drift = np.full(L, 0.5), np.full(L, 1.5)
    half = CALIB_ROUNDS // 2
    n, per_sample = max(2, stats.request_tokens), max(1, stats.requests)
    lengths = [n] * (per_sample * max(1, CALIB_TOKENS // (n * per_sample)))
    kept = []
    for i in range(CALIB_ROUNDS):
        ranks = _generate(logw, b1, drift, K, lengths, np.random.default_rng([seed, 1, i]))
        inc, r1, rf = _measured(ranks, lengths, per_sample, E, K)
        step = 1.0 if i < half else half / (i + 1)
        order = np.argsort(-logw, axis=1)                                          # [L, E] j-th heaviest rank id
        fix = np.log(target) - np.log(np.maximum(inc, 0.5 / len(ranks)))        # [L, E] by sorted position
        np.put_along_axis(logw, order, np.take_along_axis(logw, order, 1) + step * 0.4 * fix, axis=1)
        logw -= logw.max(1, keepdims=True)
        b1 = np.clip(b1 + step * 3 * (stats.reuse - r1), -5, 10)
        drift = np.clip(drift + step * 3 * (stats.reuse_far - rf), 0, 5)
        if i >= half:
            kept.append((logw.copy(), b1.copy(), drift.copy()))
    return tuple(np.mean([k[j] for k in kept], axis=0) for j in range(3))


def synthesize(stats: RoutingStats, tokens: int, seed: int = 0, model: str = "synthetic", requests: int = 1) -> Trace:
    """A decode trace of `tokens` rows in `requests` requests with `stats`' popularity and reuse (marked synthetic
    in `source`)."""
    if tokens < 2 or requests < 1 or tokens < requests:
        raise MoectlError(f"need tokens >= 2 and 1 <= requests <= tokens, got {tokens} tokens, {requests} requests")
    check_shape(stats.num_layers, stats.num_experts, stats.top_k)
    L, E, K = stats.num_layers, stats.num_experts, stats.top_k
    logw, b1, drift = calibrate(stats, seed)
    rng = np.random.default_rng([seed, 2])
    lengths = [tokens // requests + (i < tokens % requests) for i in range(requests)]
    ranks = _generate(logw, b1, drift, K, lengths, rng)                                      # [N, L, K]
    perm = np.stack([rng.permutation(E) for _ in range(L)])                               # [L, E] rank -> id
    experts = np.sort(perm[np.arange(L)[None, :, None], ranks], axis=2).astype(np.int16)
    request = [f"synthetic-{i}" for i, n in enumerate(lengths) for _ in range(n)]
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    source = f"synthetic (moectl trace synthesize, seed {seed}): routing statistics of {stats.source}"
    return Trace(model, L, E, K, request, pos, np.full(tokens, DECODE, dtype=np.uint8), experts, source=source,
                 extra={"synthetic": {"format_version": SYNTHETIC_FORMAT_VERSION, "seed": seed, "fitted_on": stats.source, "reuse": round(float(stats.reuse.mean()), 4),
                                      "reuse_far": round(float(stats.reuse_far.mean()), 4)}})


def synthesize_like(like, recipe: str, tokens: int, seed: int = 0,
                    requests: int = 1) -> tuple[Trace, RoutingStats, RoutingStats]:
    """(trace, statistics fitted on trace file `like`, the same carried to `recipe`'s shape): what
    `moectl trace synthesize` writes. The trace's model is the recipe's first trace name (how simulate finds it)."""
    from ..artifacts.trace_dir import load_trace
    from ..core.recipes import list_recipes, load_recipe

    if recipe not in list_recipes():
        raise MoectlError(f"no recipe {recipe!r}; recipes: {', '.join(list_recipes())}")
    r = load_recipe(recipe)
    shape = r.get("shape") or {}
    if not all(shape.get(k) for k in ("num_experts", "top_k", "num_layers")):
        raise MoectlError(f"recipe {recipe!r} has no shape: block with num_layers, num_experts and top_k")
    L, E, K = (int(shape.get("moe_layers", shape["num_layers"])), int(shape["num_experts"]), int(shape["top_k"]))
    fitted = fit_stats(load_trace(like))
    target = fitted.scaled(L, E, K)
    name = (r.get("trace_names") or [r.get("hf_id") or recipe])[0]
    trace = synthesize(target, tokens, seed, model=name, requests=requests)
    trace.extra["family"] = r.get("family")
    return trace, fitted, target


def writable(out) -> Path:
    """`out` as a Path whose folder exists (created), or a MoectlError naming why not (checked before the work)."""
    from pathlib import Path

    out = Path(out)
    if out.suffix != ".jsonl":                       # a trace directory: never beside another trace's files
        from ..artifacts.trace_dir import require_new_dir

        require_new_dir(out)
    try:
        (out.parent if out.suffix == ".jsonl" else out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MoectlError(f"cannot write the trace to {out}: {e.strerror or e}")
    return out


def save(trace: Trace, out) -> Path:
    """A synthesized trace as moe-routing-v1 JSONL (`out` ends in .jsonl) or a trace directory; both keep the
    `synthetic` record (seed, what it was fitted on) beside the source."""
    from pathlib import Path

    from ..artifacts.routing_jsonl import write_jsonl
    from ..artifacts.trace_dir import TraceWriter

    out = writable(out)
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    if out.suffix == ".jsonl":
        return write_jsonl(trace, out, header={"format": "moe-routing-v1", "model": trace.model, "num_layers": L,
                                               "num_experts": E, "top_k": K, "source": trace.source,
                                               "synthetic": trace.extra["synthetic"]})
    meta = {"model": trace.model, "family": trace.extra.get("family"), "fingerprint": None,
            "dataset": trace.extra["synthetic"]["fitted_on"], "num_layers": L, "moe_layer_ids": list(range(L)),
            "num_experts": E, "top_k": K, "hidden_size": None, "source": trace.source,
            "created_by": "moectl trace synthesize", "routers": None, "synthetic": trace.extra["synthetic"]}
    w = TraceWriter(out, meta)
    for req, rows in trace.request_slices():
        w.add_request(req, trace.pos[rows], trace.phase[rows], trace.experts[rows], None)
    w.close()
    return out
