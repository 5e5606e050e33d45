"""Q4_0 and Q4_K matrices repacked without loss for torch's CPU int4 kernel (group 32).

Legend: N = output rows, K = input columns, G = 32 (the group), nb = blocks.

Both are affine per 32 weights with 4-bit codes q: Q4_0 w = d (q - 8) (d fp16, one per 32), Q4_K
w = (d sc_j) q - (dmin m_j) (d, dmin fp16 per 256, sc_j, m_j 6-bit per 32). The kernel
(`_weight_int4pack_mm_for_cpu`, moectl/formats/int4_cpu.py's `Int4Linear`) computes w = (q - 8) scale + zero' per
group, so the same codes go in unchanged with scale = d (Q4_0, zero' = 0) or scale = d sc_j, zero' = 8 scale -
dmin m_j (Q4_K). In fp32 scale is exact (an fp16 times a 6-bit integer) and Q4_0's values are exactly the
dequantised ones; Q4_K's zero' is rounded once, so a weight differs from `gguf`'s dequantisation by at most one
fp32 rounding (tests/test_gguf_int4.py). Scales in bf16 would round d: keep them fp32 (or fp16 for Q4_0) for a
lossless run.
"""

from __future__ import annotations

import torch

from .gguf_encodings import T
from .int4_cpu import Int4Linear

GROUP = 32


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [nb, 32], scale [nb], zero' [nb] of Q4_0 blocks [nb, 18]."""
    d = blocks[:, :2].contiguous().view(torch.float16).float().flatten()
    qs = blocks[:, 2:]
    codes = torch.cat([qs & 15, qs >> 4], dim=1)                               # weights 0-15 low, 16-31 high
    return codes, d, torch.zeros_like(d)


def _q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [nb*8, 32], scale [nb*8], zero' [nb*8] of Q4_K blocks [nb, 144] (8 groups of 32 each)."""
    nb = blocks.shape[0]
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()               # [nb, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    s = blocks[:, 4:16]
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], dim=1).float()  # [nb, 8]
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1).float()
    qs = blocks[:, 16:].reshape(nb, 4, 32)                                    # chunk c: groups 2c (low), 2c+1 (high)
    codes = torch.stack([qs & 15, qs >> 4], dim=2).reshape(nb * 8, 32)
    scale = (d * sc).flatten()
    return codes, scale, 8 * scale - (dmin * m).flatten()


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of 4-bit codes [N, K] int32: packed [N, K/2] uint8. It interleaves rows in blocks, so
    matrices stacked by rows (gate, then up) are packed as one: packing each and stacking the results is only the
    same when each has a whole number of the kernel's row blocks (Mixtral's 14336 rows; not a 32-row expert)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def int4_parts(data: torch.Tensor, encoding: int, shape: tuple[int, int],
               scale_dtype: torch.dtype = torch.float32, pack: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [N, K/2] uint8, (scale, zero') [K/G, N, 2]) of the Q4_0 / Q4_K matrix [N, K] in `data`
    (`pack=False`: the codes [N, K] int32, for `pack_codes` after stacking)."""
    N, K = shape
    if encoding == T.Q4_0:
        codes, scale, zero = _q4_0(data.view(-1, 18))
    elif encoding == T.Q4_K:
        codes, scale, zero = _q4_k(data.view(-1, 144))
    else:
        raise ValueError(f"only Q4_0 and Q4_K map onto the int4 kernel, not {T(encoding).name}")
    q = codes.reshape(N, K).to(torch.int32)
    sz = torch.stack([scale, zero], dim=-1).reshape(N, K // GROUP, 2).transpose(0, 1).contiguous()  # [K/G, N, 2]
    return (pack_codes(q) if pack else q), sz.to(scale_dtype)


def repack_int4(data: torch.Tensor, encoding: int, shape: tuple[int, int]) -> Int4Linear:
    """An `Int4Linear` (x [T, K] -> [T, N], fp32) computing with the Q4_0 / Q4_K matrix [N, K] in `data`."""
    return Int4Linear(*int4_parts(data, encoding, shape), GROUP)


def int4_dequantized(data: torch.Tensor, encoding: int, shape: tuple[int, int]) -> torch.Tensor:
    """W [N, K] as the kernel sees it: (q - 8) scale + zero' (for comparing with `dequantize`)."""
    N, K = shape
    codes, scale, zero = (_q4_0(data.view(-1, 18)) if encoding == T.Q4_0 else _q4_k(data.view(-1, 144)))
    return ((codes.float() - 8) * scale[:, None] + zero[:, None]).reshape(N, K)


# --- Q6_K and Q8_0 on the same kernel: two 4-bit planes -------------------------------------------------------
# Q6_K: w = s_j (q - 32), q = lo + 16 hi (lo 4 bits, hi 2), s_j = d sc_j per B = 16 weights; Q8_0: w = d_j (u - 128)
# with u = q + 128 = lo + 16 hi (4 + 4 bits) per B = 32. The kernel's groups (>= 32, a power of two) are 2B wide on a
# doubled K: group j holds sub-block j's B low codes then its B high codes, scale s_j and zero' 8 s_j (so a code c
# weighs c s_j), and the input row is x's B values then the same times 16 (exact: a power of two); the offset term
# is one small product with the per-B sums of x:
#     W x = int4mm([x_j, 16 x_j]_j; [lo_j, hi_j]_j) - offset S (sum_B x),   S = [N, K/B] the scales
# The codes are the file's bits (4 + 4 per weight held): no weight is dequantised; exact up to fp32 summation order.
PLANES = {T.Q6_K: (16, 32), T.Q8_0: (32, 128)}          # encoding -> (B, offset)


def _q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lo [nb, 256], hi [nb, 256] (weight order) and scales [nb, 16] of Q6_K blocks [nb, 210] (gguf's layout)."""
    nb = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(nb, 2, 1, 64), blocks[:, 128:192].reshape(nb, 2, 1, 32)
    lo = torch.cat([ql & 15, ql >> 4], dim=2).reshape(nb, 256)
    hi = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(nb, 256)
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()
    return lo, hi, d * blocks[:, 192:208].contiguous().view(torch.int8).float()


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lo [nb, 32], hi [nb, 32] of u = q + 128 and scales [nb, 1] of Q8_0 blocks [nb, 34]."""
    u = (blocks[:, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return u & 15, u >> 4, blocks[:, :2].contiguous().view(torch.float16).float()


def plane_parts(data: torch.Tensor, encoding: int, shape: tuple[int, int],
                scale_dtype: torch.dtype = torch.float32, pack: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [N, K] uint8 of the doubled [N, 2K] code matrix, (scale, zero') [K/B, N, 2]) of a Q6_K or Q8_0
    matrix [N, K] (`pack=False`: the codes [N, 2K] int32, as `int4_parts`)."""
    N, K = shape
    B, _ = PLANES[T(encoding)]
    lo, hi, s = _q6_k(data.view(-1, 210)) if encoding == T.Q6_K else _q8_0(data.view(-1, 34))
    codes = torch.cat([lo.reshape(N, K // B, B), hi.reshape(N, K // B, B)], dim=2).reshape(N, 2 * K)
    s = s.reshape(N, K // B)
    sz = torch.stack([s, 8 * s], dim=-1).transpose(0, 1).contiguous()                   # [K/B, N, 2]
    return (pack_codes(codes) if pack else codes.to(torch.int32)), sz.to(scale_dtype)


class PlanesLinear:
    """y = x @ W^T for a Q6_K / Q8_0 W [N, K] held as `plane_parts` (x [..., K] in the scales' dtype)."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, encoding: int):
        self.packed, self.sz = packed, sz
        self.block, self.offset = PLANES[T(encoding)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape, B = x.shape, self.block
        xg = x.reshape(-1, shape[-1] // B, B)                                            # [T, K/B, B]
        x2 = torch.cat([xg, xg * 16], dim=2).reshape(xg.shape[0], -1)                    # [T, 2K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, 2 * B, self.sz)  # [T, N]
        y = y - self.offset * (xg.sum(dim=2) @ self.sz[:, :, 0])                         # the -offset s_j term
        return y.reshape(*shape[:-1], y.shape[-1])
