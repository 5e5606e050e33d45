"""Int4CpuFormat: a q4 HQQ copy repacked for torch's CPU int4 kernel, multiplied without dequantising.

Legend: N = output rows of a matrix, K = its input columns, G = group size.

On a CPU, HQQ's dequantise-then-matmul materialises the whole matrix per call; for a 14336x4096 q4g64 matrix it
measured ~30x slower than `torch.ops.aten._weight_int4pack_mm_for_cpu` on the same codes (bench/quantize.py,
docs/benchmarks.md). So when low-bit experts are computed on the CPU, q4 copies grouped along the input axis
(HQQ axis 1) are repacked once at load into that kernel's layout:

    {name}.int4   codes [N, K/2] uint8 (`_convert_weight_to_int4pack_for_cpu`)
    {name}.sz     [K/G, N, 2] compute dtype: (scale, zero') with w = (q - 8) * scale + zero', i.e.
                  zero' = (8 - z) * scale for HQQ's w = (q - z) * scale

`weights` returns, per matrix, an `Int4Linear` (callable x [T,K] -> [T,N]) that `FamilyAdapter.linear` applies;
1-D parts stay tensors. The values equal HQQ's dequantisation up to the rounding of zero' (same codes, same
scales).
"""

from __future__ import annotations

import torch

from ..models.formats import ExpertFormat, Part
from .hqq_format import HqqFormat

KERNEL_GROUPS = (32, 64, 128, 256)


class Int4Linear:
    """y = x @ W^T for an int4-packed W [N,K]."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, group: int):
        self.packed, self.sz, self.group = packed, sz, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), self.packed, self.group, self.sz)
        return y.reshape(*shape[:-1], y.shape[-1])


def int4_cpu_ok(fmt: HqqFormat) -> bool:
    """Whether the CPU kernel can take this copy set's matrices, and is fast for them: bf16 only (with fp32
    activations it measured 13x slower than a dense fp32 matmul on a 1024x256 matrix; bf16 as fast as dense)."""
    shapes = dict(zip(fmt.layout.names, fmt.layout.shapes))
    return (fmt.bits == 4 and fmt.axis == 1 and fmt.group in KERNEL_GROUPS and fmt.compute_dtype == torch.bfloat16
            and all(shapes[m][1] % fmt.group == 0 and shapes[m][0] % 16 == 0 for m in fmt.matrices))


class Int4CpuFormat(ExpertFormat):
    def __init__(self, hqq: HqqFormat):
        self.hqq, self.group, self.compute_dtype = hqq, hqq.group, hqq.compute_dtype
        self.matrices = hqq.matrices
        parts = []
        for name, shape in zip(hqq.layout.names, hqq.layout.shapes):
            if name not in self.matrices:
                parts.append(Part(name, tuple(shape), hqq.compute_dtype))
                continue
            N, K = shape
            parts += [Part(f"{name}.int4", (N, K // 2), torch.uint8),
                      Part(f"{name}.sz", (K // hqq.group, N, 2), hqq.compute_dtype)]
        super().__init__(hqq.name, parts)

    def repack(self, hqq_buf: torch.Tensor, out: torch.Tensor) -> None:
        """Write the HQQ buffer `hqq_buf`'s expert into `out` [N] in this format."""
        from hqq.core.quantize import Quantizer

        v = self.hqq.views(hqq_buf)
        parts = {}
        for name, shape in zip(self.hqq.layout.names, self.hqq.layout.shapes):
            if name not in self.matrices:
                parts[name] = v[name]
                continue
            N, K = shape
            q = Quantizer.unpack["4bit_u8"](v[f"{name}.W_q"], dtype=torch.uint8).reshape(N, K)   # axis 1: row-major
            scale = v[f"{name}.scale"].float().reshape(N, K // self.group)
            zero = v[f"{name}.zero"].float().reshape(N, K // self.group)
            parts[f"{name}.int4"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            parts[f"{name}.sz"] = torch.stack([scale, (8 - zero) * scale], -1).transpose(0, 1)
        self.pack(parts, out)

    def weights(self, views: dict[str, torch.Tensor]) -> dict:
        return {name: Int4Linear(views[f"{name}.int4"], views[f"{name}.sz"], self.group) if name in self.matrices
                else views[name] for name in self.hqq.layout.names}
