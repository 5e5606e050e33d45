"""One GGUF-encoded expert matrix on this machine's CPU: what computing it where it lies costs per use.

For each encoding llama.cpp users' MoE files hold, a matrix [rows, cols] (default 2048 x 2048: Qwen3-30B-A3B's
expert is 768 x 2048, Mixtral's 14336 x 4096) of valid random blocks: ms to dequantise it with moectl/formats/gguf_dequant.py
(fp32), ms of that plus the matmul for one token, and for Q4_0 / Q4_K ms of the int4 kernel on the repacked codes
(moectl/formats/gguf_int4_repack.py, fp32 activations and scales, lossless; and with bf16 activations and scales, which rounds the
scales). Medians of --repeat runs, encodings interleaved.

    PYTHONPATH=. python bench/gguf_expert.py [--rows 2048 --cols 2048] [--threads 1] [--repeat 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_build import k_blocks  # noqa: E402

from moectl.formats.gguf_dequant import dequantize  # noqa: E402
from moectl.formats.gguf_encodings import bits_per_weight  # noqa: E402
from moectl.formats.gguf_int4_repack import repack_int4  # noqa: E402
from moectl.formats.int4_cpu import Int4Linear  # noqa: E402

ENCODINGS = (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4)


def packed(enc: T, rows: int, cols: int) -> torch.Tensor:
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 0.02
    if enc == T.F16:
        raw = x.astype(np.float16).view(np.uint8)
    elif enc in (T.Q4_K, T.Q5_K, T.Q6_K):
        raw = k_blocks(rows, cols, enc)
    else:
        raw = quantize(x, enc)
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shape, x = (a.rows, a.cols), torch.randn(1, a.cols)
    data = {e: packed(e, *shape) for e in ENCODINGS}
    kernels = {e: repack_int4(data[e], e, shape) for e in (T.Q4_0, T.Q4_K)}
    bf16 = {e: Int4Linear(k.packed, k.sz.bfloat16(), k.group) for e, k in kernels.items()}   # scales rounded
    runs: dict[str, list[float]] = {}
    for _ in range(a.repeat):                                          # interleaved: load drifts hit all alike
        for e in ENCODINGS:
            runs.setdefault(f"{e.name} dequantise", []).append(timed(lambda: dequantize(data[e], e, shape)))
            runs.setdefault(f"{e.name} dequantise+matmul", []).append(
                timed(lambda: x @ dequantize(data[e], e, shape).T))
            if e in kernels:
                runs.setdefault(f"{e.name} int4 kernel", []).append(timed(lambda: kernels[e](x)))
                runs.setdefault(f"{e.name} int4 kernel bf16", []).append(timed(lambda: bf16[e](x.bfloat16())))
    rows = [{"what": k, "ms_median": statistics.median(v), "ms_min": min(v), "ms_max": max(v),
             "bits_per_weight": bits_per_weight(T[k.split()[0]])} for k, v in runs.items()]
    if a.json:
        print(json.dumps({"rows": a.rows, "cols": a.cols, "threads": a.threads, "results": rows}, indent=1))
        return
    print(f"matrix {a.rows} x {a.cols}, {a.threads} thread(s), {a.repeat} runs, one token")
    for r in rows:
        print(f"  {r['what']:<24} {r['bits_per_weight']:6.3f} bpw  {r['ms_median']:8.2f} ms "
              f"(min {r['ms_min']:.2f}, max {r['ms_max']:.2f})")


if __name__ == "__main__":
    main()
