"""`moectl bench`: runtime overhead vs transformers and predictor cost, as printed figures."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ._common import GatingOpts, PrecisionOpts


def bench(
    what: str = typer.Option("overhead,predictor", "--what",
                             help="Comma list: overhead (moectl vs transformers forward), predictor (MLP cost/layer)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch CPU threads for the overhead run."),
    model_shape: str = typer.Option("mixtral", "--model-shape",
                                    help="Recipe whose shape sizes the predictor-cost run (default Mixtral-8x7B)."),
    gating_threshold: Optional[float] = GatingOpts.threshold(),
    gating: Optional[str] = GatingOpts.spec(),
    lowbit: Optional[str] = PrecisionOpts.lowbit(),
    precision: Optional[str] = PrecisionOpts.precision(),
    t1: float = PrecisionOpts.t1(),
    t2: float = PrecisionOpts.t2(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Measure the runtime's overhead and the prefetch predictor's cost per layer."""
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
                                           lowbit=lowbit, precision=precision, t1=t1, t2=t2)
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
