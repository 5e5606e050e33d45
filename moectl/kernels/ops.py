"""torch-facing calls of the CPU kernels (`cpu_kernels.cpp`): tensors in, tensors out.

Legend: M = tokens, N = output rows, K = input columns, G = ceil(K / 64) blocks, NG = ceil(N / 16) row groups;
        H = query heads, KV = key/value heads, S = cached positions, Dk / Dv = key / value head size.

Every function needs `moectl.kernels.library()` (callers check it) and CPU tensors; the q4 layout is
`moectl/formats/vnni.py`'s.
"""

from __future__ import annotations

import ctypes

import torch

from . import library


def _p(t: torch.Tensor) -> int:
    return t.data_ptr()


def blocks(K: int) -> int:
    """G: 64-input blocks of a row."""
    return -(-K // 64)


def q8_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 -> (aq [M, 64 G] int8, d [M, G] fp32, xs [M, G] fp32): int8 per block of 64, its scale, and
    the block's sum of d * a."""
    x = x.contiguous()
    M, K = x.shape
    G = blocks(K)
    aq = torch.empty(M, G * 64, dtype=torch.int8)
    d = torch.empty(M, G, dtype=torch.float32)
    xs = torch.empty(M, G, dtype=torch.float32)
    library().moectl_q8_act(_p(x), M, K, _p(aq), _p(d), _p(xs))
    return aq, d, xs


def lowbit_matmul(x: torch.Tensor, codes: torch.Tensor, sm: torch.Tensor, N: int, bits: int) -> torch.Tensor:
    """y [M, N] bf16 = x [M, K] bf16 @ W^T, W in the low-bit layout of `bits` 4, 6 or 8 (moectl/formats/vnni.py):
    codes [NG, G, 8 bits 16] uint8, sm [NG, G, 2, 16] bf16."""
    M, K = x.shape
    assert bits in (4, 6, 8) and codes.shape[1:] == (blocks(K), 8 * bits * 16) and codes.is_contiguous()
    assert sm.is_contiguous() and sm.dtype == torch.bfloat16
    aq, d, xs = q8_act(x)
    y = torch.empty(M, N, dtype=torch.bfloat16)
    library().moectl_lowbit_matmul(_p(aq), _p(d), _p(xs), M, N, K, _p(codes), _p(sm), bits, _p(y))
    return y


def experts_decode(x: torch.Tensor, experts: list, weights: list[float]) -> torch.Tensor:
    """One token through a layer's experts: x [1, H] bf16; `experts` [(gate_up, down)] of `formats/vnni.VnniLinear`
    (gate_up [2I, H]: gate rows then up rows; down [H, I]); `weights` one per expert -> out [1, H] bf16 =
    sum_k bf16(weights[k] * down_k(silu(gate_k x) * up_k x)) in the order given, rounded as the torch operations
    round (cpu_kernels.cpp, 3.). Every gate_up of one bit width, every down of one."""
    x = x.contiguous()
    H, K = x.shape[-1], len(experts)
    (g0, d0) = experts[0]
    I = g0.N // 2
    assert x.numel() == H and x.dtype == torch.bfloat16 and K == len(weights) and K > 0
    assert all(g.N == 2 * I and d.N == H and g.bits == g0.bits and d.bits == d0.bits for g, d in experts)
    assert all(g.codes.shape[1] == blocks(H) and d.codes.shape[1] == blocks(I) for g, d in experts)
    ptrs = ctypes.c_void_p * K
    out = torch.empty(1, H, dtype=torch.bfloat16)
    library().moectl_experts_decode(_p(x), H, I, K, ptrs(*[_p(g.codes) for g, _ in experts]),
                                    ptrs(*[_p(g.sm) for g, _ in experts]), g0.bits,
                                    ptrs(*[_p(d.codes) for _, d in experts]), ptrs(*[_p(d.sm) for _, d in experts]),
                                    d0.bits, (ctypes.c_float * K)(*weights), _p(out))
    return out


def bf16_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [N] bf16 = w [N, K] @ x [K], both bf16 and contiguous, fp32 sums; K % 32 == 0."""
    N, K = w.shape
    assert x.numel() == K and K % 32 == 0 and w.is_contiguous() and x.is_contiguous()
    y = torch.empty(N, dtype=torch.bfloat16)
    library().moectl_bf16_gemv(_p(x), N, K, _p(w), _p(y))
    return y


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token's attention: q [H, Dk], k [KV, S, Dk], v [KV, S, Dv] (bf16; k and v may be strided views,
    their last dimension contiguous), sinks [H] fp32 or None -> out [H, Dv] bf16. Dk % 32 == 0, Dv % 16 == 0,
    Dv <= 512."""
    q = q.contiguous()
    (H, Dk), (KV, S, Dv) = q.shape, v.shape
    assert k.shape == (KV, S, Dk) and H % KV == 0 and Dk % 32 == 0 and Dv % 16 == 0 and Dv <= 512
    assert k.stride(-1) == v.stride(-1) == 1 and q.dtype == k.dtype == v.dtype == torch.bfloat16
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    out = torch.empty(H, Dv, dtype=torch.bfloat16)
    library().moectl_decode_attention(_p(q), _p(k), _p(v), H, KV, S, Dk, Dv, k.stride(0), k.stride(1), v.stride(0),
                                      v.stride(1), scale, 0 if sinks is None else _p(sinks), _p(out))
    return out
