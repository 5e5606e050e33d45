"""A decode step A/B in one process: the kept ggml graph against one built every step (docs/gguf.md, "Quiet
machine, stop 54"), or (`--ab prefetch`) moectl's ggml prefetch patch on against off (kernels/ggml_patch.py).

One process, one GGUF the torch-free engine serves (run `moectl generate -m FILE -n 1` once first: it saves the
config and tokenizer), the first-use repack finished; then alternating rounds of `--steps` decode steps in each
mode, a fresh 16-token prompt before each round. `graph-reuse`: the shim keeping the step's graph (the default) and
`MOECTL_GGML_NO_GRAPH_REUSE=1` (the shim reads it each call). `prefetch`: the distance `--distance` bytes and 0 (off,
stock ggml), set between rounds (`ggml.set_prefetch`). Prints each mode's median ms/token, their ratio, and every
round's own.

    PYTHONPATH=. python bench/decode_graph_reuse.py FILE.gguf [--threads 1] [--steps 48] [--rounds 6]
    PYTHONPATH=. python bench/decode_graph_reuse.py FILE.gguf --ab prefetch --distance 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.errors import MoectlError  # noqa: E402
from moectl.kernels import ggml  # noqa: E402
from moectl.runtime.graph_engine import GraphEngine  # noqa: E402
from moectl.setting.options import RuntimeOptions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF file the torch-free engine serves")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=48, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each mode, alternating")
    ap.add_argument("--ab", choices=["graph-reuse", "prefetch"], default="graph-reuse", help="what the modes differ in")
    ap.add_argument("--distance", type=int, default=4096, help="--ab prefetch: the distance on, bytes")
    a = ap.parse_args()
    try:
        eng, why = GraphEngine.try_load(a.model, RuntimeOptions(device="cpu", threads=a.threads))
    except MoectlError as e:
        sys.exit(f"error: {e}")
    if eng is None:
        sys.exit(f"error: the torch-free engine does not serve {a.model}: {why}")
    rng = np.random.default_rng(0)
    V = min(eng.graph.V, 1024)
    eng.forward(rng.integers(0, V, 64), None, last_only=True)
    ggml.finish_repack()                             # llama.cpp's state after its load: every expert repacked
    if a.ab == "prefetch":
        setters = {"on": lambda: ggml.set_prefetch(a.distance), "off": lambda: ggml.set_prefetch(0)}
    else:
        setters = {"kept": lambda: os.environ.pop("MOECTL_GGML_NO_GRAPH_REUSE", None),
                   "rebuilt": lambda: os.environ.__setitem__("MOECTL_GGML_NO_GRAPH_REUSE", "1")}
    first, second = setters
    ms = {first: [], second: []}
    for r in range(a.rounds):
        for mode in (first, second) if r % 2 == 0 else (second, first):
            setters[mode]()
            _, kv = eng.forward(rng.integers(0, V, 16), None, last_only=True)
            feed = rng.integers(0, V, a.steps)
            t0 = time.perf_counter()
            for t in range(a.steps):
                _, kv = eng.forward(feed[t:t + 1], kv)
            ms[mode].append((time.perf_counter() - t0) / a.steps * 1000)
    setters[first]()                                 # as it was: graph kept; prefetch on
    k, b = statistics.median(ms[first]), statistics.median(ms[second])
    print(f"{Path(a.model).name}, {a.threads} thread(s): {first} {k:.2f} ms/token, {second} {b:.2f}, {first} / "
          f"{second} {k / b:.3f}; each round's: {' '.join(f'{x / y:.3f}' for x, y in zip(ms[first], ms[second]))}; "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
