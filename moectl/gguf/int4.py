"""Q4_0 and Q4_K matrices repacked without loss for torch's CPU int4 kernel (group 32).

Legend: N = output rows, K = input columns, G = 32 (the group), nb = blocks.

Both are affine per 32 weights with 4-bit codes q: Q4_0 w = d (q - 8) (d fp16, one per 32), Q4_K
w = (d sc_j) q - (dmin m_j) (d, dmin fp16 per 256, sc_j, m_j 6-bit per 32). The kernel
(`_weight_int4pack_mm_for_cpu`, moectl/quant/int4_cpu.py's `Int4Linear`) computes w = (q - 8) scale + zero' per
group, so the same codes go in unchanged with scale = d (Q4_0, zero' = 0) or scale = d sc_j, zero' = 8 scale -
dmin m_j (Q4_K). In fp32 scale is exact (an fp16 times a 6-bit integer) and Q4_0's values are exactly the
dequantised ones; Q4_K's zero' is rounded once, so a weight differs from `gguf`'s dequantisation by at most one
fp32 rounding (tests/test_gguf_int4.py). Scales in bf16 would round d: keep them fp32 (or fp16 for Q4_0) for a
lossless run.
"""

from __future__ import annotations

import torch

from ..quant.int4_cpu import Int4Linear
from .encodings import T

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


def int4_parts(data: torch.Tensor, encoding: int, shape: tuple[int, int],
               scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [N, K/2] uint8, (scale, zero') [K/G, N, 2]) of the Q4_0 / Q4_K matrix [N, K] in `data`."""
    N, K = shape
    if encoding == T.Q4_0:
        codes, scale, zero = _q4_0(data.view(-1, 18))
    elif encoding == T.Q4_K:
        codes, scale, zero = _q4_k(data.view(-1, 144))
    else:
        raise ValueError(f"only Q4_0 and Q4_K map onto the int4 kernel, not {T(encoding).name}")
    q = codes.reshape(N, K).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([scale, zero], dim=-1).reshape(N, K // GROUP, 2).transpose(0, 1).contiguous()  # [K/G, N, 2]
    return packed, sz.to(scale_dtype)


def repack_int4(data: torch.Tensor, encoding: int, shape: tuple[int, int]) -> Int4Linear:
    """An `Int4Linear` (x [T, K] -> [T, N], fp32) computing with the Q4_0 / Q4_K matrix [N, K] in `data`."""
    return Int4Linear(*int4_parts(data, encoding, shape), GROUP)


def int4_dequantized(data: torch.Tensor, encoding: int, shape: tuple[int, int]) -> torch.Tensor:
    """W [N, K] as the kernel sees it: (q - 8) scale + zero' (for comparing with `dequantize`)."""
    N, K = shape
    codes, scale, zero = (_q4_0(data.view(-1, 18)) if encoding == T.Q4_0 else _q4_k(data.view(-1, 144)))
    return ((codes.float() - 8) * scale[:, None] + zero[:, None]).reshape(N, K)


# --- Q6_K on the same kernel ------------------------------------------------------------------------------------
# Q6_K: w = s_j (q - 32), q = lo + 16 hi (lo 4 bits, hi 2 bits), s_j = d sc_j per 16 weights: a group of 16, which
# the kernel (groups >= 32) has not. So K is doubled: kernel group j holds sub-block j's 16 lo codes then its 16 hi
# codes, with scale s_j and zero' 8 s_j (so a code c weighs c s_j), and the input row is x's 16 values then the same
# 16 times 16 (exact: a power of two); the -32 s_j term is one small product with the per-16 sums of x:
#     W x = int4mm([x_j, 16 x_j]_j; [lo_j, hi_j]_j) - 32 S (sum_16 x),   S = [N, K/16] the scales
# The same 6 bits per weight, held as 2 x 4 (+ scales): no weight is dequantised; exact up to fp32 summation order.
def _q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lo [nb, 256], hi [nb, 256] (weight order) and scales [nb, 16] of Q6_K blocks [nb, 210] (gguf's layout)."""
    nb = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(nb, 2, 1, 64), blocks[:, 128:192].reshape(nb, 2, 1, 32)
    lo = torch.cat([ql & 15, ql >> 4], dim=2).reshape(nb, 256)
    hi = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(nb, 256)
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()
    return lo, hi, d * blocks[:, 192:208].contiguous().view(torch.int8).float()


def q6_k_parts(data: torch.Tensor, shape: tuple[int, int],
               scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [N, K] uint8 of the doubled [N, 2K] code matrix, (scale, zero') [K/16, N, 2]) of a Q6_K [N, K]."""
    N, K = shape
    lo, hi, s = _q6_k(data.view(-1, 210))
    codes = torch.cat([lo.reshape(N, K // 16, 16), hi.reshape(N, K // 16, 16)], dim=2).reshape(N, 2 * K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    s = s.reshape(N, K // 16)
    sz = torch.stack([s, 8 * s], dim=-1).transpose(0, 1).contiguous()                  # [K/16, N, 2]
    return packed, sz.to(scale_dtype)


class Q6KLinear:
    """y = x @ W^T for a Q6_K W [N, K] held as `q6_k_parts` (x [..., K] in the scales' dtype)."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor):
        self.packed, self.sz = packed, sz

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xg = x.reshape(-1, shape[-1] // 16, 16)                                          # [T, K/16, 16]
        x2 = torch.cat([xg, xg * 16], dim=2).reshape(xg.shape[0], -1)                    # [T, 2K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.sz)  # [T, N]
        y = y - 32 * (xg.sum(dim=2) @ self.sz[:, :, 0])                                  # the -32 s_j term
        return y.reshape(*shape[:-1], y.shape[-1])
