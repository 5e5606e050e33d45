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
