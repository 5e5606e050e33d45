"""VnniFormat: a q4 / q8 HQQ copy repacked for moectl's own int8-activation CPU kernel (`moectl/kernels`).

Legend: N = output rows of a matrix, K = its input columns, G = ceil(K / 64) blocks, NG = ceil(N / 16) row
groups, T = tokens, C = 2^(bits - 1) (the code centre: 8 at q4, 128 at q8).

The copy's own codes, scales and zeros (at q4 the values `Int4CpuFormat`, torch's int4 kernel, computes with:
w = (q - C) scale + zero', zero' = (C - z) scale rounded to the compute dtype), in the layout `cpu_kernels.cpp`
reads:

    {name}.qN   codes [NG, G, 8 bits 16] uint8: 16 rows x 64 inputs per block, row r's codes in 32-bit lane r
    {name}.sm   [NG, G, 2, 16] bf16: the scale of each row's block (a group of 128 repeats it over 2 blocks),
                then its zero'

What differs from a dequantise-and-multiply is the activations: quantized to int8 per block of 64 (absmax / 127),
as llama.cpp quantizes them to Q8_0 for its Q4_0 / Q8_0 dot products. That is lossy on top of the copy (each
activation within half a step of amax / 127 of its block); docs/benchmarks.md has the perplexity it costs. At q8
it replaces torch's int8 kernel (`int8_cpu.py`), which needed the copy requantized per output row (1.9x q8g64's
error): here the q8g64 copy is computed as it is.

On a GPU (a slot the copy engine filled from this layout, with `--cpu-experts`) `weights` dequantises in torch.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import ops
from .expert import Part
from .hqq import HqqFormat
from .repacked import RepackedFormat

BITS = (4, 8)                   # expert copies; 6 serves a q4 model's lm_head (--dense-lowbit q4)


def _grouped(N: int, K: int) -> tuple[int, int]:
    return -(-N // 16), ops.blocks(K)


def code_bits(codes: torch.Tensor) -> int:
    """4, 6 or 8: a block of 16 rows x 64 codes is 8 x bits x 16 bytes."""
    return codes.shape[-1] // 128


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (0 .. 2^bits - 1) -> [NG, G, 8 bits 16] uint8 in the kernel's order (N and K padded with 0)."""
    N, K = q.shape
    NG, G = _grouped(N, K)
    qp = torch.zeros(NG * 16, G * 64, dtype=torch.uint8, device=q.device)
    qp[:N, :K] = q
    if bits == 8:
        return qp.view(NG, 16, G, 16, 4).permute(0, 2, 3, 1, 4).reshape(NG, G, 1024)   # [NG, G, c, r, i]
    if bits == 6:                       # the low nibbles as q4, then the high 2 bits of vectors c + 4 j at bits 2 j
        hv = (qp >> 4).view(NG, 16, G, 4, 4, 4).permute(0, 2, 4, 1, 5, 3)   # [NG, G, c, r, i, j]: k = 4 (c + 4 j) + i
        high = hv[..., 0] | hv[..., 1] << 2 | hv[..., 2] << 4 | hv[..., 3] << 6
        return torch.cat([_pack4(qp & 15, NG, G), high.reshape(NG, G, 256)], -1)
    return _pack4(qp, NG, G)


def _pack4(qp: torch.Tensor, NG: int, G: int) -> torch.Tensor:
    qv = qp.view(NG, 16, G, 2, 8, 4).permute(0, 2, 4, 1, 5, 3)            # [NG, G, c, r, i, h]: k = 4 (c + 8 h) + i
    return (qv[..., 0] | (qv[..., 1] << 4)).reshape(NG, G, 512)


def unpack_codes(codes: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """`pack_codes`' inverse: [NG, G, 8 bits 16] -> [N, K] uint8, on codes' device."""
    NG, G, _ = codes.shape
    bits = code_bits(codes)
    if bits == 8:
        q = codes.view(NG, G, 16, 16, 4).permute(0, 3, 1, 2, 4)              # [NG, r, G, c, i]
        return q.reshape(NG * 16, G * 64)[:N, :K]
    v = codes[..., :512].reshape(NG, G, 8, 16, 4)                           # [NG, G, c, r, i]
    q = torch.stack([v & 15, v >> 4], -1)                                   # [.., h]
    q = q.permute(0, 3, 1, 5, 2, 4).reshape(NG * 16, G * 64)                # [NG, r, G, h, c, i]
    if bits == 6:
        h = codes[..., 512:].reshape(NG, G, 4, 16, 4)                       # [NG, G, c, r, i]
        h = torch.stack([h >> 2 * j & 3 for j in range(4)], -1)             # [.., j]
        q = q | h.permute(0, 3, 1, 5, 2, 4).reshape(NG * 16, G * 64) << 4   # [NG, r, G, j, c, i]
    return q[:N, :K]


def pack_scales(scale: torch.Tensor, zero: torch.Tensor, K: int) -> torch.Tensor:
    """Per-(row, group) scale and zero' [N, SG] -> sm [NG, G, 2, 16] per (row group, block, s|m, row), each group's
    values repeated over its blocks (blocks past K and rows past N: 0)."""
    N, SG = scale.shape
    NG, G = _grouped(N, K)
    out = torch.zeros(2, NG * 16, G, dtype=scale.dtype, device=scale.device)
    for i, v in enumerate((scale, zero)):
        out[i, :N, :K // 64] = v.repeat_interleave(K // 64 // SG, 1)
    return out.view(2, NG, 16, G).permute(1, 3, 0, 2).contiguous()


def unpack_scales(sm: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sm [NG, G, 2, 16] -> (scale, zero') per (row, block of 64), [N, K / 64] each."""
    v = sm.permute(2, 0, 3, 1).reshape(2, -1, sm.shape[1])[:, :N, :K // 64]
    return v[0], v[1]


def dequantize(codes: torch.Tensor, sm: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """W [N, K] in sm's dtype, on codes' device (how a GPU computes a copy in this layout): w = (q - C) s + m per
    block of 64, computed in fp32 and rounded once. q - C is exact in bf16 and addcmul computes in fp32 (torch's
    opmath), so no fp32 [N, K] is ever stored: on an H200 the fp32 version's passes took 34 of a q4 request's 142 ms
    of GPU time, and a Mixtral gate_up's temporaries 470 MB each (docs/gpu-check.md)."""
    centre = 1 << (code_bits(codes) - 1)
    q = unpack_codes(codes, N, K).to(sm.dtype).reshape(N, K // 64, 64).sub_(centre)   # [N, K/64, 64], exact
    s, m = (v[..., None] for v in unpack_scales(sm, N, K))                              # [N, K/64, 1] each
    return torch.addcmul(m, q, s).reshape(N, K)


def quantize_rtn(w: torch.Tensor, bits: int = 4, group: int = 64, rows: int = 4096) -> tuple[torch.Tensor, ...]:
    """(codes, sm) of W [N, K] in this layout: HQQ's affine round-to-nearest (what `moectl quantize --method rtn`
    writes), `rows` rows at a time, each packed at once (row groups are independent), so the fp32 and packing
    temporaries stay one chunk's: a 151936 x 2048 lm_head packed whole had raised a run's peak RSS by ~0.7 GB."""
    from hqq.core.quantize import Quantizer

    assert rows % 16 == 0
    N, K = w.shape
    codes, sms = [], []
    for r in range(0, N, rows):
        wr = w[r:r + rows]
        q, meta = Quantizer.quantize(wr, nbits=bits, group_size=group, axis=1, optimize=False, bitpack=False,
                                     compute_dtype=torch.float32, device="cpu")
        scale, zero = meta["scale"].float().view(-1, K // group), meta["zero"].float().view(-1, K // group)
        centre = 1 << (bits - 1)
        codes.append(pack_codes(q.view(-1, K).to(torch.uint8), bits))
        sms.append(pack_scales(scale.to(w.dtype), ((centre - zero) * scale).to(w.dtype), K))
        del q, meta, scale, zero
    return torch.cat(codes), torch.cat(sms)


class VnniLinear:
    """y = x @ W^T for W [N, K] in the low-bit layout (callable x [..., K] -> [..., N])."""

    def __init__(self, codes: torch.Tensor, sm: torch.Tensor, N: int):
        self.codes, self.sm, self.N = codes, sm, N
        self.bits = code_bits(codes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = ops.lowbit_matmul(x.reshape(-1, shape[-1]), self.codes, self.sm, self.N, self.bits)   # [T, N]
        return y.reshape(*shape[:-1], self.N)


def random_linear(n: int, k: int, bits: int, g: torch.Generator) -> tuple[VnniLinear, int]:
    """An [n, k] weight of random codes and scales in this layout (speed measurements), and its bytes."""
    codes = pack_codes(torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g), bits)
    sm = pack_scales((torch.rand(n, k // 64, generator=g) * 0.01).bfloat16(),
                     (torch.randn(n, k // 64, generator=g) * 0.01).bfloat16(), k)
    return VnniLinear(codes, sm, n), codes.numel() + sm.numel() * 2


def vnni_ok(fmt: HqqFormat) -> bool:
    """Whether the kernel takes this copy set: q4 or q8 grouped along the input axis in multiples of 64, bf16
    compute, and the kernels built on this machine."""
    shapes = dict(zip(fmt.layout.names, fmt.layout.shapes))
    return (fmt.bits in BITS and fmt.axis == 1 and fmt.group % 64 == 0 and fmt.compute_dtype == torch.bfloat16
            and all(shapes[m][1] % fmt.group == 0 for m in fmt.matrices) and kernels.library() is not None)


class VnniFormat(RepackedFormat):
    def matrix_parts(self, name: str, shape: tuple) -> list[Part]:
        NG, G = _grouped(*shape)
        return [Part(f"{name}.q{self.hqq.bits}", (NG, G, 128 * self.hqq.bits), torch.uint8),
                Part(f"{name}.sm", (NG, G, 2, 16), self.compute_dtype)]

    def repack_matrix(self, name: str, shape: tuple, views: dict) -> dict[str, torch.Tensor]:
        bits, K = self.hqq.bits, shape[1]
        q, scale, zero = self.codes(name, shape, views)
        zero_ = ((1 << (bits - 1)) - zero) * scale
        return {f"{name}.q{bits}": pack_codes(q, bits),
                f"{name}.sm": pack_scales(scale.to(self.compute_dtype), zero_.to(self.compute_dtype), K)}

    device_kernels = False              # set at load: a GPU slot computed by the Triton kernels (runtime/load.py)

    def matrix_weights(self, name: str, shape: tuple, views: dict):
        """On the CPU a `VnniLinear`; on a GPU the Triton kernels' callable (`device_kernels`), else dequantised
        there."""
        codes, sm = views[f"{name}.q{self.hqq.bits}"], views[f"{name}.sm"]
        if codes.device.type == "cpu" and not (self.device_kernels and _interpreted()):
            return VnniLinear(codes, sm, shape[0])
        if not self.device_kernels:
            return dequantize(codes, sm, *shape)
        from ..kernels import triton_lowbit as tk

        N, K = shape
        spec = tk.Spec(f"vnni{self.hqq.bits}")
        if name != "gate_up":
            return tk.Matrix(spec, N, K, codes, sm)
        return tk.GateUp(tk.Matrix(spec, N // 2, K, codes, sm, None, 0, N),
                         tk.Matrix(spec, N // 2, K, codes, sm, None, N // 2, N))


def _interpreted() -> bool:
    from ..kernels import triton_lowbit as tk

    return tk.INTERPRET
