"""x @ w^T on the CPU for one token: torch's own bf16/fp16 GEMV instead of oneDNN's GEMM.

For a [1, K] x [N, K] product in bf16, `F.linear` goes to oneDNN (mkldnn), whose GEMM reads a 14336 x 4096
matrix at about half the speed of torch's native reduced-precision GEMV (`cpublas::gemv`, fp32 accumulation):
measured here 23 vs 9.6 ms at 1 thread, 49 vs 27 ms at 2 (a 28672 x 4096 gate_up), the same output bits. From
two rows up oneDNN's blocked GEMM is the faster one, so only single-row products take the native path, by
switching oneDNN off for that one call (a process-wide flag: a matmul another thread starts meanwhile merely
takes torch's native kernel, with the same result). fp32 never goes to oneDNN, so it is left alone.

Where moectl's CPU kernels build (`moectl/kernels`), a one-row bf16 product takes their `vdpbf16ps` GEMV instead
(8 rows a pass; exact products, fp32 sums in another order than torch's, one bf16 rounding): torch's GEMV read a
bf16 decode token's weights at 19 GB/s at one thread here, where llama.cpp's BF16 read 23 (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .. import kernels
from . import ops

REDUCED = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def native_one_row(on: bool = True):
    """oneDNN off for a one-token CPU forward (`Engine.forward`): the products `linear` does not see, the routers'
    own `F.linear` with a weight Parameter, then take torch's native GEMV too (0.14 ms a layer through oneDNN, 7 us
    native, on the Mixtral shape; paired, 0.4-0.5 ms a 2-layer token). The flag is process-wide, as in `linear`."""
    if not on:
        yield
        return
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias), through a one-row GEMV when x is one row of a reduced dtype on the CPU: moectl's
    for bf16 where it builds, else torch's native one."""
    if w.dtype in REDUCED and x.device.type == "cpu" and x.numel() == x.shape[-1]:
        if (x.dtype == w.dtype == torch.bfloat16 and w.shape[1] % 32 == 0 and w.is_contiguous()
                and kernels.library() is not None):
            return ops.bf16_gemv(x.contiguous(), w).view(*x.shape[:-1], w.shape[0])
        with native_one_row():
            return F.linear(x, w)
    return F.linear(x, w)
