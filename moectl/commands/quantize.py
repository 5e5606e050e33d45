"""`moectl quantize`: HQQ low-bit copies of every routed expert (`--lowbit q{bits}g{group}` then serves them), or
ggml block copies (`--format ggml-q4_0`; `--lowbit ggml-q4_0` serves them)."""

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
    fmt: str = typer.Option("hqq", "--format", help="hqq: HQQ's packing, set by --bits/--group-size/--axis/"
                            "--method. ggml-q4_0, ggml-q8_0, ggml-q4_k: llama.cpp's blocks (Q4_0: 32 weights and "
                            "one fp16 scale, 4.5 bits a weight; Q8_0: 8.5; Q4_K: 256-weight super-blocks, 4.5), "
                            "quantized by ggml's own quantizer (round to nearest, as llama-quantize without an "
                            "imatrix; the --bits/--group-size/--axis/--method flags do not apply) and computed on "
                            "the CPU by ggml's kernels on any x86 or ARM CPU (moectl's own q4/q8 kernels need "
                            "AVX-512 VNNI). Serve with --lowbit ggml-q4_0."),
    as_json: bool = typer.Option(False, "--json", help="Print the copy set's JSON descriptor."),
):
    """Quantize every routed expert with HQQ's quantizer (no calibration data; --method rtn or hqq), or ggml's
    (--format ggml-q4_0 ...), into one packed buffer per expert: <workdir>/experts-q{bits}g{group}.safetensors
    (experts-ggml-q4_0...) + .json (settings, per-layer relative error, bytes per expert, fingerprint).
    Resumable: Ctrl-C keeps finished layers, a second run does the rest."""
    from rich.console import Console
    from rich.table import Table

    from ..core.recipes import format_bytes
    from ..quant.quantize import quantize_model
    from ..store.facts import pick_device

    device, device_note = pick_device(device)       # checked first, said once the settings are (`quantize_model`)
    prepare_model(model, workdir)
    writable_workdir(model, workdir)                # the copies go there
    meta = quantize_model(model, bits, group_size, axis, device=device, workdir=workdir, dtype=dtype,
                          progress=not as_json, method=method, device_note=device_note, fmt=fmt)
    if as_json:
        print(json.dumps(meta))
        return
    errs = [x["rel_error"] for x in meta["layers"]]
    how = f"ggml's {meta['encoding']}" if "encoding" in meta else f"{meta['method']}, axis {meta['axis']}"
    t = Table(title=f"{meta['model']}: {meta['name']} copies ({how})"
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
