"""What the existing `ExpertStore` needs to read a GGUF model's experts, with no change to it.

Legend: E = experts, N = bytes of one packed expert.

`ExpertStore(ckpt, adapter, moe_layer_ids, dtype, offload)` asks the checkpoint for byte ranges
(`ckpt.range(key, row)`, read with `ckpt.read_into` by positioned reads) and the adapter for the expert's keys
(`adapter.expert_parts(ckpt, layer, e)`) and its format (`adapter.format(dtype)`), checking each range against the
format's part. So:
  GgufCheckpoint  a `Checkpoint` whose ranges are the GGUF tensors (uint8; a stacked `ffn_*_exps` tensor is
                  [E, N/E] so that `range(key, e)` is expert e's bytes); the preadv / page-cache machinery is
                  Checkpoint's own.
  GgufAdapter     the family's adapter, with `expert_parts` naming the GGUF tensors (rows of stacked ones),
                  `format(dtype)` the GGUF format whose views every layer shares, and `format_for(layer, dtype)`
                  the layer's own (its encodings: a Q4_K_M file mixes Q4_K and Q6_K), which the store keeps per
                  layer for `weights` (`ExpertStore.format_of(precision, layer)`). `gguf` is the GgufModel (the
                  tokenizer, dense tensors and header sizes the loaders take from it).
"""

from __future__ import annotations

import torch

from ...formats.gguf import GgufExpertFormat
from ...models import adapter_for
from ..checkpoint import ByteRange, Checkpoint
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
        self.gguf, self.family_adapter = g, adapter_for(g.config)
        self._formats: dict = {}

    def __getattr__(self, name):
        return getattr(self.family_adapter, name)

    def expert_parts(self, ckpt, layer: int, expert: int) -> list[tuple[str, int | None]]:
        out = []
        for name, _ in self.gguf.index.parts(layer, 0):
            proj, bias = name.removesuffix("_bias"), name.endswith("_bias")
            stacked = f"blk.{layer}.ffn_{proj}_exps.{'bias' if bias else 'weight'}"
            out.append((stacked, expert) if stacked in ckpt else (f"blk.{layer}.ffn_{proj}.{expert}.weight", None))
        return out

    def formats(self, dtype: torch.dtype) -> dict[int, GgufExpertFormat]:
        """{model layer: its format}, made once per dtype."""
        if dtype not in self._formats:
            self._formats[dtype] = self.gguf.expert_formats(dtype)
        return self._formats[dtype]

    def format_for(self, layer: int, dtype: torch.dtype) -> GgufExpertFormat:
        return self.formats(dtype)[layer]

    def format(self, dtype: torch.dtype) -> GgufExpertFormat:
        """The first MoE layer's format: its parts, views and size are every layer's (format.py)."""
        return next(iter(self.formats(dtype).values()))

    def format_names(self, dtype: torch.dtype = torch.float32) -> str:
        """The layers' formats, e.g. `gguf-Q4_K+Q6_K,gguf-Q4_K` in layer order: duplicates dropped."""
        return ",".join(dict.fromkeys(f.name for f in self.formats(dtype).values()))
