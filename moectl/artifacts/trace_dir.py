"""Trace directories on disk: `meta.json` + `shard-*.safetensors` (+ `routers.safetensors`); `load_trace(path)` reads
a trace directory or a moe-routing-v1 JSONL file (`routing_jsonl.py`).

Legend: N = rows (tokens), n = rows of one shard, L = MoE layers, K = top-k, E = experts,
D = hidden size, s = hidden samples in a shard.

Trace directory format, version 1 (`moectl profile` and `moectl trace import` write it; every command
that reads traces accepts it, as well as moe-routing-v1 JSONL):

    traces/
      meta.json                 what the trace is (below); rewritten atomically after every shard
      shard-00000.safetensors   rows 0..n0-1, complete requests only
      shard-00001.safetensors   ...
      routers.safetensors       optional: router weights for gate-reuse replay
                                `router.{l}.weight` [E, D] (+ `router.{l}.bias` [E]), l = MoE layer index

meta.json:
    format "moectl-trace", version 1, model (name), family, fingerprint (`family:hash`, null for
    imported traces of unknown models), dataset (the profile's --dataset spec, or the imported file),
    num_layers L, moe_layer_ids (model layer index of each trace layer), num_experts E, top_k K,
    hidden_size D (or null), num_tokens N, num_requests, requests (request-id table; shards store
    indices into it), samples_done (complete requests written: what `--resume` skips),
    shards [{file, rows, hidden_samples}], has_weights, has_router_logits, has_exact_weights,
    hidden_samples {mode: "none"|"all"|"random", requested, count, dtype, bytes_per_sample},
    routers (file name or null), source, created_by, profile (the profile's options),
    jsonl_header (imported traces only: the original first line, kept for an exact export).

Each shard (safetensors; its string metadata holds format, version and rows):
    request      int32   [n]        index into meta.requests
    pos          int32   [n]        position in the request
    phase        uint8   [n]        0 = prefill, 1 = decode
    tokens       int32   [n]        token id of the row (profiled traces)
    experts      int16   [n, L, K]  chosen expert ids, -1 = none
    weights      float16 [n, L, K]  their gate weights (when known)
    weights_exact float64 [n, L, K] imported traces only: the weights exactly as the JSONL had them
    router_logits float16 [n, L, E] optional (`profile --router-logits`): raw pre-softmax logits
    hidden.index      int64   [s]       shard-local rows that carry hidden samples
    hidden.moe_inputs float16 [s, L, D] input of every MoE block (after the post-attention norm)
    hidden.prev_final float16 [s, D]    previous token's final hidden state (zeros at a request start)

Shards are written to a temporary name and renamed, then meta.json is replaced: an interrupted run
leaves only complete shards that meta.json lists; files meta.json does not list are ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..core.fingerprint import check_fingerprint
from ..core.paths import writable_dir
from ..core.trace import HiddenSamples, Trace
from ..errors import MoectlError
from .routing_jsonl import read_jsonl, write_jsonl
from .versioned import read_descriptor, require_int, require_list

FORMAT, VERSION = "moectl-trace", 1
META = "meta.json"
ROUTERS = "routers.safetensors"


# --- writing ------------------------------------------------------------------------------------

def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class TraceWriter:
    """Buffers complete requests and writes them as shards of about `shard_rows` rows.

    `meta` holds the trace-level fields (model, family, fingerprint, num_layers, ...). With
    `resume=True` an existing directory is continued: its shards and request table are kept.
    """

    def __init__(self, out_dir: str | Path, meta: dict, shard_rows: int = 4096, resume: bool = False,
                 shard_bytes: int = 256 * 2**20):
        self.dir = Path(out_dir)
        self.shard_rows, self.shard_bytes = shard_rows, shard_bytes      # a shard closes at either limit
        writable_dir(self.dir, "the trace directory")   # proven before an old trace is deleted
        old = self.dir / META
        if resume and old.exists():
            self.meta = read_meta(self.dir)
            for key in ("fingerprint", "num_layers", "num_experts", "top_k", "dataset"):
                if meta.get(key) is not None and self.meta.get(key) != meta.get(key):
                    raise MoectlError(f"--resume: {self.dir} holds a trace with {key}={self.meta.get(key)!r}, "
                                      f"this run has {meta.get(key)!r}; use another output directory")
        else:
            if old.exists() or any(self.dir.glob("shard-*.safetensors")):
                for p in list(self.dir.glob("shard-*.safetensors")) + [old, self.dir / ROUTERS]:
                    p.unlink(missing_ok=True)                  # a fresh run replaces the old trace
            self.meta = {"format": FORMAT, "version": VERSION, **meta, "num_tokens": 0, "num_requests": 0,
                         "requests": [], "samples_done": 0, "shards": []}
            self.meta.setdefault("hidden_samples", {"mode": "none", "count": 0})
            self.meta["hidden_samples"].setdefault("count", 0)
            _atomic_json(old, self.meta)
        self._buf: list[dict] = []

    @property
    def samples_done(self) -> int:
        return int(self.meta["samples_done"]) + len(self._buf)

    def add_request(self, request: str, pos, phase, experts, weights=None, router_logits=None,
                    hidden_index=None, moe_inputs=None, prev_final=None, weights_exact=None,
                    tokens=None) -> None:
        """One complete request: pos/phase [n], experts/weights [n, L, K], router_logits [n, L, E],
        hidden samples at request-local rows hidden_index [s] (moe_inputs [s, L, D], prev_final [s, D])."""
        experts = np.asarray(experts, dtype=np.int16)
        n = experts.shape[0]
        rec = {"request": request, "pos": np.asarray(pos, dtype=np.int32).reshape(n),
               "phase": np.asarray(phase, dtype=np.uint8).reshape(n), "experts": experts}
        if weights is not None:
            rec["weights"] = np.asarray(weights, dtype=np.float16)
        if tokens is not None:
            rec["tokens"] = np.asarray(tokens, dtype=np.int32).reshape(n)
        if weights_exact is not None:
            rec["weights_exact"] = np.asarray(weights_exact, dtype=np.float64)
        if router_logits is not None:
            rec["router_logits"] = np.asarray(router_logits, dtype=np.float16)
        if hidden_index is not None and len(hidden_index):
            rec["hidden.index"] = np.asarray(hidden_index, dtype=np.int64)
            rec["hidden.moe_inputs"] = np.asarray(moe_inputs, dtype=np.float16)
            rec["hidden.prev_final"] = np.asarray(prev_final, dtype=np.float16)
        self._buf.append(rec)
        if (sum(len(r["pos"]) for r in self._buf) >= self.shard_rows
                or sum(v.nbytes for r in self._buf for v in r.values() if isinstance(v, np.ndarray)) >= self.shard_bytes):
            self.flush()

    def flush(self) -> None:
        """Write the buffered requests as one shard, then meta.json (in that order)."""
        if not self._buf:
            return
        from safetensors.numpy import save_file

        # meta is only changed once the shard is on disk: an interrupt in here leaves a consistent trace
        base = len(self.meta["requests"])
        reqs = self.meta["requests"] + [r["request"] for r in self._buf]
        t: dict[str, np.ndarray] = {
            "request": np.concatenate([np.full(len(r["pos"]), base + i, dtype=np.int32)
                                       for i, r in enumerate(self._buf)]),
        }
        for key in ("pos", "phase", "tokens", "experts", "weights", "weights_exact", "router_logits"):
            have = [key in r for r in self._buf]
            if any(have):
                if not all(have):
                    raise MoectlError(f"internal: some requests have {key}, others not")
                t[key] = np.concatenate([r[key] for r in self._buf])
        offsets = np.cumsum([0] + [len(r["pos"]) for r in self._buf])
        hid = [(off, r) for off, r in zip(offsets, self._buf) if "hidden.index" in r]
        if hid:
            t["hidden.index"] = np.concatenate([r["hidden.index"] + off for off, r in hid])
            t["hidden.moe_inputs"] = np.concatenate([r["hidden.moe_inputs"] for _, r in hid])
            t["hidden.prev_final"] = np.concatenate([r["hidden.prev_final"] for _, r in hid])
        rows = int(offsets[-1])
        name = f"shard-{len(self.meta['shards']):05d}.safetensors"
        tmp = self.dir / (name + ".tmp")
        save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, str(tmp),
                  metadata={"format": FORMAT, "version": str(VERSION), "rows": str(rows)})
        os.replace(tmp, self.dir / name)
        s = len(t["hidden.index"]) if hid else 0
        hs = dict(self.meta["hidden_samples"], count=self.meta["hidden_samples"].get("count", 0) + s)
        meta = dict(self.meta, requests=reqs, shards=self.meta["shards"] + [{"file": name, "rows": rows,
                                                                             "hidden_samples": s}],
                    num_tokens=self.meta["num_tokens"] + rows, num_requests=len(reqs),
                    samples_done=self.meta["samples_done"] + len(self._buf), hidden_samples=hs,
                    **{f"has_{k}": k in t for k in ("weights", "router_logits", "weights_exact")})
        self.meta, self._buf = meta, []
        _atomic_json(self.dir / META, self.meta)

    def write_routers(self, routers: dict[int, np.ndarray], biases: dict[int, np.ndarray] | None = None) -> None:
        from safetensors.numpy import save_file

        t = {f"router.{l}.weight": np.ascontiguousarray(w) for l, w in routers.items()}
        t.update({f"router.{l}.bias": np.ascontiguousarray(b) for l, b in (biases or {}).items()})
        save_file(t, str(self.dir / ROUTERS), metadata={"format": FORMAT, "version": str(VERSION)})
        self.meta["routers"] = ROUTERS
        _atomic_json(self.dir / META, self.meta)

    def close(self) -> dict:
        self.flush()
        _atomic_json(self.dir / META, self.meta)
        return self.meta


# --- reading ------------------------------------------------------------------------------------

def read_meta(path: str | Path) -> dict:
    d = Path(path)
    f = d / META
    if not f.exists():
        hint = f"; did you mean {d / 'traces'}?" if (d / "traces" / META).exists() else ""
        raise MoectlError(f"{d} is not a trace directory: {META} is missing (make one with `moectl profile` "
                          f"or `moectl trace import`){hint}")
    meta = read_descriptor(f, FORMAT, what="trace", version_key="version", max_version=VERSION)
    for key in ("num_layers", "num_experts", "top_k"):
        require_int(meta, key, f, minimum=1)
    for key in ("shards", "requests"):
        require_list(meta, key, f)
    return meta


def _load_shard(d: Path, shard: dict) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    p = d / shard["file"]
    if not p.exists():
        raise MoectlError(f"trace shard {p} is missing (meta.json lists it); re-run `moectl profile --resume`")
    try:
        t = load_file(str(p))
    except Exception as e:  # safetensors raises its own error types for truncated headers or data
        raise MoectlError(f"trace shard {p} is truncated or corrupt ({e}); delete the trace and re-profile") from None
    if "experts" not in t or len(t["experts"]) != shard["rows"]:
        got = len(t["experts"]) if "experts" in t else "no"
        raise MoectlError(f"trace shard {p} has {got} rows, meta.json says {shard['rows']}: corrupt trace")
    return t


def read_trace_dir(path: str | Path, expect_fingerprint: str | None = None, hidden: bool = True) -> Trace:
    """Read a trace directory into a `Trace`. With `expect_fingerprint`, a trace profiled on another
    model is an error. `hidden=False` skips hidden samples (they can be large)."""
    d = Path(path)
    meta = read_meta(d)
    if expect_fingerprint is not None:
        check_fingerprint(meta.get("fingerprint"), expect_fingerprint, "trace", d)
    L, E, K = int(meta["num_layers"]), int(meta["num_experts"]), int(meta["top_k"])
    parts: dict[str, list[np.ndarray]] = {}
    offset = 0
    for shard in meta["shards"]:
        t = _load_shard(d, shard)
        if t["experts"].shape[1:] != (L, K):
            raise MoectlError(f"{d / shard['file']}: experts shape {t['experts'].shape}, meta says [*, {L}, {K}]")
        if "hidden.index" in t:
            t["hidden.index"] = t["hidden.index"] + offset
        for k, v in t.items():
            if k == "weights_exact" or (k.startswith("hidden.") and not hidden):
                continue
            parts.setdefault(k, []).append(v)
        offset += shard["rows"]

    def cat(key, shape, dtype):
        return np.concatenate(parts[key]) if key in parts else np.zeros(shape, dtype=dtype)

    experts = cat("experts", (0, L, K), np.int16)
    reqs = meta["requests"]
    request_idx = cat("request", (0,), np.int32)
    samples = None
    if "hidden.index" in parts:
        samples = HiddenSamples(cat("hidden.index", (0,), np.int64), cat("hidden.moe_inputs", (0,), np.float16),
                                cat("hidden.prev_final", (0,), np.float16))
    routers = biases = None
    if meta.get("routers") and (d / meta["routers"]).exists():
        from safetensors.numpy import load_file

        try:
            rt = load_file(str(d / meta["routers"]))
        except Exception as e:
            raise MoectlError(f"{d / meta['routers']} is truncated or corrupt ({e})") from None
        routers = {int(k.split(".")[1]): v for k, v in rt.items() if k.endswith(".weight")}
        biases = {int(k.split(".")[1]): v for k, v in rt.items() if k.endswith(".bias")} or None
    known = {"format", "version", "model", "num_layers", "num_experts", "top_k", "fingerprint",
             "moe_layer_ids", "source", "requests", "shards"}
    return Trace(
        model=str(meta.get("model", d.name)), num_layers=L, num_experts=E, top_k=K,
        request=[reqs[i] for i in request_idx.tolist()],
        pos=cat("pos", (0,), np.int32), phase=cat("phase", (0,), np.uint8), experts=experts,
        weights=cat("weights", (0, L, K), np.float16) if "weights" in parts else None,
        fingerprint=meta.get("fingerprint"), moe_layer_ids=list(meta.get("moe_layer_ids") or range(L)),
        hidden=samples, routers=routers, router_bias=biases, source=str(meta.get("source", "")),
        extra={k: v for k, v in meta.items() if k not in known},
        router_logits=cat("router_logits", (0, L, E), np.float16) if "router_logits" in parts else None,
        tokens=cat("tokens", (0,), np.int32) if "tokens" in parts else None,
    )


def read_exact_weights(path: str | Path) -> np.ndarray | None:
    """[N, L, K] float64 weights as an imported JSONL had them, or None."""
    d = Path(path)
    meta = read_meta(d)
    if not meta.get("has_weights_exact"):
        return None
    return np.concatenate([_load_shard(d, s)["weights_exact"] for s in meta["shards"]])


# --- JSONL import / export ----------------------------------------------------------------------

def require_new_dir(out_dir: str | Path) -> Path:
    """`--out DIR` of a command that writes a whole trace: absent or empty, so two traces' files never mix (as
    make-synthetic refuses a non-empty directory). `profile --resume` continues its own trace instead."""
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "exists and is not empty"
        raise MoectlError(f"{out} {what}; give a new directory to --out (or delete that one)")
    return out


def import_jsonl(src: str | Path, out_dir: str | Path, model_name: str | None = None,
                 shard_rows: int = 65536, check=None) -> dict:
    """moe-routing-v1 JSONL -> trace directory, keeping what an exact export needs. `check(trace)`
    may raise before anything is written."""
    src, out_dir = Path(src), require_new_dir(out_dir)
    if not src.is_file():
        raise MoectlError(f"{src} is not a file; expected a moe-routing-v1 JSONL trace")
    trace = read_jsonl(src)
    if check is not None:
        check(trace)
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()]
    header = json.loads(lines[0])
    exact = None
    if trace.weights is not None:                 # fp16 loses digits; keep the parsed float64 values too
        exact = np.zeros(trace.experts.shape, dtype=np.float64)
        for i, line in enumerate(lines[1:]):
            for l, ws in enumerate(json.loads(line)["weights"]):
                exact[i, l, :len(ws)] = ws
    meta = {"model": model_name or trace.model, "family": None, "fingerprint": None, "dataset": str(src),
            "num_layers": trace.num_layers, "moe_layer_ids": list(range(trace.num_layers)),
            "num_experts": trace.num_experts, "top_k": trace.top_k, "hidden_size": None,
            "source": trace.source, "created_by": "moectl trace import", "jsonl_header": header,
            "routers": None}
    w = TraceWriter(out_dir, meta, shard_rows=shard_rows)
    for req, rows in trace.request_slices():
        w.add_request(req, trace.pos[rows], trace.phase[rows], trace.experts[rows],
                      None if trace.weights is None else trace.weights[rows],
                      weights_exact=None if exact is None else exact[rows])
    return w.close()


def export_jsonl(trace_dir: str | Path, out: str | Path) -> Path:
    """Trace directory -> moe-routing-v1 JSONL (byte-identical to the original for imported traces)."""
    trace = read_trace_dir(trace_dir, hidden=False)
    header = trace.extra.get("jsonl_header")
    return write_jsonl(trace, out, header=header, exact_weights=read_exact_weights(trace_dir))


__all__ = ["FORMAT", "VERSION", "TraceWriter", "read_meta", "read_trace_dir", "read_exact_weights",
           "require_new_dir", "import_jsonl", "export_jsonl"]


def load_trace(path: str | Path) -> Trace:
    """Load a trace directory or a moe-routing-v1 JSONL file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise MoectlError(f"trace {p} does not exist")
    if p.is_dir() or p.suffix == ".safetensors":
        return read_trace_dir(p if p.is_dir() else p.parent)
    return read_jsonl(p)
