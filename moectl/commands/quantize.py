"""`moectl quantize`: HQQ low-bit copies of every routed expert (`--lowbit q{bits}g{group}` then serves them)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ._common import CacheOpts, prepare_model, writable_workdir


def quantize(
    model: str = typer.Option(..., "--model", "-m", help="Recipe name (e.g. tiny, mixtral), checkpoint directory or .gguf file."),
    bits: int = typer.Option(4, "--bits", help="Bits per weight: 8, 4, 3 or 2."),
    group_size: int = typer.Option(64, "--group-size", help="Weights per HQQ group (one scale and zero each); "
                                   "a multiple of 8 dividing every expert matrix."),
    axis: int = typer.Option(1, "--axis", help="HQQ grouping axis: 1 groups along the input dimension (HQQ 0.2's "
                             "default, what fast kernels want), 0 along the output dimension (better at 2-3 bits)."),
    device: str = typer.Option("auto", "--device", help="Where HQQ runs: auto (CUDA when torch sees a device, "
                                                        "else the CPU), cpu, cuda or cuda:N."),
    method: Optional[str] = typer.Option(None, "--method", help="rtn: round-to-nearest per group (minutes on a "
                                         "CPU); hqq: HQQ's optimiser refines scales and zeros (hours for Mixtral on "
                                         "a CPU, seconds per layer on a GPU). Default: rtn on cpu, hqq on cuda. On "
                                         "the reference model hqq's q4g64 copies cost +0.06 % perplexity, rtn's "
                                         "+0.20 % (docs/benchmarks.md)."),
    workdir: Optional[str] = CacheOpts.workdir(),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="dtype of scales, zeros and the dequantised weights "
                                        "(default: the checkpoint's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the copy set's JSON descriptor."),
):
    """Quantize every routed expert with HQQ's quantizer (no calibration data; --method rtn or hqq) into one
    packed buffer per expert: <workdir>/experts-q{bits}g{group}.safetensors + .json (settings, per-layer relative error, bytes per expert,
    fingerprint). Resumable: Ctrl-C keeps finished layers, a second run does the rest."""
    from rich.console import Console
    from rich.table import Table

    from ..core.recipes import format_bytes
    from ..quant.quantize import quantize_model
    from ..store.facts import pick_device

    device, device_note = pick_device(device)       # checked first, said once the settings are (`quantize_model`)
    prepare_model(model, workdir)
    writable_workdir(model, workdir)                # the copies go there
    meta = quantize_model(model, bits, group_size, axis, device=device, workdir=workdir, dtype=dtype,
                          progress=not as_json, method=method, device_note=device_note)
    if as_json:
        print(json.dumps(meta))
        return
    errs = [x["rel_error"] for x in meta["layers"]]
    t = Table(title=f"{meta['model']}: {meta['name']} copies ({meta['method']}, axis {meta['axis']})"
              + (" -- already up to date" if meta.get("up_to_date") else f" in {meta['seconds']:.1f} s"),
              show_header=False)
    t.add_row("descriptor", meta["path"])
    ratio = meta["bytes_per_expert"] / meta["full_bytes_per_expert"]
    t.add_row("bytes per expert", f"{format_bytes(meta['bytes_per_expert'])} (full precision "
              f"{format_bytes(meta['full_bytes_per_expert'])}, x{ratio:.3f})")
    t.add_row("copy set", format_bytes(meta["bytes_per_expert"] * meta["num_layers"] * meta["num_experts"]))
    t.add_row("relative weight error per layer", f"mean {sum(errs) / len(errs):.4f}, max {max(errs):.4f}")
    t.add_row("serve with", f"--lowbit {meta['name']} [--precision hobbit|lowbit-only]")
    Console().print(t)
