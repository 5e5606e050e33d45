"""A decode step's kept ggml graph against one built every step (docs/gguf.md, "Quiet machine, stop 54").

One process, one GGUF the torch-free engine serves (run `moectl generate -m FILE -n 1` once first: it saves the
config and tokenizer), the first-use repack finished; then alternating rounds of `--steps` decode steps with the
shim keeping the step's graph (the default) and with `MOECTL_GGML_NO_GRAPH_REUSE=1` (the shim reads it each call), a
fresh 16-token prompt before each round. Prints each mode's median ms/token, their ratio, and every round's own.

    PYTHONPATH=. python bench/decode_graph_reuse.py FILE.gguf [--threads 1] [--steps 48] [--rounds 6]
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
    ms = {"kept": [], "rebuilt": []}
    for r in range(a.rounds):
        for mode in ("kept", "rebuilt") if r % 2 == 0 else ("rebuilt", "kept"):
            if mode == "rebuilt":
                os.environ["MOECTL_GGML_NO_GRAPH_REUSE"] = "1"
            else:
                os.environ.pop("MOECTL_GGML_NO_GRAPH_REUSE", None)
            _, kv = eng.forward(rng.integers(0, V, 16), None, last_only=True)
            feed = rng.integers(0, V, a.steps)
            t0 = time.perf_counter()
            for t in range(a.steps):
                _, kv = eng.forward(feed[t:t + 1], kv)
            ms[mode].append((time.perf_counter() - t0) / a.steps * 1000)
    os.environ.pop("MOECTL_GGML_NO_GRAPH_REUSE", None)
    k, b = statistics.median(ms["kept"]), statistics.median(ms["rebuilt"])
    print(f"{Path(a.model).name}, {a.threads} thread(s): kept {k:.2f} ms/token, rebuilt {b:.2f}, kept / rebuilt "
          f"{k / b:.3f}; each round's: {' '.join(f'{x / y:.3f}' for x, y in zip(ms['kept'], ms['rebuilt']))}")


if __name__ == "__main__":
    main()
