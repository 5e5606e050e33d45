r"""ProMoE-style hidden-state predictors: from layer l's MoE input, score the experts of layers l+d.

Legend: B = batch of tokens, D = hidden size, E = experts, H = MLP width, d = lookahead, n_d = lookaheads
that fit after layer l (l + d < L).

One `SourceLayerMLP` per source layer l predicts every lookahead at once (one output head per d, sharing the
hidden layer), so a layer costs one D x H matrix-vector product however many lookaheads there are:

    scores[d] = W2[d] @ relu(W1 @ [h ; chosen_l] + b1) + b2[d]  +  S[d] @ h + s[d]
                \______________ two-layer MLP ______________/     \__ linear skip __/

`chosen_l` (optional) is the multi-hot of the experts layer l itself chose. The linear skip path starts as
the router of the target layer (gate reuse: router[l+d] @ h) and the MLP's output layer starts at zero, so
training starts from gate reuse and early stopping on held-out recall keeps whatever beats it.
Training lives in `moectl.predict.train`; this file is the model and the fast CPU inference path
(`predict_scores`: two matrix-vector products per layer on one thread, no autograd).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn


class SourceLayerMLP(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, lookaheads: list[int], width: int,
                 use_chosen: bool = False) -> None:
        super().__init__()
        self.lookaheads = list(lookaheads)
        self.num_experts = num_experts
        self.use_chosen = use_chosen
        in_dim = hidden_size + (num_experts if use_chosen else 0)
        self.fc1 = nn.Linear(in_dim, width)
        self.fc2 = nn.Linear(width, len(self.lookaheads) * num_experts)
        self.skip = nn.Linear(hidden_size, len(self.lookaheads) * num_experts)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)
        nn.init.zeros_(self.skip.weight)
        nn.init.zeros_(self.skip.bias)

    def init_skip_from_routers(self, routers: list[np.ndarray | None], biases: list[np.ndarray | None]) -> None:
        """Start the skip path of head i at gate reuse: router [E, D] (and bias [E]) of target layer l+d_i."""
        E = self.num_experts
        with torch.no_grad():
            for i, (r, b) in enumerate(zip(routers, biases)):
                if r is not None:
                    self.skip.weight[i * E:(i + 1) * E] = torch.from_numpy(np.asarray(r, dtype=np.float32))
                if b is not None:
                    self.skip.bias[i * E:(i + 1) * E] = torch.from_numpy(np.asarray(b, dtype=np.float32))

    def forward(self, h: torch.Tensor, chosen: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, D], chosen [B, E] (0/1) -> logits [B, n_d, E]."""
        x = torch.cat([h, chosen], dim=1) if self.use_chosen else h
        out = self.fc2(torch.relu(self.fc1(x))) + self.skip(h)
        return out.view(h.shape[0], len(self.lookaheads), self.num_experts)


class MLPPredictorSet:
    """All source layers' predictors of one model; what the `mlp` prefetch policy calls."""

    kind = "mlp"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, hidden_size: int,
                 lookaheads: list[int], width: int = 128, use_chosen: bool = False) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.hidden_size, self.width, self.use_chosen = hidden_size, width, use_chosen
        self.lookaheads = sorted(set(int(d) for d in lookaheads))
        self.layers: dict[int, SourceLayerMLP] = {}
        for l in range(num_layers):
            ds = [d for d in self.lookaheads if l + d < num_layers]
            if ds:
                self.layers[l] = SourceLayerMLP(hidden_size, num_experts, ds, width, use_chosen)
        self._infer: dict[int, tuple] = {}        # float32 weights laid out for predict_scores

    # -- serialisation (artifacts/versioned.py stores config() in predictors.json, state_dict() in safetensors) --
    def config(self) -> dict:
        return {"num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k,
                "hidden_size": self.hidden_size, "lookaheads": self.lookaheads, "width": self.width,
                "use_chosen": self.use_chosen, "activation": "relu",
                "inputs": "moe_input[l]" + (" + multi_hot(chosen[l])" if self.use_chosen else ""),
                "loss": "bce", "skip_init": "router[l+d] (gate reuse)"}

    @classmethod
    def from_config(cls, cfg: dict) -> "MLPPredictorSet":
        return cls(cfg["num_layers"], cfg["num_experts"], cfg["top_k"], cfg["hidden_size"], cfg["lookaheads"],
                   cfg["width"], cfg.get("use_chosen", False))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{l}.{k}": v.detach().cpu().contiguous() for l, m in self.layers.items()
                for k, v in m.state_dict().items()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for l, m in self.layers.items():
            m.load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items() if k.split(".", 1)[0] == str(l)})
        self._infer.clear()

    def num_params(self) -> int:
        return sum(p.numel() for m in self.layers.values() for p in m.parameters())

    # -- inference --
    def targets(self, layer: int) -> list[int]:
        m = self.layers.get(layer)
        return [] if m is None else [layer + d for d in m.lookaheads]

    def _weights(self, layer: int) -> tuple:
        w = self._infer.get(layer)
        if w is None:
            m = self.layers[layer]
            D, H = self.hidden_size, self.width
            f1 = m.fc1.weight.detach().float()
            # fc1's hidden part and the skip path read the same h: one [H + n_d*E, D] matrix, one product
            w_in = torch.cat([f1[:, :D], m.skip.weight.detach().float()]).contiguous()
            b_in = torch.cat([m.fc1.bias.detach().float(), m.skip.bias.detach().float()])
            w_chosen = f1[:, D:].T.contiguous() if self.use_chosen else None          # [E, H]
            w = self._infer[layer] = (w_in, b_in, w_chosen, m.fc2.weight.detach().float().contiguous(),
                                   m.fc2.bias.detach().float(), H, list(m.lookaheads))
        return w

    @torch.no_grad()
    def predict_scores(self, layer: int, hidden, chosen=None) -> dict[int, np.ndarray]:
        """One token: hidden [D] (numpy or torch) of MoE layer `layer` -> {target layer: scores [E]}.

        `chosen`: the expert ids layer `layer` picked (used only if the set was trained with use_chosen).
        Runs on one CPU thread (see `one_thread`): a multi-threaded matrix-vector product this small only
        waits for the other cores, which the model's own compute is using.
        """
        if layer not in self.layers:
            return {}
        w_in, b_in, w_chosen, w2, b2, H, ds = self._weights(layer)
        with one_thread():
            h = torch.as_tensor(hidden).detach().to("cpu", torch.float32).reshape(-1)
            y = torch.addmv(b_in, w_in, h)                       # [H + n_d*E]
            a = y[:H]
            if w_chosen is not None and chosen is not None:
                ids = [int(e) for e in chosen if int(e) >= 0]
                a = a + w_chosen[ids].sum(0)
            out = (torch.addmv(b2, w2, a.relu()) + y[H:]).numpy()   # [n_d*E]
        E = self.num_experts
        return {layer + d: out[i * E:(i + 1) * E] for i, d in enumerate(ds)}

    @torch.no_grad()
    def predict_batch(self, layer: int, hidden: np.ndarray, chosen: np.ndarray | None = None) -> dict[int, np.ndarray]:
        """Many tokens: hidden [B, D], chosen [B, K] ids or None -> {target layer: scores [B, E]}."""
        m = self.layers.get(layer)
        if m is None:
            return {}
        h = torch.from_numpy(np.asarray(hidden, dtype=np.float32))
        c = None
        if self.use_chosen:
            c = torch.zeros(h.shape[0], self.num_experts)
            if chosen is not None:
                from .metrics import multi_hot

                c = torch.from_numpy(multi_hot(chosen, self.num_experts).astype(np.float32))
        out = m.eval()(h, c).numpy()                             # [B, n_d, E]
        return {layer + d: out[:, i] for i, d in enumerate(m.lookaheads)}


def measure_predict_cost(hidden_size: int = 4096, num_experts: int = 8, top_k: int = 2, num_layers: int = 32,
                         lookaheads: tuple[int, ...] = (1, 2, 3), width: int = 128, repeats: int = 300,
                         seed: int = 0) -> dict:
    """CPU cost of one `predict_scores` call (one source layer, every lookahead) at a model's sizes.

    Defaults are Mixtral-8x7B (D=4096, E=8, top-2). Weights are random: the cost does not depend on their
    values. Prediction runs on one CPU thread (`one_thread`). The ProMoE goal is <= 0.3 ms per layer.
    Returns ms per layer (median, p90), params per layer, width.
    """
    torch.manual_seed(seed)
    pred = MLPPredictorSet(num_layers, num_experts, top_k, hidden_size, list(lookaheads), width)
    for m in pred.layers.values():                                # non-zero weights, like a trained set
        for p in m.parameters():
            nn.init.normal_(p, std=0.02)
    layer = num_layers // 2
    rng = np.random.default_rng(seed)
    hs = rng.standard_normal((16, hidden_size)).astype(np.float32)
    for i in range(20):                                           # warm-up (builds the inference weights)
        pred.predict_scores(layer, hs[i % 16])
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        pred.predict_scores(layer, hs[i % 16])
        times.append(time.perf_counter() - t0)
    t = np.array(times) * 1e3
    return {"hidden_size": hidden_size, "num_experts": num_experts, "lookaheads": list(lookaheads),
            "width": width, "params_per_layer": sum(p.numel() for p in pred.layers[layer].parameters()),
            "threads": 1, "ms_per_layer_median": float(np.median(t)),
            "ms_per_layer_p90": float(np.percentile(t, 90)), "repeats": repeats, "goal_ms": 0.3}


class one_thread:
    """Run torch CPU ops of this block on one thread (the setting is per calling thread), then restore."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        if self.n != 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.n != 1:
            torch.set_num_threads(self.n)
