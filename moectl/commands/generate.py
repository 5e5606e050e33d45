"""`moectl generate`: one completion through the offloading runtime."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ._common import (CacheOpts, GatingOpts, PrecisionOpts, prepare_model, print_plan_note,
                      print_stats_line)


def generate(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name (e.g. tiny, mixtral) or checkpoint directory."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", min=1, help="Tokens to generate."),
    greedy: bool = typer.Option(False, "--greedy", help="Greedy decoding (default: sampling)."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0),
    seed: Optional[int] = typer.Option(0, "--seed", help="Sampling seed."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    cache_experts: Optional[int] = CacheOpts.cache_experts(),
    budget: Optional[str] = CacheOpts.budget(),
    device: str = CacheOpts.device(),
    emulate_device: bool = CacheOpts.emulate_device(),
    offload: str = CacheOpts.offload(),
    replacement: Optional[str] = CacheOpts.replacement(),
    no_plan: bool = CacheOpts.no_plan(),
    prefetch: str = CacheOpts.prefetch(),
    admission: str = CacheOpts.admission(),
    staging_buffers: int = CacheOpts.staging_buffers(),
    predictor: Optional[str] = CacheOpts.predictor(),
    workdir: Optional[str] = CacheOpts.workdir(),
    dtype: Optional[str] = CacheOpts.dtype(),
    threads: Optional[int] = CacheOpts.threads(),
    cpu_experts: str = CacheOpts.cpu_experts(),
    prefill: str = CacheOpts.prefill(),
    replay_trace: Optional[str] = CacheOpts.replay_trace(),
    gating_threshold: Optional[float] = GatingOpts.threshold(),
    gating: Optional[str] = GatingOpts.spec(),
    gate_prefill: bool = GatingOpts.prefill(),
    lowbit: Optional[str] = PrecisionOpts.lowbit(),
    precision: Optional[str] = PrecisionOpts.precision(),
    t1: float = PrecisionOpts.t1(),
    t2: float = PrecisionOpts.t2(),
    lowbit_fraction: Optional[float] = PrecisionOpts.fraction(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: text, token_ids, stats (tokens/s, "
                                 "cache hits, bytes loaded, load wait, prefill_ms, ttft_ms, decode_ms_per_token, "
                                 "host RSS)."),
):
    """Generate text from a prompt, experts streamed through the device cache."""
    import sys

    from ..runtime.engine import Engine

    prepare_model(model, workdir)
    eng = Engine.load(model, lowbit=lowbit, precision=precision, t1=t1, t2=t2,
                      lowbit_fraction=lowbit_fraction, device=device,
                      cache_experts=cache_experts, budget=budget, offload=offload,
                      threads=threads, cpu_experts=cpu_experts, prefill=prefill, replay_trace=replay_trace,
                      workdir=workdir, dtype=dtype, replacement=replacement, prefetch=prefetch, admission=admission, staging=staging_buffers, predictor=predictor,
                      emulate_device=emulate_device,
                      gating=gating or "auto", gating_threshold=gating_threshold, gate_prefill=gate_prefill,
                      plan=None if no_plan else "auto", progress=not as_json)
    print_plan_note(eng)
    stream = None
    if not as_json:
        def stream(_tok, piece):
            sys.stdout.write(piece)
            sys.stdout.flush()
    res = eng.generate(prompt, max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature,
                       top_p=top_p, seed=seed, on_token=stream, chat=chat)
    stats = {k: res.stats[k] for k in ("tokens_per_s", "hit_rate", "misses", "bytes_loaded", "bytes_per_token",
                                       "load_wait_s", "hits", "tokens", "prefill_ms", "ttft_ms",
                                       "decode_ms_per_token", "host_rss_gb", "host_peak_rss_gb", "experts_per_token",
                                       "cpu_experts", "fills", "prefill_tokens_per_s", "threads",
                                       "low_misses", "full_misses", "skips") if k in res.stats}
    if as_json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": stats}))
    else:
        print()
        print_stats_line(res.stats)
