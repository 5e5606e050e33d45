"""LowbitCopies: the host tier of an expert's low-bit copy (`moectl quantize`'s output), read into RAM.

Legend: L = MoE layers, E = experts per layer, N = bytes of one packed low-bit expert.

`--lowbit q4g64` names the copy set `<workdir>/experts-q4g64.json` (+ its safetensors shards). Its descriptor
is checked before a byte is read: format and version, the model fingerprint (copies of another model are an
error), bits and group size (a file renamed to another name is an error), layer and expert counts, and the
packed size the format computes. Then each layer's uint8 [E, N] tensor is read straight into one host buffer
(pinned when CUDA is present): the low-bit tier always lives in host RAM, whatever `--offload` says for the
full-precision copies. `--lowbit ggml-q4_0` (ggml-q8_0, ggml-q4_k) names ggml block copies
(`experts-ggml-q4_0.json`, `formats/ggml_copies.py`): checked the same way, their encoding and block-format version
instead of bits and group size, and kept as written (ggml computes their blocks; no CPU-kernel repack). On the CPU
(not pinned) with ggml loaded, ggml copies are not read but mapped from their shards copy-on-write, as a GGUF is,
and the map registered as stable memory (`kernels/ggml.py: register_stable`): ggml's CPU_REPACK then makes its
interleaved copy of each expert on first use (llama.cpp's Q4_0 GEMV / GEMM kernels) and the mapped pages it copied
leave the process, so RAM holds one copy of each expert, not two.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import torch

from ..artifacts.lowbit import FORMAT, KEY, VERSION, copy_paths
from ..artifacts.versioned import read_descriptor, require_int
from ..errors import MoectlError
from ..formats.cpu_layout import cpu_kernel_format
from ..formats.ggml_copies import ENCODINGS, FORMAT_VERSION, GgmlCopyFormat, is_ggml_copy
from ..formats.hqq import HqqFormat, parse_lowbit
from ..kernels import ggml
from ..progress import ProgressBar
from .checkpoint import byte_view, parse_header, read_at
from .memory import host_empty

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lowbit_format(meta: dict, adapter, compute_dtype: torch.dtype, path) -> HqqFormat | GgmlCopyFormat:
    """The copies' format from their descriptor, checked against the format this moectl computes."""
    dt = DTYPES.get(meta.get("dtype"))
    if dt is None:
        raise MoectlError(f"{path}: dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    if is_ggml_copy(meta.get("name")):
        if meta.get("ggml_format_version") != FORMAT_VERSION:
            raise MoectlError(f"{path}: ggml copies of format version {meta.get('ggml_format_version')!r}, this "
                              f"moectl reads {FORMAT_VERSION}: run `moectl quantize --format {meta['name']}` again")
        fmt = GgmlCopyFormat(adapter.layout(), meta["name"], compute_dtype)
    else:
        fmt = HqqFormat(adapter.layout(), require_int(meta, "bits", path), require_int(meta, "group_size", path),
                        require_int(meta, "axis", path), dt, compute_dtype)
    if require_int(meta, "bytes_per_expert", path) != fmt.nbytes:
        raise MoectlError(f"{path}: {meta['bytes_per_expert']} bytes per expert, the {fmt.name} format of this "
                          f"model has {fmt.nbytes} (made by another moectl version or for another model)")
    return fmt


def read_lowbit_meta(workdir, name: str, fingerprint: str, num_layers: int, num_experts: int) -> tuple[dict, Path]:
    if is_ggml_copy(name):
        name = name.strip().lower()
        path, _ = copy_paths(Path(workdir), name)
        if not path.exists():
            raise MoectlError(f"no low-bit copies {name} in {workdir} ({path.name} is missing): run "
                              f"`moectl quantize --model <model> --format {name}` first")
        meta = read_descriptor(path, FORMAT, what="low-bit copy set", version_key="version", max_version=VERSION,
                               expect_fingerprint=fingerprint)
        if meta.get("name") != name or meta.get("encoding") != ENCODINGS[name].name:
            raise MoectlError(f"{path} holds {meta.get('name')} copies, not the {name} asked for (renamed file?): "
                              f"run `moectl quantize --format {name}`")
    else:
        bits, group = parse_lowbit(name)
        path, _ = copy_paths(Path(workdir), f"q{bits}g{group}")
        if not path.exists():
            raise MoectlError(f"no low-bit copies {name} in {workdir} ({path.name} is missing): run "
                              f"`moectl quantize --model <model> --bits {bits} --group-size {group}` first")
        meta = read_descriptor(path, FORMAT, what="low-bit copy set", version_key="version", max_version=VERSION,
                               expect_fingerprint=fingerprint)
    if not is_ggml_copy(name) and (meta.get("bits"), meta.get("group_size")) != (bits, group):
        raise MoectlError(f"{path} holds q{meta.get('bits')}g{meta.get('group_size')} copies, not the {name} asked "
                          f"for (renamed file?): run `moectl quantize --bits {bits} --group-size {group}`")
    if (require_int(meta, "num_layers", path), require_int(meta, "num_experts", path)) != (num_layers, num_experts):
        raise MoectlError(f"{path}: {meta['num_layers']} MoE layers x {meta['num_experts']} experts, the model has "
                          f"{num_layers} x {num_experts}")
    return meta, path


class LowbitCopies:
    def __init__(self, workdir, name: str, fingerprint: str, adapter, num_layers: int, compute_dtype: torch.dtype,
                 pin: bool = False, progress: bool = True, cpu_kernel: bool = False):
        # cpu_kernel: the experts will be computed on the CPU (a CPU run, or misses placed there with
        # --cpu-experts); q4 axis-1 and q8 copies are then repacked once, here, for torch's int4 / int8 CPU
        # kernels (formats/cpu_layout.py), layouts a GPU slot dequantises too.
        meta, path = read_lowbit_meta(workdir, name, fingerprint, num_layers, adapter.num_experts)
        self.meta, self.path = meta, path
        self.format = lowbit_format(meta, adapter, compute_dtype, path)
        stored = self.format
        self.name, self.num_layers, self.num_experts = self.format.name, num_layers, adapter.num_experts
        self.expert_nbytes = stored.nbytes
        ranges = {}
        for fname in meta.get("shards", {}):
            f = path.parent / fname
            if not f.exists():
                raise MoectlError(f"{path} lists shard {fname}, which is missing: run `moectl quantize` again")
            ranges.update(parse_header(f))
        self.buffers: list[torch.Tensor] = []            # [L] of uint8 [E, N]
        # ggml copies computed by ggml on the CPU: mapped, for its repack (the docstring); read (pinned) for a GPU
        self.mapped = isinstance(stored, GgmlCopyFormat) and not pin and ggml.planned() and ggml.library() is not None
        with ProgressBar(progress, transient=True) as bar:
            task = bar.add(f"reading {self.name} copies", num_layers)
            for l in range(num_layers):
                r = ranges.get(KEY.format(l=l))
                if r is None or r.dtype != torch.uint8 or r.shape != (self.num_experts, self.expert_nbytes):
                    raise MoectlError(f"{path}: layer {l}'s copies are missing or of the wrong size "
                                      f"({r.shape if r else 'absent'}, want {(self.num_experts, self.expert_nbytes)})")
                if self.mapped:
                    self.buffers.append(self._map(r, path))
                    bar.update(task, advance=1)
                    continue
                buf = host_empty((self.num_experts, self.expert_nbytes), torch.uint8, f"reading {self.name} copies",
                                 pin=pin)
                fd = os.open(r.file, os.O_RDONLY)
                try:
                    view, pos = byte_view(buf), 0
                    while pos < r.nbytes:
                        n = read_at(fd, view[pos:], r.offset + pos)
                        if n <= 0:
                            raise MoectlError(f"{r.file} is truncated")
                        pos += n
                finally:
                    os.close(fd)
                self.buffers.append(buf)
                bar.update(task, advance=1)
        # (ggml copies need none: ggml computes their blocks as stored)
        kernel_fmt = cpu_kernel_format(stored) if (cpu_kernel and adapter.linear_callables
                                                   and isinstance(stored, HqqFormat)) else None
        if kernel_fmt is not None:
            self._repack(kernel_fmt, pin)

    def _map(self, r, path) -> torch.Tensor:
        """A layer's [E, N] bytes where they lie in the shard: a copy-on-write map (never written), registered with
        ggml as stable, asked for in the background (MADV_WILLNEED: the first tokens touch every expert)."""
        if r.file.stat().st_size < r.offset + r.nbytes:
            raise MoectlError(f"{r.file} is truncated (run `moectl quantize --format {self.name}` again)")
        arr = np.memmap(r.file, dtype=np.uint8, mode="c", offset=r.offset, shape=(self.num_experts, self.expert_nbytes))
        mm = getattr(arr, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_WILLNEED)
        ggml.register_stable(arr)
        return torch.from_numpy(arr)

    def _repack(self, fmt, pin: bool) -> None:
        # Every expert converted into `fmt`, one layer at a time (the peak is one extra layer).
        for layer, buf in enumerate(self.buffers):
            out = host_empty((self.num_experts, fmt.nbytes), torch.uint8, f"repacking {self.name} copies", pin=pin)
            for e in range(self.num_experts):
                fmt.repack(buf[e], out[e])
            self.buffers[layer] = out
        self.format, self.expert_nbytes = fmt, fmt.nbytes

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_experts * self.expert_nbytes

    def host(self, layer: int, expert: int) -> torch.Tensor:
        return self.buffers[layer][expert]
