"""`moectl inspect`: what a checkpoint is, from its config and shard headers (no weights read)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ._common import prepare_model


def inspect(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name or checkpoint directory."),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="Artifact directory (default ~/.cache/moectl/<model>)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Size the experts in this dtype (default: the checkpoint's)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Family, layers, MoE layers, experts, top-k, the experts' format (as released: MXFP4 / block FP8 stay
    packed) and bytes per expert, dense and total bytes, and the memory a GPU run needs: host RAM with
    --offload ram, device memory at the minimum (one expert slot per layer) and with every expert resident.
    Read from config.json and the shard headers only."""
    from rich.console import Console
    from rich.table import Table

    from ..recipes import format_bytes
    from ..runtime.engine import inspect_model

    prepare_model(model, workdir)
    info = inspect_model(model, workdir, dtype)
    if as_json:
        print(json.dumps(info))
        return
    t = Table(title=f"{info['model']} ({info['path']})", show_header=False)
    for k in ("family", "fingerprint", "dtype", "layers", "moe_layers", "experts", "top_k", "hidden_size",
              "expert_intermediate_size", "expert_format"):
        t.add_row(k, str(info[k]))
    t.add_row("bits_per_weight", f"{info['bits_per_weight']:.2f}")
    for k in ("bytes_per_expert", "dense_bytes", "expert_bytes", "total_bytes", "kv_reserve_bytes"):
        t.add_row(k, format_bytes(info[k]))
    t.add_row("host RAM (--offload ram)", format_bytes(info["host_ram_bytes"]))
    t.add_row("device, 1 slot/layer", format_bytes(info["device_min_bytes"]))
    t.add_row("device, all experts", format_bytes(info["device_all_bytes"]))
    Console().print(t)
