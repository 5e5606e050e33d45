"""One expert on the CPU, packed as released vs a bf16 copy: what computing where it lies costs.

A GPT-OSS expert (default gpt-oss-20b's, H = I = 2880) kept MXFP4 (13.2 MB) is dequantised by
`Mxfp4Format.weights` at every use, then multiplied; a bf16 copy (49.8 MB) is only multiplied. Prints, per
token count, the milliseconds of: dequantising alone, MXFP4 dequantise + FFN, bf16 FFN, and the bytes each
reads. The same for a block-FP8 expert (Qwen3-30B-A3B's, H = 2048, I = 768). Usage:
  python bench/cpu_expert.py [--threads N] [--tokens 1 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from moectl.models.base import ExpertLayout
from moectl.quant.fp8_block import Fp8BlockFormat
from moectl.quant.mxfp4 import Mxfp4Format


def _ms(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1000


def _random_buffer(fmt, gen) -> torch.Tensor:
    buf = torch.randint(0, 256, (fmt.nbytes,), dtype=torch.uint8, generator=gen)
    for name, v in fmt.views(buf).items():            # sane scales: e8m0 around 2**0, fp32 scales around 1e-3
        if name.endswith("scales"):
            v.copy_(torch.randint(118, 128, v.shape, dtype=torch.uint8, generator=gen))
        elif name.endswith("scale_inv"):
            v.copy_(torch.rand(v.shape, generator=gen) * 1e-3)
        elif v.dtype == torch.float8_e4m3fn:
            v.copy_(torch.randn(v.shape, generator=gen).clamp(-400, 400))
        elif v.is_floating_point():
            v.copy_(torch.randn(v.shape, generator=gen) * 0.01)
    return buf


def measure(fmt, forward, hidden: int, tokens: list[int], repeat: int, dtype=torch.bfloat16) -> list[dict]:
    buf = _random_buffer(fmt, torch.Generator().manual_seed(0))
    views = fmt.views(buf)
    dense = {k: v.contiguous() for k, v in fmt.weights(views).items()}          # the bf16 copy
    dense_bytes = sum(v.numel() * v.element_size() for v in dense.values())
    rows = []
    deq = _ms(lambda: fmt.weights(views), repeat)
    for t in tokens:
        x = torch.randn(t, hidden, dtype=dtype)
        rows.append({"format": fmt.name, "tokens": t, "packed_mb": fmt.nbytes / 1e6, "dense_mb": dense_bytes / 1e6,
                     "dequantise_ms": deq,
                     "packed_ffn_ms": _ms(lambda: forward(fmt.weights(views), x), repeat),
                     "dense_ffn_ms": _ms(lambda: forward(dense, x), repeat)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=2880)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    H = a.hidden
    gpt = Mxfp4Format(ExpertLayout(("gate_up", "gate_up_bias", "down", "down_bias"),
                                   ((H, 2 * H), (2 * H,), (H, H), (H,))), torch.bfloat16)

    def gpt_forward(w, x):                      # GPT-OSS's expert without its clamp (same bytes, same GEMMs)
        h = x @ w["gate_up"] + w["gate_up_bias"]
        return (h[:, ::2] * torch.sigmoid(h[:, 1::2])) @ w["down"] + w["down_bias"]

    qwen = Fp8BlockFormat(ExpertLayout(("gate_up", "down"), ((2 * 768, 2048), (2048, 768))), torch.bfloat16, (128, 128))

    def qwen_forward(w, x):
        g, u = (x @ w["gate_up"].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ w["down"].T

    print(f"CPU, {torch.get_num_threads()} threads; times in ms per expert call")
    print(f"{'format':14s} {'tokens':>6s} {'packed MB':>9s} {'bf16 MB':>8s} {'dequant':>8s} {'packed':>8s} {'bf16':>8s}")
    for fmt, fwd, hidden in ((gpt, gpt_forward, H), (qwen, qwen_forward, 2048)):
        for r in measure(fmt, fwd, hidden, a.tokens, a.repeat):
            print(f"{r['format']:14s} {r['tokens']:6d} {r['packed_mb']:9.2f} {r['dense_mb']:8.2f} "
                  f"{r['dequantise_ms']:8.1f} {r['packed_ffn_ms']:8.1f} {r['dense_ffn_ms']:8.1f}")


if __name__ == "__main__":
    main()
