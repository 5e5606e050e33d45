"""The fidelity yardstick (`moectl eval`): what a lossy runtime option costs, on held-out text.

Legend: W = window length (tokens), V = vocabulary, L = MoE layers.

- Perplexity: teacher-forced next-token loss over fixed windows of the held-out text. Every token is
  computed as decode would compute it: a gating policy applies to every row (`gate_prefill`), because in
  a decode every token is a one-token step.
- Greedy agreement: from held-out prompts, the lossless runtime greedily generates N tokens; the lossy one
  is fed the same tokens one decode step at a time (its prompt is a prefill, as in a real run) and we count
  how often its next-token argmax equals the lossless token. Feeding the lossless tokens keeps one early
  difference from counting as N.
- `decode=True` (`moectl eval --decode-steps`) scores each window one decode step at a time instead (its first
  token a one-token prompt, then one token per forward with the KV cache): what depends on a token's own decode
  step -- HOBBIT's full / low-bit / skip choice on a miss, made per token, and the misses themselves -- applies as
  in a real decode (a teacher-forced window is one prefill step, where a missed expert loads the best copy any of
  its tokens asks for).
- The lossless side (same engine, gating off) is computed once and kept in `<workdir>/eval/`, keyed by the
  model fingerprint, the shards' names, sizes and mtimes (retrained weights under the same config), the dtype,
  the exact token ids and the settings: another model, other weights or other text is a different key.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import MoectlError

REFERENCE_FORMAT = "moectl-eval-reference"
REFERENCE_VERSION = 1


def token_windows(tokenizer, texts: list[str], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """The texts' tokens, joined with EOS, cut into windows of `window` tokens (the ragged tail dropped)."""
    if window < 2:
        raise MoectlError(f"--window must be >= 2 tokens, not {window}")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens] if max_tokens is not None else ids
    if len(ids) < window:
        raise MoectlError(f"the dataset gives {len(ids)} tokens, fewer than one window of {window}; "
                          f"use more text, a larger --max-tokens or a smaller --window")
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def llamacpp_windows(tokenizer, texts: list[str], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """`llama-perplexity -c WINDOW -b WINDOW`'s chunks: the texts as one file (joined by newlines) tokenized as one
    text with the tokenizer's special tokens (a BOS first when it adds one), cut into WINDOW-token chunks (tail
    dropped), each chunk's first token replaced by BOS when the tokenizer adds one. Scored with `score_from =
    WINDOW // 2`: only the second half of each chunk, as llama-perplexity scores."""
    ids = tokenizer("\n".join(texts), add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id if ids and ids[0] == tokenizer.bos_token_id else None
    n = len(ids) // window if max_tokens is None else min(len(ids), max_tokens) // window
    if n < 1:
        raise MoectlError(f"the dataset gives {len(ids)} tokens, fewer than one window of {window}")
    return [([bos] if bos is not None else ids[i * window:i * window + 1]) + ids[i * window + 1:(i + 1) * window]
            for i in range(n)]


@contextmanager
def precision_as(eng, policy):
    """The engine's cache with another precision policy for a while (None: full precision only -- the lossless
    side of a comparison)."""
    from ..policies.precision import PrecisionPolicy

    cache = eng.cache
    old = cache.precision
    cache.precision = policy or PrecisionPolicy()
    try:
        yield
    finally:
        cache.precision = old


@contextmanager
def gating_as(eng, gating, gate_all: bool):
    """Run `eng` with another gating policy for a while (the lossless side uses None)."""
    rt = eng.runtime
    old = rt.gating, rt.gate_prefill
    rt.gating, rt.gate_prefill = gating, gate_all and gating is not None
    try:
        yield
    finally:
        rt.gating, rt.gate_prefill = old


class _SingleExpertRows:
    """Runtime observer: routed rows, and those left with a single expert (after gating)."""

    def __init__(self):
        self.rows = self.single = 0

    def on_route(self, layer, top_k_index, top_k_weights, hidden) -> None:
        self.rows += top_k_index.shape[0]
        self.single += int(((top_k_index >= 0).sum(-1) == 1).sum())

    def graph_forward(self, last_ids: np.ndarray) -> None:
        """The same counts from the one-graph forward's routed experts [L, T, U] (-1: a row not routed)."""
        n = (last_ids >= 0).sum(-1)                                                         # [L, T]
        self.rows += int((n > 0).sum())
        self.single += int((n == 1).sum())


def _window_logits(eng, ids: list[int], decode: bool) -> torch.Tensor:
    """Next-token logits [W-1,V] of one window: one teacher-forced prefill step, or (`decode`) one decode step
    per token after a one-token prompt."""
    if not decode and getattr(eng, "graph", None) is not None:     # one ggml graph (runtime/ggml_model.py): every row
        return eng.forward(torch.tensor([ids]))[0][0, :-1].float()             # [W-1,V]
    if not decode:
        x = torch.tensor([ids], device=eng.device)                              # [1,W]
        eng.cache.begin_step("prefill")
        logits = eng.model(input_ids=x, use_cache=False).logits[0, :-1].float()   # [W-1,V]
        eng.cache.end_token()
        return logits
    out, pkv = [], None
    for tok in ids[:-1]:
        logits, pkv = eng.forward(torch.tensor([[tok]]), pkv)                  # [1,1,V]
        out.append(logits[0, -1].float())
    return torch.stack(out)


@torch.inference_mode()
def window_nll(eng, windows: list[list[int]], progress=None, decode: bool = False, score_from: int = 0) -> dict:
    """Summed next-token NLL over the windows, with the tokens scored, experts computed and bytes loaded.
    `score_from`: the next tokens predicted from positions >= it only (llama-perplexity's second half)."""
    rt, cache = eng.runtime, eng.cache
    calls0, bytes0 = rt.expert_calls, cache.stats.as_dict()["bytes_loaded"]
    nll, scored, computed, per_window = 0.0, 0, 0, []
    rows = _SingleExpertRows()
    # the one-graph forward says what it routed (an observer would send the run to the module path)
    graph = getattr(eng, "graph", None)
    if graph is None:
        eng.add_observer(rows)
    try:
        for ids in windows:
            logits = _window_logits(eng, ids, decode)[score_from:]           # [W-1-s,V]
            if graph is not None and not decode:
                rows.graph_forward(graph.last_ids)
            target = torch.tensor(ids[1 + score_from:], device=logits.device)
            per_window.append(float(F.cross_entropy(logits, target, reduction="sum")))
            nll += per_window[-1]
            scored += len(ids) - 1 - score_from
            computed += len(ids)
            if progress is not None:
                progress()
    finally:
        eng.remove_observer(rows)
    L = len(eng.moe_layer_ids)
    return {"nll": nll, "scored": scored, "tokens": computed, "per_window": per_window,
            "experts_per_token": (rt.expert_calls - calls0) / (computed * L),
            "single_expert_fraction": rows.single / max(rows.rows, 1),
            "bytes_per_token": (cache.stats.as_dict()["bytes_loaded"] - bytes0) / computed}


@torch.inference_mode()
def greedy_continuations(eng, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The engine's greedy continuation of each prompt, n tokens (no EOS stop: the lengths stay comparable)."""
    return [eng.generate(input_ids=p, max_new_tokens=n, greedy=True, stop_at_eos=False).token_ids for p in prompts]


@torch.inference_mode()
def agreement(eng, prompts: list[list[int]], continuations: list[list[int]]) -> tuple[int, int]:
    """(matches, steps): the engine's next-token argmax against each given continuation, fed one decode step
    at a time after a prefill of the prompt."""
    same = total = 0
    for prompt, cont in zip(prompts, continuations):
        logits, pkv = eng.forward(torch.tensor([prompt]))
        for tok in cont:
            same += int(int(logits[0, -1].argmax()) == tok)
            total += 1
            logits, pkv = eng.forward(torch.tensor([[tok]]), pkv)
    return same, total


def weights_id(checkpoint: Path) -> list:
    """Which weights these are, cheaply: each shard's name, size and modification time. The fingerprint hashes
    the config only, so a model retrained with the same config (or a re-downloaded checkpoint) keeps it."""
    files = [Path(checkpoint)] if Path(checkpoint).is_file() else sorted(Path(checkpoint).glob("*.safetensors"))
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]         # a GGUF: the file itself


def reference_key(fingerprint: str, weights: list, dtype, windows, prompts, n: int, decode: bool = False,
                  score_from: int = 0) -> str:
    h = hashlib.sha256(json.dumps({"fp": fingerprint, "weights": weights, "dtype": str(dtype), "windows": windows,
                                   "prompts": prompts, "n": n} | ({"decode": True} if decode else {})
                                  | ({"score_from": score_from} if score_from else {})).encode()
                       ).hexdigest()
    return h[:16]


def lossless_reference(eng, windows, prompts, n: int, workdir: Path | None, progress=None,
                       decode: bool = False, score_from: int = 0) -> dict:
    """The lossless perplexity and greedy continuations, from `<workdir>/eval/` when computed before."""
    key = reference_key(eng.fingerprint, weights_id(eng.ref.path), eng.dtype, windows, prompts, n, decode, score_from)
    path = Path(workdir) / "eval" / f"reference-{key}.json" if workdir is not None else None
    if path is not None and path.exists():
        try:
            ref = json.loads(path.read_text())
        except json.JSONDecodeError:
            ref = {}
        if ref.get("format") == REFERENCE_FORMAT and ref.get("format_version") == REFERENCE_VERSION \
                and ref.get("fingerprint") == eng.fingerprint and ref.get("key") == key:
            return ref | {"cached": True}
    with gating_as(eng, None, False), precision_as(eng, None):
        nll = window_nll(eng, windows, progress, decode, score_from)
        conts = greedy_continuations(eng, prompts, n)
    ref = {"format": REFERENCE_FORMAT, "format_version": REFERENCE_VERSION, "fingerprint": eng.fingerprint,
           "key": key, "nll": nll["nll"], "scored": nll["scored"], "per_window": nll["per_window"],
           "continuations": conts}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(ref))
            tmp.replace(path)
        except OSError:                 # a read-only workdir: computed again next time, nothing lost
            pass
    return ref | {"cached": False}


def paired_2se(per_window: list[float], base: list[float] | None, scored: int) -> float | None:
    """Twice the standard error of a perplexity delta (relative, ~ the NLL/token difference) from the paired
    per-window differences: the sampling noise of the held-out text. None without a per-window baseline."""
    if not base or len(base) != len(per_window) or len(base) < 2:
        return None
    return 2 * statistics.stdev(a - b for a, b in zip(per_window, base)) * math.sqrt(len(base)) / scored


def evaluate(eng, windows: list[list[int]], prompts: list[list[int]], n: int, workdir: Path | None,
             progress=None, decode: bool = False, score_from: int = 0) -> dict:
    """Perplexity with the engine's gating (every token gated as in decode) vs lossless, greedy agreement,
    experts computed and bytes loaded per token (`decode`: every window scored one decode step at a time)."""
    ref = lossless_reference(eng, windows, prompts, n, workdir, progress, decode, score_from)
    gating = eng.runtime.gating
    with gating_as(eng, gating, True):
        stats = window_nll(eng, windows, progress, decode, score_from)
    with gating_as(eng, gating, False):
        same, total = agreement(eng, prompts, ref["continuations"])
    ppl, ppl0 = math.exp(stats["nll"] / stats["scored"]), math.exp(ref["nll"] / ref["scored"])
    return {"ppl": ppl, "ppl_lossless": ppl0, "ppl_delta_rel": ppl / ppl0 - 1.0,
            "ppl_delta_2se": paired_2se(stats["per_window"], ref.get("per_window"), stats["scored"]),
            "greedy_agreement": same / total if total else 1.0,
            "experts_per_token": stats["experts_per_token"], "bytes_per_token": stats["bytes_per_token"],
            "single_expert_fraction": stats["single_expert_fraction"],
            "tokens": stats["scored"], "greedy_tokens": total, "scored_as": "decode steps" if decode else "prefill",
            "gating": gating.describe() if gating is not None else "gating: off",
            "reference_cached": ref["cached"]}
