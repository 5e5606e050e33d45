"""`moectl profile`: record what the router does on a calibration set, on the offloading runtime.

Legend: T = tokens of one forward, L = MoE layers, K = top-k, E = experts, D = hidden size.

For each calibration text: one teacher-forced forward over its tokens (phase prefill), then, with
`generate=K`, K greedy decode steps with the KV cache (phase decode). A `TraceRecorder` attached to
the engine (`eng.add_observer`) turns every forward's routing events into trace rows; a complete
request goes to the `TraceWriter`, which writes shards as it goes (see `artifacts/trace_dir.py` for the format).
Nothing about a request reaches disk before the request is complete, so an interrupted run leaves
valid shards and `--resume` continues with the next text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..artifacts.trace_dir import TraceWriter
from ..errors import MoectlError


def hidden_sample_bytes(num_layers: int, hidden_size: int) -> int:
    """fp16 bytes of one hidden sample: the MoE-block input of every layer + the previous final hidden."""
    return 2 * hidden_size * (num_layers + 1)


def choose_hidden_rows(lengths: list[int], mode: str | int | None, seed: int = 0) -> list[set[int]]:
    """Request-local rows that get hidden samples, per request. `mode`: None/0 (none), "all", or N
    (N rows drawn uniformly without replacement over all rows, reproducibly so --resume draws the same)."""
    if not mode:
        return [set() for _ in lengths]
    if mode == "all":
        return [set(range(n)) for n in lengths]
    total = sum(lengths)
    pick = np.sort(np.random.default_rng(seed).choice(total, size=min(int(mode), total), replace=False))
    starts = np.cumsum([0] + lengths)
    out: list[set[int]] = [set() for _ in lengths]
    for g in pick.tolist():
        r = int(np.searchsorted(starts, g, side="right") - 1)
        out[r].add(g - int(starts[r]))
    return out


@dataclass
class _Request:
    experts: list[np.ndarray] = field(default_factory=list)       # per forward [T, L, K]
    weights: list[np.ndarray] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)        # per forward [T, L, E]
    hidden_rows: list[int] = field(default_factory=list)
    moe_inputs: list[np.ndarray] = field(default_factory=list)    # per sample [L, D]
    prev_final: list[np.ndarray] = field(default_factory=list)    # per sample [D]
    rows: int = 0


class TraceRecorder:
    """Engine observer: on_route per MoE layer, on_final_hidden once per forward (closes the forward).

    `routers` (MoE layer -> (weight [E, D], bias [E] | None), torch tensors) enables raw router logits,
    recomputed from the block input exactly as the router does (F.linear)."""

    def __init__(self, num_layers: int, top_k: int, routers: dict | None = None):
        self.L, self.K = num_layers, top_k
        self.routers = routers
        self.req: _Request | None = None
        self._fwd: dict[int, tuple] = {}
        self.hidden_wanted: set[int] = set()
        self.last_final = None          # final hidden [D] of the previous token of this request

    def start_request(self, hidden_rows: set[int] | None = None) -> None:
        self.req, self._fwd, self.last_final = _Request(), {}, None
        self.hidden_wanted = set(hidden_rows or ())

    # --- observer contract -----------------------------------------------------------------
    def on_route(self, layer, top_k_index, top_k_weights, hidden) -> None:
        if self.req is None:
            return
        idx = top_k_index.detach().to("cpu")                               # [T, K]
        w = top_k_weights.detach().float().to("cpu")                       # [T, K]
        logits = None
        if self.routers is not None:
            import torch.nn.functional as F

            W, b = self.routers[layer]
            logits = F.linear(hidden.detach().to(W.dtype), W, b).float().cpu()   # [T, E]
        rows = range(self.req.rows, self.req.rows + idx.shape[0])
        want = [r - self.req.rows for r in rows if r in self.hidden_wanted]
        h = hidden.detach()[want].float().cpu() if want else None         # [s, D]
        self._fwd[layer] = (idx, w, logits, h)

    def on_final_hidden(self, hidden) -> None:
        if self.req is None or not self._fwd:
            return
        if len(self._fwd) != self.L:
            raise MoectlError(f"recorder saw {len(self._fwd)} MoE layers in one forward, expected {self.L}")
        T = self._fwd[0][0].shape[0]
        ex = np.full((T, self.L, self.K), -1, dtype=np.int16)               # [T, L, K]
        wt = np.zeros((T, self.L, self.K), dtype=np.float16)
        for l, (idx, w, _, _) in self._fwd.items():
            k = idx.shape[1]                                                # adaptive top-k may give fewer
            ex[:, l, :k] = idx.numpy()
            wt[:, l, :k] = w.numpy()
        self.req.experts.append(ex)
        self.req.weights.append(wt)
        if self.routers is not None:
            self.req.logits.append(np.stack([self._fwd[l][2].numpy() for l in range(self.L)], axis=1))
        final = hidden.detach().float().cpu()                               # [T, D]
        want = sorted(r for r in range(self.req.rows, self.req.rows + T) if r in self.hidden_wanted)
        if want:
            moe_in = np.stack([self._fwd[l][3].numpy() for l in range(self.L)], axis=1)   # [s, L, D]
            for j, r in enumerate(want):
                t = r - self.req.rows
                if t > 0:
                    prev = final[t - 1].numpy()
                elif self.last_final is not None:
                    prev = self.last_final
                else:
                    prev = np.zeros(final.shape[-1], dtype=np.float32)      # a request's first token
                self.req.hidden_rows.append(r)
                self.req.moe_inputs.append(moe_in[j])
                self.req.prev_final.append(prev)
        self.last_final = final[-1].numpy()
        self.req.rows += T
        self._fwd = {}

    def finish_request(self) -> _Request:
        req, self.req = self.req, None
        return req


def router_weights(eng) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """MoE layer -> router weight [E, D] (and bias [E]) from the engine's model, for routers.safetensors."""
    weights, biases = {}, {}
    for l, (_, block) in enumerate(eng.adapter.moe_blocks(eng.model)):
        r = eng.adapter.router(block)
        weights[l] = r.weight
        if getattr(r, "bias", None) is not None:
            biases[l] = r.bias
    return weights, biases


def _np32(t, big: bool) -> np.ndarray:
    import torch

    return t.detach().to("cpu", torch.float16 if big else torch.float32).numpy()


@dataclass
class ProfileResult:
    out: str
    samples: int = 0
    skipped: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    hidden_samples: int = 0
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def run_profile(eng, texts: list[str], out_dir, *, model_name: str, dataset: str, max_tokens: int = 512,
                generate: int = 0, hidden_samples: str | int | None = None, router_logits: bool = False,
                resume: bool = False, shard_rows: int = 4096, seed: int = 0, progress=None,
                on_plan=None) -> ProfileResult:
    """Profile `texts` on `eng` into `out_dir`. `progress(tokens_done, tokens_total)` is called after
    each forward; `on_plan(info)` once before the first forward (hidden-sample sizes)."""
    import torch

    tok = eng.tokenizer
    seqs = []
    for t in texts:
        ids = tok(t, add_special_tokens=True)["input_ids"][:max_tokens]
        if len(ids) >= 1:
            seqs.append(ids)
    if not seqs:
        raise MoectlError("no calibration text produced any token")
    lengths = [len(s) + generate for s in seqs]
    mode = hidden_samples if hidden_samples in (None, "all") else int(hidden_samples)
    if mode is not None and mode != "all" and mode < 0:
        raise MoectlError("--hidden-samples must be a count >= 0 or 'all'")
    wanted = choose_hidden_rows(lengths, mode, seed)
    blocks = eng.adapter.moe_blocks(eng.model)
    L, K, E = len(blocks), eng.adapter.top_k, eng.adapter.num_experts
    D = int(eng.config.hidden_size)
    per_sample = hidden_sample_bytes(L, D)
    n_hidden = sum(len(w) for w in wanted)
    info = {"samples": len(seqs), "tokens_planned": sum(lengths), "hidden_samples": n_hidden,
            "hidden_bytes_per_sample": per_sample, "hidden_bytes": n_hidden * per_sample,
            "router_logits_bytes": sum(lengths) * L * E * 2 if router_logits else 0}
    if on_plan is not None:
        on_plan(info)

    rw, rb = router_weights(eng)
    big = sum(w.numel() for w in rw.values()) > 64 * 2**20          # > 256 MB in fp32: keep fp16
    meta = {"model": model_name, "family": eng.adapter.family, "fingerprint": eng.fingerprint,
            "dataset": dataset, "num_layers": L, "moe_layer_ids": [i for i, _ in blocks],
            "num_experts": E, "top_k": K, "hidden_size": D, "source": f"moectl profile ({dataset})",
            "created_by": "moectl profile", "routers": None,
            "hidden_samples": {"mode": "none" if not mode else ("all" if mode == "all" else "random"),
                               "requested": mode or 0, "dtype": "float16", "bytes_per_sample": per_sample},
            "profile": {"max_tokens": max_tokens, "generate": generate, "hidden_samples": mode or 0,
                        "router_logits": router_logits, "seed": seed}}
    writer = TraceWriter(out_dir, meta, shard_rows=shard_rows, resume=resume)
    if not writer.meta.get("routers"):
        writer.write_routers({l: _np32(w, big) for l, w in rw.items()}, {l: _np32(b, big) for l, b in rb.items()})
    start = writer.samples_done
    result = ProfileResult(out=str(out_dir), skipped=start)
    rec = TraceRecorder(L, K, routers={l: (rw[l], rb.get(l)) for l in rw} if router_logits else None)
    eos = _eos_ids(eng.config, tok)
    total = sum(lengths[start:])
    t0 = time.perf_counter()
    done = 0                                 # tokens run, for the progress bar (a dropped sample included)
    eng.add_observer(rec)
    try:
        with torch.no_grad():
            for i in range(start, len(seqs)):
                ids = seqs[i]
                rec.start_request(wanted[i])
                eng.begin_request(f"sample-{i:06d}")
                logits, past = eng.forward(torch.tensor([ids], dtype=torch.long))
                done += len(ids)
                tokens, phases = list(ids), [0] * len(ids)
                for _ in range(generate):
                    if progress is not None:
                        progress(done, total)
                    nxt = int(logits[0, -1].argmax())
                    if nxt in eos:
                        break
                    logits, past = eng.forward(torch.tensor([[nxt]], dtype=torch.long), past_key_values=past)
                    tokens.append(nxt)
                    phases.append(1)
                    done += 1
                req = rec.finish_request()
                _write_request(writer, f"sample-{i:06d}", req, tokens, phases)
                result.samples += 1
                result.tokens += len(tokens)
                result.prefill_tokens += len(ids)
                result.decode_tokens += len(tokens) - len(ids)
                result.hidden_samples += len(req.hidden_rows)
                if progress is not None:
                    progress(done, total)
    except KeyboardInterrupt:
        result.interrupted = True
        rec.finish_request()                 # the sample in flight is dropped; finished ones are written
    finally:
        eng.remove_observer(rec)
        writer.close()
        result.seconds = time.perf_counter() - t0
    return result


def _eos_ids(config, tok) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None), getattr(tok, "eos_token_id", None)):
        ids.update([src] if isinstance(src, int) else [int(i) for i in (src or [])])
    return ids


def _write_request(writer: TraceWriter, name: str, req: _Request, tokens: list[int], phases: list[int]) -> None:
    n = req.rows
    if n != len(tokens):
        raise MoectlError(f"recorder saw {n} tokens for {name}, the loop ran {len(tokens)}: is the observer "
                          f"attached to every forward?")
    experts = np.concatenate(req.experts)                                   # [n, L, K]
    hidden = {}
    if req.hidden_rows:
        hidden = {"hidden_index": np.array(req.hidden_rows), "moe_inputs": np.stack(req.moe_inputs),
                  "prev_final": np.stack(req.prev_final)}
    writer.add_request(name, np.arange(n), phases, experts, np.concatenate(req.weights),
                       router_logits=np.concatenate(req.logits) if req.logits else None, tokens=tokens, **hidden)
