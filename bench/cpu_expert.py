"""One expert on this machine's CPU: what `--cpu-experts` costs per missed expert, and what computing a released
packed checkpoint where it lies costs.

1. A Mixtral-sized expert (H 4096, I 14336) applied to one token: ms and GB/s of weights read, next to the
   measured memory read bandwidth; and the q4 kernel on a cache-resident expert (1024 x 2048): the same GB/s there
   means the kernel is compute bound. bf16: the runtime's one-row product on bf16 weights (`kernels/gemv.py`).
   q8 and q4: the kernel the runtime computes a q8g64 / q4g64 copy with on this CPU, moectl's own
   (`moectl/kernels`, int8 activations) where it builds, else torch's int8 kernel (`aten._weight_int8pack_mm`,
   per-row scales: the row's label says "q8-per-row") and int4 kernel (`aten._weight_int4pack_mm_for_cpu`), on
   random codes. The measurement code is
   `moectl/runtime/machine.py`'s, the same the runtime's cost model is fed from.
2. Released formats: a GPT-OSS expert (gpt-oss-20b's, H = I = 2880) kept MXFP4 (13.2 MB) is dequantised by
   `Mxfp4Format.weights` at every use, then multiplied; a bf16 copy (49.8 MB) is only multiplied. Per token
   count, ms of dequantising alone, MXFP4 dequantise + FFN, bf16 FFN. The same for a block-FP8 expert
   (Qwen3-30B-A3B's, H = 2048, I = 768).

    PYTHONPATH=. python bench/cpu_expert.py [--threads N] [--hidden 4096 --inter 14336] [--tokens 1 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moectl import kernels
from moectl.runtime.machine import cpu_expert_ms, cpu_expert_q4_ms, cpu_expert_q8_ms, mem_read_gbps
from moectl.setting.threads import default_threads
from moectl.models.base import ExpertLayout
from moectl.formats.fp8_block import Fp8BlockFormat
from moectl.formats.mxfp4 import Mxfp4Format

Q8 = "q8g64" if kernels.library() is not None else "q8-per-row"     # the kernel's own copy, or torch's requantized


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


def released(tokens: list[int], repeat: int, show: bool) -> list[dict]:
    """Table 2: MXFP4 (GPT-OSS) and block-FP8 (Qwen3-MoE) experts, packed vs a bf16 copy."""
    H = 2880
    gpt = Mxfp4Format(ExpertLayout(("gate_up", "gate_up_bias", "down", "down_bias"),
                                   ((H, 2 * H), (2 * H,), (H, H), (H,))), torch.bfloat16)

    def gpt_forward(w, x):                      # GPT-OSS's expert without its clamp (same bytes, same GEMMs)
        h = x @ w["gate_up"] + w["gate_up_bias"]
        return (h[:, ::2] * torch.sigmoid(h[:, 1::2])) @ w["down"] + w["down_bias"]

    qwen = Fp8BlockFormat(ExpertLayout(("gate_up", "down"), ((2 * 768, 2048), (2048, 768))), torch.bfloat16, (128, 128))

    def qwen_forward(w, x):
        g, u = (x @ w["gate_up"].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ w["down"].T

    rows = [r for fmt, fwd, hidden in ((gpt, gpt_forward, H), (qwen, qwen_forward, 2048))
            for r in measure(fmt, fwd, hidden, tokens, repeat)]
    if show:
        print(f"\nreleased formats, {torch.get_num_threads()} threads; times in ms per expert call")
        print(f"{'format':14s} {'tokens':>6s} {'packed MB':>9s} {'bf16 MB':>8s} {'dequant':>8s} {'packed':>8s} "
              f"{'bf16':>8s}")
        for r in rows:
            print(f"{r['format']:14s} {r['tokens']:6d} {r['packed_mb']:9.2f} {r['dense_mb']:8.2f} "
                  f"{r['dequantise_ms']:8.1f} {r['packed_ffn_ms']:8.1f} {r['dense_ffn_ms']:8.1f}")
    return rows



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core we may use)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16], help="token counts of table 2")
    ap.add_argument("--no-released", action="store_true", help="skip table 2 (MXFP4 / FP8 experts)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads or default_threads())
    H, I = a.hidden, a.inter
    mem = mem_read_gbps(1024 * 2**20, a.repeat)
    bf16_bytes = 3 * H * I * 2
    bf16_ms = cpu_expert_ms(H, I, torch.bfloat16, repeat=a.repeat)
    q4_ms, q4_bytes = cpu_expert_q4_ms(H, I, 64, a.repeat)
    q8_ms, q8_bytes = cpu_expert_q8_ms(H, I, a.repeat)
    # the same kernel on an expert small enough to stay in cache (1024 x 2048, 3.5 MB): if it reads no faster than
    # the Mixtral-sized one from DRAM, the kernel's arithmetic, not memory, is what limits it
    small_ms, small_bytes = cpu_expert_q4_ms(1024, 2048, 64, 20 * a.repeat)
    out = {"threads": torch.get_num_threads(), "hidden": H, "intermediate": I, "mem_read_gbps": mem,
           "bf16": {"ms": bf16_ms, "bytes": bf16_bytes, "gbps": bf16_bytes / bf16_ms / 1e6,
                    "fraction_of_mem_bw": bf16_bytes / bf16_ms / 1e6 / mem},
           Q8: {"ms": q8_ms, "bytes": q8_bytes, "gbps": q8_bytes / q8_ms / 1e6,
                          "fraction_of_mem_bw": q8_bytes / q8_ms / 1e6 / mem},
           "q4g64": {"ms": q4_ms, "bytes": q4_bytes, "gbps": q4_bytes / q4_ms / 1e6,
                     "fraction_of_mem_bw": q4_bytes / q4_ms / 1e6 / mem},
           "q4g64_in_cache": {"ms": small_ms, "bytes": small_bytes, "gbps": small_bytes / small_ms / 1e6,
                              "fraction_of_mem_bw": small_bytes / small_ms / 1e6 / mem}}
    if not a.json:
        print(f"memory read bandwidth: {mem:.1f} GB/s ({out['threads']} threads)")
        for k, shape in (("bf16", f"{H}x{I}"), (Q8, f"{H}x{I}"), ("q4g64", f"{H}x{I}"),
                         ("q4g64", "1024x2048 in cache")):
            r = out[k if "cache" not in shape else "q4g64_in_cache"]
            print(f"{k:10s} expert {shape}, 1 token: {r['ms']:7.2f} ms  {r['bytes'] / 1e6:6.1f} MB  "
                  f"{r['gbps']:5.1f} GB/s = {r['fraction_of_mem_bw']:.0%} of memory bandwidth")
    if not a.no_released:
        out["released"] = released(a.tokens, a.repeat, not a.json)
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
