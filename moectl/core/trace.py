"""Routing traces in memory: the one object every trace consumer reads.

Legend: N = tokens (rows), L = MoE layers (trace layer index, not model layer index),
K = top-k (max experts per token and layer), E = experts, D = hidden size, S = hidden samples.

On disk a trace is either a moectl trace directory (`meta.json` + `shard-*.safetensors`,
`artifacts/trace_dir.py`) or a `moe-routing-v1` JSONL file (`../shared/traces/README.md`, `artifacts/routing_jsonl.py`);
`artifacts/trace_dir.py: load_trace(path)` reads both. Rows are in generation order; a request's rows are contiguous.
An expert id of -1 means "no expert in this slot" (padding, e.g. adaptive top-k chose fewer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import MoectlError
from .fingerprint import check_fingerprint, shape_text

PREFILL, DECODE = 0, 1
PHASES = {"prefill": PREFILL, "decode": DECODE}
PHASE_NAMES = {v: k for k, v in PHASES.items()}


@dataclass
class HiddenSamples:
    """MoE-block inputs for a subset of rows (or all rows, for small models)."""

    token_index: np.ndarray          # [S] int64, rows of the trace these samples belong to
    moe_inputs: np.ndarray           # [S, L, D] float16, input of every MoE block (after the post-attention norm)
    prev_final: np.ndarray           # [S, D] float16, previous token's final hidden state (zeros at a request's start)


@dataclass
class Trace:
    model: str                       # human name, e.g. "mistralai/Mixtral-8x7B-Instruct-v0.1"
    num_layers: int                  # L (MoE layers only)
    num_experts: int                 # E
    top_k: int                       # K
    request: list[str]               # [N] request id per row
    pos: np.ndarray                  # [N] int32 position in the request
    phase: np.ndarray                # [N] uint8, PREFILL or DECODE
    experts: np.ndarray              # [N, L, K] int16 expert ids, -1 = none
    weights: np.ndarray | None = None        # [N, L, K] float16 gate weights, if known
    fingerprint: str | None = None   # model fingerprint (None for imported traces of unknown models)
    moe_layer_ids: list[int] = field(default_factory=list)   # model layer index of each trace layer
    hidden: HiddenSamples | None = None
    routers: dict[int, np.ndarray] | None = None   # trace layer -> router weight [E, D] (for gate-reuse replay)
    router_bias: dict[int, np.ndarray] | None = None   # trace layer -> [E] (GPT-OSS)
    source: str = ""
    extra: dict = field(default_factory=dict)      # anything else from meta.json
    router_logits: np.ndarray | None = None        # [N, L, E] float16 raw router logits (profile --router-logits)
    tokens: np.ndarray | None = None               # [N] int32 token id of each row (profiled traces)

    def __post_init__(self) -> None:
        if not self.moe_layer_ids:
            self.moe_layer_ids = list(range(self.num_layers))

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    def request_slices(self) -> list[tuple[str, slice]]:
        """(request id, row slice) for each request, in order."""
        out: list[tuple[str, slice]] = []
        start = 0
        for i in range(1, len(self.request) + 1):
            if i == len(self.request) or self.request[i] != self.request[start]:
                out.append((self.request[start], slice(start, i)))
                start = i
        return out

    def select(self, rows: np.ndarray | slice) -> "Trace":
        """A trace of a subset of rows (hidden samples kept where their row is kept)."""
        idx = np.arange(self.num_tokens)[rows]
        hidden = None
        if self.hidden is not None:
            remap = -np.ones(self.num_tokens, dtype=np.int64)
            remap[idx] = np.arange(len(idx))
            keep = remap[self.hidden.token_index] >= 0
            hidden = HiddenSamples(remap[self.hidden.token_index[keep]],
                                   self.hidden.moe_inputs[keep], self.hidden.prev_final[keep])
        return Trace(self.model, self.num_layers, self.num_experts, self.top_k,
                     [self.request[i] for i in idx], self.pos[idx], self.phase[idx], self.experts[idx],
                     None if self.weights is None else self.weights[idx], self.fingerprint,
                     list(self.moe_layer_ids), hidden, self.routers, self.router_bias, self.source,
                     dict(self.extra), None if self.router_logits is None else self.router_logits[idx],
                     None if self.tokens is None else self.tokens[idx])


def expert_activation_matrix(trace: Trace, rows: slice | None = None) -> np.ndarray:
    """MoE-Infinity's EAM: [L, E] counts of how often each expert ran, over `rows` (a request)."""
    ex = trace.experts if rows is None else trace.experts[rows]          # [n, L, K]
    eam = np.zeros((trace.num_layers, trace.num_experts), dtype=np.int64)
    n, L, K = ex.shape
    layer = np.broadcast_to(np.arange(L)[None, :, None], ex.shape)
    ok = ex >= 0
    np.add.at(eam, (layer[ok], ex[ok].astype(np.int64)), 1)
    return eam


def expert_activation_matrices(trace: Trace) -> dict[str, np.ndarray]:
    """One EAM per request: request id -> [L, E] int64 counts (MoE-Infinity's request-level matrices)."""
    out: dict[str, np.ndarray] = {}
    for req, rows in trace.request_slices():
        eam = expert_activation_matrix(trace, rows)
        out[req] = out[req] + eam if req in out else eam      # a request split in two runs still sums up
    return out


MAX_EXPERTS = 32767                  # expert ids are stored as int16


def check_trace_fits(trace: Trace, num_layers: int, num_experts: int, top_k: int | None, model: str,
                     fingerprint: str | None = None, source: object = None, prefix: bool = False) -> None:
    """A trace recorded on another model is one clear error, wherever a trace meets a model: its fingerprint when
    both are known, and always its shape (MoE layers, experts, top-k; an imported trace has no fingerprint).
    `prefix`: a trace of more layers is accepted (its first `num_layers` are used: a make-synthetic checkpoint
    cut to its first layers replays its full recipe's trace)."""

    label = f"trace {source} ({trace.model})" if source else f"the {trace.model} trace"
    if fingerprint is not None:
        check_fingerprint(trace.fingerprint, fingerprint, "trace", source or trace.model)
    layers_ok = trace.num_layers >= num_layers if prefix else trace.num_layers == num_layers
    if layers_ok and trace.num_experts == num_experts and top_k in (None, trace.top_k):
        return
    need = ", and a trace needs at least as many layers" if prefix else ""
    have = shape_text(trace.num_layers, trace.num_experts, trace.top_k)
    raise MoectlError(f"{label} is for {have}, {model} has {shape_text(num_layers, num_experts, top_k)}{need}: a "
                      f"trace must come from the model it is used with")
