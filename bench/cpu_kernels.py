"""The CPU matmul kernels moectl could compute a low-bit expert with, measured side by side (issue 28).

Legend: H = hidden, I = expert intermediate, T = tokens.

One Mixtral expert FFN (gate_up [2I, H], down [H, I]; H 4096, I 14336) on T tokens, bf16 activations, per kernel:
ms, and GB/s of weights read (the bytes each format holds / the time). Rounds alternate the kernels (a shared
machine: the spread of a round is the load's, not the kernel's). Kernels:

  bf16           the runtime's bf16 path (kernels/gemv.py: torch's GEMV for one row, oneDNN from two)
  q8-per-row     torch's int8 kernel `_weight_int8pack_mm` (formats/int8_cpu.py's Int8Linear: from ROWS_KERNEL rows
                 it dequantises and multiplies in bf16)
  q8-kernel-only the int8 kernel at every T (what Int8Linear avoids for a prompt)
  q4g64 / q4g128 torch's int4 kernel `_weight_int4pack_mm_for_cpu` (formats/int4_cpu.py), group 64 / 128
  dyn-quant-4bit torch's `_dyn_quant_matmul_4bit` (int8 dynamic activations x int4; KleidiAI on Arm, on x86 a
                 reference fallback); T <= 32 only (it takes minutes at 512)
  moectl-q8g64 / moectl-q4g64  moectl's own int8-activation kernels (moectl/kernels, formats/vnni.py: VnniLinear),
                 where they build

And `--q8-error`: on a Gaussian 14336 x 4096 matrix, the RMS error of HQQ's q8g64 (rtn) against the weights, and of
q8g64 requantized per output row (formats/int8_cpu.py's load-time repack) against the weights and against q8g64.

    PYTHONPATH=. python bench/cpu_kernels.py --threads 1 --tokens 1 32 512 --rounds 2 [--q8-error] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from moectl import kernels
from moectl.kernels.gemv import linear
from moectl.formats.int8_cpu import Int8Linear, requantize
from moectl.formats.vnni import random_linear


def _expert(H: int, I: int, g: torch.Generator) -> dict:
    """Each kernel's (gate_up op, down op, bytes) on random weights of the expert's shapes."""
    def int4(n, k, group):
        p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32,
                                                                             generator=g), 1)
        sz = (torch.randn(k // group, n, 2, generator=g) * 0.01).bfloat16()
        return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, group, sz)), p.numel() + sz.numel() * 2

    def int8(n, k, kernel_only=False):
        m = Int8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                       (torch.rand(n, generator=g) * 1e-3).bfloat16())
        op = (lambda x: torch.ops.aten._weight_int8pack_mm(x, m.codes, m.scale)) if kernel_only else m
        return op, n * k + n * 2

    def bf16(n, k):
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        return (lambda x: linear(x, w)), n * k * 2

    def dyn4(n, k, group=64):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        p = torch.ops.aten._dyn_quant_pack_4bit_weight(codes, torch.rand(n, k // group, generator=g), None, group,
                                                       k, n)
        return (lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x.float(), p, group, k, n)), n * k // 2

    makers = {"bf16": bf16, "q8-per-row": int8, "q8-kernel-only": lambda n, k: int8(n, k, True),
              "q4g64": lambda n, k: int4(n, k, 64), "q4g128": lambda n, k: int4(n, k, 128), "dyn-quant-4bit": dyn4}
    if kernels.library() is not None:                   # moectl's own (moectl/kernels): int8 activations, VNNI
        makers |= {"moectl-q8g64": lambda n, k: random_linear(n, k, 8, g),
                   "moectl-q4g64": lambda n, k: random_linear(n, k, 4, g)}
    out = {}
    for name, make in makers.items():
        (gu, b1), (dn, b2) = make(2 * I, H), make(H, I)
        out[name] = (gu, dn, b1 + b2)
    return out


def run(H: int, I: int, tokens: list[int], rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    kernels = _expert(H, I, g)
    rows = []
    for T in tokens:
        x = torch.randn(T, H, generator=g).bfloat16()
        names = [k for k in kernels if not (k == "dyn-quant-4bit" and T > 32)]
        times: dict = {k: [] for k in names}
        with torch.inference_mode():
            for r in range(rounds + 1):                                  # round 0 warms up
                for name in (names if r % 2 == 0 else names[::-1]):
                    gu, dn, _ = kernels[name]
                    t0 = time.perf_counter()
                    h = gu(x).to(torch.bfloat16)                          # [T, 2I]
                    dn(F.silu(h[:, :I]) * h[:, I:])                      # [T, H]
                    if r:
                        times[name].append((time.perf_counter() - t0) * 1e3)
        for name in names:
            ms = statistics.median(times[name])
            rows.append({"kernel": name, "tokens": T, "ms": ms, "min_ms": min(times[name]),
                         "max_ms": max(times[name]), "mb": kernels[name][2] / 1e6,
                         "gbps": kernels[name][2] / ms / 1e6})
    return rows


def q8_error(n: int = 14336, k: int = 4096) -> dict:
    """RMS errors (relative to the weights' RMS) of q8g64 and of q8g64 requantized per row."""
    from hqq.core.quantize import Quantizer

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    W_q, meta = Quantizer.quantize(w, nbits=8, group_size=64, axis=1, optimize=False, bitpack=True, device="cpu")
    meta["compute_dtype"] = torch.bfloat16
    q8 = Quantizer.dequantize(W_q, meta).float()
    codes, scale = requantize(q8)
    row = codes.float() * scale.float()[:, None]
    rms = w.pow(2).mean().sqrt()

    def rel(a, b):
        return float((a - b).pow(2).mean().sqrt() / rms)
    return {"q8g64_vs_weights": rel(q8, w), "per_row_vs_weights": rel(row, w), "per_row_vs_q8g64": rel(row, q8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--q8-error", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = run(a.hidden, a.inter, a.tokens, a.rounds)
    err = q8_error() if a.q8_error else None
    if a.json:
        print(json.dumps({"threads": a.threads, "rows": rows, "q8_error": err}))
        return
    print(f"one expert {a.hidden} x {a.inter}, {a.threads} thread(s), median of {a.rounds} alternating rounds")
    print(f"{'kernel':15s} {'tokens':>6s} {'MB':>7s} {'ms':>9s} {'[min-max]':>17s} {'GB/s':>6s}")
    for r in rows:
        print(f"{r['kernel']:15s} {r['tokens']:6d} {r['mb']:7.1f} {r['ms']:9.1f} [{r['min_ms']:7.1f}-"
              f"{r['max_ms']:7.1f}] {r['gbps']:6.1f}")
    if err:
        print("q8 RMS error / weights' RMS: " + ", ".join(f"{k} {v:.5f}" for k, v in err.items()))


if __name__ == "__main__":
    main()
