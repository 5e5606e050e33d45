"""MXFP4 (OCP microscaling FP4) as GPT-OSS ships its experts: two e2m1 codes per byte, one e8m0 scale per
32 weights along the input dimension.

Legend: R = output rows, G = groups of 32 inputs per row, C = G * 32 inputs.

On disk (openai/gpt-oss-*): `experts.gate_up_proj_blocks` U8 [E, 2I, H/32, 16], `_scales` U8 [E, 2I, H/32],
`experts.down_proj_blocks` U8 [E, H, I/32, 16], `_scales` U8 [E, H, I/32], biases BF16. A weight is
FP4_VALUES[code] * 2**(scale - 127); the low nibble of a byte is the earlier weight. 4 bits + 8/32 bits of
scale = 4.25 bits per weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MoectlError
from .expert import ExpertFormat, Part

# e2m1 code -> value (sign bit 3, exponent bits 2-1, mantissa bit 0)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
BITS_PER_WEIGHT = 4 + 8 / GROUP

_luts: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def byte_lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2] values of (low nibble, high nibble) of every byte: one gather decodes a byte into two weights."""
    key = (torch.device(device), dtype)
    if key not in _luts:
        v = torch.tensor(FP4_VALUES, dtype=torch.float32)
        b = torch.arange(256)
        _luts[key] = torch.stack([v[b & 0xF], v[b >> 4]], dim=-1).to(device=device, dtype=dtype)
    return _luts[key]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks U8 [..., R, G, 16], scales U8 [..., R, G] -> weights [..., R, C] in `dtype`, on their device.
    Exact in any float dtype with 8 exponent bits (fp32, bf16): a code times a power of two. The byte -> two
    values decode is one embedding lookup (int32 indices: 2x faster on a CPU than indexing with int64)."""
    vals = F.embedding(blocks.int(), byte_lut(blocks.device, dtype))      # [..., R, G, 16, 2]
    scale = torch.exp2((scales.to(torch.int32) - 127).to(dtype))          # [..., R, G]
    return (vals.flatten(-2) * scale.unsqueeze(-1)).flatten(-2)

class Mxfp4Format(ExpertFormat):
    """A GPT-OSS expert packed as released: per projection its blocks and scales (U8, exactly the file's rows)
    and its bias (in the compute dtype), 4.25 bits per weight. `weights` dequantises on the buffer's device.

    The layout is GPT-OSS's: gate_up [H, 2I], gate_up_bias [2I], down [I, H], down_bias [H] ((in, out), as the
    experts module multiplies); the file holds each projection as (out, in), blocked along `in`."""

    def __init__(self, layout, dtype: torch.dtype):
        self.layout, self.dtype = layout, dtype
        parts = []
        for name, shape in zip(layout.names, layout.shapes):
            if len(shape) == 1:                                              # a bias
                parts.append(Part(name, tuple(shape), dtype))
                continue
            cin, cout = shape
            if cin % GROUP:
                raise MoectlError(f"MXFP4 needs the input size of {name} ({cin}) to be a multiple of {GROUP}")
            parts += [Part(f"{name}.blocks", (cout, cin // GROUP, GROUP // 2), torch.uint8),
                      Part(f"{name}.scales", (cout, cin // GROUP), torch.uint8)]
        super().__init__("mxfp4", parts)

    def weights(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape in zip(self.layout.names, self.layout.shapes):
            if len(shape) == 1:
                out[name] = views[name]
            else:       # [out, in] dequantised; its transpose is the (in, out) matrix `x @ w` wants, no copy
                out[name] = dequantize(views[f"{name}.blocks"], views[f"{name}.scales"], self.dtype).T
        return out
