"""A generation's torch-free parts, shared by the two engines (`engine.py: Engine`, `graph_engine.py: GraphEngine`):
the result, the sink the tokens stream into (EOS, stop, a budget), the loop (`generate_tokens`: prefill, first pick,
one forward a token) and the run's figures from the cache's counters (`generation_stats`), the prompt's checks and
the chat template's ids (`prompt_ids`: a prompt as `generate` takes it).

Legend: T = tokens, V = vocabulary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import MoectlError
from ..store.memory import rss_bytes

PREFILL_PROGRESS_AFTER_S = 1.0   # a multi-token forward shows a progress bar once it has run this long


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]                    # generated ids only
    prompt_ids: list[int]
    stats: dict = field(default_factory=dict)
    per_token: list[dict] = field(default_factory=list)   # cache hits/misses/bytes of each forward step (--draft:
    #                                                       of each verification pass, with k, accepted, tokens)


class PrefillProgress:
    """A per-MoE-layer bar for a multi-token forward, shown once it has taken PREFILL_PROGRESS_AFTER_S: `start` as
    a forward begins, `layer(l, tokens)` as each MoE layer routes (the layers' `Runtime.on_layer`), `close` after."""

    def __init__(self, layers: int):
        self.layers, self.bar, self.t0 = layers, None, 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def layer(self, layer: int, tokens: int) -> None:
        if tokens < 2:
            return
        if self.bar is None:
            if time.perf_counter() - self.t0 < PREFILL_PROGRESS_AFTER_S:
                return
            from ..progress import ProgressBar

            bar = ProgressBar(True).__enter__()          # stays: a long prefill is worth a line
            self.bar = bar, bar.add(f"prefill ({tokens} tokens), MoE layers", total=self.layers)
        bar, task = self.bar
        bar.update(task, completed=layer + 1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar[0].__exit__(None, None, None)
            self.bar = None


class TokenSink:
    """The tokens a generation emits: streamed to `on_token(id, text_piece)`, done at EOS, at `should_stop()` or at
    `max_new` tokens."""

    def __init__(self, tokenizer, max_new: int, eos: set[int], on_token=None, should_stop=None):
        self.tokenizer, self.max_new, self.eos = tokenizer, max_new, eos
        self.on_token, self.should_stop = on_token, should_stop
        self.tokens: list[int] = []
        self.text = ""
        self.done = False

    @classmethod
    def for_generate(cls, config, tokenizer, max_new: int, stop_at_eos: bool, on_token=None,
                     should_stop=None) -> "TokenSink":
        """One `generate` call's sink, both engines': done at the config's and the tokenizer's EOS ids (none when
        not `stop_at_eos`)."""
        return cls(tokenizer, max_new, eos_ids(config, tokenizer) if stop_at_eos else set(), on_token, should_stop)

    @property
    def room(self) -> int:
        return self.max_new - len(self.tokens)

    def emit(self, tok: int) -> bool:
        """Add a token; True when generation is over."""
        self.tokens.append(tok)
        if self.on_token is not None:
            piece = ""
            if self.tokenizer is not None:
                full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
                piece, self.text = full[len(self.text):], full
            self.on_token(tok, piece)
        self.done = (tok in self.eos or (self.should_stop is not None and self.should_stop())
                     or len(self.tokens) >= self.max_new)
        return self.done


def step_delta(mark: dict, now: dict) -> dict:
    return {k: now[k] - mark[k] for k in ("hits", "misses", "bytes_loaded", "prefetches")}


def run_stats(before: dict, after: dict, tokens: int, elapsed: float) -> dict:
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    loaded = after["bytes_loaded"] - before["bytes_loaded"]
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "bytes_loaded": loaded, "bytes_per_token": loaded / tokens if tokens else 0.0,
            "load_wait_s": after["load_wait_s"] - before["load_wait_s"],   # every wait for a copy or read
            "prefetches": after["prefetches"] - before["prefetches"],
            **{k: after[k] - before[k] for k in ("low_misses", "full_misses", "skips", "fills") if k in after}}


@dataclass
class GenerationRun:
    """What `generate_tokens` hands back: the KV cache, each forward's counters and ms, and the run's times."""
    kv: Any
    per_token: list[dict]
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    ttft_s: float
    decode_s: float                 # after the first token
    elapsed_s: float
    decoder_figures: Any = None     # what a decoder of its own returned beside the KV cache (Engine's draft run)


def generate_tokens(ids: list[int], out: TokenSink, forward: Callable, pick: Callable,
                    counters: Callable[[], dict], decoder: Callable | None = None) -> GenerationRun:
    """Prefill `ids`, pick the first token, then one forward a token until `out` says stop; each forward's counters
    (`step_delta` of `counters()`) and ms in `per_token`. `forward(ids, kv, last_only=...)` -> (logits [1, T, V],
    kv); `pick(logits [V])` -> the next id. `decoder(kv)` -> (kv, its own figures): a decode of its own after the
    first token (Engine's speculative one), in place of one forward a token."""
    t0 = time.perf_counter()
    mark = counters()
    logits, kv = forward(ids, None, last_only=True)                        # the prompt's prefill
    t_prefill = time.perf_counter() - t0
    per_token = [step_delta(mark, counters())]
    out.emit(pick(logits[0, -1]))
    ttft = time.perf_counter() - t0
    per_token[0]["ms"] = ttft * 1000
    t1, decoder_figures = time.perf_counter(), None
    if decoder is not None and not out.done:
        kv, decoder_figures = decoder(kv)
    while not out.done:
        mark, t = counters(), time.perf_counter()
        logits, kv = forward([out.tokens[-1]], kv)
        per_token.append(step_delta(mark, counters()))
        nxt = pick(logits[0, -1])
        per_token[-1]["ms"] = (time.perf_counter() - t) * 1000               # the pick's time included
        out.emit(nxt)
    decode_s, elapsed = time.perf_counter() - t1, time.perf_counter() - t0
    return GenerationRun(kv, per_token, len(ids), len(out.tokens), t_prefill, ttft, decode_s, elapsed,
                         decoder_figures)


def generation_stats(run: GenerationRun, before: dict, after: dict, layers: int, expert_calls: int,
                     cpu_experts: int, threads: int, memory: dict) -> dict:
    """A generation's figures (`--json`'s "stats"): `run_stats` of the counters `before` and `after` it, its times,
    host memory, experts a token and layer (`expert_calls` over the `layers` MoE layers each token ran), the CPU's
    experts, threads and `memory` (the engine's device accounting)."""
    new = run.new_tokens
    computed = (run.prompt_tokens + new - 1) * layers                       # tokens x layers run
    rss, peak = rss_bytes()
    return run_stats(before, after, new, run.elapsed_s) | {
        "prefill_ms": run.prefill_s * 1000, "ttft_ms": run.ttft_s * 1000,
        "decode_ms_per_token": 1000 * run.decode_s / (new - 1) if new > 1 else 0.0,
        "host_rss_gb": rss / 1e9, "host_peak_rss_gb": peak / 1e9,
        "experts_per_token": expert_calls / max(computed, 1),
        "cpu_experts": cpu_experts, "threads": threads,
        "prefill_tokens_per_s": run.prompt_tokens / run.prefill_s if run.prefill_s else 0.0,
        **memory}


def eos_ids(config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids


def check_text(text: str, what: str) -> str:
    """`text` when it is text a tokenizer takes; else one clear error. Python reads bytes that are not UTF-8 (from a
    pipe, a file, argv) as lone surrogates (surrogateescape), which the tokenizers reject with a TypeError."""
    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            raise MoectlError(f"{what} is not UTF-8 text: byte 0x{ord(ch) - 0xdc00:02x} at character {i + 1}; "
                              "convert it to UTF-8 first")
    return text


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the model's chat template, or a plain fallback."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(i) for i in out]
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return tokenizer(text)["input_ids"]


def prompt_ids(prompt: str | None, input_ids, chat: bool, tokenizer: Callable[[], Any]) -> list[int]:
    """`generate`'s prompt as token ids: `input_ids` (a list, an array or a tensor, any shape) as given, else
    `prompt` encoded (with the chat template when `chat`), `tokenizer()` asked for only then (Engine loads it on
    first need). One clear error for no prompt, a prompt that is not UTF-8 text, or one that encodes to no tokens."""
    if input_ids is None:
        if prompt is None:
            raise MoectlError("generate needs a prompt or input_ids")
        check_text(prompt, "the prompt")
        tok = tokenizer()
        input_ids = (chat_ids(tok, [{"role": "user", "content": prompt}]) if chat
                     else tok(prompt, add_special_tokens=True)["input_ids"])
    flat = input_ids if hasattr(input_ids, "reshape") else np.asarray(input_ids)   # a tensor as it is (any device)
    ids = [int(i) for i in flat.reshape(-1).tolist()]
    if not ids:
        raise MoectlError("the prompt encodes to no tokens")
    return ids
