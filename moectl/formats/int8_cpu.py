"""Int8CpuFormat: a q8 HQQ copy requantized per output channel for torch's CPU int8 kernel, never dequantised
per use at decode.

Legend: N = output rows of a matrix, K = its input columns, G = the copy's group size, T = tokens.

Before this, a q8 copy computed on the CPU was dequantised (HQQ's `(q - zero) * scale`, the whole matrix) at every
use. `torch.ops.aten._weight_int8pack_mm` multiplies bf16 activations by int8 weights with one scale per output
row (w = q x scale), reading the int8 codes as they are. HQQ's q8 copies are grouped and affine (a scale and a
zero per G inputs), which that kernel cannot take, and no per-row scale reproduces them exactly. So the copy is
requantized once at load, symmetric round-to-nearest per output row, from the values the runtime would have
computed with (HQQ's own bf16 dequantisation of the copy):

    {name}.int8   codes [N, K] int8, |q| <= 127
    {name}.scale  [N] bf16: amax(|w_row|) / 127, rounded up to a bf16, so |w - q x scale| <= scale / 2 exactly

That adds a second rounding: on Gaussian weights the per-row step is about 1.9x q8g64's (a row's max against a
group's range), the added error RMS ~1.9x q8g64's own (docs/benchmarks.md, `bench/cpu_expert.py --q8-error`);
q8 stays far below q4's error. The product itself is then lossless against `dequantize` of the same codes
(fp32 accumulation, one bf16 rounding of the output; tests/test_cpu_q8.py).

The kernel's cost grows with the rows (a per-row loop: a Mixtral expert at 1 thread under load took 27 ms for
1 token, 197 for 32, 2380 for 128, 8574 for 512; bf16 2749 for 512), while dequantising the matrix costs about
one kernel call at 100-200 rows. So from `ROWS_KERNEL` rows up (a long prompt's share of an expert) the matrix is
dequantised once per call and multiplied in bf16 (5400 ms for those 512 tokens: bench/cpu_kernels.py).

On a GPU (a slot the copy engine filled from this layout) `weights` dequantises on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .expert import Part
from .hqq import HqqFormat
from .repacked import RepackedFormat

ROWS_KERNEL = 256        # below this many rows the int8 kernel; from it on dequantise + bf16 GEMM


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W [N, K] in scale's dtype: codes [N, K] int8 x scale [N], on their device."""
    return codes.to(scale.dtype) * scale[:, None]


class Int8Linear:
    """y = x @ W^T for W = codes x scale (per output row)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        self.codes, self.scale = codes, scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])                                               # [T, K]
        if x2.shape[0] < ROWS_KERNEL:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.codes, self.scale)
        else:
            y = F.linear(x2, dequantize(self.codes, self.scale))
        return y.reshape(*shape[:-1], y.shape[-1])


def requantize(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K] int8, scale [N] dtype) of W [N, K]: symmetric round-to-nearest per row, the scale rounded up
    to `dtype` so no code leaves [-127, 127] and every element is within half a step. `rows` rows at a time: the
    fp32 temporaries of a block stay in cache (a whole 28672 x 4096 matrix at once took ~3x as long)."""
    codes = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=dtype)
    for r in range(0, w.shape[0], rows):
        wr = w[r:r + rows].to(torch.float32, copy=True)                             # [rows, K], never w itself
        exact = wr.abs().amax(1) / 127
        s = exact.to(dtype)
        s = torch.where(s.float() < exact, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
        s = torch.where(s == 0, torch.ones_like(s), s)                              # an all-zero row
        torch.round(wr.div_(s.float()[:, None]), out=wr)
        codes[r:r + rows] = wr.clamp_(-127, 127)
        scale[r:r + rows] = s
    return codes, scale


def int8_cpu_ok(fmt: HqqFormat) -> bool:
    """Whether the CPU kernel takes this copy set's matrices: q8, bf16 compute (with fp32 activations the kernel
    measured 97 ms for a 28672 x 4096 matrix against 9 in bf16), K a multiple of 16 (its vector loop has no tail:
    K = 40 gave garbage, K = 13 a segfault)."""
    return (fmt.bits == 8 and fmt.compute_dtype == torch.bfloat16
            and all(shape[1] % 16 == 0 for name, shape in zip(fmt.layout.names, fmt.layout.shapes)
                    if name in fmt.matrices))


class Int8CpuFormat(RepackedFormat):
    def matrix_parts(self, name: str, shape: tuple) -> list[Part]:
        return [Part(f"{name}.int8", shape, torch.int8), Part(f"{name}.scale", (shape[0],), self.compute_dtype)]

    def repack_matrix(self, name: str, shape: tuple, views: dict) -> dict[str, torch.Tensor]:
        from hqq.core.quantize import Quantizer

        # HQQ's dequantisation, what the runtime computed with, requantized per row
        w = Quantizer.dequantize(views[f"{name}.W_q"], self.hqq.meta(name, views)).to(self.compute_dtype)
        codes, scale = requantize(w, self.compute_dtype)
        return {f"{name}.int8": codes, f"{name}.scale": scale}

    def matrix_weights(self, name: str, shape: tuple, views: dict):
        """On the CPU an `Int8Linear`; on a GPU dequantised there."""
        codes, scale = views[f"{name}.int8"], views[f"{name}.scale"]
        return Int8Linear(codes, scale) if codes.device.type == "cpu" else dequantize(codes, scale)
