"""`moectl train-predictor`'s work: which traces, which kinds, train each (`predict/train.py`), evaluate on the
held-out split, write the predictors artifact and its report.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import MoectlError
from .train import ROUTING_EPOCHS, gather_hidden, train_aux_gate, train_mlp, train_routing


def parse_lookahead(text: str | list[int]) -> list[int]:
    if isinstance(text, (list, tuple)):
        vals = [int(v) for v in text]
    else:
        try:
            vals = [int(v) for v in str(text).replace(" ", "").split(",") if v]
        except ValueError:
            raise MoectlError(f"--lookahead takes positive integers separated by commas (e.g. 1,2,3), "
                              f"not {text!r}") from None
    if not vals or min(vals) < 1:
        raise MoectlError(f"--lookahead takes positive integers separated by commas (e.g. 1,2,3), not {text!r}")
    return sorted(set(vals))


def parse_kinds(kind: str) -> list[str]:
    names = {"mlp": ["mlp"], "aux-gate": ["aux_gate"], "aux_gate": ["aux_gate"], "routing": ["routing"],
             "all": ["mlp", "aux_gate", "routing"]}
    if kind not in names:
        raise MoectlError(f"--kind must be one of mlp, aux-gate, routing, all (not {kind!r})")
    return names[kind]


def _resolve(model: str | None, workdir):
    """(workdir or None, the model's facts or None) for --model: its fingerprint (None without a checkpoint) and
    its shape, from the checkpoint's config or, when it is not downloaded, its recipe's `shape:` block."""
    if not model:
        return (Path(workdir).expanduser() if workdir else None), None
    from ..core.recipes import load_recipe, moectl_home, resolve_model
    from ..store.facts import model_sizes

    try:
        wd = resolve_model(model, workdir).workdir
    except MoectlError:
        # training needs the traces, not the weights: a recipe whose checkpoint is not downloaded still has a workdir
        recipe = load_recipe(model)              # not a recipe either: its error says what --model takes
        wd = Path(workdir).expanduser() if workdir else moectl_home() / recipe["name"]
    return wd, model_sizes(model, workdir)


def run_train_predictor(model: str | None = None, traces: list | None = None, kind: str = "all",
                        lookahead="1,2,3", epochs: int | None = None, out=None, device: str = "cpu",
                        max_minutes: float | None = 10.0, width: int = 128, workdir=None, seed: int = 0,
                        console=None, progress: bool = False, device_note: str | None = None) -> dict:
    """What `moectl train-predictor` does; returns the result dict its --json prints. `device_note` (the device
    taken and why) is printed on `console` once the inputs are checked, before training."""
    from ..artifacts.trace_dir import load_trace
    from ..core.recipes import moectl_home
    from ..core.trace import check_trace_fits
    from ..predictors.file import save_predictors
    from ..store.facts import pick_device

    t_start = time.monotonic()
    kinds = parse_kinds(kind)
    ds = parse_lookahead(lookahead)
    device = pick_device(device)[0]
    if not traces and not model:
        raise MoectlError("give --traces DIR|FILE (repeatable) or --model M (reads <workdir>/traces)")
    wd, facts = _resolve(model, workdir)
    model_fp, model_name = (facts.fingerprint, facts.name) if facts else (None, None)
    if not traces:
        default = wd / "traces"
        if not default.exists():
            raise MoectlError(f"no traces at {default}; run `moectl profile --model {model} --hidden-samples 2000` "
                              f"first, or pass --traces")
        traces = [default]
    loaded = [load_trace(p) for p in traces]
    for p, t in zip(traces, loaded):
        t.source = t.source or str(p)
        if t.num_tokens == 0:
            raise MoectlError(f"trace {p} has no rows")
    t0 = loaded[0]
    for p, t in zip(traces, loaded):
        if (t.num_layers, t.num_experts, t.top_k) != (t0.num_layers, t0.num_experts, t0.top_k):
            raise MoectlError(f"traces {traces[0]} ({t0.num_layers} layers x {t0.num_experts} experts, top-"
                              f"{t0.top_k}) and {p} ({t.num_layers} x {t.num_experts}, top-{t.top_k}) are not of "
                              f"the same model; train on one model's traces at a time")
        if facts is not None:
            check_trace_fits(t, facts.num_layers, facts.num_experts, facts.top_k, f"--model {model}", model_fp, p)
    fps = {t.fingerprint for t in loaded}
    if len(fps - {None}) > 1:
        raise MoectlError(f"the traces come from different models ({', '.join(sorted(f for f in fps if f))})")
    fingerprint = model_fp or next((f for f in fps if f), None)

    notes: list[str] = []
    has_hidden = all(t.hidden is not None and len(t.hidden.token_index) > 0 for t in loaded)
    if not has_hidden:
        hidden_kinds = [k for k in kinds if k in ("mlp", "aux_gate")]
        if kind != "all" and hidden_kinds:
            gather_hidden(loaded)                                 # raises the clear "no hidden samples" error
        if hidden_kinds:
            notes.append("the traces carry no hidden-state samples: skipped mlp and aux-gate (profile with "
                         "--hidden-samples N to train them)")
        kinds = [k for k in kinds if k == "routing"]
    if "routing" in kinds:
        try:
            from ..predictors import routing as _routing  # noqa: F401
        except ImportError:
            if kind == "routing":
                raise MoectlError("the routing predictor is not available in this build (moectl.predictors.routing)")
            notes.append("routing predictor not available in this build: skipped")
            kinds = [k for k in kinds if k != "routing"]
    if not kinds:
        raise MoectlError("nothing to train: " + "; ".join(notes))

    # time shares: the mlp trains one network per layer, the others one each
    share = {"mlp": 0.7, "aux_gate": 0.1, "routing": 0.2}
    total = sum(share[k] for k in kinds)
    minutes = {k: (max_minutes * share[k] / total if max_minutes else None) for k in kinds}

    results: dict = {}
    metrics: dict = {}
    data = gather_hidden(loaded) if any(k in ("mlp", "aux_gate") for k in kinds) else None
    from ..progress import ProgressBar

    if device_note and console is not None:
        console.print(f"[dim]{device_note}[/]", highlight=False)

    bar = ProgressBar(progress and console is not None, console)
    with bar:
        if "mlp" in kinds:
            n_src = sum(1 for l in range(t0.num_layers) if any(l + d < t0.num_layers for d in ds))
            task = bar.add("mlp (per layer)", n_src)
            results["mlp"], metrics["mlp"] = train_mlp(loaded, ds, epochs or 100, minutes["mlp"], device, seed, width,
                                                       progress=lambda i, n: bar.update(task, completed=i), data=data)
        if "aux_gate" in kinds:
            task = bar.add("aux gate", 1)
            results["aux_gate"], metrics["aux_gate"] = train_aux_gate(loaded, epochs or 100, minutes["aux_gate"], device,
                                                                      seed, data=data)
            bar.update(task, completed=1)
        if "routing" in kinds:
            task = bar.add("routing", 1)
            results["routing"], metrics["routing"] = train_routing(loaded, ds, epochs or ROUTING_EPOCHS, minutes["routing"], seed)
            bar.update(task, completed=1)

    if out is None:
        out = wd if wd is not None else moectl_home() / _safe_name(t0.model)
    json_path = save_predictors(out, fingerprint=fingerprint, model=model_name or t0.model,
                                num_layers=t0.num_layers, num_experts=t0.num_experts, top_k=t0.top_k, lookahead=ds,
                                metrics=metrics, traces=[str(p) for p in traces], **results)
    return {"out": str(json_path), "kinds": list(results), "fingerprint": fingerprint, "model": model_name or t0.model,
            "lookahead": ds, "num_layers": t0.num_layers, "num_experts": t0.num_experts, "top_k": t0.top_k,
            "traces": [str(p) for p in traces], "metrics": metrics, "notes": notes,
            "seconds": round(time.monotonic() - t_start, 2)}


def _safe_name(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "-", name.split("/")[-1]).strip("-") or "model"
