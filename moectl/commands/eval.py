"""`moectl eval`: the fidelity yardstick of every lossy runtime option (perplexity, greedy agreement, loads)."""

from __future__ import annotations

import json

import typer

from ..setting.options import RuntimeOptions
from ._common import load_engine, runtime_options


@runtime_options
def eval_(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name (e.g. tiny, mixtral), checkpoint directory or .gguf file."),
    dataset: str = typer.Option("default", "--dataset", "-d",
                                help="Held-out text: calibration YAML name or path, local file, or 'builtin'."),
    max_tokens: int = typer.Option(2048, "--max-tokens", min=2, help="Tokens of held-out text scored."),
    window: int = typer.Option(256, "--window", min=2, help="Tokens per teacher-forced window."),
    prompts: int = typer.Option(4, "--prompts", min=1, help="Held-out prompts for greedy agreement."),
    generate: int = typer.Option(32, "--generate", min=1, help="Greedy tokens compared per prompt."),
    decode_steps: bool = typer.Option(False, "--decode-steps", help="Score each window one decode step at a time "
                                      "(what a decode does per token, e.g. HOBBIT's hi/lo/skip on a miss, applies), "
                                      "not as one teacher-forced prefill."),
    llamacpp_windows: bool = typer.Option(False, "--llamacpp-windows",
                                          help="Window and score the text as `llama-perplexity -c WINDOW -b WINDOW` "
                                               "does: one text with its BOS, WINDOW-token chunks each starting "
                                               "with BOS, only the second half of each chunk scored."),
    as_json: bool = typer.Option(False, "--json", rich_help_panel="Output", help="Print one JSON object (with lossy: the settings in force "
                                 "that change outputs)."),
    opts: RuntimeOptions = None,
):
    """Perplexity with the given runtime options vs lossless on the same tokens, greedy-continuation agreement,
    experts computed and bytes loaded per token. Every scored token is computed as a decode step would be
    (gating applies to all of them); the lossless side is computed once and kept in <workdir>/eval/."""
    from rich.console import Console
    from rich.table import Table

    from ..calib.dataset import load_calibration
    from ..calib.fidelity import evaluate, token_windows
    from ..calib.fidelity import llamacpp_windows as llama_windows
    from ..progress import ProgressBar

    eng, lossy = load_engine(model, opts, progress=not as_json)
    cut = llama_windows if llamacpp_windows else token_windows
    windows = cut(eng.tokenizer, load_calibration(dataset), window, max_tokens)
    starts = [w[: max(2, window // 4)] for w in windows[:prompts]]
    spec = eng.speculator
    if spec is not None:
        spec.enabled = False                    # the yardstick's figures are without drafting; drafting is checked below
    with ProgressBar(not as_json, transient=True) as bar:
        task = bar.add("eval", total=2 * len(windows))
        r = evaluate(eng, windows, starts, generate, eng.ref.workdir, progress=lambda: bar.update(task, advance=1),
                     decode=decode_steps, score_from=window // 2 if llamacpp_windows else 0)
    if spec is not None:
        r["draft"] = draft_agreement(eng, starts, generate)
    if as_json:
        print(json.dumps(r | {"lossy": lossy}))
        return
    t = Table(title=f"{eng.ref.name}: {r['tokens']} held-out tokens of {dataset}; {r['gating']}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("perplexity", f"{r['ppl']:.4f}")
    t.add_row("perplexity, lossless" + (" (cached)" if r["reference_cached"] else ""), f"{r['ppl_lossless']:.4f}")
    t.add_row("relative perplexity delta", f"{r['ppl_delta_rel']:+.4%}")
    t.add_row(f"greedy agreement ({r['greedy_tokens']} tokens)", f"{r['greedy_agreement']:.4f}")
    t.add_row("experts computed per token and MoE layer", f"{r['experts_per_token']:.3f}")
    t.add_row("bytes loaded per token", f"{r['bytes_per_token']:.0f}")
    if "draft" in r:
        d = r["draft"]
        t.add_row(f"greedy tokens equal with --draft {d['source']} ({d['tokens']} tokens)", f"{d['greedy_agreement']:.4f}")
        t.add_row("tokens per verification pass", f"{d['tokens_per_pass']:.2f}")
    Console().print(t)


def draft_agreement(eng, prompts: list[list[int]], n: int) -> dict:
    """Greedy agreement of speculative decoding: each prompt's n greedy tokens with drafting against without
    (position by position; they must all be equal), and the draft's acceptance."""
    from ..calib.fidelity import greedy_continuations

    spec = eng.speculator
    spec.enabled = False
    plain = greedy_continuations(eng, prompts, n)
    spec.enabled = True
    passes0, tokens0 = spec.counter.passes, spec.counter.accepted + spec.counter.passes
    drafted = greedy_continuations(eng, prompts, n)
    same = sum(a == b for x, y in zip(plain, drafted) for a, b in zip(x, y))
    total = sum(len(x) for x in plain)
    passes = spec.counter.passes - passes0
    return {"source": spec.drafter.name, "tokens": total, "greedy_agreement": same / total if total else 1.0,
            "identical": plain == drafted, "acceptance": spec.acceptance().to_json(),
            "tokens_per_pass": (spec.counter.accepted + spec.counter.passes - tokens0) / passes if passes else 0.0}
