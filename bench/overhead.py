"""Runtime overhead: moectl (all experts cached) vs the transformers forward, on a tiny Mixtral.

Prints prefill forward time ratio (goal <= 1.15) and decode tokens/s of both. Not a test: a figure.
Usage: python bench/overhead.py [--layers 6 --hidden 256 --experts 8 --threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def timed(fn, repeat: int) -> float:
    fn()                                            # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    from transformers import AutoModelForCausalLM, DynamicCache, MixtralConfig, MixtralForCausalLM

    from moectl.runtime.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = MixtralConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=1024)
    path = tempfile.mkdtemp(prefix="moectl-overhead-")
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).save_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    eng = Engine.load(path, progress=False)                     # all experts cached
    ids = torch.randint(0, 4096, (1, args.prompt))

    def ref_prefill():
        with torch.inference_mode():
            ref(ids)

    def eng_prefill():
        eng.forward(ids)

    def decode(step_fn):
        def run():
            pkv, step = None, ids
            for _ in range(args.decode):
                logits, pkv = step_fn(step, pkv)
                step = logits[:, -1:].argmax(-1)
        return run

    def ref_step(step, pkv):
        with torch.inference_mode():
            out = ref(input_ids=step, past_key_values=pkv or DynamicCache(config=ref.config), use_cache=True)
        return out.logits, out.past_key_values

    t_ref, t_eng = timed(ref_prefill, 5), timed(eng_prefill, 5)
    d_ref, d_eng = timed(decode(ref_step), 2), timed(decode(eng.forward), 2)
    print(f"tiny Mixtral: {args.layers} layers, hidden {args.hidden}, {args.experts} experts, {args.threads} threads")
    print(f"prefill {args.prompt} tokens: transformers {t_ref * 1e3:.1f} ms, moectl {t_eng * 1e3:.1f} ms, "
          f"ratio {t_eng / t_ref:.3f} (goal <= 1.15)")
    print(f"decode: transformers {args.decode / d_ref:.1f} tok/s, moectl {args.decode / d_eng:.1f} tok/s, "
          f"time ratio {d_eng / d_ref:.3f}")


if __name__ == "__main__":
    main()
