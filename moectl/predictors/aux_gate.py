"""AdapMoE's auxiliary gate: the previous token's final hidden state -> the first MoE layer's experts.

Legend: B = batch of tokens, D = hidden size, E = experts, H = width of the optional hidden layer.

The first MoE layer of a token has no earlier layer to predict it from; the only signal available before
the token's forward starts is the previous token's output (the input of lm_head). AdapMoE uses a linear
D x E gate (`width=0`, the default); `width>0` adds one ReLU hidden layer. Trained with BCE on the first
layer's true top-k (the paper's KL to the router's distribution needs router logits, which traces only
carry optionally). At a request's first token the input is all zeros, so the prediction is the bias: a
learned popularity prior.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class AuxGate(nn.Module):
    kind = "aux_gate"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, width: int = 0, target_layer: int = 0) -> None:
        super().__init__()
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.width, self.target_layer = width, target_layer
        if width:
            self.net = nn.Sequential(nn.Linear(hidden_size, width), nn.ReLU(), nn.Linear(width, num_experts))
        else:
            self.net = nn.Sequential(nn.Linear(hidden_size, num_experts))
        self._infer: list[tuple[np.ndarray, np.ndarray]] | None = None

    def forward(self, prev_final: torch.Tensor) -> torch.Tensor:
        """prev_final [B, D] -> logits [B, E]."""
        return self.net(prev_final)

    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "num_experts": self.num_experts, "top_k": self.top_k,
                "width": self.width, "target_layer": self.target_layer, "inputs": "prev_final",
                "architecture": "linear" if not self.width else "mlp-relu", "loss": "bce"}

    @classmethod
    def from_config(cls, cfg: dict) -> "AuxGate":
        return cls(cfg["hidden_size"], cfg["num_experts"], cfg["top_k"], cfg.get("width", 0),
                   cfg.get("target_layer", 0))

    def load_state_dict(self, sd, strict: bool = True):
        self._infer = None
        return super().load_state_dict(sd, strict)

    @torch.no_grad()
    def predict_scores(self, prev_final_hidden) -> np.ndarray:
        """One token: the previous token's final hidden state [D] (zeros/None at a request start) -> scores [E]."""
        from .mlp import one_thread

        if self._infer is None:
            self._infer = [(m.weight.detach().float(), m.bias.detach().float())
                           for m in self.net if isinstance(m, nn.Linear)]
        with one_thread():
            x = (torch.zeros(self.hidden_size) if prev_final_hidden is None
                 else torch.as_tensor(prev_final_hidden).detach().to("cpu", torch.float32).reshape(-1))
            for i, (w, b) in enumerate(self._infer):
                x = torch.addmv(b, w, x)
                if i < len(self._infer) - 1:
                    x = x.relu()
        return x.numpy()

    @torch.no_grad()
    def predict_batch(self, prev_final: np.ndarray) -> np.ndarray:
        """prev_final [B, D] -> scores [B, E]."""
        return self.eval()(torch.from_numpy(np.asarray(prev_final, dtype=np.float32))).numpy()
