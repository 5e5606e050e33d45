"""One decode layer's experts of a GGUF file on the CPU, three ways: ggml's one-graph call (`ggml.experts_decode`,
what the runtime does in place), ggml per expert (`GgmlLinear` calls, what a prefill and the `--cpu-experts` side do),
and torch's int4 kernel on the repacked experts (the path where ggml is not built; Q4_0/Q4_K/Q6_K/Q8_0 only).

Legend: K = experts per token (top-k), H = hidden size.

    PYTHONPATH=. python bench/gguf_layer_experts.py FILE.gguf --threads 1 --experts 8 --rounds 30

Medians and minima of `--rounds` calls after a warm-up, x [1, H] bf16. The machine is shared: run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=8, help="experts of the layer computed (top-k)")
    ap.add_argument("--layer", type=int, default=0, help="MoE layer")
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from moectl.formats.gguf_ggml import GgufMappedFormat
    from moectl.formats.gguf_int4 import GgufInt4Format
    from moectl.kernels import ggml
    from moectl.store.gguf.model import open_gguf
    from moectl.store.gguf.store import GgufAdapter

    g = open_gguf(a.file)
    ad = GgufAdapter(g)
    fmt = ad.formats(torch.bfloat16)[g.index.layers[a.layer]]
    x = torch.randn(1, g.config.hidden_size).bfloat16()                     # [1, H]
    mapped = GgufMappedFormat(fmt)
    ws = [mapped.weights({"expert": torch.tensor([e])}) for e in range(a.experts)]
    pairs = [(w["gate_up"], w["down"]) for w in ws]

    def each(weights):
        y = 0
        for w in weights:
            gate, up = w["gate_up"](x).chunk(2, -1)
            y = y + w["down"](torch.nn.functional.silu(gate) * up)
        return y

    ways = {"ggml, one call": lambda: ggml.experts_decode(x, pairs, [1.0 / a.experts] * a.experts),
            "ggml, per expert": lambda: each(ws)}
    i4 = GgufInt4Format(fmt, torch.bfloat16)
    if i4.int4 or i4.planes:
        iw = [i4.weights(i4.views(i4.repack(fmt.packed(e)))) for e in range(a.experts)]
        ways["torch int4 (repacked)"] = lambda: each(iw)
    print(f"{a.file}: layer {a.layer}, {a.experts} experts, {a.threads} thread(s), encodings "
          f"{'+'.join(fmt.name.split('-')[1:])}")
    for name, f in ways.items():
        f()
        ts = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        print(f"  {name:22} median {statistics.median(ts) * 1e3:8.2f} ms   min {min(ts) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
