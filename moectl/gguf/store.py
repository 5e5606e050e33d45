"""What the existing `ExpertStore` needs to read a GGUF model's experts, with no change to it.

Legend: E = experts, N = bytes of one packed expert.

`ExpertStore(ckpt, adapter, moe_layer_ids, dtype, offload)` asks the checkpoint for byte ranges
(`ckpt.range(key, row)`, read with `ckpt.read_into` by positioned reads) and the adapter for the expert's keys
(`adapter.expert_parts(ckpt, layer, e)`) and its format (`adapter.format(dtype)`), checking each range against the
format's part. So:
  GgufCheckpoint  a `Checkpoint` whose ranges are the GGUF tensors (uint8; a stacked `ffn_*_exps` tensor is
                  [E, N/E] so that `range(key, e)` is expert e's bytes); the preadv / page-cache machinery is
                  Checkpoint's own.
  GgufAdapter     the family's adapter, with `expert_parts` naming the GGUF tensors (rows of stacked ones) and
                  `format(dtype)` the GGUF format. The store keeps ONE format for all layers: a file whose layers
                  differ in encoding (Q4_K_M) needs the store to take `format_for(layer)` (docs/gguf.md, wiring);
                  until then `format` says so in a MoectlError.
"""

from __future__ import annotations

import torch

from ..errors import MoectlError
from ..models import adapter_for
from ..store.checkpoint import ByteRange, Checkpoint
from .format import GgufExpertFormat
from .model import GgufModel


class GgufCheckpoint(Checkpoint):
    def __init__(self, g: GgufModel):                # not Checkpoint.__init__: that parses safetensors headers
        self.path, self._fds, self.ranges = g.path, {}, {}
        for name, t in g.files.tensors.items():
            rows = t.shape[0] if name.endswith(("_exps.weight", "_exps.bias")) else None
            shape = (rows, t.nbytes // rows) if rows else (t.nbytes,)
            self.ranges[name] = ByteRange(t.file, t.offset, t.nbytes, torch.uint8, shape)


class GgufAdapter:
    """The family adapter (router, layout, expert_forward ...) with the GGUF's expert keys and format."""

    def __init__(self, g: GgufModel):
        self.g, self.family_adapter = g, adapter_for(g.config)

    def __getattr__(self, name):
        return getattr(self.family_adapter, name)

    def expert_parts(self, ckpt, layer: int, expert: int) -> list[tuple[str, int | None]]:
        out = []
        for name, _ in self.g.index.parts(layer, 0):
            proj, bias = name.removesuffix("_bias"), name.endswith("_bias")
            stacked = f"blk.{layer}.ffn_{proj}_exps.{'bias' if bias else 'weight'}"
            out.append((stacked, expert) if stacked in ckpt else (f"blk.{layer}.ffn_{proj}.{expert}.weight", None))
        return out

    def format_for(self, layer: int, dtype: torch.dtype) -> GgufExpertFormat:
        return self.g.expert_formats(dtype)[layer]

    def format(self, dtype: torch.dtype) -> GgufExpertFormat:
        formats = self.g.expert_formats(dtype)
        kinds = {tuple(p.shape for p in f.parts) + (f.name,) for f in formats.values()}
        if len(kinds) > 1:
            raise MoectlError(f"{self.g.path}: its MoE layers use different encodings "
                              f"({', '.join(sorted({f.name for f in formats.values()}))}); the expert store keeps "
                              f"one format for all layers (per-layer formats: docs/gguf.md)")
        return next(iter(formats.values()))
