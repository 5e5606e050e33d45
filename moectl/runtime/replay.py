"""RoutingReplay: `--replay-trace FILE` — the router's choice replaced by a recorded one.

Legend: N = trace rows, L = MoE layers, K = experts per row and layer (the trace's top-k), T = tokens of a forward.

Real routing on real-size (or random-weight synthetic) experts: each forward of T tokens takes the trace's next
T rows, in file order (all requests one after another, wrapping at the end), and every MoE layer runs the
experts those rows chose for it, with the recorded gate weights (renormalised over the row's experts) or equal
weights when the trace has none. The router still runs (its cost is real); only its choice is replaced. The trace
must be of the model's shape (MoE layers, experts, top-k: `trace.check_trace_fits`), except that a make-synthetic
checkpoint cut to its recipe's first L layers takes the full recipe's trace (a full Mixtral trace on a 4-layer
synthetic model gives its first L layers).
"""

from __future__ import annotations

import numpy as np
import torch

from ..artifacts.trace_dir import load_trace
from ..core.trace import Trace, check_trace_fits
from ..errors import MoectlError


class RoutingReplay:
    def __init__(self, trace: Trace | str, num_layers: int, num_experts: int, top_k: int | None = None,
                 prefix: bool = False):
        """`prefix`: the model is a make-synthetic checkpoint cut to its recipe's first layers (config.json's
        `moectl_synthetic`), so a trace of more layers is its recipe's; any other trace must match the model."""
        source = None if isinstance(trace, Trace) else trace
        trace = load_trace(trace) if not isinstance(trace, Trace) else trace
        check_trace_fits(trace, num_layers, num_experts, top_k, "the model it replays on", source=source,
                         prefix=prefix)
        if trace.num_tokens == 0:
            raise MoectlError("--replay-trace: the trace has no rows")
        self.trace = trace
        self.experts = trace.experts[:, :num_layers].astype(np.int64)              # [N, L, K]
        if trace.weights is not None:
            w = np.where(self.experts >= 0, trace.weights[:, :num_layers].astype(np.float32), 0.0)
        else:
            w = (self.experts >= 0).astype(np.float32)
        s = w.sum(-1, keepdims=True)
        self.weights = np.divide(w, s, out=np.zeros_like(w), where=s > 0)         # [N, L, K], rows sum to 1
        self.cursor = 0                                                           # first row of this forward
        self.rows_used = 0

    def _rows(self, T: int) -> np.ndarray:
        return (self.cursor + np.arange(T)) % len(self.experts)

    def route(self, layer: int, idx: torch.Tensor, w: torch.Tensor):
        """The trace's (idx, w) [T,K] for this forward's T tokens at MoE layer `layer`, on the router's device
        and dtypes. A one-token row keeps only its real experts (no -1 padding)."""
        rows = self._rows(idx.shape[0])
        e, g = self.experts[rows, layer], self.weights[rows, layer]              # [T, K]
        if len(rows) == 1:
            keep = e[0] >= 0
            e, g = e[:, keep], g[:, keep]
        return (torch.from_numpy(np.ascontiguousarray(e)).to(idx.device, idx.dtype),
                torch.from_numpy(np.ascontiguousarray(g)).to(w.device, w.dtype))

    def advance(self, tokens: int) -> None:
        """After a forward of `tokens` tokens: the next forward starts at the following row."""
        self.cursor = (self.cursor + tokens) % len(self.experts)
        self.rows_used += tokens
