"""ggml's product y [T, N] = x [T, K] @ W^T with moectl's software-prefetch patch on and off (issue 42:
kernels/ggml_patch.py; the distance is one global, `ggml.set_prefetch`, so both sides run in this one process).

Legend: T = tokens, N = output rows, K = input width.

Per encoding (default Q8_0, Q5_K, Q6_K, and the repacked Q4_K, Q4_0) a matrix far past the last-level cache (`--mb`
MB of weight bytes: a quantized block of 1024 rows tiled, so quantizing stays quick), read at each T of `--tokens`
(default 1: decode's product; 4, 16, 64: a prefill's, the repacked types' gemm) by `--threads` threads. `--rounds`
rounds; each round times every distance of `--distances` (0: off, stock ggml) in turn, `--iters` calls each, so a
busy machine's slow spell falls on all of them alike. Reported: the median GB/s (weight bytes / time) per distance
and its ratio to off (> 1: prefetch faster), the load average, and ggml's streaming-read probe
(`ggml.read_bandwidth`) for scale. The figures are only as quiet as the machine.

    PYTHONPATH=. python bench/ggml_prefetch.py --threads 1 2
    PYTHONPATH=. python bench/ggml_prefetch.py --types Q6_K --distances 0 4096 --rounds 9 --json
    PYTHONPATH=. python bench/ggml_prefetch.py --tokens 4 16 64 --distances 0 4096 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from moectl.kernels import ggml

TILE_ROWS = 1024                        # rows quantized once, then tiled to the asked size
# read through llama.cpp's CPU repack (their copy made on the first call)
REPACKED = {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}


def matrix(enc: Q, mb: int, k: int) -> tuple[np.ndarray, int]:
    """(ggml's bytes [n, row bytes] of about `mb` MB, n): a random N(0, 0.02) block of TILE_ROWS rows tiled."""
    block = ggml.quantize(int(enc), torch.randn(TILE_ROWS, k, generator=torch.Generator().manual_seed(0)) * 0.02)
    reps = max(1, mb * 2**20 // block.nbytes)
    return np.ascontiguousarray(np.tile(block, (reps, 1))), reps * TILE_ROWS


def case(name: str, k: int, mb: int, threads: int, distances: list[int], rounds: int, iters: int,
         tokens: int = 1) -> dict:
    enc = Q[name]
    w, n = matrix(enc, mb, k)
    if name in REPACKED:
        if not ggml.repacks(enc, (n, k)):
            return {"encoding": name, "threads": threads, "tokens": tokens,
                    "skipped": "this CPU's ggml does not repack it"}
        ggml.register_stable(w)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))        # [T, K]
    ggml.mul_mat(enc, w, (n, k), x, threads)                     # warm: the repack copy, the pages, the handle
    gbps: dict[int, list[float]] = {d: [] for d in distances}
    for _ in range(rounds):
        for d in distances:
            ggml.set_prefetch(d)
            t0 = time.perf_counter()
            for _ in range(iters):
                ggml.mul_mat(enc, w, (n, k), x, threads)
            gbps[d].append(w.nbytes * iters / (time.perf_counter() - t0) / 1e9)
    ggml.set_prefetch(0)
    med = {d: statistics.median(v) for d, v in gbps.items()}
    return {"encoding": name, "threads": threads, "tokens": tokens, "shape": [n, k], "mb": round(w.nbytes / 2**20),
            "gbps": {str(d): round(med[d], 2) for d in distances},
            "vs_off": {str(d): round(med[d] / med[0], 3) for d in distances if 0 in med},
            "rounds": {str(d): [round(g, 2) for g in v] for d, v in gbps.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q5_K", "Q6_K", "Q4_K", "Q4_0"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1],
                    help="tokens T per product (default 1; a prefill's: 4 16 64)")
    ap.add_argument("--distances", type=int, nargs="+", default=[0, 1024, 4096, 8192],
                    help="prefetch distances in bytes; 0 (off) is the baseline the ratios use")
    ap.add_argument("--k", type=int, default=4096, help="input width K (default 4096)")
    ap.add_argument("--mb", type=int, default=256, help="weight bytes per matrix, MB (default 256)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)
    if min(a.tokens) < 1:
        print("error: --tokens must be >= 1", file=sys.stderr)
        return 1
    if 0 not in a.distances:
        a.distances = [0, *a.distances]
    os.environ["MOECTL_GGML_REPACK"] = "all"                     # Q4_K too (not repacked by default)
    torch.set_num_threads(1)
    if not ggml.available():
        print(f"error: ggml is not available: {ggml.why_not()}", file=sys.stderr)
        return 1
    unknown = [t for t in a.types if t not in Q.__members__]
    if unknown:
        print(f"error: unknown encoding {', '.join(unknown)}", file=sys.stderr)
        return 1
    out = {"load_before": os.getloadavg(), "read_gbps": {t: ggml.read_bandwidth(threads=t)["gbps"] for t in a.threads},
           "cases": []}
    for t in a.threads:
        for name in a.types:
            for tokens in a.tokens:
                r = case(name, a.k, a.mb, t, a.distances, a.rounds, a.iters, tokens)
                out["cases"].append(r)
                if not a.json:
                    if "skipped" in r:
                        print(f"{name:6} {t}t T={tokens:<3} skipped: {r['skipped']}")
                    else:
                        cells = "  ".join(f"{d}:{r['gbps'][str(d)]:5.2f} ({r['vs_off'][str(d)]:.3f})"
                                          for d in a.distances)
                        print(f"{name:6} {t}t T={tokens:<3} GB/s {cells}", flush=True)
    out["load_after"] = os.getloadavg()
    if a.json:
        print(json.dumps(out))
    else:
        print(f"read probe GB/s {out['read_gbps']}; load average {out['load_before'][0]:.2f} -> "
              f"{out['load_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
