"""RepackedFormat: an HQQ copy set repacked once at load into a CPU kernel's layout (the shared frame of
`int4_cpu.Int4CpuFormat`, `int8_cpu.Int8CpuFormat` and `vnni.VnniFormat`).

Legend: N = output rows of a matrix, K = its input columns, G = the copy's group size.

1-D parts (biases) stay as they are, in the compute dtype; each matrix becomes the kernel's parts. A subclass says
three things per matrix: its parts (`matrix_parts`), how HQQ's copy becomes them (`repack_matrix`), and what the
expert forward multiplies with (`matrix_weights`: an operator on the CPU, a dequantised matrix on a GPU).
"""

from __future__ import annotations

import torch

from .expert import ExpertFormat, Part
from .hqq import PACKING, HqqFormat


class RepackedFormat(ExpertFormat):
    def __init__(self, hqq: HqqFormat):
        self.hqq, self.group, self.compute_dtype, self.matrices = hqq, hqq.group, hqq.compute_dtype, hqq.matrices
        self.shapes = {name: tuple(shape) for name, shape in zip(hqq.layout.names, hqq.layout.shapes)}
        parts = []
        for name, shape in self.shapes.items():
            parts += self.matrix_parts(name, shape) if name in self.matrices else [Part(name, shape, self.compute_dtype)]
        super().__init__(hqq.name, parts)

    def repack(self, hqq_buf: torch.Tensor, out: torch.Tensor) -> None:
        """Write the HQQ buffer `hqq_buf`'s expert into `out` [N] in this format."""
        views = self.hqq.views(hqq_buf)
        parts = {}
        for name, shape in self.shapes.items():
            if name in self.matrices:
                parts.update(self.repack_matrix(name, shape, views))
            else:
                parts[name] = views[name]
        self.pack(parts, out)

    def weights(self, views: dict[str, torch.Tensor]) -> dict:
        return {name: self.matrix_weights(name, self.shapes[name], views) if name in self.matrices else views[name]
                for name in self.shapes}

    def codes(self, name: str, shape: tuple, views: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """HQQ's codes [N, K] uint8 (axis 1: row-major) and fp32 scale / zero [N, K / G] of matrix `name`."""
        from hqq.core.quantize import Quantizer

        N, K = shape
        q = Quantizer.unpack[PACKING[self.hqq.bits]](views[f"{name}.W_q"], dtype=torch.uint8)[:N * K // self.group]
        scale = views[f"{name}.scale"].float().reshape(N, K // self.group)
        zero = views[f"{name}.zero"].float().reshape(N, K // self.group)
        return q.reshape(N, K), scale, zero

    # --- per matrix, in the subclass --------------------------------------------------------------
    def matrix_parts(self, name: str, shape: tuple) -> list[Part]:
        raise NotImplementedError

    def repack_matrix(self, name: str, shape: tuple, views: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def matrix_weights(self, name: str, shape: tuple, views: dict):
        raise NotImplementedError
