"""ExpertStore: where every routed expert's bytes lie, and how to put one into a buffer.

Legend: L = MoE layers, E = experts per layer, N = bytes of one packed expert (`ExpertFormat.nbytes`).

Each expert is a few byte ranges of the shards (its tensors, or its rows of fused [E, ...] tensors),
found once from the headers; concatenated they are the packed buffer (`DenseFormat`: the layout's tensors in
the store dtype, no padding). Every buffer is uint8 [N]; the format gives typed views. Filling any [N] host
buffer (a RAM-tier buffer, a CPU cache slot, a pinned staging buffer) is one `preadv` per range,
straight into it, when the on-disk dtype is the store dtype (adjacent ranges merged); otherwise each
tensor is read and cast into place (one temporary per tensor). A demand load of a big expert is split
into equal byte spans read by as many threads as torch computes with when its bytes are in the page cache
(the compute is waiting anyway, and one thread's copy out of the page cache is slower than the memory
allows); from the disk itself it is one sequential read (interleaved streams are slower there). Every
byte is still read exactly once, straight into the buffer.

`ram` tier: one uint8 [E, N] host tensor per layer (pinned when CUDA is present), filled at load; the
shard files are closed afterwards, nothing stays mapped. On a CPU device these buffers are what the
experts are computed on (`runtime/cache.py: InPlaceExperts`).
`lowbit` (`store/lowbit.py: LowbitCopies`, `--lowbit q4g64`): a second copy of every expert, low-bit (HQQ, or
ggml blocks: `--lowbit ggml-q4_0`), always in host RAM; `host(l, e, LOW)` is its buffer. `format_of` / `nbytes`
give each precision's format.
`disk` tier: nothing up front; `load_into` reads an expert into the buffer it is given (a slot), and
`load_async` does it on one background thread (preadv releases the GIL, so reads overlap compute).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from ..core.cache_model import FULL  # the copies a store can serve are the cache's pool names
from ..errors import MoectlError
from ..formats.expert import DenseFormat, ExpertFormat
from ..models.base import ExpertLayout, FamilyAdapter
from ..progress import ProgressBar
from .checkpoint import ByteRange, Checkpoint, byte_view
from .memory import host_empty

PARALLEL_READ_MIN = 16 * 2**20      # demand loads at least this big are read by several threads


class ExpertStore:
    def __init__(self, ckpt: Checkpoint, adapter: FamilyAdapter, moe_layer_ids: list[int], dtype: torch.dtype,
                 offload: str = "ram", pin: bool = False, progress: bool = True):
        self.ckpt, self.adapter, self.dtype = ckpt, adapter, dtype
        self.moe_layer_ids = list(moe_layer_ids)              # trace layer -> model layer
        self.layout: ExpertLayout = adapter.layout()
        self.format: ExpertFormat = adapter.format(dtype)
        # A format per layer where the checkpoint's layers differ in encoding (a GGUF Q4_K_M file): their views
        # are `self.format`'s (the same parts and size), their `weights` their own (format_of(FULL, layer))
        per_layer = getattr(adapter, "format_for", None)
        self.formats = [per_layer(i, dtype) for i in self.moe_layer_ids] if per_layer else None
        self.num_experts = adapter.num_experts
        self.offload = offload
        self.expert_nbytes = self.format.nbytes
        # [L][E] byte ranges of each expert, in packed order (checked against the layout once, here).
        found = [[self._ranges(layer, e) for e in range(self.num_experts)] for layer in range(self.num_layers)]
        self.ranges = [[rs for rs, _ in row] for row in found]      # [L][E] of on-disk ranges
        self.places = [[ps for _, ps in row] for row in found]      # [L][E] of (byte offset, dtype) in the buffer
        # every range stored as the buffer holds it: reads go straight in (and may be split over threads)
        self.raw = all(r.dtype == dt for row in found for rs, ps in row for r, (_, dt) in zip(rs, ps))
        self._reader: ThreadPoolExecutor | None = None       # the background (prefetch) reader
        self._helpers: ThreadPoolExecutor | None = None      # threads that split one demand read
        self.buffers: list[torch.Tensor] | None = None       # [L] of uint8 [E, N] (ram tier)
        self.lowbit = None                                   # LowbitCopies, when --lowbit is given
        if offload == "ram":
            buffers = []
            with ProgressBar(progress, transient=True) as bar:
                task = bar.add("reading experts", self.num_layers * self.num_experts)
                for layer in range(self.num_layers):
                    # touch=True: with huge pages, zeroing then reading beats faulting pages in during the read
                    buf = host_empty((self.num_experts, self.expert_nbytes), torch.uint8, "reading experts into RAM",
                                     pin=pin, touch=True)
                    for e in range(self.num_experts):
                        self.load_into(layer, e, buf[e], parallel=True)
                        bar.update(task, advance=1)
                    buffers.append(buf)
            self.buffers = buffers
            ckpt.close()

    @property
    def num_layers(self) -> int:
        return len(self.moe_layer_ids)

    def format_of(self, precision: str = FULL, layer: int | None = None):
        """The format of `precision`'s copies; with `layer` (MoE index), that layer's own (its `weights`)."""
        if precision != FULL:
            return self._low().format
        return self.format if self.formats is None or layer is None else self.formats[layer]

    def nbytes(self, precision: str = FULL) -> int:
        return self.expert_nbytes if precision == FULL else self._low().expert_nbytes

    def _low(self):
        if self.lowbit is None:
            raise MoectlError("no low-bit copies are loaded: give --lowbit (made by `moectl quantize`)")
        return self.lowbit

    def _ranges(self, layer: int, expert: int) -> tuple[list[ByteRange], list[tuple[int, torch.dtype]]]:
        """The expert's on-disk byte ranges and where each lands in the packed buffer (byte offset, dtype there),
        each checked against the format; ranges adjacent on disk and in the buffer merged. A dense format is
        the layout's tensors back to back (gate and up rows both fill `gate_up`); any other format (a checkpoint
        released quantized) has one part per on-disk tensor, in order, at the format's offsets."""
        model_layer = self.moe_layer_ids[layer]
        parts = [self.ckpt.range(k, row) for k, row in self.adapter.expert_parts(self.ckpt, model_layer, expert)]
        where = f"expert {expert} of layer {model_layer} in {self.ckpt.path}"
        if isinstance(self.format, DenseFormat):
            bounds, start = [], 0
            for shape in self.layout.shapes:
                bounds.append((start, start + math.prod(shape), shape))
                start += math.prod(shape)
            pos, dst = 0, []
            for r in parts:
                n = math.prod(r.shape)
                entry = next((b for b in bounds if b[0] <= pos < b[1]), None)
                if entry is None or pos + n > entry[1] or tuple(r.shape[1:]) != tuple(entry[2][1:]):
                    want = entry[2] if entry else ()
                    raise MoectlError(f"{where} has a tensor of shape {tuple(r.shape)}, config says {tuple(want)}")
                dst.append((pos * self.dtype.itemsize, self.dtype))
                pos += n
            if pos != self.layout.numel:
                raise MoectlError(f"{where} has {pos} weights, config says {self.layout.numel}")
        else:
            fparts = self.format.parts
            padded = getattr(self.format, "padded", False) or self.formats is not None   # parts sized to the largest
            for r, p in zip(parts, fparts):
                n = math.prod(r.shape)
                if (n > p.numel if padded else n != p.numel) or (not p.dtype.is_floating_point and r.dtype != p.dtype):
                    raise MoectlError(f"{where} has a tensor of shape {tuple(r.shape)} ({r.dtype}) for {p.name}, "
                                      f"the {self.format.name} format of this config says {p.shape} ({p.dtype})")
            if len(parts) != len(fparts):
                raise MoectlError(f"{where} has {len(parts)} tensors, the {self.format.name} format has {len(fparts)}")
            dst = [(self.format.spans[p.name][0], p.dtype) for p in fparts]
        merged, places = [parts[0]], [dst[0]]
        for r, (off, dt) in zip(parts[1:], dst[1:]):
            m, (moff, mdt) = merged[-1], places[-1]
            if (r.file == m.file and r.dtype == m.dtype and dt == mdt and r.offset == m.offset + m.nbytes
                    and off == moff + math.prod(m.shape) * dt.itemsize):
                merged[-1] = ByteRange(m.file, m.offset, m.nbytes + r.nbytes, m.dtype, (math.prod(m.shape) +
                                                                                       math.prod(r.shape),))
            else:
                merged.append(r)
                places.append((off, dt))
        return merged, places

    def load_into(self, layer: int, expert: int, dst: torch.Tensor, parallel: bool = False) -> None:
        """Fill the uint8 [N] host buffer `dst` with (MoE layer `layer`, expert) in full precision: a copy of the
        RAM-tier buffer, or the shard bytes read straight into it (`parallel`: by several threads, for a demand
        load)."""
        if self.buffers is not None and dst.data_ptr() != self.buffers[layer][expert].data_ptr():
            dst.copy_(self.buffers[layer][expert])
            return
        ranges, places = self.ranges[layer][expert], self.places[layer][expert]
        view = byte_view(dst)
        if self.raw:
            # several threads only when the bytes come from the page cache (a memcpy, faster split); from the disk
            # itself one sequential stream is faster than two interleaved ones (bench/realsize.py's cold runs)
            parallel = parallel and self.ckpt.cached(ranges)
            spans = self._spans(ranges, places, torch.get_num_threads() if parallel else 1)

            def read(span):
                for r, pos in span:
                    self.ckpt.read_into(r, view[pos:pos + r.nbytes])

            if len(spans) == 1:
                read(spans[0])
                return
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(max_workers=len(spans) - 1, thread_name_prefix="moectl-read")
            helped = [self._helpers.submit(read, sp) for sp in spans[1:]]
            try:
                read(spans[0])                          # this thread reads the first span itself
            finally:
                wait(helped)
            for f in helped:
                f.result()                              # re-raise a helper's read error here
            return
        for r, (pos, dt) in zip(ranges, places):
            if r.dtype == dt:                           # stored as the buffer holds it: straight in
                self.ckpt.read_into(r, view[pos:pos + r.nbytes])
                continue
            n = math.prod(r.shape)                      # another dtype on disk: read, then cast into place
            t = torch.empty(n, dtype=r.dtype)
            self.ckpt.read_into(r, byte_view(t))
            dst[pos:pos + n * dt.itemsize].view(dt).copy_(t)

    def _spans(self, ranges: list[ByteRange], places: list[tuple[int, torch.dtype]],
               workers: int) -> list[list[tuple[ByteRange, int]]]:
        """The ranges cut into `workers` spans of equal bytes: [(piece, byte offset in the packed buffer)] each."""
        total = sum(r.nbytes for r in ranges)
        if workers <= 1 or total < PARALLEL_READ_MIN:
            workers = 1
        step = -(-total // workers)
        spans: list[list[tuple[ByteRange, int]]] = [[] for _ in range(workers)]
        read = 0                                        # bytes of the ranges before this one
        for r, (pos, _) in zip(ranges, places):
            done = 0
            while done < r.nbytes:
                w = (read + done) // step
                n = min(r.nbytes - done, (w + 1) * step - (read + done))
                spans[w].append((ByteRange(r.file, r.offset + done, n, r.dtype, (n // r.dtype.itemsize,)), pos + done))
                done += n
            read += r.nbytes
        return [sp for sp in spans if sp]

    def load_async(self, layer: int, expert: int, dst: torch.Tensor, then=None) -> Future:
        """`load_into` on the background reader thread (then `then()` there); the Future re-raises its errors."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moectl-reader")

        def job():
            self.load_into(layer, expert, dst)
            if then is not None:
                then()

        return self._reader.submit(job)

    def host(self, layer: int, expert: int, precision: str = FULL) -> torch.Tensor:
        """The packed RAM-tier buffer uint8 [N] of (MoE layer `layer`, expert); a view, never a copy."""
        if precision != FULL:
            return self._low().host(layer, expert)
        if self.buffers is None:
            raise MoectlError("the disk tier keeps no host copy of the experts; load one into a buffer with load_into")
        return self.buffers[layer][expert]
