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

One layout for both sides of a GPU run. With `--cpu-experts` a low-bit miss may be computed on the CPU or copied
to the GPU, from the same host buffer (two host copies would double the low-bit tier's RAM). So the GPU also
reads this layout: a copied slot is dequantised on the device (`dequantize`). torch packs the codes in blocks
that depend on the CPU's vector width (AVX2 and AVX-512 builds differ), so `int4pack_layout` learns the block
shape by packing probe matrices once, and says None when the packing is not of that blocked form; the runtime
then keeps HQQ's layout on the host, as before.
"""

from __future__ import annotations

import functools

import torch

from .expert import Part
from .hqq import HqqFormat
from .repacked import RepackedFormat

KERNEL_GROUPS = (32, 64, 128, 256)


class Int4Linear:
    """y = x @ W^T for an int4-packed W [N,K]."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, group: int):
        self.packed, self.sz, self.group = packed, sz, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), self.packed, self.group, self.sz)
        return y.reshape(*shape[:-1], y.shape[-1])


def _pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of packed bytes, low nibble first: [..., B] uint8 -> [..., 2B]."""
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)


@functools.lru_cache(maxsize=1)
def int4pack_layout() -> tuple[int, torch.Tensor] | None:
    """(BN, order) of torch's CPU int4 packing on this machine, or None when it is not this blocked form: the codes
    of W [N, K] pack into [N/BN, K, BN/2] bytes (blocks of BN rows, then K, then the block's BN codes of that
    column), and row r of a block is nibble `order[r]` of its column (byte order[r] // 2, low nibble first).
    Learned from probe matrices whose codes spell their own row and column, then checked on a random one."""
    N, K = 256, 64
    n, k = torch.arange(N)[:, None].expand(N, K), torch.arange(K)[None, :].expand(N, K)
    digits = [_nibbles(_pack(v)).flatten().long() for v in (n % 16, n // 16, k % 16, k // 16)]
    row, col = digits[0] + 16 * digits[1], digits[2] + 16 * digits[3]           # [N*K]: each nibble's (n, k)
    bn = int((col == 0).long().cumprod(0).sum())                                # leading nibbles of column 0
    if bn < 2 or N % bn or sorted(row[:bn].tolist()) != list(range(bn)):
        return None
    rows = row[:bn].clone()                                                     # nibble m holds row rows[m]
    m = torch.arange(N * K)
    if not (torch.equal(col, (m // bn) % K) and torch.equal(row, m // (bn * K) * bn + rows[m % bn])):
        return None
    order = torch.empty_like(rows)
    order[rows] = torch.arange(bn)
    q = torch.randint(0, 16, (2 * bn, 96), generator=torch.Generator().manual_seed(0))
    return (bn, order) if torch.equal(_unpack(_pack(q), bn, order), q) else None


@functools.lru_cache(maxsize=None)
def _order_on(device: torch.device) -> torch.Tensor:
    """`int4pack_layout`'s order, copied to `device` once (not per expert computed there)."""
    return int4pack_layout()[1].to(device)


def _unpack(packed: torch.Tensor, bn: int, order: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (uint8) from packed [N, K/2], in the layout `int4pack_layout` learned (`order` on packed's
    device)."""
    N, K = packed.shape[0], packed.shape[1] * 2
    nib = _nibbles(packed.reshape(N // bn, K, bn // 2))                        # [NB, K, BN]: nibble m
    return nib[..., order].transpose(1, 2).reshape(N, K)                       # [NB, BN, K] -> [N, K]


def dequantize(packed: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """W [N, K] in sz's dtype from the CPU kernel's packed codes [N, K/2] and (scale, zero') [K/G, N, 2], on their
    device: w = (q - 8) x scale + zero', the kernel's own formula, broadcast over each group. Needs
    `int4pack_layout()`."""
    N, K = packed.shape[0], packed.shape[1] * 2
    q = _unpack(packed, int4pack_layout()[0], _order_on(packed.device)).to(sz.dtype).view(N, K // group, group)
    scale, zero = sz.transpose(0, 1).split(1, dim=-1)                          # [N, K/G, 1] each
    return ((q - 8) * scale + zero).view(N, K)


def int4_cpu_ok(fmt: HqqFormat) -> bool:
    """Whether the CPU kernel can take this copy set's matrices, and is fast for them: bf16 only (with fp32
    activations it measured 13x slower than a dense fp32 matmul on a 1024x256 matrix; bf16 as fast as dense)."""
    shapes = dict(zip(fmt.layout.names, fmt.layout.shapes))
    return (fmt.bits == 4 and fmt.axis == 1 and fmt.group in KERNEL_GROUPS and fmt.compute_dtype == torch.bfloat16
            and all(shapes[m][1] % fmt.group == 0 and shapes[m][0] % 16 == 0 for m in fmt.matrices))


class Int4CpuFormat(RepackedFormat):
    def matrix_parts(self, name: str, shape: tuple) -> list[Part]:
        N, K = shape
        return [Part(f"{name}.int4", (N, K // 2), torch.uint8),
                Part(f"{name}.sz", (K // self.group, N, 2), self.compute_dtype)]

    def repack_matrix(self, name: str, shape: tuple, views: dict) -> dict[str, torch.Tensor]:
        q, scale, zero = self.codes(name, shape, views)
        return {f"{name}.int4": torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1),
                f"{name}.sz": torch.stack([scale, (8 - zero) * scale], -1).transpose(0, 1)}

    def matrix_weights(self, name: str, shape: tuple, views: dict):
        """On the CPU an `Int4Linear` (the kernel reads the packed codes); on a GPU (a slot the copy engine filled
        from this layout) dequantised there."""
        packed, sz = views[f"{name}.int4"], views[f"{name}.sz"]
        return Int4Linear(packed, sz, self.group) if packed.device.type == "cpu" else dequantize(packed, sz, self.group)
