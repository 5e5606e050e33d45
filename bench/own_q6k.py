"""moectl's own Q6_K matvec (moectl/kernels/ggml_q6k.c) against ggml's mul_mat, one process, rounds alternating
(docs/gguf.md, "An own Q6_K matvec").

Matrix (the default): one token (T = 1) times a matrix of random valid blocks (random codes, fp16 scales set) at
issue 42's lm_head shapes, Q6_K with the own kernel (`MOECTL_GGML_OWN_Q6K` unset: the best for this CPU), its AVX2
one (`=avx2`) and ggml's (`=0`), and Q8_0 and
Q5_K through ggml for the figure; GB/s of the matrix's bytes, medians over `--rounds`, beside the streaming-read
bandwidth (`ggml.read_bandwidth`) at the same threads, measured before and after; and GB per CPU-second (the
process's CPU time, every thread's): what a core does while it runs, the figure a busy machine still gives (its
wall clock counts the time other work holds the cores).

Decode (`--decode FILE`): a GGUF the torch-free engine serves (run `moectl generate -m FILE -n 1` once first: it
saves the config and tokenizer), rounds of `--steps` decode steps alternating the own kernel and ggml's (each has its
own handle and kept graph), a fresh 16-token prompt before each round; each mode's median ms/token and their ratio.

    PYTHONPATH=. python bench/own_q6k.py [--threads 1 2] [--rounds 6] [--reps 4] [--shapes 151936x2048 32000x4096]
    PYTHONPATH=. python bench/own_q6k.py --decode FILE.gguf [--threads 1] [--steps 32] [--rounds 6] [--own avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.errors import MoectlError  # noqa: E402
from moectl.kernels import ggml  # noqa: E402

Q8_0, Q5_K, Q6_K = 8, 13, 14                       # ggml_type codes
# (weights a block, bytes a block, byte offsets of its fp16 scales): ggml-common.h's block layouts
BLOCKS = {Q8_0: (32, 34, (0,)), Q5_K: (256, 176, (0, 2)), Q6_K: (256, 210, (208,))}
NAMES = {Q8_0: "Q8_0", Q5_K: "Q5_K", Q6_K: "Q6_K"}


def random_matrix(enc: int, N: int, K: int, seed: int = 0) -> np.ndarray:
    """[N, row bytes] of valid blocks: random codes, small positive fp16 scales (quantizing an N x K fp32 matrix
    would take minutes; the kernels' speed does not depend on the values)."""
    q, b, scales = BLOCKS[enc]
    raw = np.random.default_rng(seed).integers(0, 256, (N * K // q, b), dtype=np.uint8)
    for off in scales:
        raw[:, off:off + 2] = np.full(1, 0.001, np.float16).view(np.uint8)
    return raw.reshape(N, K // q * b)


def with_setting(setting: str, fn):
    old = os.environ.get("MOECTL_GGML_OWN_Q6K")
    os.environ["MOECTL_GGML_OWN_Q6K"] = setting
    try:
        return fn()
    finally:
        os.environ.pop("MOECTL_GGML_OWN_Q6K") if old is None else os.environ.__setitem__("MOECTL_GGML_OWN_Q6K", old)


def matrix(a) -> dict:
    import torch

    torch.set_num_threads(1)
    out = {"host_load": os.getloadavg()[0], "results": []}
    for shape in a.shapes:
        N, K = map(int, shape.split("x"))
        mats = {enc: random_matrix(enc, N, K, seed=enc) for enc in (Q6_K, Q8_0, Q5_K)}
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(0))
        modes = [("own", Q6_K, "1"), ("avx2", Q6_K, "avx2"), ("ggml", Q6_K, "0"), ("ggml", Q8_0, "0"),
                 ("ggml", Q5_K, "0")]
        for n in a.threads:
            bw0 = ggml.read_bandwidth(threads=n, passes=5)["gbps"]
            kind = {m: with_setting(setting, lambda: ggml.own_q6k_kernel(n)) for m, _, setting in modes}
            gbps: dict[tuple, list[float]] = {(m, e): [] for m, e, _ in modes}
            cpu: dict[tuple, list[float]] = {(m, e): [] for m, e, _ in modes}
            for r in range(a.rounds):
                for m, enc, setting in modes if r % 2 == 0 else modes[::-1]:
                    w = mats[enc]

                    def run():
                        ggml.mul_mat(enc, w, (N, K), x, n_threads=n)            # warm: pages, handle
                        t0, c0 = time.perf_counter(), time.process_time()
                        for _ in range(a.reps):
                            ggml.mul_mat(enc, w, (N, K), x, n_threads=n)
                        return (time.perf_counter() - t0) / a.reps, (time.process_time() - c0) / a.reps

                    wall, cpu_s = with_setting(setting, run)
                    gbps[(m, enc)].append(w.nbytes / wall / 1e9)
                    cpu[(m, enc)].append(w.nbytes / cpu_s / 1e9)
            bw1 = ggml.read_bandwidth(threads=n, passes=5)["gbps"]
            for (m, enc), v in gbps.items():
                out["results"].append({"shape": shape, "type": NAMES[enc], "kernel": kind[m],
                                       "threads": n, "gbps": statistics.median(v), "rounds": v,
                                       "gb_per_cpu_s": statistics.median(cpu[(m, enc)]),
                                       "read_gbps": (bw0, bw1), "mb": mats[enc].nbytes / 1e6})
    out["host_load_after"] = os.getloadavg()[0]
    return out


def decode(a) -> dict:
    from moectl.runtime.graph_engine import GraphEngine
    from moectl.setting.options import RuntimeOptions

    n = a.threads[0]
    eng, why = GraphEngine.try_load(a.decode, RuntimeOptions(device="cpu", threads=n))
    if eng is None:
        raise MoectlError(f"the torch-free engine does not serve {a.decode}: {why}")
    rng = np.random.default_rng(0)
    V = min(eng.graph.V, 1024)
    eng.forward(rng.integers(0, V, 64), None, last_only=True)
    ggml.finish_repack()                             # llama.cpp's state after its load: every expert repacked
    ms = {"own": [], "ggml": []}
    load0 = os.getloadavg()[0]
    for r in range(a.rounds):
        for mode in ("own", "ggml") if r % 2 == 0 else ("ggml", "own"):
            def run():
                _, kv = eng.forward(rng.integers(0, V, 16), None, last_only=True)
                feed = rng.integers(0, V, a.steps)
                t0 = time.perf_counter()
                for t in range(a.steps):
                    _, kv = eng.forward(feed[t:t + 1], kv)
                return (time.perf_counter() - t0) / a.steps * 1000
            ms[mode].append(with_setting(a.own if mode == "own" else "0", run))
    o, g = statistics.median(ms["own"]), statistics.median(ms["ggml"])
    return {"model": Path(a.decode).name, "threads": n, "own": with_setting(a.own, lambda: ggml.own_q6k_kernel(n)),
            "own_ms": o, "ggml_ms": g, "ratio": o / g,
            "rounds": list(zip(ms["own"], ms["ggml"])), "host_load": (load0, os.getloadavg()[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each mode, alternating")
    ap.add_argument("--reps", type=int, default=4, help="products timed a round (matrix)")
    ap.add_argument("--shapes", nargs="+", default=["151936x2048", "32000x4096"], help="NxK (matrix)")
    ap.add_argument("--decode", metavar="FILE", help="A/B decode steps of this GGUF instead of the matrix")
    ap.add_argument("--steps", type=int, default=32, help="decode steps a round (--decode)")
    ap.add_argument("--own", default="1", choices=["1", "avx2"],
                    help="MOECTL_GGML_OWN_Q6K for the own side of --decode (avx2: that kernel on an AVX-512 host)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    for shape in a.shapes:
        parts = shape.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[1]) % 256:
            sys.exit(f"error: --shapes takes NxK with K a multiple of 256 (whole Q6_K blocks), not {shape!r}")
    if ggml.library() is None:
        sys.exit(f"error: ggml's CPU backend is not available: {ggml.why_not()}")
    try:
        out = decode(a) if a.decode else matrix(a)
    except MoectlError as e:
        sys.exit(f"error: {e}")
    if a.json:
        print(json.dumps(out, indent=1))
    elif a.decode:
        print(f"{out['model']}, {out['threads']} thread(s): own ({out['own']}) {out['own_ms']:.2f} ms/token, ggml "
              f"{out['ggml_ms']:.2f}, own / ggml {out['ratio']:.3f}; rounds: "
              + " ".join(f"{x / y:.3f}" for x, y in out["rounds"]) + f"; load {out['host_load'][0]:.1f}")
    else:
        print(f"load average {out['host_load']:.1f} -> {out['host_load_after']:.1f}")
        print(f"{'shape':<12} {'type':<5} {'kernel':<11} {'thr':>3} {'GB/s':>6} {'read GB/s':>10} {'of read':>7} "
              f"{'GB/CPU-s':>8}")
        for r in out["results"]:
            rd = statistics.mean(r["read_gbps"])
            print(f"{r['shape']:<12} {r['type']:<5} {r['kernel']:<11} {r['threads']:>3} {r['gbps']:>6.1f} "
                  f"{rd:>10.1f} {r['gbps'] / rd:>7.2f} {r['gb_per_cpu_s']:>8.1f}")


if __name__ == "__main__":
    main()
