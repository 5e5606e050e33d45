"""How long HQQ takes per Mixtral-sized expert, and how a low-bit expert is best computed on a CPU.

1. Seconds to quantize one Mixtral-8x7B expert (random gate_up [2x14336, 4096] + down [4096, 14336], bf16) with
   `HqqFormat.quantize` (HQQ's `Quantizer.quantize`, optimize=True), the work `moectl quantize` does per expert:
   x 256 experts gives the time `moectl quantize --model mixtral` takes on this machine.
2. One 14336x4096 q4g64 matrix on the CPU, batch 1 and 16: HQQ dequantise (`HqqFormat.weights`) then matmul,
   against `torch.ops.aten._weight_int4pack_mm_for_cpu` on the same codes repacked (tinygemm layout:
   w = (q - 8) * scale + zero', zero' = (8 - z) * scale), and the dense bf16 matmul for scale.

3. `moectl inspect --lowbit`'s memory figures for Mixtral-8x7B itself (transformers' MixtralConfig defaults, bf16;
   shapes only, no checkpoint needed): host RAM with bf16 in RAM vs bf16 on disk + q4g64/q3g64/q2g64 in RAM.

Run: .venv/bin/python bench/quantize.py [--bits 4] [--group 64] [--threads 2] [--skip-quantize] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.models.base import ExpertLayout  # noqa: E402
from moectl.formats.hqq import HqqFormat  # noqa: E402

H, I = 4096, 14336                  # Mixtral-8x7B hidden and expert intermediate size
EXPERTS = 32 * 8                    # Mixtral-8x7B routed experts


def best_of(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def quantize_seconds(bits: int, group: int) -> dict:
    fmt = HqqFormat(ExpertLayout(("gate_up", "down"), ((2 * I, H), (H, I))), bits, group, 1, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    w = {"gate_up": (torch.randn(2 * I, H, generator=g) * 0.02).bfloat16(),
         "down": (torch.randn(H, I, generator=g) * 0.02).bfloat16()}
    t0, c0 = time.perf_counter(), time.process_time()
    fmt.quantize(w)
    s, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"bits": bits, "group": group, "seconds_per_expert": s, "cpu_seconds_per_expert": cpu,
            "mixtral_hours": s * EXPERTS / 3600,
            "bytes_per_expert": fmt.nbytes, "bf16_bytes_per_expert": 3 * H * I * 2}


def cpu_compute(group: int = 64) -> dict:
    """ms per batch for one [N=I, K=H] q4 matrix: HQQ dequant + matmul vs the int4pack CPU kernel vs dense."""
    fmt = HqqFormat(ExpertLayout(("w",), ((I, H),)), 4, group, 1, torch.bfloat16)
    W = (torch.randn(I, H, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    views = fmt.views(fmt.quantize({"w": W}))
    Wd = fmt.weights(views)["w"]                                             # [N,K] dequantised
    # Repack the same codes for tinygemm: int codes [N,K], scales/zeros [K/G, N, 2].
    from hqq.core.quantize import Quantizer

    q = Quantizer.unpack["4bit_u8"](views["w.W_q"], dtype=torch.uint8).reshape(I, H)      # axis 1: rows of G
    scale = views["w.scale"].float().reshape(I, H // group)
    zero = views["w.zero"].float().reshape(I, H // group)
    sz = torch.stack([scale, (8 - zero) * scale], -1).transpose(0, 1).contiguous().bfloat16()   # [K/G,N,2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    out = {}
    for m in (1, 16):
        x = torch.randn(m, H).bfloat16()
        y_deq = x @ fmt.weights(views)["w"].t()
        y_int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
        err = float((y_int4.float() - y_deq.float()).norm() / y_deq.float().norm())
        out[m] = {"dequant_matmul_ms": best_of(lambda: x @ fmt.weights(views)["w"].t()) * 1e3,
                  "dequant_only_ms": best_of(lambda: fmt.weights(views)) * 1e3,
                  "int4pack_mm_ms": best_of(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)) * 1e3,
                  "dense_bf16_ms": best_of(lambda: x @ Wd.t()) * 1e3, "int4pack_vs_dequant_rel_err": err}
    return out


def mixtral_memory() -> list[dict]:
    from transformers import MixtralConfig

    from moectl.models import adapter_for
    from moectl.store.facts import dense_nbytes, memory_plan, skeleton as _skeleton
    from moectl.runtime.offloaded import OffloadedExperts

    config = MixtralConfig()                                     # the defaults are Mixtral-8x7B's shape
    adapter = adapter_for(config)
    hf, blocks = _skeleton(config, adapter, torch.bfloat16, "MixtralConfig()")
    for i, (layer, block) in enumerate(blocks):                  # the runtime's stand-ins own no expert weights
        block.experts = OffloadedExperts(i, layer, None, None, adapter.num_experts)
    dense = dense_nbytes(hf, config)
    rows = [memory_plan(config, adapter, torch.bfloat16, dense, len(blocks), None, "ram", "cuda", "20GB")]
    for name in ("q4g64", "q3g64", "q2g64"):
        rows.append(memory_plan(config, adapter, torch.bfloat16, dense, len(blocks), name, "disk", "cuda", "20GB"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-quantize", action="store_true")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--skip-compute", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"mixtral_memory": mixtral_memory()}
    for m in res["mixtral_memory"]:
        print(f"Mixtral-8x7B bf16 {'in RAM' if m['offload'] == 'ram' else 'on disk'}"
              + (f" + {m['lowbit']} in RAM" if m["lowbit"] else "") + f", GPU budget 20GB: host RAM "
              f"{m['host']['total'] / 1e9:.1f} GB (low-bit copies {m['lowbit_copies_bytes'] / 1e9:.1f} GB, staging "
              f"{m['host']['cache_buffers'] / 1e9:.1f} GB), device {m['device_total'] / 1e9:.1f} GB with "
              f"{m['full_slots']} full + {m['lowbit_slots']} low-bit slots", flush=True)
    if a.memory_only:
        return
    res["threads"] = a.threads
    if not a.skip_compute:
        res["cpu_q4_matrix_14336x4096"] = cpu_compute(a.group)
    for m, r in res.get("cpu_q4_matrix_14336x4096", {}).items():
        print(f"batch {m:2d}: dequant+matmul {r['dequant_matmul_ms']:.1f} ms (dequant alone {r['dequant_only_ms']:.1f}) | "
              f"int4pack_mm {r['int4pack_mm_ms']:.1f} ms | dense bf16 {r['dense_bf16_ms']:.1f} ms | "
              f"int4pack vs dequant rel err {r['int4pack_vs_dequant_rel_err']:.2e}")
    if not a.skip_quantize:
        q = quantize_seconds(a.bits, a.group)
        res["quantize"] = q
        print(f"q{a.bits}g{a.group}: {q['seconds_per_expert']:.1f} s per Mixtral expert ({q['bytes_per_expert'] / 2**20:.1f} "
              f"MiB, bf16 {q['bf16_bytes_per_expert'] / 2**20:.1f} MiB; {q['cpu_seconds_per_expert']:.1f} s of CPU time) "
              f"-> {q['mixtral_hours']:.2f} h for all {EXPERTS} experts of Mixtral-8x7B on {a.threads} threads")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
