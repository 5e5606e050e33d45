"""`moectl bench`: the runtime on a model against its baselines (`--model`), or the runtime's overhead vs
transformers and the predictor's cost at real sizes (`--what`, without --model)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ._common import CacheOpts, GatingOpts, PrecisionOpts, prepare_model


def bench(
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Benchmark this model against the baselines (recipe name, checkpoint "
                                             "directory or .gguf file). Without it: --what overhead,predictor."),
    budget: Optional[str] = CacheOpts.budget(),
    cache_experts: Optional[int] = typer.Option(None, "--cache-experts", min=1,
                                                help="Expert slots in total, split evenly over MoE layers (default: "
                                                     "half the experts)."),
    prompt_len: int = typer.Option(64, "--prompt-len", min=1, help="Prompt tokens (seeded random ids)."),
    gen_len: int = typer.Option(32, "--gen-len", min=2, help="Tokens generated (greedy)."),
    repeat: int = typer.Option(3, "--repeat", min=1, help="Requests per configuration (median request reported)."),
    replay_trace: Optional[str] = CacheOpts.replay_trace(),
    device: str = typer.Option("cpu", "--device", help="cpu (the cached runs emulate a device) or cuda."),
    replacement: str = CacheOpts.replacement(),
    prefetch: str = CacheOpts.prefetch(),
    admission: str = CacheOpts.admission(),
    cpu_experts: str = CacheOpts.cpu_experts(),
    prefill: str = CacheOpts.prefill(),
    baselines: str = typer.Option(",".join(("all-resident", "transformers", "on-demand", "lru", "moectl-plan")),
                                  "--baselines", help="Comma list of baselines to run besides moectl."),
    workdir: Optional[str] = CacheOpts.workdir(),
    dtype: Optional[str] = CacheOpts.dtype(),
    what: str = typer.Option("overhead,predictor", "--what",
                             help="Without --model: comma list of overhead (moectl vs transformers forward), predictor "
                                  "(MLP cost/layer)."),
    threads: Optional[int] = CacheOpts.threads(),
    model_shape: str = typer.Option("mixtral", "--model-shape",
                                    help="Recipe whose shape sizes the predictor-cost run (default Mixtral-8x7B)."),
    gating_threshold: Optional[float] = GatingOpts.threshold(),
    gating: Optional[str] = GatingOpts.spec(),
    gate_prefill: bool = GatingOpts.prefill(),
    lowbit: Optional[str] = PrecisionOpts.lowbit(),
    precision: Optional[str] = PrecisionOpts.precision(),
    t1: float = PrecisionOpts.t1(),
    t2: float = PrecisionOpts.t2(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Measure a model's TTFT, prefill tokens/s, decode ms/token, hit rate, bytes/token, stall and predictor time
    against all-resident, transformers, on-demand and LRU baselines (and the workdir's plan), with the simulator's
    prediction; or, without --model, the runtime's overhead and the predictor's cost."""
    from rich.console import Console

    if model is not None:
        from ..bench_model import bench_model

        prepare_model(model, workdir)
        out = bench_model(model, workdir, device, budget, cache_experts, prompt_len, gen_len, replay_trace, threads,
                          replacement, prefetch or "auto", cpu_experts, dtype,
                          tuple(b.strip() for b in baselines.split(",") if b.strip()), repeat=repeat, prefill=prefill,
                          progress=not as_json, admission=admission or "off", lowbit=lowbit, precision=precision,
                          t1=t1, t2=t2, gating=gating, gating_threshold=gating_threshold, gate_prefill=gate_prefill)
        if as_json:
            print(json.dumps(out))
        else:
            Console().print(_model_table(out))
            for k, v in out["notes"].items():
                Console().print(f"[dim]{k}: {v}[/]", highlight=False)
        return
    _overhead_and_predictor(what, threads, model_shape, gating, gating_threshold, as_json, lowbit, precision, t1, t2,
                            gate_prefill)


def _model_table(out: dict):
    from rich.table import Table

    from ..recipes import format_bytes

    t = Table(title=f"moectl bench {out['model']} ({out['device']}, {out['threads']} threads, prompt "
                    f"{out['prompt_len']}, {out['gen_len']} tokens)")
    for col in ("run", "TTFT ms", "prefill tok/s", "decode ms/tok", "hit rate", "bytes/tok", "stall ms/tok",
                "predictor ms/tok", "predicted ms/tok", "measured/predicted"):
        t.add_column(col, justify="left" if col == "run" else "right")
    f = lambda v, fmt: "" if v is None else format(v, fmt)          # noqa: E731
    for name, r in out["runs"].items():
        p = out["predicted"].get(name, {})
        t.add_row(name, f(r["ttft_ms"], ".1f"), f(r["prefill_tokens_per_s"], ".0f"), f(r["decode_ms_per_token"], ".2f"),
                  f(r.get("hit_rate"), ".1%"), format_bytes(r["bytes_per_token"]) if "bytes_per_token" in r else "",
                  f(r.get("stall_ms_per_token"), ".2f"), f(r.get("predictor_ms_per_token"), ".3f"),
                  f(p.get("decode_ms_per_token"), ".2f"), f(out["measured_over_predicted"].get(name), ".2f"))
    if out["all_resident_over_transformers"] is not None:
        t.caption = (f"all-resident / transformers decode time: {out['all_resident_over_transformers']:.3f} "
                     f"(goal <= {out['goal_all_resident_ratio']})")
    return t


def _overhead_and_predictor(what, threads, model_shape, gating, gating_threshold, as_json, lowbit, precision,
                            t1, t2, gate_prefill=False) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..benchmarks import predictor_cost, runtime_overhead
    from ..errors import MoectlError
    from ..recipes import recipe_shape

    parts = [w.strip() for w in what.split(",") if w.strip()]
    unknown = set(parts) - {"overhead", "predictor"}
    if unknown:
        raise MoectlError(f"--what: unknown part(s) {sorted(unknown)}; use overhead, predictor")
    out = {}
    if "overhead" in parts:
        out["overhead"] = runtime_overhead(threads=threads, gating=gating, gating_threshold=gating_threshold,
                                           lowbit=lowbit, precision=precision, t1=t1, t2=t2,
                                           gate_prefill=gate_prefill)
    if "predictor" in parts:
        s = recipe_shape(model_shape)
        out["predictor"] = predictor_cost(s["hidden_size"], s["num_experts"], s["top_k"], s["moe_layers"])
        out["predictor"]["model_shape"] = model_shape
    if as_json:
        print(json.dumps(out))
        return
    t = Table(title="moectl bench")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("goal", justify="right")
    if "overhead" in out:
        o = out["overhead"]
        t.add_row(f"prefill {o['prefill_tokens']} tok: moectl / transformers time", f"{o['forward_time_ratio']:.3f}",
                  "<= 1.15")
        t.add_row("decode tok/s: transformers", f"{o['decode_tok_s_transformers']:.1f}", "")
        t.add_row("decode tok/s: moectl (all experts cached)" + (f", {o['lowbit']} {o['precision']}" if o["lowbit"]
                                                                     else ""), f"{o['decode_tok_s_moectl']:.1f}", "")
    if "predictor" in out:
        p = out["predictor"]
        t.add_row(f"MLP predictor ms/layer ({model_shape}: D={p['hidden_size']}, E={p['num_experts']}), median",
                  f"{p['ms_per_layer_median']:.3f}", "<= 0.3")
        t.add_row("MLP predictor ms/layer, p90", f"{p['ms_per_layer_p90']:.3f}", "")
    Console().print(t)
