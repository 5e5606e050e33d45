"""Routing traces in memory: the one object every trace consumer reads.

Legend: N = tokens (rows), L = MoE layers (trace layer index, not model layer index),
K = top-k (max experts per token and layer), E = experts, D = hidden size, S = hidden samples.

On disk a trace is either a moectl trace directory (`meta.json` + `shard-*.safetensors`, see
`moectl.artifacts.trace`) or a `moe-routing-v1` JSONL file (`../shared/traces/README.md`);
`load_trace(path)` reads both. Rows are in generation order; a request's rows are contiguous.
An expert id of -1 means "no expert in this slot" (padding, e.g. adaptive top-k chose fewer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MoectlError

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


def _short_float(x: np.floating) -> float:
    """The shortest decimal that reads back as the same fp16/fp32 value (0.80029296875 -> 0.8003)."""
    return float(np.format_float_positional(x, unique=True, trim="-"))


def jsonl_rows(trace: Trace, exact_weights: np.ndarray | None = None):
    """moe-routing-v1 row dicts, in the format's key order. `exact_weights` [N, L, K] float64 (kept by
    `trace import`) replaces the fp16 weights so an imported file exports byte for byte."""
    weights = exact_weights if exact_weights is not None else trace.weights
    for i in range(trace.num_tokens):
        ex = trace.experts[i]                                           # [L, K]
        keep = [ex[l] >= 0 for l in range(trace.num_layers)]
        row = {"request": trace.request[i], "pos": int(trace.pos[i]), "phase": PHASE_NAMES[int(trace.phase[i])],
               "experts": [ex[l][keep[l]].tolist() for l in range(trace.num_layers)]}
        if weights is not None:
            conv = float if exact_weights is not None else _short_float
            row["weights"] = [[conv(w) for w in weights[i, l][keep[l]]] for l in range(trace.num_layers)]
        yield row


def write_jsonl(trace: Trace, path: str | Path, header: dict | None = None,
                exact_weights: np.ndarray | None = None) -> Path:
    """Write `trace` as moe-routing-v1 JSONL. `header` (the original first line, kept by `trace import`)
    is written as is; otherwise one is built from the trace."""
    path = Path(path)
    if header is None:
        header = {"format": "moe-routing-v1", "model": trace.model, "num_layers": trace.num_layers,
                  "num_experts": trace.num_experts, "top_k": trace.top_k,
                  "source": trace.source or "moectl profile"}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for row in jsonl_rows(trace, exact_weights):
            f.write(json.dumps(row) + "\n")
    return path


MAX_EXPERTS = 32767                  # expert ids are stored as int16


def _jsonl_header(head, path) -> tuple[int, int, int]:
    from ..artifacts.versioned import require_int, where

    if not isinstance(head, dict):
        raise MoectlError(f"{where(path, 1)}: the header line must be a JSON object, not {type(head).__name__}")
    if head.get("format") != "moe-routing-v1":
        raise MoectlError(f"{where(path, 1)}: first line says format {head.get('format')!r}, expected 'moe-routing-v1'")
    L, E, K = (require_int(head, k, path, minimum=1, line=1) for k in ("num_layers", "num_experts", "top_k"))
    if E > MAX_EXPERTS:
        raise MoectlError(f"{where(path, 1)}: num_experts {E} is above the {MAX_EXPERTS} moectl supports")
    if K > E:
        raise MoectlError(f"{where(path, 1)}: top_k {K} is above num_experts {E}")
    return L, E, K


def _jsonl_row(r, n: int, path, L: int, E: int, K: int) -> tuple[list[list[int]], list | None]:
    """Validated (experts per layer, weights per layer or None) of row `r` at line `n`."""
    from ..artifacts.versioned import is_int, where

    at = where(path, n)
    if not isinstance(r, dict):
        raise MoectlError(f"{at}: a row must be a JSON object, not {type(r).__name__}")
    for key in ("request", "pos", "experts"):
        if key not in r:
            raise MoectlError(f"{at}: the row has no `{key}`")
    if not is_int(r["pos"]) or r["pos"] < 0:
        raise MoectlError(f"{at}: `pos` must be an integer >= 0, not {r['pos']!r}")
    if r.get("phase", "decode") not in PHASES:
        raise MoectlError(f"{at}: unknown phase {r.get('phase')!r}; expected 'prefill' or 'decode'")
    ex = r["experts"]
    if not isinstance(ex, list) or len(ex) != L:
        got = f"{len(ex)} layers" if isinstance(ex, list) else type(ex).__name__
        raise MoectlError(f"{at}: `experts` must be a list of {L} layers (the header's num_layers), got {got}")
    for l, ids in enumerate(ex):
        if not isinstance(ids, list) or not all(is_int(e) for e in ids):
            raise MoectlError(f"{at}: layer {l}: expert ids must be a list of integers, not {ids!r}")
        if len(ids) > K:
            raise MoectlError(f"{at}: layer {l} has {len(ids)} experts, more than top_k {K}")
        bad = [e for e in ids if not 0 <= e < E]
        if bad:
            raise MoectlError(f"{at}: layer {l}: expert id {bad[0]} is outside 0..{E - 1} (num_experts {E})")
    w = r.get("weights")
    if w is not None:
        if (not isinstance(w, list) or len(w) != L
                or any(not isinstance(wl, list) or len(wl) != len(ids) for wl, ids in zip(w, ex))
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) for wl in w for x in wl)):
            raise MoectlError(f"{at}: `weights` must be numbers shaped like `experts`")
    return ex, w


def read_jsonl(path: Path) -> Trace:
    """Read a `moe-routing-v1` JSONL file; anything malformed is one error naming the file and line."""
    from ..artifacts.versioned import parse_text

    lines = path.read_text().splitlines()
    if not lines:
        raise MoectlError(f"{path} is empty; expected a moe-routing-v1 JSONL trace")
    head = parse_text(lines[0], path)
    L, E, K = _jsonl_header(head, path)
    rows, numbers = [], []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise MoectlError(f"{path}:{n}: not valid JSON ({e.msg}); is the file truncated?") from None
        numbers.append(n)
    if not rows:
        raise MoectlError(f"{path}: the trace has a header but no token rows")
    N = len(rows)
    experts = np.full((N, L, K), -1, dtype=np.int16)
    checked = [_jsonl_row(r, n, path, L, E, K) for r, n in zip(rows, numbers)]
    has_w = all(w is not None for _, w in checked)
    weights = np.zeros((N, L, K), dtype=np.float16) if has_w else None
    for i, (ex, w) in enumerate(checked):
        for l, ids in enumerate(ex):
            experts[i, l, : len(ids)] = ids
            if has_w:
                weights[i, l, : len(ids)] = w[l]
    return Trace(
        model=str(head.get("model", path.stem)), num_layers=L, num_experts=E, top_k=K,
        request=[str(r["request"]) for r in rows],
        pos=np.array([r["pos"] for r in rows], dtype=np.int32),
        phase=np.array([PHASES[r.get("phase", "decode")] for r in rows], dtype=np.uint8),
        experts=experts, weights=weights, fingerprint=None, source=str(head.get("source", "")),
        extra={k: v for k, v in head.items()
               if k not in ("format", "model", "num_layers", "num_experts", "top_k", "source")},
    )


def check_trace_fits(trace: Trace, num_layers: int, num_experts: int, top_k: int | None, model: str,
                     fingerprint: str | None = None, source: object = None, prefix: bool = False) -> None:
    """A trace recorded on another model is one clear error, wherever a trace meets a model: its fingerprint when
    both are known, and always its shape (MoE layers, experts, top-k; an imported trace has no fingerprint).
    `prefix`: a trace of more layers is accepted (its first `num_layers` are used: a make-synthetic checkpoint
    cut to its first layers replays its full recipe's trace)."""
    from ..artifacts.versioned import shape_text
    from .fingerprint import check_fingerprint

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


def load_trace(path: str | Path) -> Trace:
    """Load a trace directory or a moe-routing-v1 JSONL file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise MoectlError(f"trace {p} does not exist")
    if p.is_dir() or p.suffix == ".safetensors":
        from ..artifacts.trace import read_trace_dir  # trace directory format (profile issue)

        return read_trace_dir(p if p.is_dir() else p.parent)
    return read_jsonl(p)
