"""ggml's product y [T, N] = x [T, K] @ W^T with llama.cpp's CPU repack (issue 42: moectl/kernels/ggml_shim.c
gives a registered weight a CPU_REPACK copy on first use) against the plain layout of the file, same threads.

Legend: T = tokens, N = output rows, K = input width.

Per encoding (default Q4_0, Q4_K) and shape (default 2048x768: an expert's down-sized matrix, and 151936x2048: a
Qwen3 lm_head), random weights quantized by ggml's own quantizer, 64 rows at a time (no fp32 copy of a 151936-row
matrix). Each case: the first repacked call (the copy made: its one-off cost), then `--repeat` alternating rounds
of `--iters` calls each, repack on and off, at T = 1 and 64; medians in ms per product and the ratio
repacked / plain (< 1: the repack is faster). The figures are only as quiet as the machine: run it alone.

    PYTHONPATH=. python bench/ggml_repack.py --threads 2                  # the issue's four cases
    PYTHONPATH=. python bench/ggml_repack.py --types Q4_0 --shapes 2048x768 --tokens 1 --repeat 3
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

ROWS_AT_ONCE = 8192                     # rows quantized at a time (fp32: 64 MB at K = 2048)


def matrix(enc: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """ggml's bytes [n, row bytes] of a random N(0, 0.02) matrix, quantized a block of rows at a time."""
    g = torch.Generator().manual_seed(seed)
    parts = [ggml.quantize(int(enc), torch.randn(min(ROWS_AT_ONCE, n - r), k, generator=g) * 0.02)
             for r in range(0, n, ROWS_AT_ONCE)]
    return np.concatenate(parts)


def timed(fn, iters: int) -> float:
    """ms per call, the mean over `iters` calls."""
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def case(enc: Q, n: int, k: int, tokens: list[int], threads: int, repeat: int, iters: int) -> dict:
    os.environ["MOECTL_GGML_REPACK"] = "all"                     # Q4_K too (not repacked by default)
    w = matrix(enc, n, k)
    if not ggml.repacks(enc, (n, k)):
        return {"encoding": enc.name, "shape": [n, k], "repacked": False,
                "why": "this CPU's ggml does not repack it"}
    ggml.register_stable(w)
    x = {t: torch.randn(t, k, generator=torch.Generator().manual_seed(t)) for t in tokens}
    t0 = time.perf_counter()
    ggml.mul_mat(enc, w, (n, k), x[tokens[0]], threads)          # the copy is made here
    first_ms = (time.perf_counter() - t0) * 1e3
    out = {"encoding": enc.name, "shape": [n, k], "repacked": True, "threads": threads,
           "first_call_ms": first_ms, "tokens": {}}
    for t in tokens:
        runs = {"on": [], "off": []}
        for _ in range(repeat):
            for mode in ("off", "on"):                           # alternating rounds
                os.environ["MOECTL_GGML_REPACK"] = "all" if mode == "on" else "0"
                ggml.mul_mat(enc, w, (n, k), x[t], threads)      # warm
                runs[mode].append(timed(lambda: ggml.mul_mat(enc, w, (n, k), x[t], threads), iters))
        on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
        out["tokens"][t] = {"on_ms": on, "off_ms": off, "ratio": on / off, "runs": runs}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K"], help="GGUF encodings (default Q4_0 Q4_K)")
    ap.add_argument("--shapes", nargs="+", default=["2048x768", "151936x2048"],
                    help="NxK: output rows x input width (default 2048x768 151936x2048)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64], help="rows of x (default 1 64)")
    ap.add_argument("--threads", type=int, default=1, help="ggml's threads (default 1)")
    ap.add_argument("--repeat", type=int, default=5, help="alternating rounds, repack on and off (default 5)")
    ap.add_argument("--iters", type=int, default=0, help="calls per round (default: about 0.3 s of calls)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)                            # ggml's threads are --threads; torch only makes x
    try:
        types = [Q[t.upper()] for t in a.types]
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes]
        assert all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (KeyError, ValueError, AssertionError):
        print(f"error: --types are GGUF encodings (Q4_0, Q4_K, IQ4_NL, MXFP4), --shapes NxK (2048x768); got "
              f"{a.types} {a.shapes}", file=sys.stderr)
        return 2
    if ggml.library() is None:
        print(f"error: ggml is not available: {ggml.why_not()}", file=sys.stderr)
        return 1
    results = []
    print(f"{'encoding':<8} {'N x K':>13} {'T':>3} {'plain ms':>9} {'repack ms':>9} {'ratio':>6} {'1st call ms':>11}")
    for enc in types:
        for n, k in shapes:
            iters = a.iters or max(3, int(3e8 / (n * k)))            # ~0.3 s of calls at ~1 Gweight/s
            r = case(enc, n, k, a.tokens, a.threads, a.repeat, iters)
            results.append(r)
            if not r["repacked"]:
                print(f"{enc.name:<8} {n:>6}x{k:<6} {r['why']}")
                continue
            for t, v in r["tokens"].items():
                print(f"{enc.name:<8} {n:>6}x{k:<6} {t:>3} {v['off_ms']:>9.3f} {v['on_ms']:>9.3f} "
                      f"{v['ratio']:>6.2f} {r['first_call_ms']:>11.1f}")
    print(f"{a.threads} thread(s), medians of {a.repeat} alternating rounds; the first call includes the repack")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
