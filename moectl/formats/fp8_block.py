"""Block-scaled FP8 as DeepSeek-V3 and Qwen3-*-FP8 ship their linear layers: `weight` F8_E4M3 [R, C] with
`weight_scale_inv` F32 [ceil(R/b0), ceil(C/b1)], one scale per `weight_block_size` [b0, b1] block (128 x 128
as released); the weight is `weight * weight_scale_inv` of its block (the name says "inverse" of the
quantizer's scale). 8 bits + 32 / (b0 * b1) bits per weight.

Legend: R = rows (outputs), C = columns (inputs), b0 x b1 = block.
"""

from __future__ import annotations

import torch

from .expert import ExpertFormat, Part


def bits_per_weight(block: tuple[int, int]) -> float:
    return 8 + 32 / (block[0] * block[1])


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """weight F8 [R, C], scale_inv [ceil(R/b0), ceil(C/b1)] -> [R, C] in `dtype` (the product is taken in fp32,
    as transformers' dequantising loader does, then rounded once)."""
    R, C = weight.shape
    (r, c), (b0, b1) = scale_inv.shape, block
    s = scale_inv.float()
    if R == r * b0 and C == c * b1:                    # whole blocks: one broadcast multiply, no expanded scales
        return (weight.float().view(r, b0, c, b1) * s[:, None, :, None]).view(R, C).to(dtype)
    s = s.repeat_interleave(b0, 0)[:R].repeat_interleave(b1, 1)[:, :C]                              # [R, C]
    return (weight.float() * s).to(dtype)

class Fp8BlockFormat(ExpertFormat):
    """An expert packed as a block-FP8 checkpoint stores it: gate, up and down weights (F8_E4M3, [out, in]) each
    followed by its F32 block scales, ~8 bits per weight. `weights` dequantises on the buffer's device into the
    dense layout: gate_up [2I, H] (gate rows, then up rows), down [H, I]."""

    PROJ = ("gate", "up", "down")

    def __init__(self, layout, dtype: torch.dtype, block: tuple[int, int]):
        (two_i, H), (_, I) = layout.shapes
        self.layout, self.dtype, self.block = layout, dtype, tuple(block)
        shapes = {"gate": (two_i // 2, H), "up": (two_i // 2, H), "down": (H, I)}
        parts = []
        for p in self.PROJ:
            parts += [Part(f"{p}.weight", shapes[p], torch.float8_e4m3fn),
                      Part(f"{p}.scale_inv", scale_shape(shapes[p], self.block), torch.float32)]
        super().__init__(f"fp8-b{block[0]}x{block[1]}", parts)

    def weights(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        w = {p: dequantize(views[f"{p}.weight"], views[f"{p}.scale_inv"], self.block, self.dtype) for p in self.PROJ}
        return {"gate_up": torch.cat([w["gate"], w["up"]]), "down": w["down"]}

    def describe(self) -> dict:
        return super().describe() | {"weight_block_size": list(self.block)}
