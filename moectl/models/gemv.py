"""x @ w^T on the CPU for one token: torch's own bf16/fp16 GEMV instead of oneDNN's GEMM.

For a [1, K] x [N, K] product in bf16, `F.linear` goes to oneDNN (mkldnn), whose GEMM reads a 14336 x 4096
matrix at about half the speed of torch's native reduced-precision GEMV (`cpublas::gemv`, fp32 accumulation):
measured here 23 vs 9.6 ms at 1 thread, 49 vs 27 ms at 2 (a 28672 x 4096 gate_up), the same output bits. From
two rows up oneDNN's blocked GEMM is the faster one, so only single-row products take the native path, by
switching oneDNN off for that one call (a process-wide flag: a matmul another thread starts meanwhile merely
takes torch's native kernel, with the same result). fp32 never goes to oneDNN, so it is left alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCED = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias), through torch's native GEMV when x is one row of a reduced dtype on the CPU."""
    if w.dtype in REDUCED and x.device.type == "cpu" and x.numel() == x.shape[-1]:
        was = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return F.linear(x, w)
        finally:
            torch._C._set_mkldnn_enabled(was)
    return F.linear(x, w)
