"""ExpertFormat: how one expert's bytes sit in one flat uint8 buffer, and how they become weights.

Legend: N = bytes of one packed expert (`ExpertFormat.nbytes`).

Every copy of an expert the runtime moves (a RAM-tier buffer, a disk read, a device cache slot) is one
contiguous uint8 buffer [N], so a load is one transfer whatever the precision. A format says:

  parts      (name, shape, dtype) of each tensor in the buffer, in order; each starts at a multiple of its
             dtype's size (the dense formats need no padding: their parts share one dtype).
  nbytes     the buffer's size.
  views(buf) the parts as typed tensors viewing `buf` (no copy): {name: tensor}.
  weights(v) the matrices the family's `expert_forward` multiplies with, from those views:
             {"gate_up": W, "down": W, ...} (the names and shapes of `ExpertLayout`).

The dense format (`DenseFormat`, bf16/fp16/fp32: the checkpoint's own tensors) is the trivial case: its parts
ARE the layout's tensors and `weights` returns the views as they are, so the lossless path copies and
multiplies exactly the checkpoint's bytes. A quantized format (`moectl/formats/hqq.py: HqqFormat`)
stores packed integers, scales and zeros as its parts and dequantises in `weights`, on whatever device the
buffer is on (the copy happens first, the dequantisation where the expert is computed).

Adding a format (e.g. MXFP4 blocks + scales as released, FP8 + per-block scales):
  1. subclass `ExpertFormat`; in `__init__` build the parts from the adapter's `ExpertLayout` (one entry per
     stored tensor: `Part("gate_up.blocks", shape, torch.uint8)`, ...) and call `super().__init__(name, parts)`;
     `name` is what the user types and what artifacts record (`"q4g64"`, `"mxfp4"`);
  2. override `weights(views)` to return every layout name as a tensor of the compute dtype (dequantise there;
     keep it free of host syncs so it runs on the device the buffer is on);
  3. give a way to fill a buffer: `pack({part: tensor})` writes tensors of the parts' shapes and dtypes, so a
     writer (`moectl quantize`) or a reader of another on-disk layout only has to produce the parts;
  4. `describe()` goes into artifacts' JSON; add what a reader must check (bits, group size, ...).
The store, the cache pools and the runtime only ever see `nbytes`, `views` and `weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """One tensor of a packed expert."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class ExpertFormat:
    """Byte layout of one packed expert; `weights` is the identity (the parts are the matrices)."""

    def __init__(self, name: str, parts: tuple[Part, ...] | list[Part]):
        self.name, self.parts = name, tuple(parts)
        spans, pos = {}, 0
        for p in self.parts:
            pos = -(-pos // p.dtype.itemsize) * p.dtype.itemsize          # aligned to its dtype
            spans[p.name] = (pos, pos + p.nbytes)
            pos += p.nbytes
        self.spans: dict[str, tuple[int, int]] = spans                     # name -> (start, end) byte offsets
        self.nbytes = -(-pos // 8) * 8 if len({p.dtype for p in self.parts}) > 1 else pos

    @property
    def precision_name(self) -> str:
        """What a live view calls a copy in this format (`runtime/live_view.py: residency`): its name; a format that
        only says where a GGUF's blocks are computed (`gguf_ggml.py`: ggml, on the mapped file) names the file's
        encodings."""
        return self.name

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views {part name: tensor} of the uint8 buffer `buf` [N] (on any device; no copy)."""
        out = {}
        for p in self.parts:
            a, b = self.spans[p.name]
            out[p.name] = buf[a:b].view(p.dtype).view(p.shape)
        return out

    def weights(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The matrices `expert_forward` uses, from `views(buf)`; dense formats return the views themselves."""
        return views

    def pack(self, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """A uint8 buffer [N] holding `tensors` (one per part, cast to the part's dtype); into `out` if given."""
        buf = torch.zeros(self.nbytes, dtype=torch.uint8) if out is None else out
        for name, v in self.views(buf).items():
            v.copy_(tensors[name].reshape(v.shape))
        return buf

    def describe(self) -> dict:
        """What an artifact records about the format (readers compare it)."""
        return {"name": self.name, "nbytes": self.nbytes,
                "parts": [[p.name, list(p.shape), str(p.dtype).replace("torch.", "")] for p in self.parts]}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.nbytes} bytes)"


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class DenseFormat(ExpertFormat):
    """The checkpoint's tensors in one float dtype, concatenated in layout order (no padding)."""

    def __init__(self, layout, dtype: torch.dtype):
        self.layout, self.dtype = layout, dtype
        super().__init__(DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", "")),
                         [Part(n, tuple(s), dtype) for n, s in zip(layout.names, layout.shapes)])
