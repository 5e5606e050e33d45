"""`moe-routing-v1` JSONL traces (`../shared/traces/README.md`): a header line, then one JSON row per token. Read into
the in-memory `Trace` (`core/trace.py`) with every malformed line one error naming the file and line; written back
in the format's key order (an imported file exports byte for byte).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..core.trace import MAX_EXPERTS, PHASE_NAMES, PHASES, Trace
from ..errors import MoectlError
from .versioned import is_int, parse_text, require_int, where


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


def _jsonl_header(head, path) -> tuple[int, int, int]:
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
    raw = Path(path).read_bytes()
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        what = "a GGUF model file" if raw[:4] == b"GGUF" else f"not UTF-8 text (byte 0x{raw[e.start]:02x})"
        raise MoectlError(f"{path}:{line}: {what}, not a moe-routing-v1 JSONL trace" + (
            f"; `moectl profile --model {path}` records one" if raw[:4] == b"GGUF" else "")) from None
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
