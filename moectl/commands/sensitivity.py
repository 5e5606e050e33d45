"""`moectl sensitivity`: per-layer Fisher sensitivities (AdapMoE) and the default gating threshold T_g."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ._common import CacheOpts, prepare_model, writable_workdir


def sensitivity(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name (e.g. tiny, mixtral), checkpoint directory or .gguf file."),
    dataset: str = typer.Option("default", "--dataset", "-d",
                                help="Calibration set: YAML name or path, local text/JSONL/Parquet, or 'builtin'."),
    max_tokens: int = typer.Option(4096, "--max-tokens", min=2, help="Calibration tokens used in all."),
    window: int = typer.Option(256, "--window", min=2, help="Tokens per teacher-forced window."),
    target_ppl_delta: Optional[float] = typer.Option(
        None, "--target-ppl-delta",
        help="Also search T_g: the largest whose relative perplexity cost stays within this (e.g. 0.01), "
             "measured on held-out windows of the dataset; stored as the runtime's default gating."),
    rule: str = typer.Option(
        "ablation", "--rule",
        help="What the gating rule m^2 x S_l <= T_g uses per layer: 'ablation' (measured: the loss of keeping only "
             "the top-1 in that layer, per unit of squared dropped mass; L+1 extra forward passes) or 'fisher' "
             "(AdapMoE's S_l = E||dL/dO_l||^2). Fisher's S_l is computed and stored either way."),
    cache_experts: Optional[int] = CacheOpts.cache_experts(),
    budget: Optional[str] = CacheOpts.budget(),
    device: str = CacheOpts.device(),
    emulate_device: bool = CacheOpts.emulate_device(),
    offload: str = CacheOpts.offload(),
    workdir: Optional[str] = CacheOpts.workdir(),
    dtype: Optional[str] = CacheOpts.dtype(),
    as_json: bool = typer.Option(False, "--json", help="Print sensitivity.json's content as one JSON object."),
):
    """S_l = mean over calibration tokens of ||dL/dO_l||^2 (O_l: MoE block l's output), through the runtime;
    with --rule ablation (default) also the measured per-layer cost the gating rule then uses.

    Writes <workdir>/sensitivity.json. With --target-ppl-delta, the first half of the windows gives the
    sensitivities and the second half (other tokens) chooses T_g."""
    from rich.console import Console
    from rich.table import Table

    from ..artifacts.sensitivity import RULES, rule_sensitivities, save_sensitivity
    from ..calib.dataset import load_calibration
    from ..calib.fidelity import evaluate, token_windows
    from ..calib.sensitivity import (
        TailRecorder,
        ablation_sensitivity,
        fisher_sensitivity,
        search_threshold,
        threshold_grid,
    )
    from ..errors import MoectlError
    from ..policies.gating import SensitivityGating
    from ..progress import ProgressBar
    from ..runtime.engine import Engine
    from ..status import print_device

    if rule not in RULES:
        raise MoectlError(f"unknown --rule {rule!r}; choose one of {', '.join(RULES)}")
    if target_ppl_delta is not None and target_ppl_delta < 0:
        raise MoectlError(f"--target-ppl-delta must be >= 0, not {target_ppl_delta}")
    prepare_model(model, workdir)
    writable_workdir(model, workdir)                # sensitivity.json is written at the end: check now
    eng = Engine.load(model, device=device, cache_experts=cache_experts, budget=budget, offload=offload,
                      workdir=workdir, dtype=dtype, emulate_device=emulate_device, prefetch="none", progress=not as_json)
    print_device(eng)
    texts = load_calibration(dataset)
    windows = token_windows(eng.tokenizer, texts, window, max_tokens)
    search = target_ppl_delta is not None
    if search and len(windows) < 2:
        raise MoectlError(f"--target-ppl-delta needs at least 2 windows of {window} tokens (one to measure, one to "
                          f"search on); the dataset gives {len(windows)}: lower --window or raise --max-tokens")
    fit = windows[: (len(windows) + 1) // 2] if search else windows
    tails = TailRecorder(len(eng.moe_layer_ids))
    eng.add_observer(tails)
    with ProgressBar(not as_json, transient=True) as bar:
        task = bar.add("sensitivity (forward + backward)", total=len(fit))
        res = fisher_sensitivity(eng.model, [b for _, b in eng.adapter.moe_blocks(eng.model)], fit, eng.device,
                                 before_window=lambda: eng.cache.begin_step("prefill"),
                                 after_window=lambda: (eng.cache.end_token(), bar.update(task, advance=1)))
    eng.remove_observer(tails)
    meta = {"fingerprint": eng.fingerprint, "model": eng.ref.name, "dataset": dataset, "window": window,
            "windows": len(fit), "tokens": res["tokens"], "moe_layer_ids": eng.moe_layer_ids,
            "sensitivities": res["sensitivities"], "rule": rule, "threshold": None}
    if rule == "ablation":
        with ProgressBar(not as_json, transient=True) as bar:
            task = bar.add("ablation (one pass per MoE layer)", total=len(eng.moe_layer_ids) + 1)
            meta |= ablation_sensitivity(eng, fit, lambda: bar.update(task, advance=1))
            meta["tokens"] = res["tokens"]
    sens = rule_sensitivities(meta)
    if search:
        held = windows[len(fit):]
        grid = threshold_grid(sens, tails.tails)
        with ProgressBar(not as_json, transient=True) as bar:
            task = bar.add("searching T_g", total=len(grid))
            def score(t):
                eng.runtime.gating = SensitivityGating(t, sens)
                r = evaluate(eng, held, [], 0, eng.ref.workdir)          # perplexity only
                bar.update(task, advance=1)
                return r
            found = search_threshold(score, grid, target_ppl_delta)
        meta["threshold"] = found["threshold"]
        meta["search"] = found | {"windows": len(held), "tokens": sum(len(w) - 1 for w in held)}
    path = save_sensitivity(eng.ref.workdir, meta)
    if as_json:
        print(json.dumps(meta | {"path": str(path)}))
        return
    t = Table(title=f"{eng.ref.name}: sensitivity per MoE layer ({res['tokens']} tokens of {dataset}; "
                    f"the gating rule uses {rule})")
    t.add_column("MoE layer", justify="right")
    t.add_column("model layer", justify="right")
    t.add_column("Fisher S_l", justify="right")
    t.add_column("S_l / max", justify="right")
    if rule == "ablation":
        t.add_column("ablation A_l", justify="right")
        t.add_column("A_l / max", justify="right")
    top, atop = max(res["sensitivities"]) or 1.0, max(sens) or 1.0
    for l, (mid, s) in enumerate(zip(eng.moe_layer_ids, res["sensitivities"])):
        extra = [f"{sens[l]:.4g}", f"{sens[l] / atop:.3f}"] if rule == "ablation" else []
        t.add_row(str(l), str(mid), f"{s:.4g}", f"{s / top:.3f}", *extra)
    console = Console()
    console.print(t)
    if search:
        c = meta["search"]["chosen"]
        if c is None:
            console.print(f"no T_g on the grid keeps the perplexity cost within {target_ppl_delta:.2%}: gating stays off")
        else:
            console.print(f"T_g = {c['threshold']:.4g}: perplexity {c['ppl_delta_rel']:+.2%} (target "
                          f"{target_ppl_delta:.2%}), {c['experts_per_token']:.3f} experts/token/layer "
                          f"(top-{eng.adapter.top_k}); stored as the default gating")
    console.print(f"wrote {path}")
