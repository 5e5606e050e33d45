"""`moectl generate`: one completion through the offloading runtime."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ..setting.options import RuntimeOptions
from ..status import print_stats_line
from ._common import SamplingOpts, load_engine, print_draft_line, runtime_options


@runtime_options
def generate(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name (e.g. tiny, mixtral), checkpoint directory or .gguf file."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", min=1, help="Tokens to generate."),
    greedy: bool = SamplingOpts.greedy(),
    temperature: float = SamplingOpts.temperature(),
    top_p: float = SamplingOpts.top_p(),
    seed: Optional[int] = SamplingOpts.seed(),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    as_json: bool = typer.Option(False, "--json", rich_help_panel="Output", help="Print one JSON object: text, token_ids, stats (tokens/s, "
                                 "cache hits, bytes loaded, load wait, prefill_ms, ttft_ms, decode_ms_per_token, "
                                 "host RSS), lossy (the settings in force that change outputs), config ({option: \\[value, "
                                 "source]}, source flag | plan | sensitivity.json | default); with --draft also "
                                 "acceptance (per position, the file `simulate --acceptance` reads) and draft "
                                 "(passes, accepted tokens per pass, expert bytes per token, ms per token)."),
    opts: RuntimeOptions = None,
):
    """Generate text from a prompt, experts streamed through the device cache."""
    import sys

    from ..runtime.generation import check_text

    check_text(prompt, "--prompt")                  # before the model loads
    eng, lossy = load_engine(model, opts, progress=not as_json, torch_free=True)
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
    out = {"text": res.text, "token_ids": res.token_ids, "stats": stats, "lossy": lossy,
           "config": eng.resolved_options()}
    if "draft" in res.stats:                 # speculative decoding's figures, its acceptance per position on top
        out |= {"acceptance": res.stats["draft"]["acceptance"], "draft": res.stats["draft"]}
    if as_json:
        print(json.dumps(out))
    else:
        print()
        print_stats_line(res.stats)
        if "draft" in res.stats:
            print_draft_line(res.stats["draft"])
