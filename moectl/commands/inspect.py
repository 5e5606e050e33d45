"""`moectl inspect`: what a checkpoint is, from its config and shard headers (no weights read)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ._common import prepare_model, say


def inspect(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name, checkpoint directory or .gguf file."),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="Artifact directory (default ~/.cache/moectl/<model>)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Size the experts in this dtype (default: the checkpoint's)."),
    lowbit: Optional[str] = typer.Option(None, "--lowbit", help="Size a low-bit copy set too, e.g. q4g64 (HQQ; "
                                         "need not exist yet)."),
    offload: str = typer.Option("ram", "--offload", help="Where the full-precision copies would live: ram or disk."),
    device: str = typer.Option("auto", "--device",
                               help="The device the memory figures are for: auto (CUDA when torch sees a device, else "
                                    "the CPU), cpu, or cuda / cuda:N (sized whether or not this machine has one)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Device budget the cache would get (default: the "
                                         "minimum, one slot per layer of each pool)."),
    lowbit_fraction: Optional[float] = typer.Option(None, "--lowbit-fraction", min=0.0, max=0.99,
                                                    help="Share of the cache bytes for low-bit slots (default 0.25)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="With --lowbit, the pools the runtime would "
                                            "make: hobbit (the default: --lowbit-fraction of the bytes low-bit) or "
                                            "lowbit-only (every byte low-bit, no full-precision slots)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Family, layers, MoE layers, experts, top-k, the experts' format (as released: MXFP4 / block FP8 stay
    packed) and bytes per expert, dense and total bytes; the host RAM and device memory a configuration needs
    (dense weights, copies per tier, KV reserve, cache), before anything is loaded. Read from config.json and
    the shard headers only."""
    import contextlib
    import re

    from rich.console import Console
    from rich.table import Table

    from ..core.recipes import format_bytes, is_gguf_path
    from ..errors import MoectlError
    from ..kernels import ggml
    from ..kernels import isa as isas
    from ..store.facts import inspect_model, pick_device

    if offload not in ("ram", "disk"):
        raise MoectlError(f"--offload is ram or disk, not {offload!r}")
    note = None
    if device in (None, "auto"):                # the figures of the device a run would take
        device, note = pick_device("auto")
    elif re.fullmatch(r"cuda(:\d+)?", device):     # sizes, not a run: a GPU this machine lacks is fine
        device = "cuda"
    elif device != "cpu":
        raise MoectlError(f"--device is auto, cpu, cuda or cuda:N, not {device!r}")
    if precision not in (None, "full", "hobbit", "lowbit-only"):
        raise MoectlError(f"--precision is full, hobbit or lowbit-only, not {precision!r}")
    # a bad MOECTL_GGML_ISA stops a run that would use ggml; a report goes on without ggml (its figures are a run's
    # without it) and says why in one line
    bad_isa = ggml.setting_error()
    with ggml.unavailable(bad_isa) if bad_isa else contextlib.nullcontext():
        prepare_model(model, workdir)
        info = inspect_model(model, workdir, dtype, lowbit, offload, device, budget, lowbit_fraction, precision)
        if is_gguf_path(info["path"]):               # ggml computes a GGUF: which build, read from its library
            info["ggml"] = ggml.describe()
    if bad_isa and "ggml" in info:
        say(f"{info['ggml']['why_not']}; the figures are without ggml (its kernels, repack and mapped weights)",
            one_line=True)
    if note:
        say(f"{note}; the memory figures are for it")
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
    if "ggml" in info:
        g = info["ggml"]
        t.add_row("ggml (CPU kernels)", f"{g['isa']} build: {g['built_for']} ({' '.join(g['features'])})"
                  if g["features"] is not None else f"unavailable: {isas.ENV}={g['isa']!r} (see above)"
                  if bad_isa else f"{g['isa']} build: not loaded ({g['why_not']})")
        if g["expert_rows"]["types"]:
            t.add_row("moectl's expert kernels", " ".join(g["expert_rows"]["types"]) if g["expert_rows"]["on"]
                      else "off (MOECTL_GGML_EXPERT_ROWS, ...)")
    Console().print(t)
    Console().print(memory_table(info["memory"]))


def memory_table(m: dict):
    from rich.table import Table

    from ..core.recipes import format_bytes

    what = (f"full copies in {'RAM' if m['offload'] == 'ram' else 'shards on disk'}"
            + (f" + {m['lowbit']} copies in RAM" if m["lowbit"] else "") + f", on {m['device']}")
    t = Table(title=f"memory: {what}", show_header=False)
    t.add_row("bytes per expert", format_bytes(m["bytes_per_expert_full"]) + (
        f" full, {format_bytes(m['bytes_per_expert_lowbit'])} {m['lowbit']}" if m["lowbit"] else ""))
    for k, name in (("dense", "host: dense weights"), ("full_copies", "host: full-precision copies"),
                    ("lowbit_copies", "host: low-bit copies"), ("cache_buffers", "host: cache buffers / staging"),
                    ("kv_reserve", "host: KV reserve")):
        if m["host"][k]:
            t.add_row(name, format_bytes(m["host"][k]))
    t.add_row("host RAM needed", format_bytes(m["host"]["total"]))
    if (m.get("ggml_repack") or {}).get("total"):   # ggml's CPU repack: copies in place of the file's pages
        r = m["ggml_repack"]
        t.add_row("of which ggml's repack", f"{format_bytes(r['total'])} anonymous, made on first use (experts "
                  f"{format_bytes(r['experts'])}, dense {format_bytes(r['dense'])}), in place of those file pages")
    if m.get("load_peak"):                  # a GGUF in place: loading holds more for a while than the run keeps
        p = m["load_peak"]
        t.add_row("host RAM peak while loading", f"{format_bytes(p['total'])} (dense {format_bytes(p['dense'])} + "
                  f"experts as held {format_bytes(p['experts'])} + {p['step_what']} {format_bytes(p['step'])})")
    if m["device"] != "cpu":
        t.add_row("device memory needed", f"{format_bytes(m['device_total'])} (dense {format_bytes(m['dense_bytes'])}"
                  f" + KV reserve {format_bytes(m['kv_reserve_bytes'])} + {m['full_slots']} full"
                  + (f" + {m['lowbit_slots']} low-bit" if m["lowbit"] else "") + " slots"
                  + ("" if m["budget"] else ", the minimum") + ")")
    return t
