"""Figures, not tests: runtime overhead vs transformers, and predictor cost at real model sizes.

`moectl bench` and the scripts in `bench/` print these.
"""

from __future__ import annotations

import tempfile
import time

import torch

from ..runtime.machine import best_s


def runtime_overhead(layers: int = 6, hidden: int = 256, intermediate: int = 512, experts: int = 8,
                     prompt: int = 128, decode: int = 32, threads: int | None = None, gating: str | None = None,
                     gating_threshold: float | None = None, lowbit: str | None = None, precision: str | None = None,
                     t1: float = 0.6, t2: float = 0.9, gate_prefill: bool = False) -> dict:
    """A random tiny Mixtral, all experts cached: moectl forward time / transformers forward time
    for a prefill, and decode tokens/s of both (greedy, KV cache). `gating` / `gating_threshold` gate moectl's
    decode steps (a random model has no sensitivities: only the score-only rule applies). `lowbit` (e.g. q4g64):
    the random model is quantized first and moectl runs with those copies and `precision` (all experts in place on
    the CPU: lowbit-only computes every expert from its copy, HOBBIT has no misses to act on)."""
    from transformers import AutoModelForCausalLM, DynamicCache, MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    from ..models.kv_cache import cache_kwargs, output_cache
    from ..runtime.engine import Engine

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cfg = MixtralConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                            num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024)
        with tempfile.TemporaryDirectory(prefix="moectl-overhead-") as path:
            torch.manual_seed(0)
            bars = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()           # no "Writing model shards" / "Loading weights": bench's table
            try:                                        # is the output
                MixtralForCausalLM(cfg).save_pretrained(path)
                ref = AutoModelForCausalLM.from_pretrained(path).eval()
            finally:
                if bars:
                    hf_logging.enable_progress_bar()
            if lowbit:
                from ..formats.hqq import parse_lowbit
                from ..quant.quantize import quantize_model

                quantize_model(path, *parse_lowbit(lowbit), workdir=path, progress=False)
            eng = Engine.load(path, progress=False, gating=gating, gating_threshold=gating_threshold, gate_prefill=gate_prefill,   # all cached
                              workdir=path, lowbit=lowbit, precision=precision, t1=t1, t2=t2, threads=threads)
            ids = torch.randint(0, 4096, (1, prompt), generator=torch.Generator().manual_seed(0))

            def ref_step(step, pkv):
                with torch.inference_mode():
                    out = ref(input_ids=step, **cache_kwargs(ref, pkv or DynamicCache(config=ref.config)),
                              use_cache=True)
                return out.logits, output_cache(out)

            def decode_with(step_fn):
                def run():
                    pkv, step = None, ids
                    for _ in range(decode):
                        logits, pkv = step_fn(step, pkv)
                        step = logits[:, -1:].argmax(-1)
                return run

            t_ref = best_s(lambda: ref_step(ids, None), 5)
            t_eng = best_s(lambda: eng.forward(ids), 5)
            d_ref = best_s(decode_with(ref_step), 2)
            d_eng = best_s(decode_with(eng.forward), 2)
    finally:
        torch.set_num_threads(old_threads)
    return {"layers": layers, "hidden": hidden, "experts": experts, "threads": torch.get_num_threads() if not threads
            else threads, "prefill_tokens": prompt, "prefill_ms_transformers": t_ref * 1e3,
            "prefill_ms_moectl": t_eng * 1e3, "forward_time_ratio": t_eng / t_ref, "goal_ratio": 1.15,
            "decode_tok_s_transformers": decode / d_ref, "decode_tok_s_moectl": decode / d_eng,
            "lowbit": lowbit, "precision": precision or ("hobbit" if lowbit else "full")}


def predictor_cost(hidden_size: int = 4096, num_experts: int = 8, top_k: int = 2, num_layers: int = 32) -> dict:
    """CPU cost per layer of the MLP (ProMoE) predictor at a model's sizes (default Mixtral-8x7B)."""
    from ..predictors.mlp import measure_predict_cost

    return measure_predict_cost(hidden_size=hidden_size, num_experts=num_experts, top_k=top_k,
                                num_layers=num_layers)
