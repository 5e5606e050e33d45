"""Routing-only expert predictor: which experts will layer l+d choose, from routing decisions alone.

Works on routing-only traces (no hidden states). Inputs are DuoServe-style (the current token's
choices at the layers seen so far, layer-to-layer affinity, popularity) plus what a pairwise table
misses: temporal locality (the previous tokens' choices at the target layer) and token-level
matching (earlier tokens of this request whose routing at layers <= l matches the current token's
are likely the same token or context, so their choice at the target layer is a strong hint).

Per expert e of target layer j = l + d the features are:
  nn      similarity-weighted vote of the m best-matching earlier tokens of the request for e at j
  nn_conf best match similarity (how sure the matching is; same for every e)
  prev1   previous token chose e at j            prev2  the token before it did
  ema     decayed frequency of e at j in this request
  aff     mean P(e at j | c at l) over the current choices c at l (affinity, from training traces)
  pop     P(e at j) in the training traces
  agree   overlap of the current and previous token's choices at l (same for every e)
A tiny MLP per lookahead d (shared by every layer and expert, so it trains on a few hundred tokens)
maps the features to P(e chosen at j).

Legend: L = MoE layers, E = experts, K = top-k, F = features, H = history tokens, m = neighbours.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from ..core.trace import PREFILL, Trace

FEATURES = ["nn", "nn_conf", "prev1", "prev2", "ema", "aff", "pop", "agree"]


class RoutingState:
    """Incremental feature builder for one stream of tokens (reset per request)."""

    def __init__(self, L: int, E: int, K: int, aff: np.ndarray, pop: np.ndarray,
                 gamma: float = 0.6, ema: float = 0.8, neighbours: int = 8, max_history: int = 1024):
        self.L, self.E, self.K = L, E, K
        self.aff, self.pop = aff, pop                 # [D, L, E, E] (source l -> l+d+1), [L, E]
        self.gamma, self.ema_decay, self.m, self.max_history = gamma, ema, neighbours, max_history
        self.reset()

    def reset(self) -> None:
        self.buf = np.zeros((64, self.L, self.E), dtype=np.float32)   # [capacity, L, E] multi-hot
        self.hist = self.buf[:0]                                       # [H, L, E] view
        self.ema = np.zeros((self.L, self.E), dtype=np.float32)
        self.cur = np.zeros((self.L, self.E), dtype=np.float32)
        self.sim = np.zeros(0, dtype=np.float32)                       # [H]
        self.norm = 0.0
        self.last = -1

    def observe(self, layer: int, chosen) -> None:
        ids = [int(e) for e in chosen if e >= 0]
        self.cur[layer, ids] = 1.0
        k = max(len(ids), 1)
        if len(self.hist):
            self.sim = self.gamma * self.sim + self.hist[:, layer, ids].sum(1) / k
        self.norm = self.gamma * self.norm + 1.0
        self.last = layer

    def end_token(self) -> None:
        H = len(self.hist)
        if H == self.max_history:                      # full: drop the oldest half
            keep = self.max_history // 2
            self.buf[:keep] = self.buf[H - keep: H]
            H = keep
        if H == len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros_like(self.buf)])
        self.buf[H] = self.cur
        self.hist = self.buf[: H + 1]
        self.ema = self.ema_decay * self.ema + (1 - self.ema_decay) * self.cur
        self.cur = np.zeros_like(self.cur)
        self.sim = np.zeros(len(self.hist), dtype=np.float32)
        self.norm = 0.0
        self.last = -1

    def features(self, d: int) -> np.ndarray | None:
        """[E, F] features for target layer last + d (None past the last layer)."""
        l, j = self.last, self.last + d
        if l < 0 or j >= self.L:
            return None
        E, H = self.E, len(self.hist)
        f = np.zeros((E, len(FEATURES)), dtype=np.float32)
        if H:
            s = self.sim / max(self.norm, 1e-9) + 1e-4 * np.arange(H) / H       # ties -> most recent
            top = np.argpartition(-s, min(self.m, H) - 1)[: self.m] if H > self.m else np.arange(H)
            w = s[top] ** 4
            f[:, 0] = (w[:, None] * self.hist[top, j]).sum(0) / max(w.sum(), 1e-9)
            f[:, 1] = s[top].max()
            f[:, 2] = self.hist[-1, j]
            f[:, 7] = (self.hist[-1, l] * self.cur[l]).sum() / self.K
        if H > 1:
            f[:, 3] = self.hist[-2, j]
        f[:, 4] = self.ema[j] / (1 - self.ema_decay ** (H + 1) + 1e-9) if H else 0.0
        ids = np.nonzero(self.cur[l])[0]
        if len(ids):
            f[:, 5] = self.aff[d - 1, l, ids].mean(0)
        f[:, 6] = self.pop[j]
        return f


def affinity_tables(traces: list[Trace], max_d: int) -> tuple[np.ndarray, np.ndarray]:
    """aff [max_d, L, E, E]: P(e at l+d | c at l) (rows sum to ~K); pop [L, E]: P(e at l)."""
    L, E = traces[0].num_layers, traces[0].num_experts
    aff = np.zeros((max_d, L, E, E), dtype=np.float64)
    pop = np.zeros((L, E), dtype=np.float64)
    for tr in traces:
        mh = multi_hot(tr)                                        # [N, L, E]
        pop += mh.sum(0)
        for d in range(1, max_d + 1):
            aff[d - 1, : L - d] += np.einsum("nlc,nle->lce", mh[:, : L - d], mh[:, d:])
    aff /= np.maximum(aff.sum(-1, keepdims=True), 1e-9) / traces[0].top_k
    pop /= np.maximum(pop.sum(-1, keepdims=True), 1e-9) / traces[0].top_k
    return aff.astype(np.float32), pop.astype(np.float32)


def multi_hot(tr: Trace) -> np.ndarray:
    N, L, K = tr.experts.shape
    mh = np.zeros((N, L, tr.num_experts), dtype=np.float32)
    n, l, k = np.nonzero(tr.experts >= 0)
    mh[n, l, tr.experts[n, l, k].astype(np.int64)] = 1.0
    return mh


class RoutingPredictor(nn.Module):
    """Per-lookahead MLP over per-expert routing features (see the module docstring)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, lookahead: list[int],
                 hidden: int = 16, gamma: float = 0.6, ema: float = 0.8, neighbours: int = 8):
        super().__init__()
        self.L, self.E, self.K = num_layers, num_experts, top_k
        self.lookahead = sorted(int(d) for d in lookahead)
        self.hidden, self.gamma, self.ema, self.neighbours = hidden, gamma, ema, neighbours
        F = len(FEATURES)
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(F, hidden), nn.ReLU(), nn.Linear(hidden, 1))
                                   for _ in self.lookahead)
        D = max(self.lookahead)
        self.register_buffer("aff", torch.zeros(D, num_layers, num_experts, num_experts))
        self.register_buffer("pop", torch.zeros(num_layers, num_experts))
        self._np = None

    def config(self) -> dict:
        return {"kind": "routing", "num_layers": self.L, "num_experts": self.E, "top_k": self.K,
                "lookahead": self.lookahead, "hidden": self.hidden, "gamma": self.gamma, "ema": self.ema,
                "neighbours": self.neighbours, "features": FEATURES}

    @classmethod
    def from_config(cls, cfg: dict) -> "RoutingPredictor":
        return cls(cfg["num_layers"], cfg["num_experts"], cfg["top_k"], cfg["lookahead"], cfg.get("hidden", 16),
                   cfg.get("gamma", 0.6), cfg.get("ema", 0.8), cfg.get("neighbours", 8))

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        out = super().load_state_dict(state, strict=strict, assign=assign)
        self._np = None
        return out

    def new_state(self) -> RoutingState:
        return RoutingState(self.L, self.E, self.K, self.aff.numpy(), self.pop.numpy(),
                            self.gamma, self.ema, self.neighbours)

    def _numpy_heads(self):
        """Weights as numpy arrays: predict() runs per layer per token, torch call overhead dominates."""
        if self._np is None:
            self._np = [tuple(p.detach().numpy().astype(np.float32) for p in (h[0].weight, h[0].bias,
                                                                                 h[2].weight, h[2].bias))
                        for h in self.heads]
        return self._np

    def predict(self, state: RoutingState, d: int) -> np.ndarray | None:
        """P(expert chosen) [E] at layer state.last + d, or None past the last layer."""
        f = state.features(d)
        if f is None:
            return None
        w1, b1, w2, b2 = self._numpy_heads()[self.lookahead.index(d)]
        z = np.maximum(f @ w1.T + b1, 0) @ w2.T + b2
        return 1 / (1 + np.exp(-z[:, 0]))

    def forward(self, feats: torch.Tensor, head: int) -> torch.Tensor:      # [n, F] -> [n] logits
        return self.heads[head](feats)[:, 0]


def _decode_requests(tr: Trace):
    """(request rows) for each request, decode rows only (prefill is streamed, not predicted)."""
    for _, sl in tr.request_slices():
        rows = np.arange(sl.start, sl.stop)
        rows = rows[tr.phase[rows] != PREFILL]
        if len(rows):
            yield rows


def build_dataset(model: RoutingPredictor, traces: list[Trace]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Replay traces through RoutingState: per lookahead d, features [n*E, F] and labels [n*E]."""
    out: dict[int, tuple[list, list]] = {d: ([], []) for d in model.lookahead}
    for tr in traces:
        mh = multi_hot(tr)
        st = model.new_state()
        for rows in _decode_requests(tr):
            st.reset()
            for r in rows:
                for l in range(tr.num_layers):
                    st.observe(l, tr.experts[r, l])
                    for d in model.lookahead:
                        f = st.features(d)
                        if f is not None:
                            out[d][0].append(f)
                            out[d][1].append(mh[r, l + d])
                st.end_token()
    return {d: (np.concatenate(x) if x else np.zeros((0, len(FEATURES)), np.float32),
                np.concatenate(y) if y else np.zeros(0, np.float32)) for d, (x, y) in out.items()}


def train_routing_predictor(traces: list[Trace], lookahead: list[int] = (1, 2), epochs: int = 8,
                            max_minutes: float = 5.0, seed: int = 0, hidden: int = 16,
                            val_fraction: float = 0.2, batch: int = 4096,
                            max_rows: int = 100_000) -> tuple[RoutingPredictor, dict]:
    """Fit the predictor on `traces` (all of one model). Returns (predictor, metrics) where metrics
    has per-lookahead validation top-k recall of the predictor and of two baselines (previous token's
    choice at the target layer, and popularity), measured on the last `val_fraction` of the tokens."""
    if not traces:
        raise ValueError("train_routing_predictor needs at least one trace")
    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # tiny matmuls: threads only add overhead
    try:
        return _train(traces, lookahead, epochs, max_minutes, seed, hidden, val_fraction, batch, max_rows, t0)
    finally:
        torch.set_num_threads(threads)


def _train(traces, lookahead, epochs, max_minutes, seed, hidden, val_fraction, batch, max_rows, t0):
    torch.manual_seed(seed)
    tr0 = traces[0]
    for tr in traces:
        if (tr.num_layers, tr.num_experts) != (tr0.num_layers, tr0.num_experts):
            raise ValueError("traces of different models given to train_routing_predictor")
    model = RoutingPredictor(tr0.num_layers, tr0.num_experts, tr0.top_k, list(lookahead), hidden)
    aff, pop = affinity_tables(traces, max(model.lookahead))
    model.aff.copy_(torch.from_numpy(aff))
    model.pop.copy_(torch.from_numpy(pop))
    data = build_dataset(model, traces)
    metrics: dict = {"kind": "routing", "tokens": int(sum(t.num_tokens for t in traces)), "lookahead": {}}
    E = model.E
    for hi, d in enumerate(model.lookahead):
        X, Y = data[d]
        n = len(X) // E
        n_val = int(n * val_fraction)
        Xt, Yt = torch.from_numpy(X[: (n - n_val) * E]), torch.from_numpy(Y[: (n - n_val) * E])
        pos = float(Yt.mean()) if len(Yt) else 0.5
        loss_fn = nn.BCEWithLogitsLoss()
        opt = torch.optim.Adam(model.heads[hi].parameters(), lr=0.01)
        with torch.no_grad():                                   # start at the base rate
            model.heads[hi][2].bias.fill_(float(np.log(max(pos, 1e-3) / max(1 - pos, 1e-3))))
        g = torch.Generator().manual_seed(seed)
        if len(Xt) > max_rows:                                  # keep training a few seconds
            keep = torch.randperm(len(Xt), generator=g)[:max_rows]
            Xt, Yt = Xt[keep], Yt[keep]
        loss = torch.tensor(float("nan"))
        run = 0
        for _ in range(epochs):
            if time.time() - t0 > max_minutes * 60 or not len(Xt):
                break
            run += 1
            for idx in torch.randperm(len(Xt), generator=g).split(batch):
                opt.zero_grad()
                loss = loss_fn(model(Xt[idx], hi), Yt[idx])
                loss.backward()
                opt.step()
        model._np = None
        # validation recall@K of the predictor vs baselines, on held-out (later) tokens
        Xv, Yv = X[(n - n_val) * E:].reshape(n_val, E, -1), Y[(n - n_val) * E:].reshape(n_val, E)
        with torch.no_grad():
            pv = model(torch.from_numpy(Xv.reshape(-1, Xv.shape[-1])), hi).reshape(n_val, E).numpy() if n_val else Yv
        metrics["lookahead"][str(d)] = {
            "recall": _recall_at_k(pv, Yv, model.K),
            "recall_prev_token": _recall_at_k(Xv[..., FEATURES.index("prev1")] + 1e-3 * Xv[..., FEATURES.index("pop")], Yv, model.K),
            "recall_popularity": _recall_at_k(Xv[..., FEATURES.index("pop")], Yv, model.K),
            "train_loss": float(loss.detach()),
            "epochs_run": run,
        }
    metrics["train_seconds"] = time.time() - t0
    model._np = None
    return model.eval(), metrics


def _recall_at_k(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Fraction of chosen experts that are among the k best-scored (mean over rows)."""
    if not len(scores):
        return float("nan")
    top = np.argsort(-scores, axis=1)[:, :k]
    hit = np.take_along_axis(labels, top, 1).sum(1)
    return float((hit / np.maximum(labels.sum(1), 1)).mean())
