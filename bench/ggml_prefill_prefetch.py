"""A GGUF file's prefill (one forward of T tokens through the torch-free engine's one ggml graph) with moectl's
software-prefetch patch on and off (issue 42: kernels/ggml_patch.py), or (`--ab gemm`) with the experts' row tiles
running each expert's routed rows 4 at a time by gemm and by gemv only (`MOECTL_GGML_EXPERT_GEMM`), both sides in this
one process: the distance and the gemm's switch are globals (`ggml.set_prefetch`, `ggml.set_expert_gemm`), read by the
products as they run.

Legend: T = tokens of the prefill.

Per file: the engine loaded, a warm-up forward of T tokens and the first-use repack finished (untimed, as
bench/moectl_timed.py does), then `--rounds` rounds, each timing one forward of the same T tokens at every distance
of `--distances` (0: off, stock ggml) in turn, so a busy machine's slow spell falls on all of them alike. Reported:
the median tokens/s per distance, its ratio to off (> 1: prefetch faster) and the load average. `--ab gemm`: the
two sides are "gemv" (the row tiles, every routed row by gemv: stop 55's) and "gemm" (groups of 4 by gemm), both at
the first non-zero distance of `--distances`; "vs_off" is gemm's ratio to gemv (> 1: gemm faster). The same switch
runs the experts ggml does not repack (a Q8_0 file's; Q4_0 / Q5_0 / IQ4_NL where not repacked) by llamafile's tinyBLAS
on each expert's gathered rows: on a Q8_0 file "gemv" is stock's vec_dot and "gemm" tinyBLAS. `--ab rows`: moectl's
expert-rows kernels (kernels/ggml_rows: Q5_K, Q6_K, Q3_K, IQ4_XS, IQ3_XXS, IQ2_XXS experts) off ("stock": vec_dot
below 8 routed rows, ggml's tiled kernel from 8), for the experts of 2-8 rows ("rows<=8"), for every expert of 2 or
more ("rows"; `MOECTL_GGML_EXPERT_ROWS`). The figures are only as quiet as the machine.

    PYTHONPATH=. python bench/ggml_prefill_prefetch.py ~/.cache/moectl/gguf_vs_llamacpp/qwen3-moe-2/model-Q4_0.gguf
    PYTHONPATH=. python bench/ggml_prefill_prefetch.py FILE.gguf --tokens 64 --threads 1 --rounds 8 --json
    PYTHONPATH=. python bench/ggml_prefill_prefetch.py FILE.gguf --ab gemm --tokens 64 --threads 1 2
    PYTHONPATH=. python bench/ggml_prefill_prefetch.py ~/.cache/moectl/gguf_vs_llamacpp/*/model-Q8_0.gguf --ab gemm

A file needs one earlier `moectl generate` run (it saves the config and tokenizer the torch-free engine reads):
made here where missing (bench/moectl_timed.py `first_run`).
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

import moectl_timed                     # bench/: the first `moectl generate` run a GGUF file's engine needs


def modes(ab: str, distances: list[int]) -> dict:
    """{side's name: what sets it}, the baseline first: a distance each (`--ab prefetch`); else at the first non-zero
    distance the experts' gemm off and on (`--ab gemm`), the expert-rows kernels off, for 2-8 rows, for all
    (`--ab rows`), or a one-row expert by vec_dot and by the kernel (`--ab rows1`). Every side sets every switch."""
    from moectl.kernels import ggml

    if ab == "prefetch":
        return {str(d): (lambda d=d: ggml.set_prefetch(d)) for d in distances}
    d = next(d for d in distances if d > 0)

    def side(gemm: bool = True, rows: int = ggml.expert_rows(), rows_min: int = ggml.expert_rows_min()):
        def set_it():
            ggml.set_prefetch(d)
            ggml.set_expert_gemm(gemm)
            ggml.set_expert_rows(rows)
            ggml.set_expert_rows_min(rows_min)
        return set_it
    if ab == "rows":
        return {"stock": side(rows=0), "rows<=8": side(rows=8), "rows": side()}
    if ab == "rows1":
        return {"vec_dot": side(rows_min=2), "rows": side(rows_min=1)}
    return {"gemv": side(gemm=False), "gemm": side(gemm=True)}


def case(path: Path, tokens: int, threads: int, sides: dict, rounds: int) -> dict:
    from moectl.kernels import ggml
    from moectl.runtime.graph_engine import GraphEngine
    from moectl.setting.options import RuntimeOptions

    opts = RuntimeOptions(device="cpu", threads=threads, progress=False, gating="none")
    eng, why = GraphEngine.try_load(str(path), opts)
    if eng is None and why and why.startswith("no "):              # no config / tokenizer saved yet: save them
        moectl_timed.first_run(str(path))
        eng, why = GraphEngine.try_load(str(path), opts)
    if eng is None:
        return {"file": path.name, "threads": threads, "skipped": why}
    rng = np.random.default_rng(0)
    V = eng.graph.V
    ids = rng.integers(0, min(V, 1024), tokens)                      # [T]
    eng.forward(rng.integers(0, min(V, 1024), tokens), None, last_only=True)   # warm-up: pages, handle
    ggml.finish_repack()
    tps: dict[str, list[float]] = {m: [] for m in sides}
    for _ in range(rounds):
        for m, set_side in sides.items():
            set_side()
            t0 = time.perf_counter()
            eng.forward(ids, None, last_only=True)
            tps[m].append(tokens / (time.perf_counter() - t0))
    ggml.set_prefetch(ggml.prefetch_bytes())
    ggml.set_expert_gemm(ggml.expert_gemm())
    ggml.set_expert_rows(ggml.expert_rows())
    ggml.set_expert_rows_min(ggml.expert_rows_min())
    med = {m: statistics.median(v) for m, v in tps.items()}
    base = med[next(iter(sides))]
    return {"file": path.name, "threads": threads, "tokens": tokens,
            "tps": {m: round(med[m], 1) for m in sides},
            "vs_off": {m: round(med[m] / base, 3) for m in sides},
            "rounds": {m: [round(t, 1) for t in v] for m, v in tps.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="GGUF files")
    ap.add_argument("--tokens", type=int, default=64, help="tokens T of the prefill (default 64)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--distances", type=int, nargs="+", default=[0, 4096],
                    help="prefetch distances in bytes; 0 (off) is the baseline the ratios use")
    ap.add_argument("--ab", choices=["prefetch", "gemm", "rows", "rows1"], default="prefetch",
                    help="what to compare: prefetch distances (default), or the experts' routed rows by gemm "
                         "(tinyBLAS for experts not repacked, e.g. Q8_0) against by gemv / vec_dot only "
                         "(MOECTL_GGML_EXPERT_GEMM), or moectl's expert-rows kernels (Q5_K, Q6_K, Q3_K, IQ4_XS, "
                         "IQ3_XXS, IQ2_XXS) off, for experts of 2-8 routed rows, for all "
                         "(MOECTL_GGML_EXPERT_ROWS), at the first non-zero distance")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)
    missing = [str(f) for f in a.files if not f.is_file()]
    if missing:
        print(f"error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 1
    if a.tokens < 1 or a.rounds < 1:
        print("error: --tokens and --rounds must be >= 1", file=sys.stderr)
        return 1
    if a.ab in ("gemm", "rows", "rows1") and not any(d > 0 for d in a.distances):
        print(f"error: --ab {a.ab} runs with the prefetch on: give a non-zero distance in --distances",
              file=sys.stderr)
        return 1
    if a.ab == "prefetch" and 0 not in a.distances:
        a.distances = [0, *a.distances]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moectl.kernels import ggml
    if not ggml.available():
        print(f"error: ggml is not available: {ggml.why_not()}", file=sys.stderr)
        return 1
    out = {"load_before": os.getloadavg(), "cases": []}
    names = [f.name for f in a.files]
    label = {f: f"{f.parent.name}/{f.name}" if names.count(f.name) > 1 else f.name for f in a.files}   # rows apart
    width = max(20, *(len(v) for v in label.values()))
    for t in a.threads:
        for f in a.files:
            sides = modes(a.ab, a.distances)
            r = case(f, a.tokens, t, sides, a.rounds)
            out["cases"].append(r)
            if not a.json:
                if "skipped" in r:
                    print(f"{label[f]:{width}} {t}t  skipped: {r['skipped']}")
                else:
                    cells = "  ".join(f"{m}:{r['tps'][m]:6.1f} ({r['vs_off'][m]:.3f})" for m in sides)
                    print(f"{label[f]:{width}} {t}t T={a.tokens}  {cells}", flush=True)
    out["load_after"] = os.getloadavg()
    if a.json:
        print(json.dumps(out))
    else:
        print(f"tokens/s (ratio to the first side); load average {out['load_before'][0]:.2f} -> "
              f"{out['load_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
