"""`moectl quantize`: HQQ low-bit copies of every routed expert, written once, resumable layer by layer.

Legend: L = MoE layers, E = experts per layer, N = bytes of one packed low-bit expert (`HqqFormat.nbytes`).

For each MoE layer: each expert is read from the checkpoint (the store's disk tier: its bytes straight into one
buffer), each of its matrices quantized by HQQ (`Quantizer.quantize`, no calibration data; on the GPU when one
is there; with its optimiser (`--method hqq`, the GPU's default) or round-to-nearest (`rtn`, the CPU's), see
`methods.py`) and the codes, scales and zeros packed into that expert's row of a uint8 [E, N] tensor: one contiguous
buffer per expert, so a copy is one transfer. A finished layer is written to `<stem>.parts/layer-NNN.safetensors`
(written to a temporary name, then renamed: Ctrl-C leaves finished layers and nothing half-written), with the
settings in its metadata; a second run skips the layers whose part matches the settings and redoes the rest.
When every layer is done the parts become the copy set (its files: `artifacts/lowbit.py`).

HQQ is deterministic, so an interrupted run resumed gives the file an uninterrupted run gives.

`fmt="ggml-q4_0"` (or ggml-q8_0, ggml-q4_k) writes ggml's blocks instead (`formats/ggml_copies.py`: ggml's own
quantizer, round to nearest per block as llama-quantize without an importance matrix; bits, group, axis and method
do not apply), the same way, named by the format: `--lowbit ggml-q4_0` serves them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

from ..artifacts.lowbit import FORMAT, HQQ_VERSION, KEY, SHARD_BYTES, VERSION, copy_paths
from ..errors import MoectlError
from ..formats.ggml_copies import FORMAT_VERSION as GGML_FORMAT_VERSION, GgmlCopyFormat, is_ggml_copy
from ..formats.hqq import HqqFormat, check_settings, lowbit_name
from ..progress import ProgressBar
from .methods import check_method, optimize


def _settings(fingerprint: str, fmt: HqqFormat | GgmlCopyFormat, dtype: torch.dtype, method: str) -> dict:
    if isinstance(fmt, GgmlCopyFormat):
        return {"fingerprint": fingerprint, "method": method, "encoding": fmt.encoding.name,
                "ggml_format_version": GGML_FORMAT_VERSION, "dtype": str(dtype).replace("torch.", ""),
                "bytes_per_expert": fmt.nbytes}
    return {"fingerprint": fingerprint, "method": method, "bits": fmt.bits, "group_size": fmt.group,
            "axis": fmt.axis, "dtype": str(dtype).replace("torch.", ""), "bytes_per_expert": fmt.nbytes}


def _done_part(path: Path, settings: dict) -> float | None:
    """The relative error stored in a finished layer part made with `settings`, else None."""
    from safetensors import safe_open

    if not path.exists():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if json.loads(meta.get("settings", "{}")) != settings:
            return None
        return float(meta["rel_error"])
    except Exception:                   # damaged or foreign: redo the layer
        return None


def quantize_model(model: str, bits: int, group: int = 64, axis: int = 1, device: str | None = None,
                   workdir: str | None = None, dtype: str | None = None, progress: bool = True,
                   on_expert=None, method: str | None = None, device_note: str | None = None,
                   fmt: str | None = None) -> dict:
    """Write (or finish) the copy set of `model` at `bits`/`group`/`axis` (HQQ), or in ggml's blocks with `fmt`
    (ggml-q4_0, ggml-q8_0, ggml-q4_k); returns its JSON descriptor.
    `device`: cpu or cuda (default: cuda when present). `method`: rtn or hqq (`quant/methods.py`; default rtn
    on a CPU, hqq on a GPU). `on_expert(layer, expert)` runs after each expert (tests use it to interrupt a run).
    `device_note` (the device taken and why) is printed on stderr once the settings are checked."""
    from safetensors.torch import load_file, save_file

    from ..core.recipes import resolve_model
    from ..models import config_fingerprint
    from ..store.checkpoint import Checkpoint
    from ..store.expert_store import ExpertStore
    from ..store.facts import built, load_config, parse_dtype, pick_device, skeleton

    ggml_copy = fmt is not None and fmt.strip().lower() != "hqq"
    if ggml_copy and not is_ggml_copy(fmt):
        raise MoectlError(f"--format {fmt!r}: choose hqq, ggml-q4_0, ggml-q8_0 or ggml-q4_k")
    device = pick_device(device)[0]
    if ggml_copy:
        from ..kernels import ggml

        ggml.require()                              # built here on first use, or one error: line saying why not
        device, method = "cpu", "rtn"               # ggml's quantizer: round to nearest, on the CPU
    method = check_method(method, device)
    ref = built(resolve_model(model, workdir))
    config, adapter = load_config(ref.path)
    if adapter.gguf is not None:
        s = adapter.gguf.sizes()
        raise MoectlError(f"{ref.path} is a GGUF file: its experts are already stored low-bit "
                          f"({adapter.format_names()}, {s['bits_per_weight']:.2f} bits per weight) and run as "
                          f"stored, that is their full precision here; `moectl quantize` makes low-bit copies "
                          f"of a safetensors checkpoint's experts")
    dt = parse_dtype(dtype, config)
    if not ggml_copy:
        check_settings(bits, group, axis, adapter.layout().shapes)
    if device_note:
        from rich.console import Console

        Console(stderr=True).print(f"[dim]{device_note}[/]", highlight=False)
    _, blocks = skeleton(config, adapter, dt, ref.path)
    moe_layer_ids = [i for i, _ in blocks]
    fingerprint = config_fingerprint(config)
    fmt = GgmlCopyFormat(adapter.layout(), fmt, dt) if ggml_copy else HqqFormat(adapter.layout(), bits, group, axis, dt)
    name = fmt.name if ggml_copy else lowbit_name(bits, group)
    dequantized = fmt.dequantized if ggml_copy else fmt.weights
    json_path, parts_dir = copy_paths(ref.workdir, name)
    settings = _settings(fingerprint, fmt, dt, method)
    L, E = len(moe_layer_ids), adapter.num_experts
    if json_path.exists():                          # finished before with these settings: nothing to do
        try:
            old = json.loads(json_path.read_text())
        except json.JSONDecodeError:
            old = {}
        if all(old.get(k) == v for k, v in settings.items()) and \
                all((ref.workdir / f).exists() for f in old.get("shards", {})):
            return old | {"path": str(json_path), "seconds": 0.0, "up_to_date": True}

    store = ExpertStore(Checkpoint(ref.path), adapter, moe_layer_ids, dt, offload="disk", progress=False)
    parts_dir.mkdir(parents=True, exist_ok=True)
    errors: list[float | None] = [_done_part(parts_dir / f"layer-{l:03d}.safetensors", settings) for l in range(L)]
    todo = [l for l in range(L) if errors[l] is None]
    full = torch.empty(store.expert_nbytes, dtype=torch.uint8)
    t0, done = time.perf_counter(), 0
    with ProgressBar(progress) as bar:
        task = bar.add(f"quantizing experts to {name} ({method}) on {device}", total=L * E)
        bar.update(task, completed=(L - len(todo)) * E, info=f"{L - len(todo)} layers already done" if
                   len(todo) < L else "")
        for l in todo:
            out = torch.zeros(E, fmt.nbytes, dtype=torch.uint8)
            err2 = ref2 = 0.0
            for e in range(E):
                store.load_into(l, e, full)
                w = store.format.views(full)
                fmt.quantize(w, out=out[e], device=device, optimize=optimize(method))
                deq = dequantized(fmt.views(out[e]))
                for m in adapter.layout().names:
                    err2 += float((deq[m].float() - w[m].float()).pow(2).sum())
                    ref2 += float(w[m].float().pow(2).sum())
                done += 1
                left = (time.perf_counter() - t0) / done * (len(todo) * E - done)
                bar.update(task, advance=1, info=f"layer {l + 1}/{L}, ETA {left:.0f}s")
                if on_expert is not None:
                    on_expert(l, e)
            errors[l] = math.sqrt(err2 / ref2) if ref2 > 0 else 0.0
            part = parts_dir / f"layer-{l:03d}.safetensors"
            tmp = part.with_suffix(".tmp")
            save_file({KEY.format(l=l): out}, str(tmp),
                      metadata={"settings": json.dumps(settings, sort_keys=True), "rel_error": repr(errors[l])})
            os.replace(tmp, part)
    store.ckpt.close()

    # Every layer done: the parts become the copy set.
    total = L * E * fmt.nbytes
    stem = f"experts-{name}"
    if total <= SHARD_BYTES:
        shards = {f"{stem}.safetensors": list(range(L))}
        tensors = {}
        for l in range(L):
            tensors.update(load_file(str(parts_dir / f"layer-{l:03d}.safetensors")))
        tmp = ref.workdir / f"{stem}.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"settings": json.dumps(settings, sort_keys=True)})
        os.replace(tmp, ref.workdir / f"{stem}.safetensors")
    else:
        shards = {}
        for l in range(L):
            fname = f"{stem}-{l + 1:05d}-of-{L:05d}.safetensors"
            os.replace(parts_dir / f"layer-{l:03d}.safetensors", ref.workdir / fname)
            shards[fname] = [l]
    if ggml_copy:
        from ..kernels.ggml import LLAMACPP_VERSION

        how = {"version": VERSION, "quantizer": f"ggml (llama-cpp-python {LLAMACPP_VERSION})",
               "encoding": settings["encoding"], "ggml_format_version": GGML_FORMAT_VERSION,
               "bits_per_weight": 8 * fmt.nbytes / adapter.layout().numel}
    else:
        import hqq

        how = {"version": HQQ_VERSION, "hqq_version": getattr(hqq, "__version__", "?"), "bits": bits,
               "group_size": group, "axis": axis}
    meta = {"format": FORMAT, "model": ref.name, "fingerprint": fingerprint, "name": name, "method": method,
            **how, "dtype": settings["dtype"], "num_layers": L, "num_experts": E, "moe_layer_ids": moe_layer_ids,
            "bytes_per_expert": fmt.nbytes, "full_bytes_per_expert": store.expert_nbytes,
            "expert_format": fmt.describe(), "key": KEY,
            "layers": [{"layer": l, "model_layer": moe_layer_ids[l], "rel_error": errors[l]} for l in range(L)],
            "shards": shards}
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, json_path)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return meta | {"path": str(json_path), "seconds": time.perf_counter() - t0}
