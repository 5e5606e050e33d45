"""`moectl profile`: routing traces (+ sampled hidden states) of a model on a calibration set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ._common import CacheOpts, prepare_model


def profile(
    model: str = typer.Option(..., "--model", "-m", help="recipe name, checkpoint directory or .gguf file"),
    dataset: str = typer.Option(None, "--dataset", "-d",
                                help="calibration YAML (name or path), local text/JSONL/Parquet file or "
                                     "directory, saved `datasets` directory, or 'builtin' "
                                     "[default: the recipe's calibration set, else 'default']"),
    max_tokens: int = typer.Option(512, "--max-tokens", help="prompt tokens per sample (longer texts are cut)"),
    max_samples: int = typer.Option(None, "--max-samples", help="at most this many calibration texts"),
    generate: int = typer.Option(0, "--generate", help="greedy decode tokens after each sample (decode phase)"),
    hidden_samples: str = typer.Option("0", "--hidden-samples",
                                       help="tokens with hidden-state samples: a count, or 'all'"),
    router_logits: bool = typer.Option(False, "--router-logits", help="also store the full router logits"),
    workdir: Path = typer.Option(None, "--workdir", help="artifact directory [default: $MOECTL_HOME/<model>]"),
    out: Path = typer.Option(None, "--out", help="trace directory [default: <workdir>/traces]"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run after its last complete sample"),
    split: str = typer.Option(None, "--split", help="dataset split (default: the calibration set's)"),
    device: str = CacheOpts.device(),
    budget: str = typer.Option(None, "--budget", help="device memory for the expert cache, e.g. 2GB"),
    cache_experts: int = typer.Option(None, "--cache-experts", help="expert cache size in experts"),
    emulate_device: bool = CacheOpts.emulate_device(),
    replacement: Optional[str] = CacheOpts.replacement(),
    prefetch: str = typer.Option("none", "--prefetch",
                                 help="runtime prefetch while recording, as in `generate` [default: none]"),
    admission: str = CacheOpts.admission(),
    staging_buffers: int = CacheOpts.staging_buffers(),
    predictor: str = CacheOpts.predictor(),
    shard_rows: int = typer.Option(4096, "--shard-rows", help="rows per shard file"),
    seed: int = typer.Option(0, "--seed", help="seed of the hidden-sample draw"),
    as_json: bool = typer.Option(False, "--json", help="print the result as one JSON object"),
) -> None:
    """Record routing traces (expert ids, gate weights, optional hidden states) on a calibration set.

    The run goes through the offloading runtime with the given cache size and policies; --json reports
    its cache hits and misses per phase, which `moectl simulate` on the recorded trace reproduces. On a
    CPU the experts are computed in place (every access a hit) unless --emulate-device gives it slots."""
    from rich.console import Console

    from ..calib.dataset import load_calibration
    from ..calib.profile import run_profile
    from ..core.paths import writable_dir
    from ..core.recipes import format_bytes, resolve_model
    from ..errors import MoectlError
    from ..progress import ProgressBar
    from ..runtime.engine import Engine
    from ..status import print_device
    from ..store.facts import pick_device

    console = Console(stderr=as_json)
    hs = hidden_samples.strip().lower()
    if hs not in ("all", "none") and not hs.isdigit():
        raise MoectlError(f"--hidden-samples takes a count or 'all', not {hidden_samples!r}")
    hs_mode = "all" if hs == "all" else (int(hs) if hs.isdigit() and int(hs) > 0 else None)
    if generate < 0 or max_tokens < 1:
        raise MoectlError("--generate must be >= 0 and --max-tokens >= 1")
    pick_device(device)                                 # a device torch does not see: one line, before any work
    prepare_model(model, workdir)
    ref = resolve_model(model, str(workdir) if workdir else None)
    if dataset is None:
        from ..core.recipes import REPO_ROOT

        dataset = ((ref.recipe or {}).get("defaults") or {}).get("calibration") or "default"
        if not Path(dataset).exists() and (REPO_ROOT / dataset).exists():
            dataset = str(REPO_ROOT / dataset)             # recipe paths are relative to the repo
    out_dir = writable_dir(out or ref.workdir / "traces", "--out" if out else "the trace directory")
    texts = load_calibration(dataset, split=split, max_samples=max_samples)
    eng = Engine.load(model=model, device=device, workdir=str(workdir) if workdir else None,
                      budget=budget, cache_experts=cache_experts, replacement=replacement or "lru", prefetch=prefetch, admission=admission, staging=staging_buffers,
                      predictor=predictor, emulate_device=emulate_device)
    print_device(eng)

    def show_plan(info: dict) -> None:
        msg = (f"profiling [bold]{ref.name}[/] on {info['samples']} samples (~{info['tokens_planned']} tokens) "
               f"-> {out_dir}\nhidden samples: {info['hidden_samples']} x "
               f"{format_bytes(info['hidden_bytes_per_sample'])} = [bold]{format_bytes(info['hidden_bytes'])}[/]")
        if info["router_logits_bytes"]:
            msg += f"; router logits: {format_bytes(info['router_logits_bytes'])}"
        console.print(msg)

    with ProgressBar(console=console, transient=as_json) as bar:
        task = bar.add("profile (tokens)")
        t_start = [None]

        def progress(done: int, total: int) -> None:
            import time

            t_start[0] = t_start[0] or time.perf_counter()
            dt = time.perf_counter() - t_start[0]
            bar.update(task, completed=done, total=total, info=f"{done / dt:.0f} tok/s" if dt > 0 else "")

        res = run_profile(eng, texts, out_dir, model_name=ref.name, dataset=dataset, max_tokens=max_tokens,
                          generate=generate, hidden_samples=hs_mode, router_logits=router_logits,
                          resume=resume, shard_rows=shard_rows, seed=seed, progress=progress,
                          on_plan=show_plan)
    summary = {"out": str(out_dir), "samples": res.samples, "skipped_resumed": res.skipped,
               "tokens": res.tokens, "prefill_tokens": res.prefill_tokens, "decode_tokens": res.decode_tokens,
               "hidden_samples": res.hidden_samples, "seconds": round(res.seconds, 3),
               "tokens_per_s": round(res.tokens_per_s, 1), "interrupted": res.interrupted}
    # the cache statistics of the recorded run: `moectl simulate` on the trace with the same sizes and
    # policies gives the same counts (the shared rules of moectl/core/cache_model.py)
    summary["cache"] = {ph: {k: v for k, v in eng.cache.state.totals(ph).items() if k in ("hits", "misses")}
                        for ph in ("prefill", "decode")}
    summary["cache"].update(replacement=replacement or "lru", prefetch=prefetch, slots=sum(eng.cache.slots_per_layer))
    if as_json:
        print(json.dumps(summary))
    else:
        console.print(f"wrote {res.samples} samples ({res.prefill_tokens} prefill + {res.decode_tokens} decode "
                      f"tokens, {res.hidden_samples} hidden samples) to {out_dir} "
                      f"at {res.tokens_per_s:.0f} tok/s")
    if res.interrupted:
        console.print("[yellow]interrupted[/]: complete samples are saved; run again with --resume to continue")
        raise KeyboardInterrupt          # the CLI prints "interrupted" and exits 130
