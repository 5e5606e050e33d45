"""moectl on a GGUF file in place beside llama.cpp on the same file (issue 30): host memory and CPU decode.

    python bench/gguf_decode.py FILE.gguf [--threads 1] [--tokens 32] [--rounds 3] [--dtype bf16]

One process loads FILE with `--model FILE` (CPU, experts in place: Q4_0/Q4_K matrices repacked for the int4 kernel,
others dequantised per use) and states: `inspect`'s figures from the header, the bytes the run then holds (expert
buffers, dense tensors), the process's RSS after load and its peak (VmHWM). Then `rounds` paired rounds, each
one moectl greedy decode of `tokens` tokens (ms/token of the decode steps) and one `llama-bench -p 0 -n tokens
-r 1 -t threads` on the same file (ms/token = 1000 / tokens per second), alternated so that load on a shared
machine hits both alike; medians and every round printed, JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompt", default="The function returns the")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workdir", default=None, help="moectl's artifact directory for this file (nothing is written)")
    ap.add_argument("--llamacpp-root", default=None, help="llama.cpp's build (default: $MOECTL_HOME's, else "
                                                          "~/.cache/moectl's)")
    a = ap.parse_args()

    import torch

    import llamacpp
    from moectl.runtime.engine import Engine
    from moectl.store.facts import dense_nbytes, inspect_model
    from moectl.store.memory import rss_bytes

    torch.set_num_threads(a.threads)
    root = Path(a.llamacpp_root) if a.llamacpp_root else llamacpp.home()
    if not llamacpp.built(root):
        root = Path("~/.cache/moectl/llamacpp").expanduser() / llamacpp.VERSION
    info = inspect_model(a.gguf, a.workdir, dtype=a.dtype, device="cpu")
    eng = Engine.load(a.gguf, device="cpu", dtype=a.dtype, threads=a.threads, progress=False, gating="none",
                      workdir=a.workdir)
    held = {"experts": sum(b.numel() for b in eng.store.buffers), "dense": dense_nbytes(eng.model, eng.config)}
    out = {"file": a.gguf, "threads": a.threads, "tokens": a.tokens, "dtype": a.dtype,
           "inspect": {"expert_format": info["expert_format"], "bits_per_weight": info["bits_per_weight"],
                       "file_expert_bytes": info["gguf"]["expert_bytes"], "dense_bytes": info["dense_bytes"],
                       "cpu_in_place": info["gguf"]["cpu_in_place"], "file_bytes": info["gguf"]["file_bytes"]},
           "held": held, "note": eng.plan_note,
           "rss_after_load_gb": rss_bytes()[0] / 1e9, "peak_rss_after_load_gb": rss_bytes()[1] / 1e9}
    rounds = []
    for _ in range(a.rounds):
        r = eng.generate(a.prompt, max_new_tokens=a.tokens)
        row = {"moectl_ms": r.stats["decode_ms_per_token"]}
        if not a.no_llamacpp:
            b = llamacpp.bench(a.gguf, a.threads, prompt=0, gen=a.tokens, reps=1, root=root)
            row |= {"llamacpp_ms": 1000 / b["tokens_per_s"], "llamacpp_rss_gb": b["rss_gb"]}
        rounds.append(row)
        print(row, file=sys.stderr, flush=True)
    out["rounds"] = rounds
    out["peak_rss_gb"] = rss_bytes()[1] / 1e9
    out["moectl_ms_median"] = statistics.median(r["moectl_ms"] for r in rounds)
    if not a.no_llamacpp:
        out["llamacpp_ms_median"] = statistics.median(r["llamacpp_ms"] for r in rounds)
    print(json.dumps(out, indent=None if a.json else 1))


if __name__ == "__main__":
    main()
