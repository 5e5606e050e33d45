"""Training and held-out evaluation of the hidden-state predictors (mlp, aux-gate); routing is delegated; the
command's orchestration is `predict/pipeline.py`.

Legend: S = hidden samples (tokens with a stored MoE input), L = MoE layers, K = top-k, E = experts,
D = hidden size, n_d = lookaheads of a source layer.

Data: `Trace.hidden` (HiddenSamples: moe_inputs [S, L, D], prev_final [S, D]) with the true experts of the
same rows. Split: requests are ranked by a hash of their id; the first 80 % train, the next 10 % validate
(early stopping), the last 10 % test (every number we report). With fewer than 10 requests, fixed 16-row
blocks are split the same way. The split depends only on ids, so every predictor and baseline is measured
on the very same test tokens.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..core.trace import Trace
from ..errors import MoectlError
from ..predictors.aux_gate import AuxGate
from ..predictors.metrics import frequency_scores, gate_reuse_scores, ks_for, mean_metrics, multi_hot, set_metrics
from ..predictors.mlp import MLPPredictorSet

TRAIN, VAL, TEST = 0, 1, 2
BLOCK_ROWS = 16


def split_rows(trace: Trace) -> np.ndarray:
    """[N] uint8 TRAIN / VAL / TEST for every row, by request (or by 16-row block when requests are few)."""
    N = trace.num_tokens
    slices = trace.request_slices()
    if len(slices) >= 10:
        units = [(zlib.crc32(f"{rid}:{s.start}".encode()), s) for rid, s in slices]
    else:
        units = [(zlib.crc32(f"{trace.model}:block{b}".encode()), slice(b, min(b + BLOCK_ROWS, N)))
                 for b in range(0, N, BLOCK_ROWS)]
    units.sort(key=lambda u: u[0])
    n = len(units)
    n_test = max(1, round(0.1 * n)) if n >= 3 else 0
    n_val = max(1, round(0.1 * n)) if n >= 3 else 0
    out = np.full(N, TRAIN, dtype=np.uint8)
    for i, (_, s) in enumerate(units):
        if i >= n - n_test:
            out[s] = TEST
        elif i >= n - n_test - n_val:
            out[s] = VAL
    return out


@dataclass
class HiddenData:
    """Hidden samples of one or more traces of the same model, with their labels and split."""

    moe_inputs: np.ndarray      # [S, L, D] float16
    prev_final: np.ndarray      # [S, D] float16
    experts: np.ndarray         # [S, L, K] int16 true experts of the sampled rows
    split: np.ndarray           # [S] uint8
    routers: dict | None        # trace layer -> [E, D]
    router_bias: dict | None
    num_layers: int
    num_experts: int
    top_k: int

    @property
    def hidden_size(self) -> int:
        return int(self.moe_inputs.shape[2])

    def rows(self, which: int) -> np.ndarray:
        return np.nonzero(self.split == which)[0]


def gather_hidden(traces: list[Trace]) -> HiddenData:
    """Stack the hidden samples of `traces` (same model) and split them."""
    if not traces:
        raise MoectlError("no traces given")
    t0 = traces[0]
    for t in traces:
        if t.hidden is None or len(t.hidden.token_index) == 0:
            raise MoectlError(f"trace {t.source or t.model} has no hidden-state samples; the mlp and aux-gate "
                              f"predictors need them: profile with `moectl profile --hidden-samples N`")
        if (t.num_layers, t.num_experts, t.fingerprint) != (t0.num_layers, t0.num_experts, t0.fingerprint):
            raise MoectlError(f"traces {t0.source} and {t.source} come from different models "
                              f"({t0.fingerprint} vs {t.fingerprint}); train on one model's traces at a time")
    parts = []
    for t in traces:
        idx = t.hidden.token_index
        parts.append((t.hidden.moe_inputs, t.hidden.prev_final, t.experts[idx], split_rows(t)[idx]))
    cat = [np.concatenate([p[i] for p in parts]) for i in range(4)]
    routers = next((t.routers for t in traces if t.routers), None)
    bias = next((t.router_bias for t in traces if t.router_bias), None)
    return HiddenData(cat[0], cat[1], cat[2], cat[3], routers, bias, t0.num_layers, t0.num_experts, t0.top_k)


class Deadline:
    """Shares a wall-clock budget among the units of work still to do (layers, kinds)."""

    def __init__(self, minutes: float | None) -> None:
        self.end = None if not minutes else time.monotonic() + 60.0 * minutes

    def share(self, units_left: int) -> float | None:
        """An end time for the next unit: an equal share of what is left."""
        if self.end is None:
            return None
        now = time.monotonic()
        return now + max(0.0, self.end - now) / max(1, units_left)


def _fit(module: nn.Module, xs: list[torch.Tensor], y: torch.Tensor, val_score, epochs: int,
         end_time: float | None, device: str, lr: float = 1e-3, batch_size: int = 256,
         patience: int = 10, seed: int = 0) -> dict:
    """Minibatch Adam on BCE; keeps the state with the best validation score (epoch 0 = the init)."""
    gen = torch.Generator().manual_seed(seed)
    module.to(device)
    xs = [x.to(device) for x in xs]
    y = y.to(device)
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=1e-4)
    loss_fn = nn.BCEWithLogitsLoss()
    best = (val_score(module), 0)
    best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    epoch = 0
    n = y.shape[0]
    for epoch in range(1, epochs + 1):
        if end_time is not None and time.monotonic() > end_time:
            break
        module.train()
        perm = torch.randperm(n, generator=gen).to(device)
        for i in range(0, n, batch_size):
            b = perm[i:i + batch_size]
            loss = loss_fn(module(*[x[b] for x in xs]), y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        score = val_score(module)
        if score > best[0] + 1e-6:
            best = (score, epoch)
            best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        elif epoch - best[1] >= patience:
            break
    module.load_state_dict(best_state)
    module.to("cpu").eval()
    return {"epochs_run": epoch, "best_epoch": best[1], "val_recall": float(best[0])}


def _recall_at_k(logits: torch.Tensor, target: torch.Tensor, k: int) -> float:
    """Mean recall@k of logits [..., E] against 0/1 targets [..., E]."""
    top = logits.topk(k, dim=-1).indices
    hits = target.gather(-1, top).sum(-1)
    return float((hits / target.sum(-1).clamp(min=1)).mean())


def train_mlp(traces: list[Trace], lookaheads: list[int], epochs: int = 100, max_minutes: float | None = 10.0,
              device: str = "cpu", seed: int = 0, width: int = 128, use_chosen: bool = False,
              progress=None, data: HiddenData | None = None) -> tuple[MLPPredictorSet, dict]:
    """One SourceLayerMLP per source layer; returns the set and its held-out metrics vs gate reuse."""
    data = data or gather_hidden(traces)
    torch.manual_seed(seed)
    L, E, K, D = data.num_layers, data.num_experts, data.top_k, data.hidden_size
    pred = MLPPredictorSet(L, E, K, D, lookaheads, width, use_chosen)
    if not pred.layers:
        raise MoectlError(f"no lookahead in {lookaheads} fits in a model with {L} MoE layers")
    tr, va = data.rows(TRAIN), data.rows(VAL)
    if len(tr) == 0 or len(va) == 0:
        raise MoectlError(f"too few hidden samples to split ({len(data.split)}); profile more tokens")
    deadline = Deadline(max_minutes)
    fit_info = {}
    for i, (l, m) in enumerate(pred.layers.items()):
        targets = [l + d for d in m.lookaheads]
        if data.routers:
            m.init_skip_from_routers([data.routers.get(t) for t in targets],
                                     [(data.router_bias or {}).get(t) for t in targets])

        def tensors(rows):
            h = torch.from_numpy(data.moe_inputs[rows, l].astype(np.float32))
            c = torch.from_numpy(multi_hot(data.experts[rows, l], E).astype(np.float32))
            y = torch.from_numpy(np.stack([multi_hot(data.experts[rows, t], E) for t in targets], 1)
                                 .astype(np.float32))                   # [n, n_d, E]
            return h, c, y

        h_tr, c_tr, y_tr = tensors(tr)
        h_va, c_va, y_va = tensors(va)

        def val_score(mod, h_va=h_va.to(device), c_va=c_va.to(device), y_va=y_va.to(device)):
            with torch.no_grad():
                return _recall_at_k(mod.eval()(h_va, c_va), y_va, K)

        fit_info[l] = _fit(m, [h_tr, c_tr], y_tr, val_score, epochs, deadline.share(len(pred.layers) - i),
                           device, seed=seed + l)
        if progress:
            progress(i + 1, len(pred.layers))
    pred._infer.clear()
    metrics = evaluate_mlp(pred, data)
    metrics["fit"] = {str(l): v for l, v in fit_info.items()}
    metrics["split"] = {"train": int(len(tr)), "val": int(len(va)), "test": int(len(data.rows(TEST)))}
    return pred, metrics


def evaluate_mlp(pred: MLPPredictorSet, data: HiddenData, rows: np.ndarray | None = None) -> dict:
    """Per (source layer, lookahead): mlp vs gate reuse vs frequency on the same (test) rows."""
    rows = data.rows(TEST) if rows is None else rows
    tr = data.rows(TRAIN)
    E, K = data.num_experts, data.top_k
    ks = ks_for(K, E)
    per_d: dict[int, list[dict]] = {d: [] for d in pred.lookaheads}
    for l in pred.layers:
        scores = pred.predict_batch(l, data.moe_inputs[rows, l].astype(np.float32), data.experts[rows, l])
        for t, s in scores.items():
            truth = data.experts[rows, t]
            row = {"source": l, "target": t, "mlp": set_metrics(s, truth, ks),
                   "frequency": set_metrics(frequency_scores(data.experts[tr, t], E, len(rows)), truth, ks)}
            if data.routers and t in data.routers:
                g = gate_reuse_scores(data.moe_inputs[rows, l], data.routers[t], (data.router_bias or {}).get(t))
                row["gate_reuse"] = set_metrics(g, truth, ks)
            per_d[t - l].append(row)
    out = {"ks": ks, "test_tokens": int(len(rows)), "lookahead": {}}
    for d, layer_rows in per_d.items():
        cols = [c for c in ("mlp", "gate_reuse", "frequency") if layer_rows and c in layer_rows[0]]
        out["lookahead"][str(d)] = {"per_layer": layer_rows,
                                    "mean": {c: mean_metrics([r[c] for r in layer_rows]) for c in cols}}
    return out


def train_aux_gate(traces: list[Trace], epochs: int = 100, max_minutes: float | None = 2.0, device: str = "cpu",
                   seed: int = 0, width: int = 0, data: HiddenData | None = None) -> tuple[AuxGate, dict]:
    """The first-layer gate from the previous token's final hidden state; metrics vs frequency."""
    data = data or gather_hidden(traces)
    torch.manual_seed(seed)
    E, K, D = data.num_experts, data.top_k, data.hidden_size
    gate = AuxGate(D, E, K, width)
    tr, va = data.rows(TRAIN), data.rows(VAL)
    if len(tr) == 0 or len(va) == 0:
        raise MoectlError(f"too few hidden samples to split ({len(data.split)}); profile more tokens")
    # start at the training split's popularity (logit of each expert's frequency): epoch 0 = frequency baseline
    freq = multi_hot(data.experts[tr, 0], E).mean(0).clip(1e-3, 1 - 1e-3)
    with torch.no_grad():
        gate.net[-1].bias.copy_(torch.from_numpy(np.log(freq / (1 - freq)).astype(np.float32)))

    def tensors(rows):
        return (torch.from_numpy(data.prev_final[rows].astype(np.float32)),
                torch.from_numpy(multi_hot(data.experts[rows, 0], E).astype(np.float32)))

    x_tr, y_tr = tensors(tr)
    x_va, y_va = (t.to(device) for t in tensors(va))

    def val_score(mod):
        with torch.no_grad():
            return _recall_at_k(mod.eval()(x_va), y_va, K)

    fit = _fit(gate, [x_tr], y_tr, val_score, epochs, Deadline(max_minutes).share(1), device, seed=seed)
    gate._infer = None
    metrics = evaluate_aux_gate(gate, data)
    metrics["fit"] = fit
    return gate, metrics


def evaluate_aux_gate(gate: AuxGate, data: HiddenData, rows: np.ndarray | None = None) -> dict:
    rows = data.rows(TEST) if rows is None else rows
    ks = ks_for(data.top_k, data.num_experts)
    truth = data.experts[rows, gate.target_layer]
    freq = frequency_scores(data.experts[data.rows(TRAIN), gate.target_layer], data.num_experts, len(rows))
    return {"ks": ks, "test_tokens": int(len(rows)), "target_layer": gate.target_layer,
            "aux_gate": set_metrics(gate.predict_batch(data.prev_final[rows]), truth, ks),
            "frequency": set_metrics(freq, truth, ks)}


ROUTING_EPOCHS = 20           # default passes of the routing predictor: ~150 weights per head, more only overfit


def train_routing(traces: list[Trace], lookaheads: list[int], epochs: int, max_minutes: float | None,
                  seed: int = 0):
    """The routing-only predictor (moectl.predictors.routing): inputs are expert choices, no hidden states."""
    from ..predictors.routing import train_routing_predictor

    return train_routing_predictor(traces, lookahead=lookaheads, epochs=epochs, max_minutes=max_minutes or 5.0,
                                   seed=seed)


def evaluate_routing(pred, test: Trace, train: list[Trace]) -> dict:
    """Replay `test` (decode rows) through the routing predictor, token by token, layer by layer.

    Per lookahead d and target layer: the predictor's scores vs the frequency baseline (the target layer's most
    popular experts in the `train` traces) and the previous token's choice at the target layer (ties broken by
    frequency), all on the same tokens. `test` must not be among `train` (e.g. the other file of the model).
    """
    from ..core.trace import PREFILL

    L, E, K = test.num_layers, test.num_experts, test.top_k
    ks = ks_for(K, E)
    pop = sum(multi_hot(t.experts.reshape(-1, K), E).reshape(t.num_tokens, L, E).sum(0) for t in train)   # [L, E]
    pop = pop / max(1, pop.sum(1).max())
    scores = {d: {t: ([], [], [], []) for t in range(d, L)} for d in pred.lookahead}   # routing, freq, prev, truth
    state = pred.new_state()
    for _, sl in test.request_slices():
        rows = [r for r in range(sl.start, sl.stop) if test.phase[r] != PREFILL]
        state.reset()
        prev = None
        for r in rows:
            for l in range(L):
                state.observe(l, test.experts[r, l])
                for d in pred.lookahead:
                    if l + d >= L:
                        continue
                    t = l + d
                    s = scores[d][t]
                    s[0].append(pred.predict(state, d))
                    s[1].append(pop[t])
                    s[2].append((multi_hot(prev[t][None], E)[0] if prev is not None else 0) + 1e-3 * pop[t])
                    s[3].append(test.experts[r, t])
            state.end_token()
            prev = test.experts[r]
    out = {"ks": ks, "test_tokens": 0, "lookahead": {}}
    for d, per_t in scores.items():
        rows_out = []
        for t, (rs, fs, ps, ys) in per_t.items():
            if not ys:
                continue
            y = np.stack(ys)
            rows_out.append({"target": t, "routing": set_metrics(np.stack(rs), y, ks),
                             "frequency": set_metrics(np.stack(fs), y, ks),
                             "prev_token": set_metrics(np.stack(ps), y, ks)})
        if rows_out:
            out["test_tokens"] = rows_out[0]["routing"]["tokens"]
            out["lookahead"][str(d)] = {"per_layer": rows_out, "mean": {
                c: mean_metrics([r[c] for r in rows_out]) for c in ("routing", "frequency", "prev_token")}}
    return out
