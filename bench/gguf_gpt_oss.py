"""GPT-OSS's MXFP4 GGUF experts in place on the CPU: ggml's openai-moe graph (`kernels/ggml.py: moe` -> mg_moe_oai,
biases and swiglu_oai where they lie in the mapped file) against the path it replaces, MXFP4 dequantised per use
(`MOECTL_GGML=0`), on the same file (issue 42). The ggml path is the whole forward as one graph now
(runtime/ggml_model.py, GPT-OSS's since it was added); `MOECTL_GGML_GRAPH=0` in the environment times the
per-module path (one `mg_moe_oai` a layer) instead.

`bench/gguf_vs_llamacpp.py --shape gpt-oss-20b` times GPT-OSS-20B's expert shapes written as a Mixtral-family
checkpoint (make-synthetic's "GPT-OSS-like": no biases, SiLU): it never reaches GPT-OSS's own expert path. This
writes a real `gpt_oss` checkpoint (transformers' GptOssForCausalLM, random weights) with the given shapes (default
gpt-oss-20b's experts: H = I = 2880, 32 experts, top-4), `--layers` deep, and its GGUF with MXFP4 experts and F32
biases as llama.cpp ships them (tests/gguf_build.py: the converter's layout), then per path, `--repeat` rounds:
prefill tokens/s (one forward of `--prefill` tokens) and decode ms/token (`--gen` tokens fed one at a time).
Medians and [min-max].

    PYTHONPATH=. python bench/gguf_gpt_oss.py --layers 1 --threads 1 --repeat 3

`--write-only --dense Q8_0` writes the file in llama-quantize's MXFP4_MOE layout (dense Q8_0) and prints its path,
for `bench/gguf_vs_llamacpp.py --gguf FILE` (moectl's one graph beside llama.cpp on the real GPT-OSS architecture).

Memory: one layer at the default shapes is ~0.8 G weights (3.2 GB fp32 while written, on disk too until the GGUF
is made; ~2x that at the write's peak). Run it alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def write_model(out: Path, hidden: int, inter: int, experts: int, top_k: int, layers: int,
                dense: str = "F32") -> Path:
    """The gpt_oss checkpoint and its MXFP4 GGUF (`dense`: the attention / embedding / lm_head encoding; Q8_0 is
    llama-quantize's MXFP4_MOE) under `out` (reused when there)."""
    import torch
    from gguf import GGMLQuantizationType as T
    from transformers import AutoModelForCausalLM, GptOssConfig

    from gguf_build import write_gguf
    from model_factory import save_tokenizer

    suffix = "MXFP4" if dense == "F32" else f"MXFP4-{dense}"
    gguf = out / f"gpt-oss-{hidden}x{inter}-{experts}e-top{top_k}-{layers}l-{suffix}.gguf"
    if gguf.exists():
        return gguf
    ckpt = out / gguf.stem
    cfg = GptOssConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                       num_experts_per_tok=top_k, num_hidden_layers=layers, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=64, sliding_window=128, max_position_embeddings=4096,
                       layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                       bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():             # biases start at 0: give them values, as a trained model has
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(ckpt)
    del model
    save_tokenizer(ckpt)
    part = gguf.with_name(gguf.name + ".part")        # an interrupted write leaves no file that looks made
    write_gguf(ckpt, part, expert_encoding=T.MXFP4, dense_encoding=T[dense])
    part.replace(gguf)
    shutil.rmtree(ckpt)                               # only the conversion reads it (fp32: 3.3 GB a default layer)
    return gguf


def time_path(path: Path, ggml_on: bool, prefill: int, gen: int, repeat: int, threads: int) -> dict:
    import torch

    from moectl.runtime.engine import Engine

    os.environ["MOECTL_GGML"] = "1" if ggml_on else "0"
    eng = Engine.load(str(path), progress=False, threads=threads, workdir=str(path.parent / "wd"))
    prompt = torch.randint(2, 1000, (1, prefill), generator=torch.Generator().manual_seed(0))
    pre, dec = [], []
    with torch.no_grad():
        for _ in range(repeat):
            t0 = time.perf_counter()
            _, pkv = eng.forward(prompt)
            pre.append(prefill / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i in range(gen):
                _, pkv = eng.forward(torch.tensor([[5 + i]]), pkv)
            dec.append(1e3 * (time.perf_counter() - t0) / gen)
    return {"note": eng.plan_note, "prefill": pre, "decode": dec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2880, help="hidden size (gpt-oss-20b: 2880)")
    ap.add_argument("--inter", type=int, default=2880, help="expert intermediate size (gpt-oss-20b: 2880)")
    ap.add_argument("--experts", type=int, default=32, help="experts per layer (gpt-oss-20b: 32)")
    ap.add_argument("--top-k", type=int, default=4, help="experts per token (gpt-oss-20b: 4)")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers")
    ap.add_argument("--prefill", type=int, default=64, help="prefill tokens timed")
    ap.add_argument("--gen", type=int, default=8, help="decode tokens timed")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per path")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "moectl" / "bench-gpt-oss",
                    help="where the checkpoint and GGUF go (reused)")
    ap.add_argument("--dense", default="F32", choices=["F32", "Q8_0"], help="the dense matrices' encoding (Q8_0: "
                    "llama-quantize's MXFP4_MOE layout)")
    ap.add_argument("--write-only", action="store_true", help="write the file, print its path, time nothing (for "
                    "bench/gguf_vs_llamacpp.py --gguf)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    path = write_model(a.work, a.hidden, a.inter, a.experts, a.top_k, a.layers, a.dense)
    if a.write_only:
        print(path)
        return
    print(f"{path.name}, {a.threads} thread(s), prefill {a.prefill} tokens, decode {a.gen}, {a.repeat} rounds")
    print(f"{'path':<12} {'prefill tok/s':>22} {'decode ms/token':>22}")
    for name, on in (("dequantise", False), ("ggml", True)):
        r = time_path(path, on, a.prefill, a.gen, a.repeat, a.threads)
        cell = lambda v, f: f"{statistics.median(v):{f}} [{min(v):{f}}-{max(v):{f}}]"    # noqa: E731
        print(f"{name:<12} {cell(r['prefill'], '.1f'):>22} {cell(r['decode'], '.1f'):>22}")
        print(f"  ({r['note']})")


if __name__ == "__main__":
    main()
