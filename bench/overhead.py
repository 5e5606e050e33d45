"""Runtime overhead: moectl (all experts cached) vs the transformers forward, on a tiny Mixtral.

Prints the prefill forward-time ratio (goal <= 1.15) and decode tokens/s of both. Same as
`moectl bench --what overhead`. Usage: python bench/overhead.py [--threads 1]
"""

from __future__ import annotations

import argparse

from moectl.benchmark.overhead import runtime_overhead

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    r = runtime_overhead(layers=a.layers, hidden=a.hidden, experts=a.experts, threads=a.threads)
    print(f"tiny Mixtral: {r['layers']} layers, hidden {r['hidden']}, {r['experts']} experts, {r['threads']} threads")
    print(f"prefill {r['prefill_tokens']} tokens: transformers {r['prefill_ms_transformers']:.1f} ms, "
          f"moectl {r['prefill_ms_moectl']:.1f} ms, ratio {r['forward_time_ratio']:.3f} (goal <= 1.15)")
    print(f"decode: transformers {r['decode_tok_s_transformers']:.1f} tok/s, moectl {r['decode_tok_s_moectl']:.1f} tok/s")
