"""One Mixtral-sized expert (H 4096, I 14336) applied to one token on this machine's CPU: ms and GB/s of weights
read, next to the measured memory read bandwidth. What `--cpu-experts` costs per missed expert.

    PYTHONPATH=. python bench/cpu_expert.py [--threads N] [--hidden 4096 --inter 14336] [--json]

bf16: F.linear on bf16 weights (the runtime's CPU path). q4: torch's CPU int4 kernel
(`aten._weight_int4pack_mm_for_cpu`, group 64) on packed random codes, speed only (no runtime path serves q4
yet). The measurement code is `moectl/machine.py`'s, the same the runtime's cost model is fed from.
"""

from __future__ import annotations

import argparse
import json

import torch

from moectl.machine import cpu_expert_ms, cpu_expert_q4_ms, default_threads, mem_read_gbps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core we may use)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads or default_threads())
    H, I = a.hidden, a.inter
    mem = mem_read_gbps(1024 * 2**20, a.repeat)
    bf16_bytes = 3 * H * I * 2
    bf16_ms = cpu_expert_ms(H, I, torch.bfloat16, repeat=a.repeat)
    q4_ms, q4_bytes = cpu_expert_q4_ms(H, I, 64, a.repeat)
    out = {"threads": torch.get_num_threads(), "hidden": H, "intermediate": I, "mem_read_gbps": mem,
           "bf16": {"ms": bf16_ms, "bytes": bf16_bytes, "gbps": bf16_bytes / bf16_ms / 1e6,
                    "fraction_of_mem_bw": bf16_bytes / bf16_ms / 1e6 / mem},
           "q4g64": {"ms": q4_ms, "bytes": q4_bytes, "gbps": q4_bytes / q4_ms / 1e6,
                     "fraction_of_mem_bw": q4_bytes / q4_ms / 1e6 / mem}}
    if a.json:
        print(json.dumps(out))
        return
    print(f"memory read bandwidth: {mem:.1f} GB/s ({out['threads']} threads)")
    for k in ("bf16", "q4g64"):
        r = out[k]
        print(f"{k:6s} expert {H}x{I}, 1 token: {r['ms']:7.2f} ms  {r['bytes'] / 1e6:6.0f} MB  {r['gbps']:5.1f} GB/s "
              f"= {r['fraction_of_mem_bw']:.0%} of memory bandwidth")


if __name__ == "__main__":
    main()
